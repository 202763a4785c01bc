"""Tests of package."""
