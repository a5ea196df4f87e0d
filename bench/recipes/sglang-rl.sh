#!/usr/bin/env bash
# One GPU: the RL loop colocated with SGLang, its memory released for every train step; reward, exact syncs, peak memory released vs held (bench/sglang_live.sh --colocated-rl, needs WS_SGLANG_WHL; docs/sglang.md).
LIVE_ARGS="--colocated-rl ${LIVE_ARGS:-}" exec bash "$(dirname "$0")/../sglang_live.sh" "$@"
