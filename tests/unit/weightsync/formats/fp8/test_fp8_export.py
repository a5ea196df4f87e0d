"""Which tensors travel as FP8 (checked against the transformers modules of every tiny family), and
the exported stream: its manifest entries, its bytes, and its values."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.formats.fp8 import blocks as fp8
from weightsync.formats.fp8.export import export_metas, export_tensors, is_quantized
from weightsync.formats.fp8.receive import Dequantizer, logical_metas
from weightsync.models import resolve_model

FAMILIES = ["tiny-qwen2", "tiny-qwen2-tied", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe"]
# What block-FP8 checkpoints keep in 16 bits (by HF name suffix)
KEPT = ("embed_tokens.weight", "lm_head.weight", "norm.weight", ".bias", "mlp.gate.weight", "shared_expert_gate.weight")


def _meta_model(spec: str):
    from transformers import AutoModelForCausalLM

    config, _ = resolve_model(spec)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("spec", FAMILIES)
def test_rule_quantizes_exactly_the_linear_projections_in_memory(spec):
    model = _meta_model(spec)
    quantized = []
    for name, t in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        linear = isinstance(module, torch.nn.Linear) and leaf == "weight"
        fused_experts = owner.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj")
        not_converted = name.endswith(("lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight"))
        want = (linear or fused_experts) and not not_converted
        assert is_quantized(name, tuple(t.shape)) == want, name
        quantized += [name] * want
    # attention q/k/v/o and the MLP (or experts) of every layer
    assert any(".self_attn.q_proj.weight" in n for n in quantized)
    assert any("mlp.down_proj" in n or "experts.down_proj" in n for n in quantized)


@pytest.mark.parametrize("spec", FAMILIES)
def test_rule_on_checkpoint_names_keeps_what_fp8_checkpoints_keep(spec):
    from transformers.core_model_loading import revert_weight_conversion

    model = _meta_model(spec)
    on_disk = revert_weight_conversion(model, model.state_dict())
    assert on_disk, spec
    for name, t in on_disk.items():
        assert is_quantized(name, tuple(t.shape)) == (not name.endswith(KEPT)), name
    if "moe" in spec:  # per-expert names on disk
        assert is_quantized("model.layers.1.mlp.experts.3.gate_proj.weight", (32, 64))
        assert not is_quantized("model.layers.1.mlp.gate.weight", (4, 64))
    if spec == "tiny-qwen2-moe":
        assert is_quantized("model.layers.0.mlp.shared_expert.up_proj.weight", (48, 64))


def test_rule_ignores_vectors_and_unknown_names():
    assert not is_quantized("model.layers.0.mlp.down_proj.weight", (64,))
    assert not is_quantized("model.layers.0.mystery.weight", (64, 64))
    assert is_quantized("model.layers.0.self_attn.kv_b_proj.weight", (4096, 512))  # DeepSeek MLA


def _tiny_named(spec: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    config, _ = resolve_model(spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return [(n, t.detach()) for n, t in model.state_dict().items()]


@pytest.mark.parametrize("spec", ["tiny-qwen2", "tiny-qwen3-moe"])
def test_stream_matches_its_metas_and_dequantizes_back(spec):
    named = _tiny_named(spec)
    metas = export_metas(TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named)
    out = list(export_tensors(iter(named)))
    assert [(m.name, m.shape, m.dtype) for m in metas] == [(n, tuple(t.shape), t.dtype) for n, t in out]
    src = dict(named)
    for i, (n, t) in enumerate(out):
        if t.dtype == fp8.FP8_DTYPE:
            assert out[i - 1][0] == n + "_scale_inv"  # the scale travels first
            q, s = fp8.quantize(src[n])
            assert torch.equal(t.view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[i - 1][1], s)
        elif not n.endswith("_scale_inv"):
            assert t.dtype == torch.bfloat16 and torch.equal(t, src[n].to(torch.bfloat16))
    # the receiving side folds the pairs back into the model's own names
    assert [m.name for m in logical_metas(metas)] == [n for n, _ in named]
    deq = Dequantizer()
    back = dict(deq(iter(out)))
    deq.check_complete()
    assert list(back) == [n for n, _ in named]
    for n, t in named:
        if is_quantized(n, tuple(t.shape)):
            assert torch.equal(back[n], fp8.dequantize(*fp8.quantize(t)))


def test_dequantizer_pairs_across_buckets_in_either_order_and_reports_leftovers():
    w = torch.randn(130, 70)
    q, s = fp8.quantize(w)
    want = fp8.dequantize(q, s)
    for order in ([("x.weight_scale_inv", s)], [("x.weight", q)]), ([("x.weight", q)], [("x.weight_scale_inv", s)]):
        deq = Dequantizer()
        first = [(n, t.clone()) for n, t in order[0]]
        assert list(deq(iter(first))) == []
        for _, t in first:
            t.zero_()  # the bucket buffer is reused: the held copy must not change
        ((name, got),) = list(deq(iter(order[1])))
        assert name == "x.weight" and torch.equal(got, want)
        deq.check_complete()
    deq = Dequantizer()
    list(deq(iter([("x.weight_scale_inv", s)])))
    with pytest.raises(ValueError, match="tensor x.weight: its FP8 weight or scale never arrived"):
        deq.check_complete()


@pytest.mark.parametrize(
    "metas,match",
    [
        ([TensorMeta("a.weight", (4, 4), torch.float8_e4m3fn)], r"a.weight_scale_inv is missing"),
        ([TensorMeta("a.weight_scale_inv", (1, 1), torch.float32)], r"a.weight is not in the manifest"),
        (
            [
                TensorMeta("a.weight_scale_inv", (2, 1), torch.float32),
                TensorMeta("a.weight", (4, 4), torch.float8_e4m3fn),
            ],
            r"shape \[2, 1\].*expected \[1, 1\]",
        ),
        (
            [TensorMeta("a.weight_scale_inv", (1, 1), torch.float32), TensorMeta("a.weight", (4, 4), torch.bfloat16)],
            r"a.weight is torch.bfloat16",
        ),
    ],
)
def test_logical_metas_refuses_broken_pairs(metas, match):
    with pytest.raises(ValueError, match=match):
        logical_metas(metas)


def test_fp8_export_bytes_are_half_of_bf16_plus_scales_on_a_7b_shape():
    from bench.model_shapes import shapes

    bf16 = [TensorMeta(n, s, torch.bfloat16) for n, s in shapes("7b")]
    f8 = export_metas(bf16)
    lin = [m for m in bf16 if is_quantized(m.name, m.shape)]
    lin_bf16 = sum(m.nbytes for m in lin)
    scales = sum(m.nbytes for m in f8 if m.name.endswith("_scale_inv"))
    assert sum(m.nbytes for m in f8 if m.dtype == fp8.FP8_DTYPE) * 2 == lin_bf16
    assert scales == sum(4 * torch.Size(fp8.scale_shape(m.shape)).numel() for m in lin)
    assert 0 < scales < lin_bf16 * 1.3e-4  # one float32 (4 bytes) per 128x128 block of 2-byte weights
    kept = sum(m.nbytes for m in bf16) - lin_bf16
    total_bf16, total_f8 = sum(m.nbytes for m in bf16), sum(m.nbytes for m in f8)
    assert total_f8 == kept + lin_bf16 // 2 + scales
    # Qwen2.5-7B: embeddings + lm_head (2.2 GB) stay bf16, so the whole sync is 0.57x the bf16 bytes
    assert 0.56 < total_f8 / total_bf16 < 0.58
    # and the bucket plan carries it (alignment padding aside)
    man = make_manifest(f8, version=1, sync_id="s", bucket_bytes=1 << 30)
    assert total_f8 <= man.total_bytes < total_f8 + 256 * len(f8)


def _linear_stream(bad: dict[str, tuple[int, int]] | None = None):
    """Four quantized projections and a norm; `bad`: name -> (row, col) of a NaN weight."""
    torch.manual_seed(0)
    named = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(300, 200)) for i in range(4)]
    named.insert(2, ("model.norm.weight", torch.ones(200)))
    for name, (r, c) in (bad or {}).items():
        dict(named)[name][r, c] = float("nan")
    return named


def test_a_non_finite_weight_fails_the_stream_after_its_last_tensor_naming_the_first_bad_one():
    named = _linear_stream(
        {"model.layers.1.mlp.up_proj.weight": (290, 10), "model.layers.3.mlp.up_proj.weight": (0, 0)}
    )
    want = export_metas(TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named)
    got = []
    stream = export_tensors(iter(named))
    with pytest.raises(
        ValueError,
        match=r"^tensor model.layers.1.mlp.up_proj.weight: block \[2, 0\] holds inf or "
        r"nan; refusing to export it as FP8 \(the trainer's weights have diverged\)$",
    ):
        for item in stream:
            got.append(item)
    assert [n for n, _ in got] == [m.name for m in want]  # every tensor went out before the error
    assert not torch.isfinite(dict(got)["model.layers.1.mlp.up_proj.weight_scale_inv"]).all()


def test_quantize_can_leave_the_finiteness_check_to_its_caller():
    w = torch.randn(200, 300)
    w[150, 260] = float("inf")
    q, s = fp8.quantize(w, "w", check_finite=False)
    assert s[1, 2] == float("inf") and torch.isfinite(s).sum() == s.numel() - 1
    with pytest.raises(ValueError, match=r"tensor w: block \[1, 2\] holds inf or nan"):
        fp8.check_scales(s, "w")
    with pytest.raises(ValueError, match=r"tensor w: block \[1, 2\] holds inf or nan"):
        fp8.quantize(w, "w")  # the default still checks every call


class _HostSyncs:
    """Counts what makes the host wait for a device tensor's value: bool(), .item(), .tolist()."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for attr in ("__bool__", "item", "tolist"):
            orig = getattr(torch.Tensor, attr)
            monkeypatch.setattr(torch.Tensor, attr, self._counting(attr, orig))

    def _counting(self, attr, orig):
        def f(t, *a, **k):
            self.calls.append(attr)
            return orig(t, *a, **k)

        return f


