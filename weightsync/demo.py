"""The end-to-end demo: real trainer-svc and rollout-svc processes on this machine.

It starts a trainer (megatron-core backend by default, tiny Qwen2 config) and two rollouts with
*different* random weights, lets them register and catch up, then runs rounds of
"change the trainer's weights → `wsctl sync` → check every rollout computes exactly what the
trainer exported" and prints a report. Exit code 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from weightsync.control.client import channel, last_logits, rollout_stub
from weightsync.local.procs import start_rollout, start_trainer, wsctl
from weightsync.v1 import rollout_pb2

PROMPT = [11, 42, 7, 199, 3, 64, 5]


def _logits(proc) -> tuple[torch.Tensor, int, bool]:
    logits, version = last_logits(proc.address, PROMPT)
    g = rollout_stub(channel(proc.address), "", 60).Generate(
        rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=PROMPT)],
            sampling=rollout_pb2.SamplingParams(max_new_tokens=4, temperature=0),
        )
    )
    return logits, version, g.samples[0].prefix_cache_hit


def _reference_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    torch.set_num_threads(1)  # the rollout runs single-threaded: same reduction order, exact comparison
    with torch.no_grad():
        return m(torch.tensor([PROMPT])).logits[0, -1].float()


def _perturb(src: Path, dst: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    state = {
        k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in load_file(str(src / "model.safetensors")).items()
    }
    dst.mkdir(parents=True, exist_ok=True)  # a rerun of the demo writes over its own earlier round
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def _wsctl(trainer, *args) -> dict:
    out = wsctl("--address", trainer.address, "--json", *args)
    if out.returncode != 0:
        raise RuntimeError(f"wsctl {' '.join(args)} failed ({out.returncode}): {out.stderr or out.stdout}")
    return json.loads(out.stdout) if out.stdout.strip() else {}


def run(backend: str, model: str, rounds: int, workdir: Path) -> int:
    print(f"weightsync demo: backend={backend} model={model} rollouts=2 rounds={rounds} (logs in {workdir})")
    procs = []
    try:
        trainer = start_trainer(
            workdir, "--backend", backend, "--model", model, "--init-seed", "1", "--data-root", str(workdir)
        )  # wsctl export/load below write and read there
        procs.append(trainer)
        trainer.wait_ready(300)
        rollouts = [
            start_rollout(
                workdir,
                "--model",
                model,
                "--init-seed",
                str(10 + i),
                "--trainer-address",
                trainer.address,
                name=f"rollout-{i}",
            )
            for i in range(2)
        ]
        procs += rollouts
        for r in rollouts:
            r.wait_ready(300)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = _wsctl(trainer, "status")
            if len(st["rollouts"]) == 2 and all(int(r["version"]) == int(st["version"]) for r in st["rollouts"]):
                break
            time.sleep(0.3)
        print(wsctl("--address", trainer.address, "status").stdout)
        rows, failures = [], 0
        for k in range(rounds):
            cur, new = workdir / f"export-{k}", workdir / f"weights-{k}"
            _wsctl(trainer, "export", str(cur))
            _perturb(cur, new, seed=k)
            _wsctl(trainer, "load", str(new))
            rep = _wsctl(trainer, "sync")
            ref = _reference_logits(new)
            for r in rollouts:
                logits, version, hit = _logits(r)
                diff = float((logits - ref).abs().max())
                ok = rep["ok"] and version == int(rep["version"]) and diff == 0.0 and not hit
                failures += not ok
                rows.append(
                    (
                        k + 1,
                        r.name,
                        version,
                        float(rep["seconds"]),
                        int(rep["bytes"]) / 1e6,
                        diff,
                        "miss" if not hit else "HIT",
                        "ok" if ok else "FAIL",
                    )
                )
        print(
            f"{'round':>5} {'rollout':<10} {'version':>7} {'sync_s':>8} {'MB':>7} {'max|Δlogit|':>11} "
            f"{'prefix':>6} {'check':>5}"
        )
        for row in rows:
            print(
                f"{row[0]:>5} {row[1]:<10} {row[2]:>7} {row[3]:>8.3f} {row[4]:>7.2f} {row[5]:>11.3g} "
                f"{row[6]:>6} {row[7]:>5}"
            )
        print(wsctl("--address", trainer.address, "status").stdout)
        print(
            "PASS: every rollout serves exactly the trainer's exported weights after each sync"
            if not failures
            else f"FAIL: {failures} check(s) failed; see logs in {workdir}"
        )
        return 1 if failures else 0
    finally:
        for p in procs:
            p.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightsync.demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["megatron", "hf"], default="megatron")
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    ns = p.parse_args(argv)
    # Absolute: the trainer takes this as its data root, and the export/load paths below are handed
    # to it over gRPC, where a relative path would be resolved again under that root.
    workdir = (ns.workdir or Path(tempfile.mkdtemp(prefix="weightsync-demo-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return run(ns.backend, ns.model, ns.rounds, workdir)


if __name__ == "__main__":
    sys.exit(main())
