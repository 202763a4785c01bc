"""Tests of metrics/rl."""
