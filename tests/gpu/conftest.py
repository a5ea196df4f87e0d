import os

# NVLink multicast stays off on the shared GPU hosts (it can take the host's GPUs out of service).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

# test_services_gpu's `fleet` fixture (a tmp dir and the GPU count), shared by the other GPU test modules
from test_services_gpu import fleet  # noqa: E402, F401
