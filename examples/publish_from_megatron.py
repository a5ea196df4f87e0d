"""A megatron-core training loop on two ranks publishes its weights after every step, each rank
streaming the tensors it owns.

Two processes (torchrun, gloo, CPU) train a tiny Qwen2 GPTModel split over two pipeline stages
(PP=2) with megatron's pipeline schedule and AdamW. After each step every rank calls
`pub.sync(hf_tensors(model_chunks, config))`: the helper turns each rank's chunk into HF-named
tensors with this project's Megatron->HF rules, each stage's rank streams its own layers to the
rollout, and rank 0 (which serves the registry the rollout points at) commits the version. Rank 0
then gathers the whole model in HF layout (the same rules, funnelled to rank 0), loads it into a
transformers model and checks that the rollout's last-position logits (the Score RPC) equal that
model's bit for bit: the rollout serves exactly the trainer's weights. Auth is on (a token file).

    torchrun --standalone --nproc-per-node 2 examples/publish_from_megatron.py [--steps 2]

Rank 0 prints one `EXACT step=.. version=.. senders=0,1` line per step and `OK` at the end; the
job exits non-zero otherwise. About 30 s on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

PROMPT = [5, 17, 42, 7, 99, 3]


def tiny_qwen2():
    """The tiny Qwen2 config the services also know by name (--model tiny-qwen2), built locally."""
    from weightsync.models import resolve_model

    config, _ = resolve_model("tiny-qwen2")
    return config


def build_model(config):
    """Your megatron-core model: here trainer-svc's builder (a local-spec GPTModel for the HF
    config, with megatron-core's CPU workarounds); in your job, the chunks your framework builds."""
    from megatron.core import parallel_state as ps

    from trainer_svc.actor.megatron.hf_meta import build_spec
    from trainer_svc.actor.megatron.model import build_chunks
    from trainer_svc.actor.megatron.parallel import Parallelism

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    return build_chunks(build_spec(config), Parallelism(pp=2), seed=0)


def train_step(chunks, opt, tokens: torch.Tensor) -> None:
    """One pipeline step (forward, backward over both stages) and the optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # megatron-core's schedules allocate one counter on "cuda"; trainer-svc's shim keeps it on CPU
    from trainer_svc.actor.megatron.train_backend import _schedules_on_cpu

    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch, pos, attention_mask=None, labels=batch)  # the last stage returns per-token losses
        return out, lambda loss: (loss.float().mean(), {})

    for c in chunks:
        c.config.batch_p2p_comm = False  # the batched p2p path synchronises a CUDA device
    with _schedules_on_cpu():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=chunks[0],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
        )
    opt.step()
    opt.zero_grad(set_to_none=True)


def gathered_hf_model(chunks, config):
    """Rank 0: the whole model in HF layout, gathered with the same rules, as a transformers model
    (None elsewhere). Collective: every rank calls it."""
    from transformers import AutoModelForCausalLM

    from trainer_svc.actor.megatron.export import export_tensors
    from trainer_svc.actor.megatron.hf_meta import build_spec
    from trainer_svc.actor.megatron.hf_tensors import current_parallelism
    from trainer_svc.actor.megatron.parallel import rank_map

    tensors = dict(
        export_tensors(chunks, build_spec(config), current_parallelism(), rank_map(), torch.float32, to_rank0=True)
    )
    if dist.get_rank() != 0:
        return None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def rollout_last_logits(address: str, token: str) -> tuple[torch.Tensor, int]:
    """The rollout's logits at the last prompt position, and the weights version that computed them."""
    from weightsync.control.client import last_logits

    return last_logits(address, PROMPT, token=token)


def last_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1].float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="training steps, each published (default 2)")
    args = ap.parse_args(argv)

    from trainer_svc.actor.megatron.hf_tensors import hf_tensors
    from weightsync.local.procs import free_port, start_rollout
    from weightsync.publisher import Auth, Publisher, SyncOptions

    # the rollout runs one intra-op thread; so does the reference model here: same weights, same logits
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run it with torchrun --nproc-per-node 2 (two pipeline stages)")
    config = tiny_qwen2()
    chunks = build_model(config)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)

    work = token_file = None
    if rank == 0:  # the control plane, the rollout and the token live with rank 0
        work = Path(tempfile.mkdtemp(prefix="publish-megatron-"))
        config.save_pretrained(work / "model")  # the rollout serves this config; random weights until synced
        token_file = work / "token"
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)

    # --- the publisher: every rank builds it; rank 0 serves, every rank sends its own tensors ---
    pub = Publisher(
        model=config,
        grpc_address=f"127.0.0.1:{free_port()}",
        http_address=f"127.0.0.1:{free_port()}",
        auth=Auth(token_file=str(token_file) if token_file else ""),
        options=SyncOptions(bucket_bytes=1 << 20, sync_timeout_s=120),
        group=dist.group.WORLD,
    ).start()
    rollout = None
    ok = True
    try:
        if rank == 0:
            rollout = start_rollout(
                work,
                "--model",
                str(work / "model"),
                "--init-seed",
                "7",
                "--trainer-address",
                pub.address,
                "--auth-token-file",
                str(token_file),
            )
            rollout.wait_ready(timeout=180)
        pub.wait_for_rollouts(1, timeout=180)  # collective: rank 0 waits, every rank returns
        token = token_file.read_text().strip() if rank == 0 else ""

        reference = gathered_hf_model(chunks, config)
        if rank == 0:
            before, v0 = rollout_last_logits(rollout.address, token)
            # before any sync the rollout serves its own random weights: the check below is not vacuous
            ok = v0 == 0 and not torch.equal(before, last_logits(reference))
            print(f"{'BEFORE' if ok else 'UNEXPECTED'} version={v0}", flush=True)
        for step in range(1, args.steps + 1):
            train_step(chunks, opt, torch.randint(0, config.vocab_size, (2, 16)))

            report = pub.sync(hf_tensors(chunks, config))  # <- the one call your loop adds, on every rank

            reference = gathered_hf_model(chunks, config)
            if rank == 0:
                expected = last_logits(reference)
                got, version = rollout_last_logits(rollout.address, token)
                senders = ",".join(str(s.rank) for s in report.senders)
                exact = version == report.version == step and torch.equal(got, expected)
                ok &= exact
                print(
                    f"{'EXACT' if exact else 'MISMATCH'} step={step} version={version} senders={senders} "
                    f"bytes={report.bytes} max_abs_diff={(got - expected).abs().max().item()}",
                    flush=True,
                )
    finally:
        if rollout is not None:
            rollout.stop()
        pub.close()
    if rank == 0:
        print("OK" if ok else "FAILED", flush=True)
        if not ok and rollout is not None:
            print(rollout.log()[-4000:], file=sys.stderr)
    verdict = torch.tensor([int(ok)])
    dist.broadcast(verdict, src=0)  # every rank exits with rank 0's verdict
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
