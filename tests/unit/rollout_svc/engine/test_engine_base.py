"""rollout_svc.engine.base.Engine: what an engine must implement, and the defaults of the optional
hooks, driven through both apply strategies of the transaction."""

import pytest
import torch

from rollout_svc.engine.base import Engine
from rollout_svc.sync.transaction import SyncTransaction
from tests.support.packed import packed_sync
from weightsync.bus.copy.checksum import bucket_checksum
from weightsync.bus.plan import TensorMeta
from weightsync.formats.fp8.spec import BLOCK_FP8
from weightsync.v1 import rollout_pb2


class DictEngine(Engine):
    """Weights in a dict; overrides none of the optional hooks."""

    name = "dict"

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = {n: t.clone() for n, t in weights.items()}
        self.calls: list = []

    def param_metas(self):
        return {n: TensorMeta(n, tuple(t.shape), t.dtype) for n, t in self.weights.items()}

    def load_weights(self, named):
        names = []
        for n, t in named:
            self.weights[n].copy_(t)
            names.append(n)
        self.calls.append(("load_weights", sorted(names)))

    def flush_cache(self):
        self.calls.append("flush_cache")

    def generate(self, prompts, sampling, step=None):
        return []

    def score(self, token_ids, prompt_length):
        return [], torch.empty(0)

    def num_ranks(self):
        return 1

    def num_parameters(self):
        return sum(t.numel() for t in self.weights.values())

    def prefix_cache_entries(self):
        return 0


WEIGHTS = {"a": torch.zeros(300, 64), "b": torch.zeros(7, dtype=torch.bfloat16), "c": torch.zeros(200, 64)}


def _sync(new: dict[str, torch.Tensor]):
    return packed_sync(new)


def test_an_engine_lacking_a_required_method_cannot_be_built():
    class NoLoader(DictEngine):
        load_weights = Engine.load_weights  # abstract again

    with pytest.raises(TypeError, match="load_weights"):
        NoLoader(WEIGHTS)


def test_the_optional_hooks_default_to_what_an_engine_holding_its_weights_needs():
    eng = DictEngine(WEIGHTS)
    assert eng.hf_config() is None and not eng.yields_between_steps and not eng.stops_on_cancel
    assert not eng.streams_tokens  # its streams are sent at the end of generation (openai_api/routes.py)
    assert eng.loads_quantized(BLOCK_FP8) is False  # a quantized sync is dequantized for it
    assert eng.writable_params(list(eng.param_metas().values())) is None
    eng.begin_apply()
    assert eng.calls == []
    eng.end_apply()
    assert eng.calls == ["flush_cache"]
    new = {n: torch.randn(t.shape).to(t.dtype) for n, t in WEIGHTS.items()}
    m, bufs = _sync(new)
    eng.load_bucket(m.buckets[0], bufs[0])  # unpacked, then load_weights
    assert eng.calls[-1] == ("load_weights", sorted(s.meta.name for s in m.buckets[0].slots))
    for s in m.buckets[0].slots:
        assert torch.equal(eng.weights[s.meta.name], new[s.meta.name])


@pytest.mark.parametrize("mode, loads", [("inplace", "per bucket"), ("staged", "at commit")])
def test_both_apply_strategies_sync_an_engine_that_overrides_no_hook(mode, loads):
    eng = DictEngine(WEIGHTS)
    tx = SyncTransaction(eng, mode)
    new = {n: torch.randn(t.shape).to(t.dtype) for n, t in WEIGHTS.items()}
    m, bufs = _sync(new)
    assert len(m.buckets) > 1
    tx.prepare(m, timeout=30)
    for b, buf in zip(m.buckets, bufs):
        tx.consume_bucket("s1", b.index, buf, bucket_checksum(buf))
    loaded_before_commit = [c for c in eng.calls if c != "flush_cache"]
    assert len(loaded_before_commit) == (len(m.buckets) if loads == "per bucket" else 0)
    version, _, _ = tx.commit("s1", 1, {i: bucket_checksum(b) for i, b in enumerate(bufs)})
    assert version == 1 and tx.state == rollout_pb2.SERVING
    assert eng.calls[-1] == "flush_cache"  # inplace: end_apply's default; staged: after the load
    for n, t in new.items():
        assert torch.equal(eng.weights[n], t), n
