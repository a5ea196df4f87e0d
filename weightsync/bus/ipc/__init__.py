"""CUDA IPC transport: a trainer and rollouts on one GPU share bucket buffers by handle.

handles.py (share / map), sender.py (trainer, one PushBucket per bucket), receiver.py (rollout).
"""
