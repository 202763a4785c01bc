"""Tests of metrics/system."""
