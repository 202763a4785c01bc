"""Tests of comm."""
