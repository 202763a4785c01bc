"""Tests of parallel."""
