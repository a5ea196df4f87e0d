"""The top of a sync profile (weightsync/obs/sync_profile.py, the `profile_syncs` debug switch): the functions with the
most time of their own and the most cumulative time, per sync.

    python bench/profile_summary.py /tmp/prof/trainer.pstats.1234 [--syncs 12] [--top 25]
"""

from __future__ import annotations

import argparse
import io
import pstats
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="pstats files written by the `profile_syncs` debug switch")
    ap.add_argument(
        "--syncs", type=int, default=1, help="syncs the file covers (all but the first): times are divided by it"
    )
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for path in args.files:
        st = pstats.Stats(path)
        total = st.total_tt / args.syncs
        print(f"== {path}: {total * 1e3:.2f} ms of profiled host time per sync ({args.syncs} syncs)")
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(path, stream=out).sort_stats(key).print_stats(args.top)
            print(f"-- by {key}")
            body = out.getvalue()
            print(body[body.find("   ncalls") :])
    return 0


if __name__ == "__main__":
    sys.exit(main())
