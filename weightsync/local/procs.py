"""Start trainer-svc / rollout-svc as real subprocesses on loopback ports and wait until ready.

Everything binds 127.0.0.1, which the services allow without a token. The trainer's admin file
operations are confined to its `--data-root`; unless a caller passes one, the launcher gives it
the system temp directory, where the demo, the RL driver and the tests keep their files.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port that is free now, picked *below* the kernel's ephemeral range: between this
    check and the service's bind (a second or two of imports) any outgoing connection on the
    machine may be given an ephemeral port, so a port from that range can be taken in between."""
    lo, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 16384), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    grpc_port: int
    http_port: int
    log_path: Path
    extra: dict = field(default_factory=dict)
    #: a rollout is started (engine loaded, serving) before it is ready: /readyz says 503 "not current"
    #: until its first sync commits, and the callers of wait_ready() want the started process
    started_ok: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-4000:]}")
            try:
                code, body = http_get(self.http_port, "/readyz", timeout=1)
                if code == 200 or (self.started_ok and code == 503 and body.startswith(self.started_ok)):
                    return
            except OSError:
                pass
            time.sleep(0.05)  # a loopback GET: cheap, and every service start waits here
        raise TimeoutError(f"{self.name} not ready within {timeout}s:\n{self.log()[-4000:]}")

    def metric(self, name: str, labels: str = "") -> float | None:
        _, text = http_get(self.http_port, "/metrics")
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return None

    def stop(self, sig_kill: bool = False) -> None:
        if self.popen.poll() is None:
            if sig_kill:
                self.popen.kill()
            else:
                self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def _env() -> dict:
    env = dict(os.environ)
    # One intra-op thread: fp32 results are then bit-reproducible across processes (a reference
    # computed in another process with torch.set_num_threads(1) matches exactly), and 2-core CI
    # machines aren't oversubscribed by several services. Benchmarks on big hosts raise it
    # (WS_LOCAL_OMP_THREADS) so that a 7B model's CPU init does not take minutes.
    env["OMP_NUM_THREADS"] = os.environ.get("WS_LOCAL_OMP_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_trainer(workdir: Path, *args: str, nproc: int = 1, name: str = "trainer") -> Proc:
    gp, hp = free_port(), free_port()
    log = workdir / f"{name}.log"
    root = () if "--data-root" in args else ("--data-root", os.path.realpath(tempfile.gettempdir()))
    cmd = [
        sys.executable,
        "-m",
        "trainer_svc",
        "serve",
        "--grpc-address",
        f"127.0.0.1:{gp}",
        "--http-address",
        f"127.0.0.1:{hp}",
        *root,
        *args,
    ]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "trainer_svc",
            *cmd[3:],
        ]
    p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    return Proc(name, p, gp, hp, log)


def start_rollout(workdir: Path, *args: str, name: str = "rollout", grpc_port: int | None = None) -> Proc:
    gp, hp = grpc_port or free_port(), free_port()
    log = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "rollout_svc",
        "serve",
        "--grpc-address",
        f"127.0.0.1:{gp}",
        "--http-address",
        f"127.0.0.1:{hp}",
        "--rollout-id",
        name,
        *args,
    ]
    p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    return Proc(name, p, gp, hp, log, started_ok=("not current",))


def wsctl(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightsync.wsctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def wait_registered(trainer_address: str, rollout_ids: list[str], timeout: float = 120.0, token: str = "") -> None:
    """Block until every named rollout appears in the trainer's status (registration is asynchronous)."""
    from weightsync.control.client import channel, trainer_stub
    from weightsync.v1 import trainer_pb2

    ch = channel(trainer_address)
    try:
        stub = trainer_stub(ch, token, 30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            known = {r.rollout_id for r in stub.GetStatus(trainer_pb2.TrainerStatusRequest()).rollouts}
            if set(rollout_ids) <= known:
                return
            time.sleep(0.05)
    finally:
        ch.close()
    raise TimeoutError(
        f"rollouts {sorted(rollout_ids)} did not register with the trainer at {trainer_address} "
        f"within {timeout:.0f}s (see the rollouts' logs)"
    )
