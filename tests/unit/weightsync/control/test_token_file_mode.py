"""Issue 49: a token file others may read is refused, with the fix (`chmod 600`); group access is
allowed, as a Kubernetes Secret volume mounted 0440 for the pod's fsGroup gives it."""

from __future__ import annotations

import os

import pytest

from weightsync.config import ConfigError
from weightsync.control.auth import load_token
from weightsync.wsctl.cli import main


def _token(tmp_path, mode: int):
    p = tmp_path / "token"
    p.write_text("s3cret\n")
    p.chmod(mode)
    return p


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o666, 0o602])
def test_a_token_file_others_can_access_is_refused_naming_chmod_600(tmp_path, mode):
    p = _token(tmp_path, mode)
    with pytest.raises(ConfigError, match=rf"^auth_token_file: {p} has mode {mode:04o}, .* run `chmod 600 {p}`"):
        load_token("", str(p))


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o440])
def test_owner_or_group_only_is_accepted(tmp_path, mode):
    assert load_token("", str(_token(tmp_path, mode))) == "s3cret"


def test_a_secret_volume_symlink_is_judged_by_its_target(tmp_path):
    data = tmp_path / "..data"
    data.mkdir()
    target = _token(data, 0o440)
    link = tmp_path / "token-link"
    os.symlink(target, link)
    assert load_token("", str(link)) == "s3cret"
    target.chmod(0o444)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_token("", str(link))


def test_wsctl_refuses_a_world_readable_token_file(tmp_path, capsys):
    p = _token(tmp_path, 0o644)
    assert main(["--address", "127.0.0.1:1", "--token-file", str(p), "status"]) == 2
    assert f"chmod 600 {p}" in capsys.readouterr().err
