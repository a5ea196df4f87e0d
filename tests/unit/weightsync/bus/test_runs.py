"""Run entries (weightsync.bus.runs): a MoE layer's experts as one manifest entry, exactly the plain layout."""

from __future__ import annotations

import pytest
import torch

from weightsync.bus.layout import KnownLayouts, ManifestCache, layout_digest
from weightsync.bus.plan import TensorMeta, manifest_from_proto
from weightsync.formats.fp8.export import export_metas

HIDDEN, INTER = 256, 128


def moe_metas(layers: int = 2, experts: int = 8, dtype=torch.bfloat16) -> list[TensorMeta]:
    """A small MoE in HF names: attention, router, then each expert's gate/up/down."""
    out = [TensorMeta("model.embed_tokens.weight", (64, HIDDEN), dtype)]
    for i in range(layers):
        p = f"model.layers.{i}"
        out.append(TensorMeta(f"{p}.input_layernorm.weight", (HIDDEN,), dtype))
        out += [TensorMeta(f"{p}.self_attn.{n}_proj.weight", (HIDDEN, HIDDEN), dtype) for n in "qkvo"]
        out.append(TensorMeta(f"{p}.mlp.gate.weight", (experts, HIDDEN), dtype))
        for e in range(experts):
            out.append(TensorMeta(f"{p}.mlp.experts.{e}.gate_proj.weight", (INTER, HIDDEN), dtype))
            out.append(TensorMeta(f"{p}.mlp.experts.{e}.up_proj.weight", (INTER, HIDDEN), dtype))
            out.append(TensorMeta(f"{p}.mlp.experts.{e}.down_proj.weight", (HIDDEN, INTER), dtype))
    out.append(TensorMeta("model.norm.weight", (HIDDEN,), dtype))
    return out


def _manifest(metas, bucket_bytes=1 << 20):
    cache = ManifestCache()
    m = cache.manifest(metas, version=3, sync_id="s", bucket_bytes=bucket_bytes, checksum_algo="c", origin="o")
    return cache, m


def _layout(m):
    return [(b.index, b.nbytes, b.sender, [(s.meta, s.offset) for s in b.slots]) for b in m.buckets]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-block"])
@pytest.mark.parametrize("bucket_bytes", [16 << 20, 700_000], ids=["one-bucket", "runs-split-by-buckets"])
def test_run_manifest_expands_to_exactly_the_plain_one(fp8, bucket_bytes):
    metas = export_metas(moe_metas()) if fp8 else moe_metas()
    cache, m = _manifest(metas, bucket_bytes)
    plain, runs = cache.full_proto(m), cache.full_proto(m, runs=True)
    n_plain = sum(len(b.tensors) for b in plain.buckets)
    n_runs = sum(len(b.tensors) for b in runs.buckets)
    assert n_plain == len(metas)
    per_expert = 6 if fp8 else 3  # gate, up, down (and each one's scale)
    if bucket_bytes > 1 << 20:  # each layer's 8 experts: one entry in place of 8 x per_expert
        assert n_runs == n_plain - 2 * (8 * per_expert - 1)
    else:  # a run ends where its bucket does
        assert n_runs < n_plain
    assert any(t.run_count for b in runs.buckets for t in b.tensors)
    a, b = manifest_from_proto(plain), manifest_from_proto(runs)
    assert _layout(a) == _layout(b) == _layout(m)
    assert [mt.nbytes for mt in b.metas()] == [mt.nbytes for mt in metas]
    assert layout_digest(a) == layout_digest(b) == m.layout_digest
    # both forms are one layout to a rollout: held under one digest
    known = KnownLayouts()
    assert known.manifest_of(runs).layout_digest == m.layout_digest


