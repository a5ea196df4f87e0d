#!/usr/bin/env bash
# One or two GPUs: SGLang's real engine behind rollout-svc, synced from a megatron trainer (bench/sglang_live.sh, which needs WS_SGLANG_WHL; see docs/sglang.md).
exec bash "$(dirname "$0")/../sglang_live.sh" "$@"
