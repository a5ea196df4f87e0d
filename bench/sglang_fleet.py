"""The services of bench/sglang_live.py on a GPU host: a megatron trainer on cuda:0 and SGLang / built-in
rollouts where `rollout_layout` puts them, started and stopped together, and the `wsctl` / Sync RPC calls
the runs make through them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import torch

from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.local.procs import start_rollout, start_trainer, wait_registered, wsctl

SGLANG_ARGS = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": "true",
    # 0.5.10 captures piecewise CUDA graphs by default, via sgl_kernel.weak_ref_tensor (absent here)
    "disable_piecewise_cuda_graph": "true",
    "mem_fraction_static": "0.25",
    "context_length": "2048",
    "grammar_backend": "none",
    "log_level": "warning",
}
#: transport -> (SGLang rollout, built-in rollout) it syncs; nccl needs a GPU of the rollouts' own
TARGETS = {"ipc": ("s0", "b0"), "tcp": ("s0", "b0"), "nccl": ("s1", "b1")}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_random_hf(cfg_dir: Path, out: Path, seed: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(cfg_dir)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(out)
    del m
    torch.cuda.empty_cache()
    return out


def save_random_fp8(bf16_dir: Path, out: Path, device: str = "cuda") -> Path:
    """`bf16_dir`'s weights as a block-FP8 checkpoint, written as DeepSeek-V3's are: every linear weight e4m3 beside
    its float32 `weight_scale_inv` (one per 128x128 block; weightsync's own fp8-block export, quantized on the GPU)
    and config.json with the `quantization_config` from which SGLang builds block-FP8 (Fp8LinearMethod) layers."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from weightsync.formats.fp8.export import export_tensors
    from weightsync.formats.fp8.spec import BLOCK_FP8, hf_quantization_config

    out.mkdir(parents=True, exist_ok=True)  # a later run at the same shape overwrites it, as save_random_hf does
    cfg = AutoConfig.from_pretrained(bf16_dir)
    cfg.quantization_config = hf_quantization_config(BLOCK_FP8)
    cfg.save_pretrained(out)
    for i, f in enumerate(sorted(bf16_dir.glob("*.safetensors"))):  # shard by shard: one in GPU memory at a time
        quantized = {n: t.contiguous() for n, t in export_tensors(load_file(f, device=device).items())}
        save_file(quantized, out / f"model-fp8-{i:05d}.safetensors", metadata={"format": "pt"})
        del quantized
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def copy_under(src: Path, dst: Path) -> Path:
    """`wsctl load` reads only under the trainer's data root (the temp dir here): load a copy from there."""
    shutil.copytree(src, dst)
    return dst


def ws(address: str, *args: str, timeout: float = 300.0) -> dict:
    p = wsctl("--address", address, "--json", *args, timeout=timeout)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError as exc:
        msg = f"wsctl {' '.join(args)} exited {p.returncode}: {p.stdout[-2000:]} {p.stderr[-2000:]}"
        raise RuntimeError(msg) from exc
    if p.returncode != 0:
        raise RuntimeError(f"wsctl {' '.join(args)} exited {p.returncode}: {json.dumps(out)[:3000]}")
    return out


def sync_times(address: str, tstub, rid: str, transport: str, reps: int) -> tuple[list[dict], list[float]]:
    """The first sync through `wsctl sync`, the repeats through the same Sync RPC (no CLI start-up)."""
    from google.protobuf.json_format import MessageToDict

    from weightsync.v1 import trainer_pb2

    reports = [ws(address, "sync", "--rollout", rid, "--transport", transport, timeout=300)]
    for _ in range(reps - 1):
        req = trainer_pb2.SyncRequest(rollout_ids=[rid], transport=transport, timeout_seconds=120)
        rep = MessageToDict(tstub.Sync(req, timeout=180).report, preserving_proto_field_name=True)
        reports.append(rep)
    bad = [r for r in reports if not r.get("ok")]
    if bad:
        raise RuntimeError(f"sync {transport} -> {rid} failed: {json.dumps(bad[0])[:3000]}")
    return reports, [float(r["seconds"]) for r in reports]


def bytes_per_rank(report: dict) -> list[int]:
    """The SGLang rollout's bytes per TP rank in a sync's report (RolloutSyncResult.bytes_per_rank)."""
    (rollout,) = report.get("rollouts", [{}])
    return [int(b) for b in rollout.get("bytes_per_rank", [])]


def rollout_layout(transports: list[str], gpus: int, tp: int) -> dict:
    """name -> (engine, device) of the rollouts, the trainer on cuda:0. ipc/tcp: s0 (SGLang, its TP ranks on
    GPUs 0..tp-1) and b0 on cuda:0. nccl: s1 and b1 on cuda:1 when there are tp + 1 GPUs (the trainer's GPU
    its own); else s1's ranks share GPUs 0..tp-1 with the trainer (SGLang receives on its last rank's GPU:
    NCCL takes no two ranks on one GPU: `--receive-rank`) and b1 is on cuda:1. An SGLang rollout's entry also
    names its receive rank."""
    rollouts = {"s0": ("sglang", "cuda:0", 0), "b0": ("builtin", "cuda:0")}
    if "nccl" in transports:
        own = gpus >= tp + 1
        s1 = ("sglang", "cuda:1", 0) if own else ("sglang", "cuda:0", tp - 1)
        rollouts.update({"s1": s1, "b1": ("builtin", "cuda:1")})
    return rollouts


class Fleet:
    """A megatron trainer on cuda:0 and rollouts (name -> (engine, device[, receive rank])), all serving
    `start_dir`."""

    def __init__(self):
        self.procs, self.chans, self.stubs = [], [], {}
        self.trainer = self.tstub = None

    def start(
        self,
        work: Path,
        init_model: Path,
        start_dir: Path,
        rollouts: dict,
        ready_timeout: float,
        inflight: int = 0,
        tp_size: int = 1,
        bucket_mb: int = 0,
        export_dtype: str = "bfloat16",
        sglang_dir: Path | None = None,
    ) -> None:
        """Assign the Fleet before calling this: if a service fails to start, stop() still reaches the others.
        `inflight`: Generate calls one client may have in flight (the rollouts' default is 4; --concurrency
        sends its N from one client). `tp_size`: SGLang's, its ranks on the GPUs from each SGLang rollout's
        device on. `bucket_mb`: the trainer's bucket size (0: its default). `export_dtype`: the trainer's;
        `sglang_dir`: what the SGLang rollouts serve instead of `start_dir` (a block-FP8 checkpoint for fp8-block
        syncs: save_random_fp8)."""
        targs = ["--bucket-mb", str(bucket_mb)] if bucket_mb else []
        t = start_trainer(
            work, "--backend", "megatron", "--model", str(init_model), "--init-seed", "1", "--param-dtype", "bfloat16",
            "--transport", "ipc", "--export-dtype", export_dtype, "--no-auto-sync-new-rollouts", *targs,
        )  # fmt: skip
        self.procs.append(t)
        self.trainer = t
        for name, (engine, device, *receive) in rollouts.items():
            serves = sglang_dir if engine == "sglang" and sglang_dir else start_dir
            args = rollout_args(engine, device, receive, serves, t.address, ready_timeout, inflight, tp_size)
            self.procs.append(start_rollout(work, *args, name=name))
        deadline = time.monotonic() + ready_timeout
        for p in self.procs:
            p.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
            log(f"{p.name} ready")
        wait_registered(t.address, list(rollouts), max(1.0, deadline - time.monotonic()))
        for p in self.procs[1:]:
            ch = channel(p.address)
            self.chans.append(ch)
            self.stubs[p.name] = rollout_stub(ch, "", 120)
        tch = channel(t.address)
        self.chans.append(tch)
        self.tstub = trainer_stub(tch, "", 180)

    def stop(self, res: dict, tag: str = "") -> None:
        for ch in self.chans:
            ch.close()
        for p in self.procs:
            res.setdefault("logs_tail", {})[tag + p.name] = p.log()[-2500:]
            logs = Path(os.environ.get("OUT", "/tmp")) / "logs"  # sglang_live.sh tars them (8 files come back)
            logs.mkdir(exist_ok=True)
            (logs / f"{tag}{p.name}.log").write_text(p.log())
            p.stop()
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)  # SGLang's scheduler children too
            except (ProcessLookupError, PermissionError):
                pass

    def log_of(self, name: str) -> str:
        return next((p.log() for p in self.procs if p.name == name), "")


