"""rollout-svc: inference engines that generate rollouts and apply new weights transactionally.

A rollout pod needs neither megatron-core nor (for the built-in engine) sglang.
"""
