"""Our loader at SGLang tp_size=2, through SGLang's own parallel layers on CPU: one process per TP rank (a gloo
world of 2, SGLang's `init_distributed_environment` / `initialize_model_parallel`), each building its rank's
model and loading every bucket through SGLang's `update_weights_from_tensor` with our `load_format`.

`python -m tests.sglang_exec.tp_checks <version>` starts the two ranks (`... <version> <rank> <port>`), each of
which prints its rows; it prints RESULT_MARK + JSON {check: "ok" | traceback} as exec_checks does. Checked: each
rank's parameters equal, exactly, a model of the same rank that SGLang's own flattened-bucket path loaded; the
second sync is written by the slot table with shards (BY_TABLE); the ranks' sums, combined as the rollout
combines them (sglang_direct._combined), give each bucket's checksum; each rank read about its shard, not the
whole bucket. Then each rank exports its table of pieces through SGLang's `update_weights_from_tensor` (our
EXPORT entry; sglang_export_worker.py, one file per rank), the table is mapped as rollout-svc maps it (CUDA IPC
stood in for) and a third sync is written by rollout-svc's shard copy (rollout_svc/engine/sglang_shards.py
`write_rank`) with no SGLang call: the same exact parameters, and the ranks' sums again give each checksum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import torch

from tests.support.sglang_site import RESULT_MARK, activate

FAMILIES = ("tiny-qwen2", "tiny-qwen3-moe")
TP = 2


def rank_main(version: str, rank: int, port: int) -> None:
    activate(version)
    from tests.sglang_exec.sglang_side import init_tp

    init_tp(rank, TP, port)
    out = {}
    for family in FAMILIES:
        try:
            out[family] = _rank_syncs(family, rank)
        except Exception:  # reported to the parent, which fails the check with it
            out[family] = {"error": traceback.format_exc(limit=-8)}
    print(RESULT_MARK + json.dumps(out), flush=True)


def _rank_syncs(family: str, rank: int) -> dict:
    """Two syncs of `family` at this rank: its result rows and each bucket's own checksum, per sync."""
    from rollout_svc.engine import sglang_loader as sl
    from tests.sglang_exec.direct_checks import _params, register_loader
    from tests.sglang_exec.exec_checks import _model, adapter, packed_buckets, trainer_export
    from tests.sglang_exec.sglang_side import SglangSide
    from weightsync.bus.copy.checksum import bucket_checksum

    syncs, model, side, pieces = [], None, None, None
    for seq0, seed in ((100, 3), (200, 4), (300, 5)):
        cfg, named = trainer_export(family, seed=seed)
        if model is None:
            model = _model(cfg)
            side = SglangSide(model)
            register_loader(side)
        ref = _model(cfg)
        ref_eng = adapter(SglangSide(ref))
        rows, sums = [], []
        buckets = packed_buckets(named)
        if seq0 == 300:  # rollout-svc writes this sync from the ranks' exported tables
            pieces = _export_pieces(side, [sl.layout_key(plan) for plan, _ in buckets], rank)
            calls = len(side.calls)
        for k, (plan, buf) in enumerate(buckets):
            if pieces is not None:
                rows.append(_written_by_rollout(plan, buf, pieces, seq0 + k))
            else:
                results = [torch.zeros(1, sl.RESULT_WORDS, dtype=torch.int64) for _ in range(TP)]
                entries = [(sl.header(seq0 + k, plan), buf)] + [(sl.RESULT, r) for r in results]
                side.update_weights_from_tensor(named_tensors=entries, load_format=sl.LOADER)
                rows.append(results[rank][0].tolist())
            whole = plan.nbytes - plan.nbytes % 4
            sums.append(
                [plan.index, plan.nbytes, bucket_checksum(buf[: plan.nbytes]), buf[whole : plan.nbytes].tolist()]
            )
            ref_eng._send_flattened(ref_eng.bucket_payloads(plan, buf))  # SGLang's own path, this rank
        mine, theirs = _params(model), _params(ref)
        differ = [n for n, t in theirs.items() if not torch.equal(mine[n], t)]
        assert not differ, f"rank {rank}: our loader's parameters differ from SGLang's loader's: {differ[:5]}"
        syncs.append({"rows": rows, "buckets": sums})
    assert len(side.calls) == calls, "SGLang was called while rollout-svc wrote the shards"
    return {"syncs": syncs}


