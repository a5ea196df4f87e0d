"""SGLang's own options reach its Engine: `inference.sglang` from a config file, `--sglang-arg KEY=VALUE`
flags and WS_ROLLOUT_SGLANG (JSON), merged key by key (flags > env > file), checked against the installed
SGLang's ServerArgs before the Engine is built.

A stand-in `sglang` package (ServerArgs with a few real field names, an Engine that records its keyword
arguments) is installed in sys.modules: the real SGLang needs a GPU; the names are real SGLang fields.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import types

import pytest

from rollout_svc.config import RolloutConfig
from weightsync.config import ConfigError, add_arguments, resolve


@dataclasses.dataclass
class _ServerArgs:
    model_path: str = ""
    tp_size: int = 1
    dtype: str = "auto"
    base_gpu_id: int = 0
    skip_tokenizer_init: bool = False
    mem_fraction_static: float | None = None
    context_length: int | None = None
    attention_backend: str | None = None
    sampling_backend: str | None = None
    cuda_graph_max_bs: int | None = None
    enable_memory_saver: bool = False
    random_seed: int | None = None
    log_level: str = "info"
    trust_remote_code: bool = False
    disable_radix_cache: bool = False
    enable_deterministic_inference: bool = False
    incremental_streaming_output: bool = False
    custom_weight_loader: list[str] | None = None


class _Engine:
    built: list[dict] = []

    def __init__(self, **kwargs):
        _ServerArgs(**kwargs)  # as SGLang does: an unknown keyword is a TypeError
        _Engine.built.append(kwargs)
        self.loop = asyncio.new_event_loop()  # as SGLang's Engine.__init__; the adapter runs it on its own thread


@pytest.fixture
def fake_sglang(monkeypatch):
    mods = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.server_args": types.ModuleType("sglang.srt.server_args"),
        "sglang.srt.entrypoints": types.ModuleType("sglang.srt.entrypoints"),
        "sglang.srt.entrypoints.engine": types.ModuleType("sglang.srt.entrypoints.engine"),
    }
    mods["sglang.srt.server_args"].ServerArgs = _ServerArgs
    mods["sglang.srt.entrypoints.engine"].Engine = _Engine
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    _Engine.built = []
    return _Engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from weightsync.models import resolve_model

    out = tmp_path_factory.mktemp("tiny-hf")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(resolve_model("tiny-qwen2")[0]).save_pretrained(str(out))
    return str(out)


def _resolve(argv, env=None):
    p = argparse.ArgumentParser()
    add_arguments(p, RolloutConfig, "WS_ROLLOUT")
    return resolve(RolloutConfig, p.parse_args(argv), "WS_ROLLOUT", env or {})


def test_file_env_and_flags_merge_key_by_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine: sglang\nsglang: {mem_fraction_static: 0.5, context_length: 4096, attention_backend: fa3}\n")
    cfg = _resolve(
        ["--config", str(f), "--sglang-arg", "mem_fraction_static=0.6", "--sglang-arg", "cuda_graph_max_bs=8"],
        {"WS_ROLLOUT_SGLANG": '{"context_length": 8192, "attention_backend": "triton"}'},
    )
    assert cfg.inference.sglang == {
        "mem_fraction_static": 0.6,  # flag over file
        "context_length": 8192,  # env over file
        "attention_backend": "triton",
        "cuda_graph_max_bs": 8,  # typed as YAML reads it
    }
    nested = tmp_path / "n.yaml"
    nested.write_text("inference: {engine: sglang, sglang: {context_length: 2048}}\n")
    assert _resolve(["--config", str(nested)]).inference.sglang == {"context_length": 2048}


@pytest.mark.parametrize(
    "argv, env, match",
    [
        (["--engine", "sglang", "--sglang-arg", "mem_fraction_static"], {}, "is not KEY=VALUE"),
        (["--engine", "sglang"], {"WS_ROLLOUT_SGLANG": "{not json"}, "is not a JSON object"),
        (["--engine", "sglang", "--sglang-arg", "mem-fraction=0.5"], {}, "are not identifiers"),
        (["--sglang-arg", "mem_fraction_static=0.5"], {}, "set engine=sglang"),
    ],
)
def test_malformed_options_are_refused_naming_the_fix(argv, env, match):
    with pytest.raises(ConfigError, match=match):
        _resolve(argv, env)


def test_options_reach_sglangs_engine(fake_sglang, model_dir):
    from rollout_svc.engine.sglang_engine import SglangEngine

    cfg = _resolve(
        ["--engine", "sglang", "--model", model_dir, "--dtype", "bfloat16", "--device", "cuda:1"]
        + ["--sglang-arg", "mem_fraction_static=0.6", "--sglang-arg", "attention_backend=triton"]
        + ["--sglang-arg", "enable_memory_saver=true", "--sglang-arg", "context_length=8192"]
    )
    engine = SglangEngine.from_rollout_config(cfg.inference)
    (kwargs,) = fake_sglang.built
    assert kwargs["mem_fraction_static"] == 0.6 and kwargs["attention_backend"] == "triton"
    assert kwargs["context_length"] == 8192 and kwargs["enable_memory_saver"] is True
    assert (kwargs["model_path"], kwargs["dtype"], kwargs["base_gpu_id"]) == (model_dir, "bfloat16", 1)
    assert kwargs["skip_tokenizer_init"] is True
    assert kwargs["incremental_streaming_output"] is False  # streamed items stay cumulative (sglang_stream.py)
    assert engine.opts.colocated  # the adapter's own reading of enable_memory_saver (release/resume memory)
    # our loader is registered in SGLang's workers (sglang_loader.py): CUDA buckets are written through it
    assert kwargs["custom_weight_loader"] == ["rollout_svc.engine.sglang_loader.load"]


@pytest.mark.parametrize(
    "option, match",
    [
        ("mem_fraction_statc=0.6", "not a field of SGLang .*ServerArgs; did you mean mem_fraction_static"),
        ("tp_size=2", "set by rollout-svc itself: set the rollout's `tp` instead"),
        ("skip_tokenizer_init=false", "set by rollout-svc itself: the adapter needs it"),
        ("incremental_streaming_output=true", "set by rollout-svc itself: the adapter needs it"),
    ],
)
def test_unknown_or_owned_options_are_refused_before_the_engine_starts(fake_sglang, model_dir, option, match):
    from rollout_svc.engine.sglang_engine import SglangEngine

    cfg = _resolve(["--engine", "sglang", "--model", model_dir, "--sglang-arg", option])
    with pytest.raises(ValueError, match=match):
        SglangEngine.from_rollout_config(cfg.inference)
    assert fake_sglang.built == []


@pytest.mark.parametrize("before", [None, "1"])
@pytest.mark.parametrize("starts", [True, False])
def test_sglangs_nccl_cumem_setting_stays_out_of_the_rollout_process(
    fake_sglang, model_dir, monkeypatch, before, starts
):
    """SGLang's Engine() sets NCCL_CUMEM_ENABLE=0 in the process that builds it unless it is set already
    (`_set_envs_and_config`, 0.5.10 and 0.5.23). That process is rollout-svc's, whose own NCCL transport must
    agree on cuMem with the trainer's NCCL: with SGLang's 0 left behind, the first NCCL sync into an SGLang
    rollout failed ncclCommInitRank ("unhandled cuda error") on two H100s. SGLang's ranks keep SGLang's value."""
    from rollout_svc.engine.sglang_engine import SglangEngine

    seen = []

    class EnvSettingEngine(fake_sglang):
        def __init__(self, **kwargs):
            if "NCCL_CUMEM_ENABLE" not in os.environ:  # as SGLang does
                os.environ["NCCL_CUMEM_ENABLE"] = "0"
            seen.append(os.environ["NCCL_CUMEM_ENABLE"])  # what its spawned schedulers inherit
            if not starts:
                raise RuntimeError("scheduler died")
            super().__init__(**kwargs)

    monkeypatch.setattr(sys.modules["sglang.srt.entrypoints.engine"], "Engine", EnvSettingEngine)
    if before is None:
        monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_CUMEM_ENABLE", before)
    cfg = _resolve(["--engine", "sglang", "--model", model_dir])
    if starts:
        SglangEngine.from_rollout_config(cfg.inference)
    else:
        with pytest.raises(RuntimeError, match="scheduler died"):
            SglangEngine.from_rollout_config(cfg.inference)
    assert seen == [before or "0"]
    assert os.environ.get("NCCL_CUMEM_ENABLE") == before
