"""CUDA IPC transport: a trainer and rollouts on one GPU share bucket buffers by handle (handles.py, sender.py, receiver.py)."""
