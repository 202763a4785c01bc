"""Statistics carried in fixed-size states: moments and quantile histograms.

Depends on ``core.state`` only; ``metrics`` builds on it.
"""
