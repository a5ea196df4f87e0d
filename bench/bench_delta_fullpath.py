"""The rollout's CPU work per dense TCP bucket: the copy into its delta base, then the checked copy into the engine.

What a full sync costs the rollout per bucket besides the link, for comparing trees (the delta-apply
branch's extra word-sums pass at receipt against main, and against the sums taken from the checked
copy): one 16 MiB bucket of 16 bf16 tensors, median of `reps` after 3 warm-ups. Run each tree in turn:

    for t in main branch; do OMP_NUM_THREADS=1 python bench/bench_delta_fullpath.py /tmp/$t 30; done
"""

from __future__ import annotations

import json
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")

import torch  # noqa: E402

from rollout_svc.sync.delta_base import DeltaBase  # noqa: E402
from weightsync.bus.copy.verified_copy import copy_into  # noqa: E402
from weightsync.bus.layout import ManifestCache  # noqa: E402
from weightsync.bus.plan import TensorMeta  # noqa: E402


def main() -> int:
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    torch.manual_seed(0)
    metas = [TensorMeta(f"w{i}", (1 << 19,), torch.bfloat16) for i in range(16)]
    m = ManifestCache().manifest(metas, version=1, sync_id="s1", bucket_bytes=16 << 20)
    (plan,) = m.buckets
    dense = torch.randint(0, 256, (plan.nbytes,), dtype=torch.uint8)
    params = [torch.empty(mm.shape, dtype=mm.dtype) for mm in metas]
    base = DeltaBase()
    base.prepared(m, None, 0, "", False)
    writer = base.for_sync("s1")
    keeper = getattr(base, "sums_keeper", None)  # trees without it sum at receipt, or keep no sums

    def one():
        buf = writer.received(plan, dense)
        if keeper is not None:
            copy_into(plan, buf, params, sums_to=keeper("s1", plan.index, buf))
        else:
            copy_into(plan, buf, params)

    for _ in range(3):
        one()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        one()
        ts.append(time.perf_counter() - t0)
    print(json.dumps({"tree": sys.argv[1], "median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
