"""Summarise what bench/profile/sitecustomize.py recorded: medians per timed piece, then the last
three syncs' stream phases as one timeline of both services (ms from the stream's start).

    python3 bench/profile/summarize.py /tmp/prof
"""

import glob
import json
import os
import statistics
import sys

out = sys.argv[1]
evs, T = [], {}
for f in glob.glob(os.path.join(out, "*_*.json")):
    try:
        d = json.load(open(f))
    except Exception:
        continue
    if not d["T"]:
        continue
    for k, v in d["T"].items():
        T.setdefault(k, []).extend(v)
    evs += [tuple(e) for e in d["EV"]]
    if d.get("missing"):
        print(f"{os.path.basename(f)}: not timed (not found): {', '.join(d['missing'])}")
for k in sorted(T):
    v = T[k]
    print(f"{k:22s} n={len(v):4d} median {statistics.median(v) * 1e3:8.3f} ms  max {max(v) * 1e3:8.3f}")
evs.sort(key=lambda e: e[1])
sends = [e for e in evs if e[0] == "t._send"]
for s in sends[-3:]:
    s0, s1 = s[1], s[2]
    print(f"--- stream (_send) {1e3 * (s1 - s0):.2f} ms; events relative to its start (ms):")
    for k, a, b in evs:
        if s0 - 0.003 <= a <= s1 + 0.003 and k != "t._send":
            print(f"   {k:20s} {1e3 * (a - s0):8.3f} -> {1e3 * (b - s0):8.3f}  ({1e3 * (b - a):.3f})")
syncs = [e for e in evs if e[0] == "t.sync"]
for s in syncs[-3:]:
    s0, s1 = s[1], s[2]
    print(f"--- sync (t.sync) {1e3 * (s1 - s0):.2f} ms, both services; events relative to its start (ms):")
    for k, a, b in evs:
        if s0 <= a <= s1 and k != "t.sync":
            print(f"   {k:20s} {1e3 * (a - s0):8.3f} -> {1e3 * (b - s0):8.3f}  ({1e3 * (b - a):.3f})")