def test_a_rollout_refuses_a_bad_run_naming_the_tensor():
    cache, m = _manifest(moe_metas())
    msg = cache.full_proto(m, runs=True)
    run = next(t for b in msg.buckets for t in b.tensors if t.run_count)
    run.run_members[1].nbytes += 2  # up_proj's size no longer matches its shape
    with pytest.raises(ValueError, match=r"member 'model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight': nbytes="):
        manifest_from_proto(msg)
    msg = cache.full_proto(m, runs=True)
    run = next(t for b in msg.buckets for t in b.tensors if t.run_count)
    run.run_stride -= 256  # blocks overlap
    with pytest.raises(ValueError, match=r"run 'model\.layers\.0\.mlp\.experts\.'\{0\.\.\}\): run_stride="):
        manifest_from_proto(msg)
    msg = cache.full_proto(m, runs=True)
    b0 = next(b for b in msg.buckets if any(t.run_count for t in b.tensors))
    b0.num_tensors += 1
    with pytest.raises(ValueError, match=rf"buckets\[{b0.index}\]\.num_tensors={b0.num_tensors} but its entries hold"):
        manifest_from_proto(msg)
    msg = cache.full_proto(m, runs=True)
    run = next(t for b in msg.buckets for t in b.tensors if t.run_count)
    run.run_first = 1  # its experts 1..2 collide with expert 2's entries after it
    with pytest.raises(
        ValueError, match=r"\('model\.layers\.0\.mlp\.experts\.2\.gate_proj\.weight'\): name is empty or repeated"
    ):
        manifest_from_proto(msg)


def test_the_engine_refuses_a_run_that_names_an_expert_it_lacks():
    from bench.control_plane import meta_engine
    from rollout_svc.sync.transaction import SyncTransaction
    from weightsync.bus.errors import SyncError

    metas = moe_metas()
    cache, m = _manifest(metas, 16 << 20)  # one run per layer: experts 0..7
    msg = cache.full_proto(m, runs=True)
    run = next(t for b in msg.buckets for t in b.tensors if t.run_count)
    run.run_first = 1  # experts 1..8: the engine has no expert 8
    # the layout it claims is not the one its runs spell out
    with pytest.raises(ValueError, match=r"layout_digest=\w+ does not match its buckets"):
        KnownLayouts().manifest_of(msg)
    msg.layout_digest = ""  # a manifest that claims none: the rollout computes it, then the engine decides
    tx = SyncTransaction(meta_engine(metas), "inplace")
    tx.validate(KnownLayouts().manifest_of(cache.full_proto(m, runs=True)))  # the unchanged run is accepted
    with pytest.raises(
        SyncError, match=r"tensor model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight: the engine has no such"
    ):
        tx.validate(KnownLayouts().manifest_of(msg))


def test_digest_differs_when_any_tensor_in_a_run_differs():
    base = moe_metas()
    _, m = _manifest(base)
    seen = {m.layout_digest}
    i = next(k for k, t in enumerate(base) if t.name == "model.layers.1.mlp.experts.5.up_proj.weight")
    variants = [
        TensorMeta(base[i].name, (INTER + 1, HIDDEN), base[i].dtype),  # one expert's shape
        TensorMeta(base[i].name, base[i].shape, torch.float16),  # its dtype
        TensorMeta(base[i].name.replace("up_proj", "upp_proj"), base[i].shape, base[i].dtype),  # its name
    ]
    for v in variants:
        metas = [*base[:i], v, *base[i + 1 :]]
        cache, mv = _manifest(metas)
        # the run form, expanded, carries the change: the rollout computes the changed digest
        assert layout_digest(manifest_from_proto(cache.full_proto(mv, runs=True))) == mv.layout_digest
        seen.add(mv.layout_digest)
    assert len(seen) == 1 + len(variants)


def test_run_form_counts_for_the_rollout_limits():
    from rollout_svc.limits import ManifestLimits

    cache, m = _manifest(moe_metas(layers=4, experts=16), 64 << 20)  # 218 tensors in 30 entries
    msg = cache.full_proto(m, runs=True)
    assert sum(len(b.tensors) for b in msg.buckets) < 64 < m.num_tensors
    # an engine of 10 large parameters takes at most 2 x 10 + 64 tensors, and bytes enough
    few = {f"p{i}": TensorMeta(f"p{i}", (4096, 4096), torch.float32) for i in range(10)}
    with pytest.raises(Exception, match=f"manifest has {m.num_tensors} tensors"):
        ManifestLimits(few, max_bucket_mb=16).check(msg)
