"""Issue 49: hostile or broken configuration ends in a ConfigError naming the file or the key, never a
traceback; a boolean is not an integer."""

from __future__ import annotations

import pytest

from rollout_svc.config import RolloutConfig
from tests.unit.weightsync.test_config import _resolve
from weightsync.config import ConfigError

HUGE = "9" * 5000  # past Python's int_max_str_digits (4300): int() and the YAML/JSON parsers raise ValueError


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("c.yaml", "max_n: [1\n", r"config file .*c\.yaml: not valid YAML"),
        ("c.json", '{"max_n": 1', r"config file .*c\.json: not valid JSON"),
        ("c.yaml", f"max_n: {HUGE}\n", r"config file .*c\.yaml: a value cannot be read"),
        ("c.json", f'{{"max_n": {HUGE}}}', r"config file .*c\.json: a value cannot be read"),
        ("c.json", "[" * 100_000, r"config file .*c\.json: (nested too deeply|not valid JSON)"),
    ],
    ids=["yaml", "json", "yaml-huge-int", "json-huge-int", "json-deep"],
)
def test_a_broken_config_file_is_a_config_error_naming_it(tmp_path, name, text, match):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        _resolve(RolloutConfig, ["--config", str(f)], prefix="WS_ROLLOUT")


def test_a_non_utf8_config_file_is_a_config_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"max_n: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: not valid YAML"):
        _resolve(RolloutConfig, ["--config", str(f)], prefix="WS_ROLLOUT")


@pytest.mark.parametrize(
    "argv, env, match",
    [
        (["--max-n", HUGE], {}, r"^max_n: '9999.*\(5002 characters\) is not a valid int$"),
        ([], {"WS_ROLLOUT_MAX_N": "1" + "0" * 30}, r"^max_n: '1000000000000000000000000000000' is out of range"),
        (["--sglang-arg", f"max_running_requests={HUGE}"], {}, r"^sglang: max_running_requests: Exceeds the limit"),
    ],
    ids=["flag", "env-over-int64", "option"],
)
def test_a_huge_integer_option_is_a_config_error_naming_the_key(argv, env, match):
    with pytest.raises(ConfigError, match=match):
        _resolve(RolloutConfig, argv, env, prefix="WS_ROLLOUT")


@pytest.mark.parametrize("text", ["max_n: true\n", "sync_timeout_s: false\n"])
def test_a_boolean_is_not_a_number(tmp_path, text):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    key = text.split(":")[0]
    with pytest.raises(ConfigError, match=rf"^{key}: (True|False) is a boolean, not a (int|float) \(give a number\)$"):
        _resolve(RolloutConfig, ["--config", str(f)], prefix="WS_ROLLOUT")


def test_numbers_still_parse(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_n: 3\nsync_timeout_s: 12\n")
    cfg = _resolve(RolloutConfig, ["--config", str(f), "--max-new-tokens", "100"], prefix="WS_ROLLOUT")
    assert (cfg.limits.max_n, cfg.limits.max_new_tokens) == (3, 100)
