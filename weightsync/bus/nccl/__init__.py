"""NCCL transport: one broadcast group of the trainer and every targeted rollout.

libnccl.py (ctypes binding), group.py (communicator, the channel), sender.py (trainer, group cache),
receiver.py (rollout), liveness.py (aborts the group when a member dies mid-stream).
"""
