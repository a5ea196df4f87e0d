"""torchrun worker for test_step_megatron: rank 0 drives training ops through the collective
channel, the other ranks serve them (as MegatronActor.worker_loop does once it dispatches to
trainer_svc.train.collective). argv: out, weights dir, then one or more `tp,pp` layouts of the same
world size, run in turn in one launch (each launch pays megatron's imports in every rank; a layout
only its build and steps). Writes, per layout, log-probs and 3 steps of metrics as JSON."""

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


def serve(actor) -> None:
    """A non-zero rank: run rank 0's commands until it ends this layout."""
    while True:
        op, args = actor.channel.receive()
        if op == "shutdown":
            return
        if not collective.handle_worker_command(actor, op, args):
            raise SystemExit(f"unexpected op {op}")


def drive(actor, weights: str, load: str | None) -> dict:
    """Rank 0: train_init, log-probs, 3 train steps through the collective channel."""
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
    return {"logprobs": rows, "steps": steps}


def main() -> None:
    from megatron.core import parallel_state as ps

    out, weights, layouts = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank0 = int(os.environ.get("RANK", "0")) == 0
    report = {}
    for layout in layouts:
        tp, pp = (int(x) for x in layout.split(","))
        # TP=1 writes its random init as HF weights; other layouts load them (random init differs with PP)
        load = weights if os.path.exists(os.path.join(weights, "config.json")) else None
        actor = MegatronActor.create(resolve_model("tiny-qwen2")[0], tp=tp, pp=pp, seed=1, weights_dir=load)
        if rank0:
            report[layout] = drive(actor, weights, load)
        else:
            serve(actor)
        ps.destroy_model_parallel()  # the next layout initialises its own groups
    if rank0:
        with open(out, "w") as f:
            json.dump(report, f)


main()
sys.stdout.flush()
os._exit(0)  # skip gloo's teardown, which aborts now and then at exit
