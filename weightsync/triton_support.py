"""Whether this process can run our Triton kernels (the checksum, the FP8 quantizer).

Triton ships with CUDA builds of torch, not with the CPU build, and its kernels need a GPU: every
kernel module falls back to torch when `available()` is false. Asked once per process.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
