#!/usr/bin/env bash
# End-to-end check of rollout-svc --engine sglang on a networked CUDA host (NOT run in this
# project's CI: its GPU hosts have no network to install SGLang). Needs docker with the NVIDIA
# runtime, >= 1 GPU, and an HF model directory with weights (MODEL_DIR, e.g. Qwen2.5-0.5B-Instruct).
#
#   MODEL_DIR=/models/Qwen2.5-0.5B-Instruct scripts/sglang_gpu_e2e.sh
#
# What it does, for TRANSPORT in nccl ipc:
#   1. builds (or pulls, with ROLLOUT_IMAGE=...) the rollout image from docker/rollout.Dockerfile,
#      and the trainer image from docker/trainer.Dockerfile (or TRAINER_IMAGE=...);
#   2. starts trainer-svc (backend hf, on cuda:0, transport $TRANSPORT) and
#      `rollout-svc serve --engine sglang` on the same host network (GPU 0; for ipc both share it);
#   3. `wsctl sync --transport $TRANSPORT`, then `wsctl export` of the trainer's tensors;
#   4. scores a fixed prompt on the rollout (Score RPC: teacher-forced log-probs; SGLang returns no
#      logits) and compares with transformers run on the exported directory (bf16 tolerance).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${MODEL_DIR:?set MODEL_DIR to an HF model directory with *.safetensors}"
ROLLOUT_IMAGE=${ROLLOUT_IMAGE:-weightsync-rollout:e2e}
TRAINER_IMAGE=${TRAINER_IMAGE:-weightsync-trainer:e2e}
WORK=${WORK:-$(mktemp -d /tmp/ws-sglang-e2e.XXXXXX)}
TOL=${TOL:-0.05}            # max |logprob difference| allowed (bf16 engine vs fp32 transformers)
TRAINER_PORT=50051; ROLLOUT_PORT=50061

if [[ -z "${PULL:-}" ]]; then
  docker build -f docker/rollout.Dockerfile -t "$ROLLOUT_IMAGE" .
  docker build -f docker/trainer.Dockerfile -t "$TRAINER_IMAGE" .
else
  docker pull "$ROLLOUT_IMAGE"; docker pull "$TRAINER_IMAGE"
fi

cleanup() { docker rm -f ws-e2e-trainer ws-e2e-rollout >/dev/null 2>&1 || true; }
trap cleanup EXIT

wsctl_() { docker exec ws-e2e-trainer wsctl --address "127.0.0.1:$TRAINER_PORT" --timeout 600 "$@"; }

wait_ready() {  # container, http port
  for _ in $(seq 1 180); do
    if docker exec "$1" python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$2/readyz', timeout=2)" 2>/dev/null; then return 0; fi
    sleep 5
  done
  echo "$1 not ready after 15 min"; docker logs --tail 200 "$1"; exit 1
}

for TRANSPORT in nccl ipc; do
  cleanup
  echo "=== transport $TRANSPORT"
  # --ipc=host: CUDA IPC handles and NCCL shared memory between the two containers.
  docker run -d --name ws-e2e-trainer --gpus all --network host --ipc=host -v "$MODEL_DIR:/model:ro" -v "$WORK:/work" \
    --entrypoint trainer-svc "$TRAINER_IMAGE" serve --backend hf --model /model --device cuda:0 --export-dtype bfloat16 \
    --transport "$TRANSPORT" --grpc-address "0.0.0.0:$TRAINER_PORT" --http-address 127.0.0.1:8081 \
    --no-auto-sync-new-rollouts
  wait_ready ws-e2e-trainer 8081
  docker run -d --name ws-e2e-rollout --gpus all --network host --ipc=host -v "$MODEL_DIR:/model:ro" \
    --entrypoint rollout-svc "$ROLLOUT_IMAGE" serve --engine sglang --model /model --tp 1 --dtype bfloat16 --device cuda:0 \
    --apply-mode inplace --trainer-address "127.0.0.1:$TRAINER_PORT" --grpc-address "0.0.0.0:$ROLLOUT_PORT" \
    --http-address 127.0.0.1:8082
  wait_ready ws-e2e-rollout 8082

  wsctl_ --json sync --transport "$TRANSPORT" | tee "$WORK/sync-$TRANSPORT.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['ok'] and all(x['ok'] for x in r['rollouts']), r" \
    "$WORK/sync-$TRANSPORT.json"
  wsctl_ export "/work/export-$TRANSPORT"

  # Score on the rollout, transformers on the export: the rollout must compute the trainer's function.
  docker run --rm -i --gpus all --network host -v "$WORK:/work" --entrypoint python "$TRAINER_IMAGE" - "$ROLLOUT_PORT" "/work/export-$TRANSPORT" "$TOL" <<'PY'
import sys
import torch
from transformers import AutoModelForCausalLM
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import rollout_pb2

port, export_dir, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
ids = [9707, 11, 1879, 0, 576, 525, 264, 1273, 315, 279, 4680, 5942]
r = rollout_stub(channel(f"127.0.0.1:{port}"), token="", timeout=120).Score(
    rollout_pb2.ScoreRequest(token_ids=ids, prompt_length=1))
m = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
with torch.no_grad():
    lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)
want = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
diff = max(abs(a - b) for a, b in zip(r.logprobs, want))
print(f"rollout version {r.version}: max |logprob diff| vs transformers on the export = {diff:.4g} (tol {tol})")
assert len(r.logprobs) == len(want) and diff < tol, (list(r.logprobs), want)
PY
done
echo "OK: SGLang rollout matches the trainer's export after NCCL and IPC syncs"
