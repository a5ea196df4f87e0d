"""rollout-svc writes NCCL and TCP buckets into every SGLang TP rank's shards itself (issue 47, tp_size > 1).

At `tp_size` 1 rollout-svc maps the table SGLang's worker exports and writes each bucket into SGLang's parameters
with the in-place apply's copy (sglang_mapped.py). At `tp_size` > 1 a rank holds only parts of most tensors, so
each rank exports a table of its own (sglang_export_worker.py `_pieces_table`): per `Piece` of its slot tables
(weightsync/bus/copy/shard_copy.py: a row range, a column range's rows, a tensor held whole, fused qkv/gate_up
included), where in the bucket the bytes are and the parameter region they go to. rollout-svc maps every rank's
table (each allocation opens on its own GPU) and writes each received bucket into every rank with the shard copy
(`copy_sharded_all`: the copy-and-checksum kernel, aligned rows and short column rows):

- a rank on the receive GPU: the kernel there, as SGLang's own worker would run it;
- a rank on another GPU: one peer copy of the bucket to the rank's GPU (a staging buffer kept per GPU), then the
  kernel there. The kernel on the receive GPU could write the other GPU's memory through peer access, moving
  only the rank's shard over NVLink, and does so for ordinary allocations; but into memory mapped from another
  process by CUDA IPC (SGLang's parameters) it faulted with an illegal address on 2xH200 (torch 2.11, CUDA 13,
  2026-11-28, tests/gpu/test_sglang_peer_write_gpu.py), so `peer_writes` is off unless a deployment proves it.

Each rank's copy reports its `common` and `shard` word sums, combined as the workers' are (sglang_direct._combined):
the ranks' `common` sums agree and their `shard` sums add up to the bucket's, so the transaction's check after
the write (apply_inplace.py) proves every rank holds the trainer's bytes. `bytes_per_rank` reports the bucket
bytes each rank's copy read. The guarantees are sglang_mapped.py's: only while an in-place sync holds SGLang
paused, an abort after a written bucket leaves the rollout STALE, the first sync of a layout goes through
SGLang's loader (that is how the tables are learnt), a layout no mapped table covers goes through it too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from rollout_svc.engine import sglang_loader as sl
from rollout_svc.engine.sglang_export_worker import read_piece_name
from weightsync.bus.copy import shard_copy
from weightsync.bus.copy.shard_copy import Piece
from weightsync.bus.copy.verified_copy import PendingChecksum

log = logging.getLogger(__name__)
#: prepared copy tables kept (per rank and layout)
MAX_PREPARED = 512


def map_shard_tables(tables: Sequence, open_allocation) -> dict[str, list[list[Piece]]]:
    """layout key -> per TP rank, its pieces with destinations mapped into this process (`open_allocation`: a
    CUDA IPC handle -> the flat uint8 storage it names); ValueError naming the entry that does not fit."""
    out: dict[str, list[list[Piece]]] = {}
    for rank, table in enumerate(tables):
        maps = [open_allocation(h) for h in table.allocations]
        for t in table.tensors:
            key, slot, src, rows, row_bytes, stride = read_piece_name(t.name)
            if not 0 <= t.allocation < len(maps):
                raise ValueError(f"TP rank {rank} entry {t.name}: allocation {t.allocation} of {len(maps)}")
            whole = maps[t.allocation]
            if t.nbytes != rows * row_bytes or t.offset < 0 or t.offset + t.nbytes > whole.numel():
                raise ValueError(
                    f"TP rank {rank} entry {t.name}: {t.nbytes} bytes at offset {t.offset} do not fit "
                    f"{rows} rows of {row_bytes} bytes inside its allocation of {whole.numel()} bytes"
                )
            dst = whole[t.offset : t.offset + t.nbytes]
            out.setdefault(key, [[] for _ in tables])[rank].append(Piece(slot, src, rows, row_bytes, stride, dst))
    for key, ranks in out.items():
        empty = [r for r, ps in enumerate(ranks) if not ps]
        if empty:
            raise ValueError(f"layout {key}: TP rank {empty[0]} exported no piece of it (the ranks' tables differ)")
    return out


def write_rank(plan, buf: torch.Tensor, pieces: list[Piece], cache: dict, peer: bool, stages: dict) -> torch.Tensor:
    """Copy one rank's pieces of bucket `plan` out of `buf` and return its int64 [2, 2] (`common`, `shard`)
    sums, queued on the current streams: from `buf` itself when the rank's memory is on `buf`'s device or
    `peer` (the kernel on `buf`'s GPU writes through peer access), else from a copy of the bucket on the
    rank's GPU (`stages`: device -> a staging buffer kept there)."""
    dev = pieces[0].dst.device
    src = buf
    if dev != buf.device and not peer:
        stage = stages.get(dev)
        if stage is None or stage.numel() < plan.nbytes:
            stage = stages[dev] = torch.empty(plan.nbytes, dtype=torch.uint8, device=dev)
        src = stage[: plan.nbytes]
        src.copy_(buf[: plan.nbytes])  # torch orders it after the receive GPU's stream and before the kernel
    if len(cache) >= MAX_PREPARED:
        cache.clear()
    # per rank and layout (a rank's pieces of one layout are one list): the copy's tables count from the
    # bucket's buffer, so the receiver's fresh buffers of a later sync reuse them
    prepared = cache.setdefault(id(pieces), {})
    if src.is_cuda:
        with torch.cuda.device(src.device):
            return shard_copy.copy_sharded_all([plan], [src], [pieces], prepared, src_relative=True)[0]
    return shard_copy.copy_sharded_all([plan], [src], [pieces], prepared, src_relative=True)[0]


def enable_peer(a: torch.device, b: torch.device) -> bool:
    """Whether kernels on GPU `a` may write GPU `b`'s memory, enabling it (both ways) if so: torch enables
    peer access between two GPUs at their first copy (at::cuda::get_p2p_access)."""
    if a == b:
        return True
    if a.type != "cuda" or b.type != "cuda" or not torch.cuda.can_device_access_peer(a.index, b.index):
        return False
    x, y = torch.zeros(1, device=a), torch.zeros(1, device=b)
    y.copy_(x)
    x.copy_(y)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    return True


class SglangShardsMixin:
    """Expects SglangMappedMixin (`open_allocation`, `writing_in_place`, `_rollout_writes_declined`) and
    SglangDirectMixin (`_count_bytes`)."""

    #: layout key -> per TP rank, its pieces mapped into this process
    _shard_pieces: dict[str, list[list[Piece]]] | None = None
    #: True: the receive GPU's kernel writes a rank on another GPU through peer access; off by default: it faulted
    #: writing CUDA-IPC-mapped memory (the module's docstring), so that rank gets a peer copy of the bucket first
    peer_writes: bool = False

    def map_shards(self, tables: Sequence) -> int:
        """Map every TP rank's exported table (sglang_export.py); the number of layouts now covered."""
        got = map_shard_tables(tables, self.open_allocation)  # type: ignore[attr-defined]
        self._shard_pieces = {**(self._shard_pieces or {}), **got}
        return len(got)

    def write_shards(self, plan, buf: torch.Tensor) -> PendingChecksum | None:
        """Write bucket `plan` (bytes in `buf`, received by rollout-svc over NCCL or TCP) into every TP rank's
        mapped shards and return its checksum (every rank's copy done); None (nothing written) when no mapped
        table covers its layout, SGLang is not held paused by an in-place sync, or `buf` is a trainer's IPC
        buffer."""
        if not self._shard_pieces or not self.writing_in_place or self._rollout_writes_declined():  # type: ignore[attr-defined]
            return None
        from weightsync.bus.ipc.handles import source_handle

        if source_handle(buf) is not None:
            # a colocated IPC bucket (the trainer's own buffer) keeps going to the ranks as per-rank handles
            # (sglang_peer.py), the path measured at tp 2; this write is for buffers rollout-svc received
            return None
        key = sl.layout_key(plan)
        ranks = self._shard_pieces.get(key)
        if ranks is None:
            return None
        checked = self.__dict__.setdefault("_shards_checked", {})
        if key not in checked:  # once per layout: the mapped geometry against the bucket's plan
            why = next((w for w in (shard_copy.check(plan, ps) for ps in ranks) if w), "")
            if why:  # (the worker checked the same pieces: a table that does not fit is a defect, not a state)
                log.error(
                    "bucket %d: the mapped shard table does not fit its layout (%s); SGLang's loader writes it",
                    plan.index,
                    why,
                )
                del self._shard_pieces[key]
                return None
            checked[key] = [shard_copy.bytes_read(plan, ps) for ps in ranks]
        read = checked[key]
        cache = self.__dict__.setdefault("_shard_prepared", {})
        stages = self.__dict__.setdefault("_shard_stages", {})
        peer = self.__dict__.setdefault("_peer_ok", {})
        with self.timed("shard_writes"):  # type: ignore[attr-defined]
            sums = []
            for pieces in ranks:
                dev = pieces[0].dst.device
                if (buf.device, dev) not in peer:
                    peer[(buf.device, dev)] = bool(self.peer_writes) and enable_peer(buf.device, dev)
                sums.append(write_rank(plan, buf, pieces, cache, peer[(buf.device, dev)], stages))
            total = _combined(plan.index, [s.cpu().tolist() for s in sums])
        self._count_bytes(plan.nbytes, buf, read, moved=False)  # type: ignore[attr-defined]
        whole = plan.nbytes - plan.nbytes % 4
        return PendingChecksum(total, buf[whole : plan.nbytes].cpu(), plan.nbytes)

    def drop_shards(self) -> None:
        for name in ("_shard_pieces", "_shards_checked", "_shard_prepared", "_shard_stages", "_peer_ok"):
            self.__dict__.pop(name, None)


def _combined(index: int, ranks: list[list[list[int]]]) -> torch.Tensor:
    """The bucket's [sum, sum of squares] from every rank's [[common], [shard]] sums (wrapping int64)."""
    from rollout_svc.engine.sglang_direct import _int64
    from weightsync.bus.errors import SyncError

    commons = {tuple(r[0]) for r in ranks}
    if len(commons) != 1:
        raise SyncError(f"bucket {index}: the TP ranks' copies read different bytes ({sorted(commons)})", "DATA_LOSS")
    c1, c2 = commons.pop()
    s1 = sum(r[1][0] for r in ranks)
    s2 = sum(r[1][1] for r in ranks)
    return torch.tensor([_int64(c1 + s1), _int64(c2 + s2)], dtype=torch.int64)
