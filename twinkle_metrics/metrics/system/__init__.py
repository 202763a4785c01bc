"""System metrics: training progress and throughput, parameter and gradient norms, MoE routing."""