def test_the_stream_waits_for_the_device_once_at_its_end_not_per_tensor(monkeypatch):
    named = _linear_stream()
    syncs = _HostSyncs(monkeypatch)
    stream = export_tensors(iter(named))
    n = 0
    for _ in stream:
        n += 1
        assert syncs.calls == [], f"host synchronisation before tensor {n} of the stream: {syncs.calls}"
    assert n == 2 * 4 + 1 and syncs.calls == ["__bool__"]  # one check, after the last tensor


def test_the_end_check_costs_one_wait_per_device_and_searches_only_when_something_is_bad(monkeypatch):
    from weightsync.formats.fp8 import export

    checked: list[int] = []
    orig = export._all_finite
    monkeypatch.setattr(export, "_all_finite", lambda t: checked.append(t.numel()) or orig(t))
    list(export_tensors(iter(_linear_stream())))
    blocks = 4 * 3 * 2  # four 300x200 weights of 3x2 blocks, one concatenated check
    assert checked == [blocks]
    checked.clear()
    with pytest.raises(ValueError, match="layers.2.mlp.up_proj.weight: block \\[0, 1\\]"):
        list(export_tensors(iter(_linear_stream({"model.layers.2.mlp.up_proj.weight": (5, 130)}))))
    assert checked == [blocks, 6, 6, 6]  # then tensor by tensor up to the first bad one
