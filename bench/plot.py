"""Plot bench_sync.py results: effective GB/s per path and model, against the raw NCCL ceiling."""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _times(rec, key):
    xs = rec.get(key + "_s_rx") or rec.get(key + "_s")
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results")
    p.add_argument("--out", default="docs/bench_sync.png")
    p.add_argument(
        "--no-checksum",
        action="store_true",
        help="leave out the *_csum paths (e.g. a run measured before the checksum kernel changed)",
    )
    ns = p.parse_args()
    res = json.load(open(ns.results))
    recs = res["nccl_1to1"]
    keys = ["raw", "naive"] + sorted(
        {k[:-2] for r in recs for k in r if k.startswith("bus_") and k.endswith("_s")},
        key=lambda k: (int(k.split("_")[1][:-3]), "csum" in k),
    )
    if ns.no_checksum:
        keys = [k for k in keys if not k.endswith("_csum")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        vals = [r["bytes"] / 1e9 / _times(r, key) for r in recs]
        ax.bar([j + i * width for j in range(len(recs))], vals, width, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(recs))])
    ax.set_xticklabels([f"{r['model']} ({r['bytes'] / 1e9:.1f} GB)" for r in recs])
    ax.set_ylabel("effective GB/s (engine has all weights)")
    ax.set_title(f"weight sync 1→1, {res['device']} x{res['gpus']}, NCCL {res['nccl']}, {res['date']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(ns.out, dpi=110)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
