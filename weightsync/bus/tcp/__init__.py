"""TCP transport: raw sockets from host memory, for CPU hosts and links NCCL cannot cross.

wire.py (frames, HMAC hello, the channel), sender.py (trainer), receiver.py (rollout listener).
"""
