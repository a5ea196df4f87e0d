#!/usr/bin/env bash
# Set up a virtualenv (CPU torch) and run the main job on this machine with a tiny model:
#  1. the sync demo: trainer-svc + 2 rollout-svc, syncs through wsctl, exactness report;
#  2. the RL loop: generate → reward → GRPO step on the megatron-core actor → sync, 20 steps,
#     per-step table and a PNG plot (reward rises from chance as the weights reach the rollouts).
set -euo pipefail
. "$(dirname "$0")/_venv.sh" demo
OUTDIR=${OUTDIR:-runs/demo}
mkdir -p "$OUTDIR"
python -m weightsync.demo --workdir "$OUTDIR/sync"
python -m weightsync.rl --steps 20 --backend megatron --workdir "$OUTDIR/rl" --plot "$OUTDIR/rl.png" \
    --require-learning 0.3 "$@"
echo "plot: $OUTDIR/rl.png   logs: $OUTDIR"