def _export_pieces(side, keys: list[str], rank: int) -> dict:
    """This rank's table of pieces, exported through SGLang's update_weights_from_tensor (our EXPORT entry) and
    mapped as rollout-svc maps it: layout key -> this rank's pieces."""
    import tempfile

    from rollout_svc.engine import sglang_export_worker as worker
    from rollout_svc.engine import sglang_loader as sl
    from rollout_svc.engine.sglang_export import SglangExportMixin
    from rollout_svc.engine.sglang_shards import map_shard_tables
    from tests.sglang_exec.export_checks import _FakeIpc

    ipc, out_dir = _FakeIpc(), tempfile.mkdtemp(prefix="ws-tp-tables-")
    worker.share_storage = ipc.share
    try:
        results = [torch.zeros(1, sl.RESULT_WORDS, dtype=torch.int64) for _ in range(TP)]
        ask = torch.zeros(1, dtype=torch.uint8)
        entries = [(sl.EXPORT + worker.request(7, out_dir, keys, sharded=True), ask)]
        side.update_weights_from_tensor(
            named_tensors=entries + [(sl.RESULT, r) for r in results], load_format=sl.LOADER
        )
        seq, status, size, _, how = results[rank][0].tolist()[:5]
        assert (seq, status, how) == (7, sl.OK, worker.EXPORTED), f"rank {rank}'s export: {results[rank][0].tolist()}"
        table = SglangExportMixin._read_table(worker.table_path(out_dir, 7, rank), size)
        assert table is not None and not os.listdir(out_dir), "the rank's table file was not read whole and removed"
    finally:
        worker.share_storage = None
    got = map_shard_tables([table], ipc.open)
    assert sorted(got) == sorted(set(keys)), "the exported table does not cover every layout"
    return {key: ranks[0] for key, ranks in got.items()}


def _written_by_rollout(plan, buf, pieces: dict, seq: int) -> list[int]:
    """rollout-svc's write of this rank's pieces of one bucket, reported as the loader's result row."""
    from rollout_svc.engine import sglang_loader as sl
    from rollout_svc.engine.sglang_shards import write_rank
    from weightsync.bus.copy import shard_copy

    mine = pieces[sl.layout_key(plan)]
    assert not shard_copy.check(plan, mine), shard_copy.check(plan, mine)
    got = write_rank(plan, buf, mine, {}, True, {}).tolist()
    return [seq, sl.OK, *got[0], sl.BY_TABLE, 0, *got[1], shard_copy.bytes_read(plan, mine)]


def combine(family: str, ranks: list[dict]) -> None:
    """The parent's checks of one family from both ranks' reports (module docstring)."""
    from rollout_svc.engine import sglang_loader as sl
    from rollout_svc.engine.sglang_direct import _combined
    from weightsync.bus.copy.checksum import from_sums
    from weightsync.bus.plan import BucketPlan

    for r in ranks:
        assert "error" not in r, r.get("error")
    for s, (a, b) in enumerate(zip(ranks[0]["syncs"], ranks[1]["syncs"])):
        assert a["buckets"] == b["buckets"], "the ranks packed different buckets"
        read = [0, 0]
        for k, (index, nbytes, want, tail) in enumerate(a["buckets"]):
            rows = [a["rows"][k], b["rows"][k]]
            plan = BucketPlan(index=index)
            seq = rows[0][0]
            got = from_sums(torch.tensor(_combined(plan, rows, seq)), torch.tensor(tail, dtype=torch.uint8), nbytes)
            assert got == want, f"bucket {index}: the ranks' combined checksum is not the bucket's"
            how = {row[4] for row in rows}
            assert how == ({sl.LEARNED} if s == 0 else {sl.BY_TABLE}), f"sync {s} bucket {index}: written {how}"
            read = [read[0] + rows[0][8], read[1] + rows[1][8]]
        if s >= 1:
            total = sum(nbytes for _, nbytes, _, _ in a["buckets"])
            # the shards halve the matrices; norms, biases and alignment gaps every rank reads whole
            assert all(r < 0.6 * total for r in read), f"bytes read per rank {read} of {total}: not its shard"


def main(version: str) -> None:
    from tests.sglang_exec.sglang_side import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.sglang_exec.tp_checks", version, str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        for r in range(TP)
    ]
    reports, errors = [], []
    for p in procs:
        out, err = p.communicate(timeout=240)
        lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_MARK)]
        reports.append(json.loads(lines[0][len(RESULT_MARK) :]) if lines else None)
        errors.append(err[-4000:])
    results = {}
    for family in FAMILIES:
        name = f"tp2_shards[{family}]"
        try:
            assert all(reports), f"a rank printed no results:\n{errors}"
            combine(family, [rep[family] for rep in reports])
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=-8)
    print(RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(sys.argv[1])
