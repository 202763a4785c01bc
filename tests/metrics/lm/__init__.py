"""Tests of metrics/lm."""
