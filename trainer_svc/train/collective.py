"""Training calls as collective commands: rank 0 announces, every rank runs the same step.

Under torchrun only global rank 0 serves gRPC; the other ranks wait in
`MegatronActor.worker_loop()` for commands on the actor's `CommandChannel`
(weightsync/publisher/commands.py: JSON, never pickle).
`run()` on rank 0 broadcasts the training op with its request (protobuf bytes, base64 in the
JSON) and then runs it locally; on a worker, the actor's loop hands any op it does not know to
`handle_worker_command()`, which runs the same function. With one rank (or HfActor) `run()` just
calls the function.
"""

from __future__ import annotations

import base64
import logging

log = logging.getLogger(__name__)

OPS = ("train_init", "train_step", "compute_logprobs", "save_checkpoint")


def _encode(msg) -> str:
    return base64.b64encode(msg.SerializeToString()).decode()


def _decode(cls, text: str):
    msg = cls()
    msg.ParseFromString(base64.b64decode(text))
    return msg


def _execute(actor, op: str, args: dict):
    from weightsync.v1 import trainer_pb2

    if op == "train_init":
        from trainer_svc.config import CheckpointConfig, OptimConfig
        from trainer_svc.train.checkpoint import resume_if_configured
        from trainer_svc.train.step import train_state

        if actor.train_state is not None:
            return False
        optim, ckpt = OptimConfig(**args["optim"]), CheckpointConfig(**args["checkpoint"])
        optim.validate()
        ckpt.validate()
        train_state(actor, optim)
        return resume_if_configured(actor, ckpt)
    if op == "train_step":
        from trainer_svc.train.step import train_step

        return train_step(actor, _decode(trainer_pb2.TrainStepRequest, args["request"]))
    if op == "compute_logprobs":
        from trainer_svc.train.step import compute_logprobs

        req = _decode(trainer_pb2.ComputeLogprobsRequest, args["request"])
        return compute_logprobs(actor, list(req.samples), reference=req.reference)
    if op == "save_checkpoint":
        if args.get("format", "native") == "torch_dist":
            # weights only, every rank writes its shards; numbered by completed steps like native
            return actor.save_megatron(args["dir"], iteration=actor.step)
        from trainer_svc.train.checkpoint import save_checkpoint

        return str(save_checkpoint(actor, args["dir"]))
    raise ValueError(f"unknown training op {op!r}")


def run(actor, op: str, request=None, **args):
    """On rank 0: tell the workers (if any) to run `op`, then run it here; returns rank 0's result."""
    if request is not None:
        args["request"] = _encode(request)
    channel = getattr(actor, "channel", None)
    if channel is not None and getattr(channel, "group", None) is not None:
        channel.send(op, **args)
    return _execute(actor, op, args)


def handle_worker_command(actor, op: str, args: dict) -> bool:
    """For a worker loop: run a training op; False when `op` is not one (the caller reports it)."""
    if op not in OPS:
        return False
    _execute(actor, op, args)
    return True
