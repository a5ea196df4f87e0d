"""The weight bus: plan → pack → move → unpack, independent of the model and of the transport.

Export code yields HF-named tensors; `plan` lays them out in fixed-size flat buckets from
metadata alone; `pack`/`unpack` copy between tensors and bucket buffers; transports move
buffers and nothing else. The CPU (TCP) path and the GPU (NCCL / CUDA IPC) path share all of it.
"""
