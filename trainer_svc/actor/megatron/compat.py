"""CPU compat layer: lets megatron-core 0.16.1's GPTModel (local layer spec) build, run forward
and backward on a CPU-only torch with the gloo backend.

megatron-core assumes CUDA in a handful of places that are not about the math: where to allocate a
buffer, where to build a causal mask, which generator the RNG tracker forks. Each patch below
replaces one of those only when `torch.cuda.is_available()` is False; in that situation the
original call raises ("Torch not compiled with CUDA enabled" / no device), so a patch can only turn
a crash into CPU placement and never changes what a CUDA run does. On a GPU host this module is a
no-op. Call `apply_cpu_compat()` before building the model (the builder does).
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)

_applied = False


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _make_cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """The same named-state fork semantics as megatron's tracker, on the CPU generator.

        Dropout on CPU tensors draws from the CPU generator, so that is the state a fork must
        swap; the CUDA tracker would call torch.cuda.get_rng_state() and fail.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def apply_cpu_compat() -> bool:
    """Install the CPU patches if CUDA is unavailable; idempotent. Returns whether they are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    # 1. ~30 call sites allocate with device=torch.cuda.current_device() (TP gather buffers in
    #    tensor_parallel/mappings.py and layers.py, attention buffers, and rotary's
    #    `inv_freq.to(torch.cuda.current_device())` in get_emb). Answering "cpu" keeps them on CPU.
    torch.cuda.current_device = _cpu_current_device

    # 2. fused_softmax's torch fallback builds its default causal mask with device="cuda"
    #    (transformer/utils.py:get_default_causal_mask); fused_softmax imported it by name, so the
    #    name is replaced in both modules.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    tutils.get_default_causal_mask = _cpu_causal_mask

    # 3. The RNG tracker (tensor_parallel/random.py) stores torch.cuda RNG states; attention and
    #    embedding dropout run inside `get_cuda_rng_tracker().fork()` even at p=0. The module
    #    looks its tracker class up by name when it creates one, so a CPU-generator subclass is
    #    swapped in there and any tracker already created is dropped.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = _make_cpu_rng_tracker_class()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    # 4. With tied embeddings and PP>1 the last stage's copy of the embedding is synchronised from the
    #    first stage in LanguageModule.setup_embeddings_and_output_layer, which first moves it with
    #    `weight.data.cuda()`. Inside that one call, Tensor.cuda keeps the tensor where it is.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original_setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        with _tensor_cuda_is_identity():
            return original_setup(self, *args, **kwargs)

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer
    _applied = True
    log.debug("megatron-core CPU compat patches applied")
    return True


def apply_megatron_fixes() -> None:
    """Work around megatron-core 0.16.1 bugs that hit CPU and GPU hosts alike; idempotent.

    Without Transformer Engine, transformer/moe/moe_utils.py never defines `te_general_gemm` (its
    import sits in a try block whose except only sets HAVE_TE=False), yet the MoE router's
    RouterGatingLinearFunction tests `te_general_gemm is not None` and raises NameError. Defining
    it as None selects the torch.mm path that the code intends when TE is absent.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
