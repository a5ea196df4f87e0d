#!/usr/bin/env bash
# Issue 34: SGLang 0.5.10's real Engine on one GPU behind `rollout-svc --engine sglang`, synced from a
# megatron trainer over ipc and tcp, and nccl when 2 GPUs are visible (bench/sglang_live.py). One command,
# fits one 10-minute device call:
#
#   WS_SGLANG_WHL=<dir of SGLang's wheels> [WS_PEAKED_DIR=<dir>] [LIVE_ARGS=--timing-model=1.5b] bash bench/sglang_live.sh
# (LIVE_ARGS="--concurrency 16": also 16 concurrent one-prompt requests against the same 16 in sequence;
#  LIVE_ARGS="--transports=ipc,nccl --tp-size 2" on 2 GPUs: SGLang tp_size=2, bytes read per TP rank recorded;
#  LIVE_ARGS="--timing-only --timing-model=7b --timing-dtype=fp8-block": block-FP8 syncs, SGLang serving a
#  block-FP8 checkpoint, against the built-in engine in the same run)
#
# WS_PEAKED_DIR: bench/peaked_model.py's checkpoints (a small Qwen2 trained to decisive next-token margins,
# so the greedy comparison with transformers is strict); made there first if the folder has none.
# Without it the trainer holds random weights of the Qwen2.5-0.5B shape (greedy ties, see docs/sglang.md).
#
# Wheels: the services' (.whl/: grpcio, protobuf, megatron-core, fastapi, ...) and SGLang's
# ($WS_SGLANG_WHL: sglang 0.5.10 + its light deps; docs/sglang.md lists them), installed --no-deps into
# /tmp/site. sgl_kernel and flashinfer cannot be installed on the host: the harness shim
# (tests/support/sgl_kernel_shim.py) stands in, loaded in every process by sitecustomize.
# Output: $OUT/sglang_live.json (copy it to bench/results/sglang_live_<device>_<date>.json), its log
# sglang_live.txt and the services' logs in logs.tgz.
set -uo pipefail
. "$(dirname "$0")/sglang_env.sh"
# NCCL's own reason for a failed init in the services' logs (the 2026-11-25b run had only "unhandled cuda error")
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
PEAKED=()
if [ -n "${WS_PEAKED_DIR:-}" ]; then
  [ -f "$WS_PEAKED_DIR/peaked_report.json" ] || python3 bench/peaked_model.py --out "$WS_PEAKED_DIR" \
    || { echo "training the peaked model failed" >&2; exit 3; }
  PEAKED=(--peaked "$WS_PEAKED_DIR")
fi
# the JSON's `shell_command`: this recipe's own line (its `command` is the python line below)
export WS_LIVE_COMMAND=${WS_LIVE_COMMAND:-"WS_PEAKED_DIR=${WS_PEAKED_DIR:-} LIVE_TIMEOUT=${LIVE_TIMEOUT:-480} LIVE_ARGS=\"${LIVE_ARGS:-}\" bash bench/sglang_live.sh"}
timeout ${LIVE_TIMEOUT:-480} python3 bench/sglang_live.py --out "$OUT/sglang_live.json" "${PEAKED[@]}" ${LIVE_ARGS:-} 2>&1 \
  | tee "$OUT/sglang_live.txt"
rc=$?
# the services' logs as one file (a device call brings back at most 8)
[ -d "$OUT/logs" ] && tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit $rc
