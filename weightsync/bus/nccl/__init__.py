"""NCCL transport: one broadcast group of the trainer and every targeted rollout (libnccl.py, group.py, sender.py, receiver.py, liveness.py)."""
