"""The worker's side of sglang_export.py: our slot tables as a CUDA IPC destination table, made in SGLang's TP
worker, where the parameters live.

sglang_loader.load hands an export call here (its first entry is named `sglang_loader.EXPORT` + `request(...)`'s
text): the layouts asked for (sglang_loader.layout_key, in bucket order) must all have a slot table whose every
tensor lies whole in one region of one parameter (`Table.dests`); their parameters' storages are then shared by
CUDA IPC here (weightsync/bus/ipc/handles.py `share`, as the built-in engine's `writable_params` are in its
own process) and the table, `weightsync.bus.ipc.trainer_writes.offer`'s IpcDestinations, is written into a file of
rollout-svc's private directory: under another name first, then renamed, so that a half-written table is never
read. sglang_loader reports (seq, status, the file's size, how) in the call's result row.

At `tp_size` > 1 (the request says `sharded`) each TP rank writes a file of its own (`table_path(..., rank)`)
for rollout-svc's own writes (sglang_shards.py), never for the trainer's: one entry per `Piece` of the rank's
slot tables (shard_copy.py: a row range, a column range's rows, or a tensor held whole), its destination the
entry's bytes (a flat uint8 region of a parameter) and its geometry in the entry's name (`piece_name`).

Imported by SGLang's worker: torch and the bus only (and never sglang_loader: it imports this module).
"""

from __future__ import annotations

import json
import logging
import os

import torch

log = logging.getLogger(__name__)

#: row[4] of an export call: the table is in the file; a layout has no table yet; a layout never will
EXPORTED, UNLEARNED, UNWRITABLE = 4, 5, 6
#: a table is a few hundred bytes per tensor and per allocation: far below this at any model size we sync
MAX_TABLE_BYTES = 64 << 20
#: tests stand in for CUDA IPC sharing (a flat uint8 tensor of a whole storage -> CudaIpcHandle)
share_storage = None


def request(seq: int, out_dir: str, keys: list[str], sharded: bool = False) -> str:
    """The export call's request text (after sglang_loader.EXPORT); `sharded`: a pieces table per TP rank."""
    return json.dumps([seq, out_dir, list(keys), bool(sharded)], separators=(",", ":"))


def table_path(out_dir: str, seq: int, rank: int | None = None) -> str:
    """Where the worker writes call `seq`'s table (`rank`: a sharded export's, one file per TP rank)."""
    return os.path.join(out_dir, f"table-{seq}.pb" if rank is None else f"table-{seq}-r{rank}.pb")


def piece_name(key: str, slot: int, src: int, rows: int, row_bytes: int, stride: int) -> str:
    """A sharded table's entry name: the bucket layout and where in the bucket the piece's bytes are."""
    return json.dumps([key, slot, src, rows, row_bytes, stride], separators=(",", ":"))


def read_piece_name(name: str) -> tuple[str, int, int, int, int, int]:
    key, slot, src, rows, row_bytes, stride = json.loads(name)
    return str(key), int(slot), int(src), int(rows), int(row_bytes), int(stride)


def seq_of(text: str) -> int:
    return int(json.loads(text)[0])


def export(model: torch.nn.Module, text: str, rank: int = 0) -> tuple[int, int]:
    """Answer request `text` (module docstring) as TP rank `rank`: (how, the table file's size, 0 when none
    was written)."""
    seq, out_dir, keys, *more = json.loads(text)
    sharded = bool(more and more[0])
    keys = [str(k) for k in keys]
    how, data = _pieces_table(model, keys) if sharded else _table(model, keys)
    if data is None:
        return how, 0
    path = table_path(str(out_dir), int(seq), rank if sharded else None)
    with open(path + ".part", "wb") as f:
        f.write(data)
    os.replace(path + ".part", path)
    return how, len(data)


def _table(model: torch.nn.Module, keys: list[str]) -> tuple[int, bytes | None]:
    """(how, the serialized IpcDestinations or None) for layouts `keys`, in order."""
    from weightsync.bus.ipc.trainer_writes import offer

    tables: dict = getattr(model, "_ws_slot_tables", None) or {}
    params, metas = [], []
    for key in keys:
        table = tables.get(key)
        if table is None:
            log.warning("layout %s has no slot table yet; nothing exported", key)
            return UNLEARNED, None
        if table.dests is None:
            log.warning("layout %s is written by SGLang's loader (%s); nothing exported", key, table.why)
            return UNWRITABLE, None
        params += table.dests
        metas += [s.meta for s in table.plan.slots]
    if any(p.data_ptr() % 4 for p in params):
        # the trainer's kernel writes 32-bit words (trainer_writes.check refuses such a table)
        log.warning("a destination does not start on a 4-byte boundary; nothing exported")
        return UNWRITABLE, None
    share = share_storage
    if share is None:
        from weightsync.bus.ipc.handles import share
    return EXPORTED, offer(None, params, share, wanted=metas).SerializeToString()


def _pieces_table(model: torch.nn.Module, keys: list[str]) -> tuple[int, bytes | None]:
    """(how, the serialized IpcDestinations of this rank's pieces, or None) for layouts `keys`."""
    from weightsync.bus.ipc.trainer_writes import offer
    from weightsync.bus.plan import TensorMeta

    tables: dict = getattr(model, "_ws_slot_tables", None) or {}
    regions, metas = [], []
    for key in keys:
        table = tables.get(key)
        if table is None:
            log.warning("layout %s has no slot table yet; nothing exported", key)
            return UNLEARNED, None
        if not table.replays:
            log.warning("layout %s is written by SGLang's loader (%s); nothing exported", key, table.why)
            return UNWRITABLE, None
        for p in table.pieces if table.pieces is not None else _whole_pieces(table):
            region = p.dst.detach().reshape(-1).view(torch.uint8)
            regions.append(region)
            name = piece_name(key, p.slot, p.src, p.rows, p.row_bytes, p.stride)
            metas.append(TensorMeta(name, (p.nbytes,), torch.uint8))
    share = share_storage
    if share is None:
        from weightsync.bus.ipc.handles import share
    return EXPORTED, offer(None, regions, share, wanted=metas).SerializeToString()


def _whole_pieces(table) -> list:
    """A table of whole tensors (`dests`) as pieces: each slot one row of its whole bytes."""
    from weightsync.bus.copy.shard_copy import Piece

    out = []
    for i, (slot, dst) in enumerate(zip(table.plan.slots, table.dests)):
        nb = slot.meta.nbytes
        out.append(Piece(i, slot.offset, 1, nb, nb, dst))
    return out
