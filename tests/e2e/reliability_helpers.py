"""Helpers for the reliability e2e tests: a model big enough to interrupt, weight sets, RPC shortcuts,
a Score checker that detects mixed weights, and a TCP proxy that can cut or stall the bus."""
from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from weightsync.bus.tcp.wire import HELLO_MAGIC
from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.local.bus_links import SenderLinks, close_sockets
from weightsync.v1 import rollout_pb2, trainer_pb2

PROMPT = [5, 17, 42, 7, 99, 3, 1000, 2047]
# hidden 256, 4 layers, vocab 4096 (the size), wider MLP: ~34 MB fp32, 33 buckets at --bucket-mb 1
MODEL_KW = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False)


def make_model_dirs(root: Path, seeds: list[int]) -> tuple[Path, list[Path]]:
    """A config-only dir (for --model) and one HF weights dir per seed (for LoadWeights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**MODEL_KW)
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


def sync_rpc(trainer_address: str, token: str = "", rollout_ids=(), timeout: float = 120.0,
             retry_s: float = 60.0) -> trainer_pb2.SyncReport:
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


class BusProxy:
    """Forwards TCP connections listen_host:port -> target; after `after_bytes` (trainer→rollout) it can cut,
    stall (forward nothing, hold both sockets open) or go slow (forward at `rate` bytes/s, a slow link).

    Only weight-bus connections (those that open with the bus hello) are shaped and counted in
    `connections`; the sync link, which shares the rollout's data port, always passes. A connection
    the target refuses (the rollout is down) is closed, as a real proxy does."""

    def __init__(self, listen_host: str, listen_port: int, target: tuple[str, int]):
        self.target = target
        self.mode = "pass"  # pass | cut | stall | slow
        self.after_bytes = 0
        self._pace: SenderLinks | None = None  # slow mode: the paced links' own token bucket
        self.forwarded = 0
        self.connections = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((listen_host, listen_port))
        self.sock.listen(8)
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, mode: str, after_bytes: int = 0, rate: float = 0.0) -> None:
        if mode == "slow" and rate <= 0:
            raise ValueError("slow mode needs rate > 0 (bytes/s)")
        self._pace = SenderLinks(rate) if mode == "slow" else None
        self.mode, self.after_bytes, self.forwarded = mode, after_bytes, 0

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._open, args=(c,), daemon=True).start()

    def _open(self, c: socket.socket) -> None:
        try:
            c.settimeout(10)
            magic = b""
            while len(magic) < 4:  # which protocol: the bus hello's magic, or the sync link's
                got = c.recv(4 - len(magic))
                if not got:
                    raise OSError("closed before its first bytes")
                magic += got
            c.settimeout(None)
            u = socket.create_connection(self.target, timeout=10)
            u.settimeout(None)
            u.sendall(magic)
        except OSError:
            close_sockets((c,), shutdown=True)
            return
        bus = magic == HELLO_MAGIC
        self.connections += bus
        self._conns += [c, u]
        threading.Thread(target=self._pump, args=(c, u, bus), daemon=True).start()
        threading.Thread(target=self._pump, args=(u, c, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, shaped: bool) -> None:
        """Forward src -> dst; `shaped`: a bus connection's trainer→rollout side, which the mode applies to."""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                pace = self._pace
                if shaped and pace is not None and self.forwarded + len(data) > self.after_bytes:
                    pace.take(0, len(data))
                elif shaped and self.mode != "pass" and self.forwarded + len(data) > self.after_bytes:
                    if self.mode == "cut":
                        break
                    while not self._closed:  # stall: hold both sockets open, forward nothing more
                        time.sleep(0.1)
                    return
                dst.sendall(data)
                if shaped:
                    self.forwarded += len(data)
        except OSError:
            pass
        close_sockets((src, dst), shutdown=True)

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        close_sockets(self._conns)


def jitter(max_s: float) -> None:
    time.sleep(random.random() * max_s)
