#!/usr/bin/env bash
# Issue 47 item 3: the RL CLI itself, `python -m weightsync.rl --engine sglang`, on one GPU: a megatron trainer
# and one SGLang rollout colocated (enable_memory_saver, released for every train step), from random weights of
# bench/peaked_model.py's shape, the demo's target-tokens task; exits 1 unless the reward rises by RL_MARGIN.
# (bench/sglang_live.py --colocated-rl measures memory; this checks the CLI path end to end.) One device call:
#
#   WS_SGLANG_WHL=<dir of SGLang's wheels> [RL_STEPS=12] bash bench/sglang_rl_cli.sh
#
# Wheels and the sgl_kernel shim: bench/sglang_env.sh. Output: $OUT/rl_cli.json (the per-step records),
# rl_cli.txt (the CLI's table), rl_cli.png, the services' logs in logs.tgz.
set -uo pipefail
. "$(dirname "$0")/sglang_env.sh"
WORK=$(mktemp -d /tmp/ws-rl-cli-XXXX)
python3 - "$WORK/model" <<'PY' || { echo "writing the start model failed" >&2; exit 3; }
import sys
from pathlib import Path
from bench import peaked_model
from bench.sglang_live import save_random_hf
cfg = Path(sys.argv[1] + "-cfg")
peaked_model.config().save_pretrained(str(cfg))
save_random_hf(cfg, Path(sys.argv[1]), seed=2)
PY
# the harness's SGLang settings (bench/sglang_live.py SGLANG_ARGS): no sgl_kernel on these hosts
SGL=()
for kv in attention_backend=triton sampling_backend=pytorch disable_cuda_graph=true \
  disable_piecewise_cuda_graph=true mem_fraction_static=0.25 context_length=2048 grammar_backend=none; do
  SGL+=(--sglang-arg "$kv")
done
timeout ${RL_TIMEOUT:-200} python3 -m weightsync.rl --engine sglang --backend megatron --model "$WORK/model" \
  --rollouts 1 --steps "${RL_STEPS:-12}" --lr 1e-2 --quiet --workdir "$WORK/run" --json "$OUT/rl_cli.json" \
  --plot "$OUT/rl_cli.png" --require-learning "${RL_MARGIN:-0.3}" "${SGL[@]}" 2>&1 | tee "$OUT/rl_cli.txt"
rc=$?
tar czf "$OUT/logs.tgz" -C "$WORK/run" . 2>/dev/null
exit $rc
