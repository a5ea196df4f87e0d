"""Helpers for the reliability e2e tests: a model big enough to interrupt, weight sets, RPC shortcuts
and a Score checker that detects mixed weights. The proxy that cuts, stalls or paces the bus is
tests.support.bus_proxy."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.v1 import rollout_pb2, trainer_pb2

PROMPT = [5, 17, 42, 7, 99, 3, 1000, 2047]
# hidden 256, 4 layers, vocab 4096 (the size), wider MLP: ~34 MB fp32, 33 buckets at --bucket-mb 1
MODEL_KW = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def make_model_dirs(root: Path, seeds: list[int], **config) -> tuple[Path, list[Path]]:
    """A config-only dir (for --model) and one HF weights dir per seed (for LoadWeights);
    `config` overrides MODEL_KW (e.g. a larger vocab_size for a stream longer than the kernels' buffers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**MODEL_KW, **config})
    cfg_dir = root / "model"
    cfg.save_pretrained(str(cfg_dir))
    dirs = []
    for s in seeds:
        torch.manual_seed(s)
        m = Qwen2ForCausalLM(cfg)
        d = root / f"weights-{s}"
        m.save_pretrained(str(d), safe_serialization=True)
        dirs.append(d)
    return cfg_dir, dirs


def rstub(proc_or_addr, token: str = "", timeout: float = 60.0):
    addr = proc_or_addr if isinstance(proc_or_addr, str) else proc_or_addr.address
    return rollout_stub(channel(addr), token, timeout)


def tstub(proc_or_addr, token: str = "", timeout: float = 120.0):
    addr = proc_or_addr if isinstance(proc_or_addr, str) else proc_or_addr.address
    return trainer_stub(channel(addr), token, timeout)


def score(stub, ids=PROMPT) -> tuple[torch.Tensor, int]:
    r = stub.Score(rollout_pb2.ScoreRequest(token_ids=ids, prompt_length=1, return_last_logits=True))
    return torch.from_numpy(np.frombuffer(r.last_logits_f32, dtype="<f4").copy()), r.version


def status(stub) -> rollout_pb2.RolloutStatus:
    return stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except grpc.RpcError as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout}s (last: {last})")


def sync_rpc(
    trainer_address: str, token: str = "", rollout_ids=(), timeout: float = 120.0, retry_s: float = 60.0
) -> trainer_pb2.SyncReport:
    """Sync, retrying while another sync (e.g. a catch-up) holds the trainer."""
    deadline = time.monotonic() + retry_s
    stub = tstub(trainer_address, token, timeout)
    while True:
        try:
            return stub.Sync(trainer_pb2.SyncRequest(rollout_ids=list(rollout_ids))).report
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def load(trainer_address: str, d: Path, token: str = "") -> int:
    deadline = time.monotonic() + 60
    while True:
        try:
            return tstub(trainer_address, token).LoadWeights(trainer_pb2.LoadWeightsRequest(hf_path=str(d))).version
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class MixedWeightChecker:
    """Scores every rollout in a loop; each answer's logits must equal the reference of the version it reports."""

    def __init__(self, refs: dict[int, torch.Tensor], addresses: list[str], pause_s: float = 0.005):
        self.refs = refs
        self.addresses = addresses
        self.pause_s = pause_s
        self.checked = 0
        self.refused = 0
        self.mismatches: list[str] = []
        self.unknown_versions: list[int] = []
        self.bad_codes: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(a,), daemon=True) for a in addresses]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, address: str) -> None:
        stub = rstub(address, timeout=30)
        while not self._stop.is_set():
            try:
                logits, version = score(stub)
            except grpc.RpcError as exc:
                # down (killed) or refusing (STALE / busy): fine; anything else is a bug
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.bad_codes.append(f"{address}: {exc.code().name}: {exc.details()}")
                self.refused += 1
                self._stop.wait(0.05)
                continue
            ref = self.refs.get(version)
            if ref is None:
                self.unknown_versions.append(version)
            elif not torch.equal(ref, logits):
                self.mismatches.append(f"{address} v{version}: max diff {(ref - logits).abs().max().item():.3g}")
            self.checked += 1
            self._stop.wait(self.pause_s)


def jitter(max_s: float) -> None:
    time.sleep(random.random() * max_s)
