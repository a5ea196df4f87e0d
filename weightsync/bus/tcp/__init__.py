"""TCP transport: raw sockets from host memory, for CPU hosts and links NCCL cannot cross (wire.py, sender.py, receiver.py)."""
