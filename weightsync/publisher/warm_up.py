"""Compile a publisher's GPU kernels at start-up instead of in the first sync after it.

The bucket checksum (Triton) costs about a second to compile, the FP8 quantizer about as much per
shape class; a first sync that paid them would miss latency targets for no reason. Global rank 0
packs and checksums every sync's buckets; with `--senders all` every other rank packs, checksums
and (fp8-block) quantizes its own, so it warms the same kernels for the tensors it owns.
"""

from __future__ import annotations

import logging

from weightsync.bus.copy.checksum import warm_up as bucket_checksum_warm_up
from weightsync.formats.fp8.warm import warm_fused_write, warm_quantize, warm_quantize_slots

log = logging.getLogger(__name__)


def warm_up(device, metas, quantized: bool, who: str = "trainer") -> None:
    """`metas`: the tensors this process quantizes (used only when `quantized`)."""
    took = bucket_checksum_warm_up(device)
    if took:
        log.info("%s: checksum kernel ready on %s in %.2fs", who, device, took)
    if quantized:
        took = warm_quantize(metas, device)
        # a one-rank actor's flat buckets quantize in place (trainer_svc/actor/megatron/flat_export.py)
        took += warm_quantize_slots(device)
        # and writes them dequantized into a colocated engine (ipc trainer_writes, fp8_write.py)
        took += warm_fused_write(device)
        if took:
            log.info("%s: FP8 quantize kernels ready on %s in %.2fs", who, device, took)
