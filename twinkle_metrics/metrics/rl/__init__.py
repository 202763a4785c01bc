"""RL and preference metrics: the GRPO family, DPO, rewards, the value head, rollout mismatch."""
