"""weightsync: shared pieces of the trainer and rollout services.

Importing this package (and the control-plane modules under it) must stay cheap: no torch,
no megatron, no sglang at import time. Modules that move tensors import torch themselves.
"""

__version__ = "0.1.0"