def rollout_args(
    engine: str, device: str, receive: list, start_dir, trainer: str, ready_timeout: float, inflight: int, tp_size: int
) -> list[str]:
    """rollout-svc's flags for one rollout of the fleet (`receive`: [SGLang's receive rank] or [])."""
    args = ["--engine", engine, "--model", str(start_dir), "--device", device, "--dtype", "bfloat16"]
    args += ["--apply-mode", "inplace", "--serve-initial-weights", "--trainer-address", trainer]
    args += ["--register-timeout-s", str(ready_timeout)]
    if inflight > 4:
        args += ["--max-inflight-requests", str(max(16, inflight)), "--max-inflight-per-client", str(inflight)]
    if engine == "sglang":
        args += [a for k, v in SGLANG_ARGS.items() for a in ("--sglang-arg", f"{k}={v}")]
        args += ["--tp", str(tp_size), "--receive-rank", str(receive[0] if receive else 0)]
        if tp_size > 1:  # its custom all-reduce is sgl_kernel's (absent: the shim); NCCL's instead
            args += ["--sglang-arg", "disable_custom_all_reduce=true"]
    return args


def direct_lines(fleet: Fleet, name: str) -> list[str]:
    """How rollout `name`'s buckets were written in SGLang's workers (rollout_svc/engine/sglang_direct.py logs
    each change: learning the slot table, then the table, or SGLang's loader where it has none)."""
    lines = fleet.log_of(name).splitlines()
    marks = ("written in SGLang's workers", "slot tables exported", "will not write into SGLang")
    how = [ln[-160:] for ln in lines if any(m in ln for m in marks)][-12:]
    return how + [ln[-400:] for ln in lines if "sglang apply timings" in ln][-8:]
