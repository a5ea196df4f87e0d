"""torchrun worker for test_step_megatron: rank 0 drives training ops through the collective
channel, the other ranks serve them (as MegatronActor.worker_loop does once it dispatches to
trainer_svc.train.collective). Writes log-probs and 3 steps of metrics as JSON."""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.support.train_requests import make_request  # noqa: E402
from trainer_svc.actor.megatron.actor import MegatronActor  # noqa: E402
from trainer_svc.config import CheckpointConfig, OptimConfig  # noqa: E402
from trainer_svc.train import collective  # noqa: E402
from weightsync.models import resolve_model  # noqa: E402
from weightsync.v1 import trainer_pb2  # noqa: E402

out, tp, pp, weights = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# TP=1 writes its random init as HF weights; other layouts load them (random init differs with PP)
load = weights if os.path.exists(os.path.join(weights, "config.json")) else None
actor = MegatronActor.create(resolve_model("tiny-qwen2")[0], tp=tp, pp=pp, seed=1, weights_dir=load)
if int(os.environ.get("RANK", "0")) != 0:
    while True:
        op, args = actor.channel.receive()
        if op == "shutdown":
            os._exit(0)  # skip gloo's teardown, which aborts now and then at exit
        if not collective.handle_worker_command(actor, op, args):
            raise SystemExit(f"unexpected op {op}")
if load is None:
    from trainer_svc.export_hf import save_hf_dir

    save_hf_dir(actor, weights)
collective.run(
    actor,
    "train_init",
    optim=dataclasses.asdict(OptimConfig(lr=1e-3)),
    checkpoint=dataclasses.asdict(CheckpointConfig()),
)
req = make_request(kl_coef=0.1, entropy_coef=0.01)
req.micro_batch_size = 4
rows = collective.run(actor, "compute_logprobs", trainer_pb2.ComputeLogprobsRequest(samples=req.samples))
for s, r in zip(req.samples, rows):
    s.rollout_logprobs[:] = r
steps = [collective.run(actor, "train_step", req) for _ in range(3)]
actor.shutdown()
with open(out, "w") as f:
    json.dump({"logprobs": rows, "steps": steps}, f)
os._exit(0)
