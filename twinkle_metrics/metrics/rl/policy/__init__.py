"""The policy family (GRPO, PPO, GSPO, CISPO) in one place: ``table`` declares the columns
once, ``sums`` holds the per-call work as pure functions, ``records`` the top-k KL records,
``metric`` the classes."""
from twinkle_metrics.metrics.rl.policy.metric import CISPOMetric, GRPOMetric, GSPOMetric, PPOMetric

__all__ = ["GRPOMetric", "PPOMetric", "GSPOMetric", "CISPOMetric"]
