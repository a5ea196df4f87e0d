"""Your own training loop publishes its weights to a real rollout-svc after every optimizer step.

A plain transformers + AdamW loop on a tiny Qwen2 (built here, nothing downloaded) embeds
`weightsync.publisher.Publisher`, starts one rollout-svc process pointed at it
(`--trainer-address`), with a control-plane token on both sides, and after each step checks that
the rollout serves exactly the published weights: its last-position logits (the Score RPC) equal,
bit for bit, those of the local model. Runs on CPU in about half a minute:

    python examples/publish_from_own_loop.py [--steps 3]

Prints one `EXACT step=.. version=..` line per step and `OK` at the end; exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path

import torch

PROMPT = [5, 17, 42, 7, 99, 3]


def tiny_qwen2():
    """The tiny Qwen2 config the services also know by name (--model tiny-qwen2), built locally."""
    from weightsync.models import resolve_model

    config, _ = resolve_model("tiny-qwen2")
    return config


def rollout_last_logits(address: str, token: str) -> tuple[torch.Tensor, int]:
    """The rollout's logits at the last prompt position, and the weights version that computed them."""
    from weightsync.control.client import last_logits

    return last_logits(address, PROMPT, token=token)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps, each published (default 3)")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from weightsync.local.procs import free_port, start_rollout
    from weightsync.publisher import Auth, Publisher, SyncOptions

    # The rollout runs one intra-op thread (weightsync.local.procs): so does this process, so that
    # the same weights give the same logits bit for bit.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="publish-own-loop-"))
    config = tiny_qwen2()
    model_dir = work / "model"
    config.save_pretrained(model_dir)  # the rollout serves this config; its own weights are random until synced
    token_file = work / "token"
    token_file.write_text(secrets.token_hex(16))
    token_file.chmod(0o600)

    # --- your model and optimizer --------------------------------------------------------------
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # --- the publisher: what `rollout-svc --trainer-address` points at ---------------------------
    pub = Publisher(
        model=model_dir,
        grpc_address=f"127.0.0.1:{free_port()}",
        http_address=f"127.0.0.1:{free_port()}",
        auth=Auth(token_file=str(token_file)),
        options=SyncOptions(bucket_bytes=16 << 20),
    ).start()
    rollout = start_rollout(
        work,
        "--model",
        str(model_dir),
        "--init-seed",
        "7",
        "--trainer-address",
        pub.address,
        "--auth-token-file",
        str(token_file),
    )
    token = token_file.read_text().strip()
    ok = False
    try:
        rollout.wait_ready(timeout=180)
        pub.wait_for_rollouts(1, timeout=120)
        with torch.no_grad():
            mine = model(torch.tensor([PROMPT])).logits[0, -1].float()
        before, v0 = rollout_last_logits(rollout.address, token)
        # before any sync the rollout serves its own random weights: the check below is not vacuous
        ok = v0 == 0 and not torch.equal(before, mine)
        print(f"{'BEFORE' if ok else 'UNEXPECTED'} version={v0} differs={not torch.equal(before, mine)}", flush=True)
        for step in range(1, args.steps + 1):
            batch = torch.randint(0, config.vocab_size, (4, 16))
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            report = pub.sync(model.named_parameters())  # <- the one call your loop adds

            with torch.no_grad():
                expected = model(torch.tensor([PROMPT])).logits[0, -1].float()
            got, version = rollout_last_logits(rollout.address, token)
            exact = version == report.version == step and torch.equal(got, expected)
            ok &= exact
            print(
                f"{'EXACT' if exact else 'MISMATCH'} step={step} version={version} loss={loss.item():.4f} "
                f"bytes={report.bytes} seconds={report.seconds:.3f} max_abs_diff={(got - expected).abs().max().item()}",
                flush=True,
            )
    finally:
        rollout.stop()
        pub.close()
    print("OK" if ok else "FAILED", flush=True)
    if not ok:
        print(rollout.log()[-4000:], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
