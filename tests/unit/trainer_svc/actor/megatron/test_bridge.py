"""Converter backends (issue #9): the bridge API contract and its validator, the generic bridge
wrapper (plan / checked export) on a scripted fake bridge, selection errors, and — where mbridge
is installed (the test extra pins it) — built-in rules vs mbridge on real megatron-core models
under torchrun: the same name -> tensor map for every family, exact."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types

import pytest
import torch

from tests.support.megatron_models import SUPPORT, torchrun
from trainer_svc.actor.megatron.bridge import BridgeConverter, BridgeUnavailable, make_converter
from trainer_svc.actor.megatron.parallel import Parallelism
from trainer_svc.bridge_contract import (
    CONTRACTS,
    Contract,
    check_contract,
    check_instance,
    missing_package_error,
    require_bridge,
)
from weightsync.bus.plan import TensorMeta

BRIDGE_FAMILIES = ["qwen2", "llama", "qwen3", "qwen2-tied"]
HAS_MBRIDGE = importlib.util.find_spec("mbridge") is not None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# ---- the contract validator, on a fake package ---------------------------------------------------


def _fake_package(**over):
    """A package shaped like the contract below; `over` replaces pieces to break it."""

    class Bridge:
        TABLE = {"a.weight": ["x"], "b.weight": ["y"]}

        def __init__(self, hf_config, dtype=None):
            self.vocab_size = None

        def export(self, models):
            return iter(())

    class AutoBridge:
        @classmethod
        def from_config(cls, hf_config, **kwargs):
            return Bridge(hf_config)

    root = types.ModuleType("fakebridge")
    core = types.ModuleType("fakebridge.core")
    core.Bridge = over.get("Bridge", Bridge)
    root.core = core
    root.AutoBridge = over.get("AutoBridge", AutoBridge)
    return root


FAKE = Contract(
    converter="fake",
    module="fakebridge",
    distribution="fakebridge-dist",
    pinned="1.2.3",
    install="pip install fakebridge==1.2.3",
    callables={
        "AutoBridge.from_config": ("hf_config",),
        "core.Bridge.__init__": ("hf_config", "dtype"),
        "core.Bridge.export": ("models",),
    },
    contains={"core.Bridge.TABLE": ("a.weight", "b.weight")},
    instance_attrs=("vocab_size",),
)


def test_contract_holds_on_a_matching_package():
    assert check_contract(FAKE, _fake_package()) == []


def test_contract_names_a_missing_symbol():
    root = _fake_package()
    del root.AutoBridge
    assert check_contract(FAKE, root) == [
        "fakebridge.AutoBridge.from_config is missing (fakebridge has no attribute 'AutoBridge')"
    ]


def test_contract_names_a_renamed_parameter_and_kwargs_do_not_hide_it():
    class Bridge:
        TABLE = {"a.weight": [], "b.weight": []}

        def __init__(self, config, **kwargs):  # hf_config renamed, dtype swallowed by **kwargs
            pass

        def export(self, models):
            pass

    problems = check_contract(FAKE, _fake_package(Bridge=Bridge))
    assert problems == [
        "fakebridge.core.Bridge.__init__ takes no parameter hf_config, dtype (has: config, kwargs, self)"
    ]


def test_contract_names_a_missing_table_key():
    class Bridge:
        TABLE = {"a.weight": []}

        def __init__(self, hf_config, dtype=None):
            pass

        def export(self, models):
            pass

    assert check_contract(FAKE, _fake_package(Bridge=Bridge)) == [
        "fakebridge.core.Bridge.TABLE has no entry 'b.weight'"
    ]


def test_instance_check_names_the_attribute_the_version_and_the_fix():
    with pytest.raises(BridgeUnavailable) as e:
        check_instance(FAKE, object())
    msg = str(e.value)
    assert "object instance has no attribute 'vocab_size'" in msg
    assert "pinned against 1.2.3" in msg and "pip install fakebridge==1.2.3" in msg and "converter=builtin" in msg


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(CONTRACTS, "fake", FAKE)
    msg = missing_package_error("fake")
    assert msg == (
        "converter='fake' needs the fakebridge-dist package, which is not installed: "
        "pip install fakebridge==1.2.3 (or set converter=builtin)"
    )
    with pytest.raises(BridgeUnavailable, match="pip install fakebridge==1.2.3"):
        require_bridge("fake")


def test_unknown_converter_and_unsupported_family_are_refused_before_any_import():
    cfg = types.SimpleNamespace(vocab_size=250, model_type="qwen3_moe")
    with pytest.raises(ValueError, match="converter='nope' is not one of builtin, mbridge, megatron-bridge"):
        make_converter("nope", types.SimpleNamespace(hf_config=cfg, family="qwen2"), Parallelism(), torch.float32)
    with pytest.raises(ValueError, match="supports the families llama, qwen2, qwen3 .* not 'qwen3_moe'"):
        make_converter(
            "mbridge", types.SimpleNamespace(hf_config=cfg, family="qwen3_moe"), Parallelism(), torch.float32
        )
    assert (
        make_converter(
            "builtin", types.SimpleNamespace(hf_config=cfg, family="qwen3_moe"), Parallelism(), torch.float32
        )
        is None
    )


@pytest.mark.skipif(_installed("megatron.bridge"), reason="megatron-bridge is installed here")
def test_megatron_bridge_absent_gives_the_install_line():
    cfg = types.SimpleNamespace(vocab_size=250, model_type="qwen2")
    with pytest.raises(
        BridgeUnavailable, match=r"needs the megatron-bridge package.*pip install megatron-bridge==0\.6\.2"
    ):
        make_converter(
            "megatron-bridge", types.SimpleNamespace(hf_config=cfg, family="qwen2"), Parallelism(), torch.float32
        )


# ---- the config field -----------------------------------------------------------------------------


def _trainer_config(argv, env=None):
    import argparse

    from trainer_svc.config import ENV_PREFIX, TrainerConfig
    from weightsync.config import add_arguments, resolve

    p = argparse.ArgumentParser()
    add_arguments(p, TrainerConfig, ENV_PREFIX)
    return resolve(TrainerConfig, p.parse_args(argv), ENV_PREFIX, env or {})


def test_config_converter_default_choices_and_backend():
    from weightsync.config import ConfigError

    assert _trainer_config([]).actor.converter == "builtin"
    with pytest.raises(
        ConfigError, match=r"converter: 'nope' is not one of \['builtin', 'mbridge', 'megatron-bridge'\]"
    ):
        _trainer_config([], {"WS_TRAINER_CONVERTER": "nope"})
    with pytest.raises(ConfigError, match="converter=mbridge applies to backend=megatron"):
        _trainer_config(["--backend", "hf", "--converter", "mbridge"])


@pytest.mark.skipif(_installed("megatron.bridge"), reason="megatron-bridge is installed here")
def test_config_refuses_a_bridge_that_is_not_installed():
    from weightsync.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"needs the megatron-bridge package, which is not installed: "
        r"pip install megatron-bridge==0\.6\.2",
    ):
        _trainer_config(["--converter", "megatron-bridge"])


@pytest.mark.skipif(not HAS_MBRIDGE, reason="mbridge not installed")
def test_config_accepts_an_installed_bridge():
    assert _trainer_config([], {"WS_TRAINER_CONVERTER": "mbridge"}).actor.converter == "mbridge"


# ---- the real packages against the pinned contracts ----------------------------------------------


@pytest.mark.skipif(not HAS_MBRIDGE, reason="mbridge not installed (pip install 'mbridge[megatron]==0.15.1')")
def test_installed_mbridge_matches_its_contract():
    import importlib.metadata

    import mbridge

    c = CONTRACTS["mbridge"]
    assert check_contract(c, mbridge) == []
    assert importlib.metadata.version("mbridge") == c.pinned, "test extra and contract pin must agree"


@pytest.mark.skipif(
    not _installed("megatron.bridge"),
    reason="megatron-bridge not installable next to megatron-core 0.16.1 / Python 3.11 (docs/conversion.md)",
)
def test_installed_megatron_bridge_matches_its_contract():
    import megatron.bridge

    assert check_contract(CONTRACTS["megatron-bridge"], megatron.bridge) == []


# ---- the generic wrapper on a scripted bridge ----------------------------------------------------


class _Scripted:
    """A bridge adapter that yields a fixed list and counts how much of it was consumed."""

    def __init__(self, items):
        self.items, self.consumed = items, 0

    def export(self, chunks):
        for item in self.items:
            self.consumed += 1
            yield item


def _conv(items, tied=False):
    cfg = types.SimpleNamespace(vocab_size=5, tie_word_embeddings=tied)
    return BridgeConverter("fake", _Scripted(items), cfg, padded_vocab=8)


REF = [
    TensorMeta("model.embed_tokens.weight", (5, 2), torch.bfloat16),
    TensorMeta("model.norm.weight", (2,), torch.bfloat16),
]


def test_plan_takes_the_bridge_order_drops_tied_extras_and_trims_padded_vocab():
    emb = torch.arange(16.0).reshape(8, 2)
    items = [
        ("model.norm.weight", torch.ones(2)),
        ("model.embed_tokens.weight", emb),
        ("model.embed_tokens.weight", emb),
        ("lm_head.weight", emb),
    ]
    conv = _conv(items, tied=True)
    metas = conv.plan(None, REF)
    assert [(m.name, m.shape, m.dtype) for m in metas] == [
        ("model.norm.weight", (2,), torch.bfloat16),
        ("model.embed_tokens.weight", (5, 2), torch.bfloat16),
    ]
    got = list(conv.export(None, metas))
    assert [n for n, _ in got] == ["model.norm.weight", "model.embed_tokens.weight"]
    assert got[1][1].dtype == torch.bfloat16 and torch.equal(got[1][1], emb[:5].to(torch.bfloat16))


def test_plan_refuses_unknown_missing_and_misshapen_tensors():
    with pytest.raises(ValueError) as e:
        _conv([("model.embed_tokens.weight", torch.zeros(6, 2)), ("lm_head.weight", torch.zeros(5, 2))]).plan(None, REF)
    msg = str(e.value)
    assert "tensor model.embed_tokens.weight: converter fake yields shape (6, 2), transformers expects (5, 2)" in msg
    assert "tensor lm_head.weight: yielded by converter fake, but the transformers model has no such tensor" in msg
    assert "tensor model.norm.weight: converter fake does not yield it (1 missing)" in msg
    assert msg.endswith("Use converter=builtin")


def test_export_mismatch_drains_the_bridge_then_names_the_position():
    items = [("model.norm.weight", torch.ones(2)), ("model.embed_tokens.weight", torch.zeros(5, 2))]
    conv = _conv(items)
    with pytest.raises(
        ValueError,
        match=r"converter fake yielded model.norm.weight \(2,\) at position 0, the plan "
        r"expects model.embed_tokens.weight \(5, 2\)",
    ):
        list(conv.export(None, REF))
    assert conv.adapter.consumed == 2  # the other ranks' collectives were run to the end


def test_export_closed_early_still_drains_the_bridge():
    conv = _conv([("model.embed_tokens.weight", torch.zeros(5, 2)), ("model.norm.weight", torch.ones(2))])
    it = conv.export(None, REF)
    next(it)
    it.close()
    assert conv.adapter.consumed == 2


def test_export_finishes_the_bridge_before_handing_out_the_last_tensor():
    # a tied model at PP>1: the last stage's head copy trails the planned tensors
    emb = torch.zeros(5, 2)
    conv = _conv(
        [("model.embed_tokens.weight", emb), ("model.norm.weight", torch.ones(2)), ("model.embed_tokens.weight", emb)],
        tied=True,
    )
    it = conv.export(None, REF)
    next(it)
    next(it)  # everything planned is out; the consumer need not pull again
    assert conv.adapter.consumed == 3


def test_export_with_an_unplanned_trailing_tensor_is_an_error():
    conv = _conv(
        [
            ("model.embed_tokens.weight", torch.zeros(5, 2)),
            ("model.norm.weight", torch.ones(2)),
            ("model.layers.0.extra.weight", torch.ones(2)),
        ]
    )
    it = conv.export(None, REF)
    next(it)
    with pytest.raises(
        ValueError,
        match="tensor model.layers.0.extra.weight: yielded by converter fake, but the "
        "transformers model has no such tensor",
    ):
        next(it)  # refused before the last planned tensor is handed out


def test_export_that_stops_short_is_an_error():
    conv = _conv([("model.embed_tokens.weight", torch.zeros(5, 2))])
    with pytest.raises(ValueError, match=r"stopped after 1 of 2 tensors \(next expected: model.norm.weight\)"):
        list(conv.export(None, REF))


# ---- import hygiene ------------------------------------------------------------------------------


def test_config_side_imports_no_torch_and_bridge_module_imports_no_bridge():
    code = (
        "import sys, json; import trainer_svc.bridge_contract as c; c.missing_package_error('mbridge'); "
        "a = sorted(sys.modules); import trainer_svc.actor.megatron.bridge; b = sorted(sys.modules); "
        "print(json.dumps([a, b]))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert not {m for m in before if m.split(".")[0] in ("torch", "megatron", "mbridge", "transformers")}
    assert not {m for m in after if m.split(".")[0] in ("megatron", "mbridge")}


# ---- built-in vs mbridge on real models ----------------------------------------------------------

LAYOUTS = [(2, 2, 1, "float32"), (1, 2, 2, "bfloat16")]


@pytest.mark.skipif(not HAS_MBRIDGE, reason="mbridge not installed (pip install 'mbridge[megatron]==0.15.1')")
@pytest.mark.parametrize("tp,pp,vpp,dtype", LAYOUTS, ids=[f"tp{t}-pp{p}-vpp{v}-{d}" for t, p, v, d in LAYOUTS])
def test_builtin_and_mbridge_give_the_same_tensors(tp, pp, vpp, dtype, hf_dirs, tmp_path):
    out = tmp_path / "report.json"
    proc = torchrun(
        SUPPORT / "_bridge_roundtrip.py",
        tp * pp,
        [
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--vpp",
            str(vpp),
            "--dtype",
            dtype,
            "--out",
            str(out),
            *[str(hf_dirs[f]) for f in BRIDGE_FAMILIES],
        ],
        timeout=300,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(BRIDGE_FAMILIES)
    for family, res in report.items():
        assert "error" not in res, f"{family}: {res['error']}"
        assert res["load_equal"], f"{family}: mbridge's load differs from the built-in load on some rank"
        assert res["export_same_names"] and res["export_mismatch"] == [], f"{family}: export differs {res}"
        assert res["actor_mismatch"] == [] and res["actor_missing"] == [], f"{family}: {res}"
        assert res["metas_match"], f"{family}: export_metas() is not what the mbridge export yields"
        assert res["saved_exact"], f"{family}: save_hf() through mbridge wrote other tensors than it exports"
        # the point of planning in the bridge's order: it is not the rule table's
        assert res["order_differs"], f"{family}: expected mbridge's order to differ from the rule table's"
