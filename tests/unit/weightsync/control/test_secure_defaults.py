"""Issue 19 attacks on the control plane: exposure without a token, smuggled auth headers, NaN settings."""

from __future__ import annotations

import logging
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from weightsync.config import ConfigError
from weightsync.control.exposure import check_exposure, is_loopback

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize(
    "host,loop",
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.7", False),
        ("trainer.rl.svc", False),
    ],
)
def test_loopback_classification(host, loop):
    assert is_loopback(host) is loop


def test_exposed_listener_needs_a_token_or_explicit_insecure(caplog):
    listeners = {"grpc_address": "0.0.0.0:50051", "http_address": "127.0.0.1:8081"}
    with pytest.raises(ConfigError, match=r"grpc_address=0.0.0.0:50051.*without a token.*--insecure"):
        check_exposure(listeners, token="", insecure=False, prog="trainer-svc")
    assert check_exposure(listeners, token="s3cret", insecure=False, prog="trainer-svc") == [
        "grpc_address=0.0.0.0:50051"
    ]
    assert check_exposure({"grpc_address": "127.0.0.1:1"}, token="", insecure=False, prog="x") == []
    with caplog.at_level(logging.WARNING):
        check_exposure(listeners, token="", insecure=True, prog="trainer-svc")
    assert any(
        r.levelno == logging.WARNING and "INSECURE" in r.getMessage() and "0.0.0.0:50051" in r.getMessage()
        for r in caplog.records
    )


def _serve(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "rollout_svc", "serve", "--http-address", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def test_rollout_svc_refuses_to_listen_on_all_interfaces_without_a_token():
    out = _serve("--grpc-address", "0.0.0.0:0")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "cannot start" in out.stderr and "without a token" in out.stderr and "grpc_address=0.0.0.0:0" in out.stderr
    out = _serve("--data-address", "0.0.0.0:0")  # the TCP bus listener counts too
    assert out.returncode == 1 and "data_address=0.0.0.0:0" in out.stderr, out.stderr[-2000:]
    # a NaN timeout is a config error naming the field (exit 2), before anything binds
    out = _serve("--sync-timeout-s", "nan")
    assert out.returncode == 2 and "sync_timeout_s: 'nan' is not a finite number" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "NaN"])
def test_float_settings_reject_non_finite_values(raw):
    import argparse

    from trainer_svc.config import ENV_PREFIX, TrainerConfig
    from weightsync.config import add_arguments, resolve

    p = argparse.ArgumentParser()
    add_arguments(p, TrainerConfig, ENV_PREFIX)
    with pytest.raises(ConfigError, match=r"sync_timeout_s: .* is not a finite number"):
        resolve(TrainerConfig, p.parse_args([f"--sync-timeout-s={raw}"]), ENV_PREFIX, environ={})
    with pytest.raises(ConfigError, match=r"lr: .* is not a finite number"):
        resolve(TrainerConfig, p.parse_args([]), ENV_PREFIX, environ={f"{ENV_PREFIX}_LR": raw})


def test_one_authorization_header_per_request():
    from weightsync.control.auth import TokenAuthInterceptor

    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[TokenAuthInterceptor("s3cret")])
    handler = grpc.method_handlers_generic_handler(
        "t.T", {"M": grpc.unary_unary_rpc_method_handler(lambda r, c: b"ok")}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = ch.unary_unary("/t.T/M")
        good, bad = ("authorization", "Bearer s3cret"), ("authorization", "Bearer guess")
        assert call(b"", metadata=(good,), timeout=10) == b"ok"
        for md in ((bad, good), (good, bad), (good, good), (), (bad,)):
            with pytest.raises(grpc.RpcError) as ei:
                call(b"", metadata=md, timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, md  # before: (bad, good) was let through
        ch.close()
    finally:
        server.stop(0)
