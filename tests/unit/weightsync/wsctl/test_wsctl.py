"""wsctl against a real in-process trainer: `--json` on either side of the subcommand, a closed
stdout pipe, and a corrupt checkpoint answered INVALID_ARGUMENT (exit 1, not 3 "unreachable")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.local_apps import start_trainer
from weightsync.wsctl.cli import EXIT_FAILED, EXIT_OK, main


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("data-root")


@pytest.fixture(scope="module")
def trainer(root):
    # admin file operations stay under the data root: the corrupt checkpoints are written there
    app = start_trainer(data_root=str(root))
    yield app
    app.stop()


@pytest.mark.parametrize("argv", [["--json", "status"], ["status", "--json"], ["--json", "status", "--json"]])
def test_json_on_either_side(trainer, capsys, argv):
    assert main(["--address", trainer.grpc.address, *argv]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["version"] == str(trainer.actor.version)


def test_sync_json_after_the_subcommand(trainer, capsys):
    # no rollout registered: the sync "fails" (exit 1) but the report is JSON, not a usage error (2)
    assert main(["--address", trainer.grpc.address, "sync", "--json"]) == EXIT_FAILED
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and rep["rollouts"] == []
    assert rep["error"]["code"] == "NO_ROLLOUTS" and "no rollout is registered" in rep["error"]["message"]


def test_nothing_to_sync_says_why(trainer, capsys):
    assert main(["--address", trainer.grpc.address, "sync"]) == EXIT_FAILED
    io = capsys.readouterr()
    assert io.out == "" and "nothing to sync: no rollout is registered" in io.err, io


def test_errors_are_json_in_json_mode(trainer, capsys):
    assert main(["--address", trainer.grpc.address, "--json", "sync", "--rollout", "nope"]) == EXIT_FAILED
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "NOT_FOUND" and "'nope' is not registered" in err["message"] and err["exit_code"] == 1
    assert main(["--address", "127.0.0.1:1", "--timeout", "5", "status", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["error"]["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert main(["--json", "--token-file", "/nonexistent/token", "status"]) == 2
    assert "No such file" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_version(capsys):
    from weightsync import __version__

    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"wsctl {__version__}"


def test_bash_completion_completes_subcommands_and_their_options(tmp_path):
    (tmp_path / "c.sh").write_text(
        subprocess.run(
            [sys.executable, "-m", "weightsync.wsctl.cli", "completion", "bash"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )

    def complete(*words):
        line = (
            f"source {tmp_path / 'c.sh'}; COMP_WORDS=(wsctl {' '.join(words)}); COMP_CWORD={len(words)}; "
            '_wsctl; echo "${COMPREPLY[@]}"'
        )
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True).stdout.split()

    assert set(complete("sy")) == {"sync"}
    assert "--allow-rollback" in complete("sync", "--al") and complete("sync", "--tr") == ["--transport"]
    assert complete("completion", "z") == ["zsh"]


def test_plain_output_without_json(trainer, capsys):
    assert main(["--address", trainer.grpc.address, "status"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("trainer  version") and not out.lstrip().startswith("{")


def test_closed_pipe_is_quiet(trainer):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen(
        [sys.executable, "-m", "weightsync.wsctl.cli", "--address", trainer.grpc.address, "status", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    p.stdout.close()  # like `| head` that has already exited
    err = p.stderr.read().decode()
    assert p.wait(60) == EXIT_OK, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("content", [b"", b'\x08\x00\x00\x00\x00\x00\x00\x00{"a"', os.urandom(4096), "truncated"])
def test_load_of_a_corrupt_safetensors_is_invalid_argument(trainer, root, capsys, content):
    tmp_path = root / f"case-{abs(hash(content if isinstance(content, str) else bytes(content[:64]))):x}"
    tmp_path.mkdir()
    if content == "truncated":
        from trainer_svc.export_hf import save_hf_dir

        good = tmp_path / "good"
        save_hf_dir(trainer.actor, str(good))
        data = (good / "model.safetensors").read_bytes()
        content = data[: len(data) // 2]
    d = tmp_path / "bad"
    d.mkdir()
    (d / "model.safetensors").write_bytes(content)
    version = trainer.actor.version
    assert main(["--address", trainer.grpc.address, "load", str(d)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "model.safetensors" in err and "not a readable safetensors file" in err, err
    assert trainer.actor.version == version  # nothing loaded


def test_megatron_index_names_the_corrupt_file(tmp_path):
    from trainer_svc.actor.megatron.load import index_safetensors

    (tmp_path / "model-00001.safetensors").write_bytes(os.urandom(100))
    with pytest.raises(ValueError, match="model-00001.safetensors is not a readable safetensors file"):
        index_safetensors(str(tmp_path))
