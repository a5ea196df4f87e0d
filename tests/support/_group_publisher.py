"""torchrun worker for tests/unit/weightsync/publisher/test_group_publisher.py: a Publisher over a
2-rank gloo group (the whole job of 2, or global ranks 1 and 2 of a job of 3), no rollout. Each
rank prints `RESULT <json>` per case: the error it raised (every rank must raise the same one) or
what sync() returned."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from weightsync.publisher import Publisher, SyncOptions

SPEC = {
    "embed.weight": ((8, 4), torch.float32),
    "norm.weight": ((4,), torch.float32),
    "layer.0.weight": ((4, 4), torch.float32),
    "layer.1.weight": ((4, 4), torch.float32),
}
# a valid split: rank 0 owns the first two, rank 1 the last two
OWN = {0: ["embed.weight", "norm.weight"], 1: ["layer.0.weight", "layer.1.weight"]}


def tensors(names, rank, shape_of=None):
    return [(n, torch.full((shape_of or {}).get(n, SPEC.get(n, ((4,),))[0]), float(rank))) for n in names]


def _fails_on_rank_1(names, rank):
    yield from tensors(names[:1], rank)
    if rank == 1:
        raise KeyError("the user's export broke")
    yield from tensors(names[1:], rank)


def case(name, fn, rank):
    try:
        out = {"ok": True, **fn()}
    except Exception as exc:
        out = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
    # one write(2) of less than PIPE_BUF bytes: the two ranks' lines never interleave on the shared pipe
    out["error"] = out.get("error", "")[:2000]
    line = "RESULT " + json.dumps({"case": name, "rank": rank, **out}) + "\n"
    os.write(1, line.encode())


def main() -> int:
    dist.init_process_group("gloo")
    # two ranks: the whole job is the group; three: global ranks 1 and 2 form it, rank 0 stays out
    group = dist.group.WORLD if dist.get_world_size() == 2 else dist.new_group([1, 2])
    if dist.get_rank() not in dist.get_process_group_ranks(group):
        dist.barrier()
        dist.destroy_process_group()
        return 0
    rank = dist.get_rank(group)
    case("snapshot", lambda: Publisher(model=SPEC, group=group, snapshot=True) and {}, rank)
    case("ipc", lambda: Publisher(model=SPEC, group=group, options=SyncOptions(transport="ipc")) and {}, rank)
    pub = Publisher(model=SPEC, grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", group=group)
    pub.start()

    def sync(names, shape_of=None, items=None):
        r = pub.sync(tensors(names, rank, shape_of) if items is None else items)
        return {"version": r.version, "report_ok": r.ok, "rollouts": len(r.rollouts), "pub_version": pub.version}

    case("twice", lambda: sync(OWN[rank] + (["norm.weight"] if rank == 1 else [])), rank)
    case("missing", lambda: sync(OWN[rank][:1] if rank == 1 else OWN[rank]), rank)
    case("shape", lambda: sync(OWN[rank], {"layer.1.weight": (2, 4)} if rank == 1 else None), rank)
    case("unknown", lambda: sync(OWN[rank] + (["lm_head.weight"] if rank == 0 else [])), rank)
    case("raises", lambda: sync(None, items=_fails_on_rank_1(OWN[rank], rank)), rank)
    case("valid", lambda: sync(OWN[rank]), rank)
    case("valid-again", lambda: sync(OWN[rank]), rank)
    case("address", lambda: {"address": pub.address}, rank)
    pub.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main()
    # end without the interpreter's teardown of torch (seconds per process on a busy 2-core box)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
