"""Our loader in SGLang's TP workers (rollout_svc/engine/sglang_loader.py): how it learns a slot table from the
copies a model's own `load_weights` makes, and when it keeps that loader instead. A toy model stands in for
SGLang's (fused qkv rows, a padded vocabulary zeroed past the checkpoint's rows); tests/sglang_exec runs the
same loader against SGLang's real model classes."""

from __future__ import annotations

import torch

from rollout_svc.engine import sglang_loader as sl
from weightsync.bus.copy.checksum import bucket_checksum, from_sums
from weightsync.bus.pack import alloc_buffer, pack_bucket
from weightsync.bus.plan import TensorMeta, plan_buckets

H = 8


class Toy(torch.nn.Module):
    """q/k/v fused into qkv (rows q, k, v), an embedding padded to 16 rows (checkpoint: 10)."""

    def __init__(self, mode: str = "copy"):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.full((3 * H, H), float("nan"), dtype=torch.bfloat16), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.full((16, H), float("nan"), dtype=torch.bfloat16), requires_grad=False)
        self.mode = mode

    def load_weights(self, named):
        for name, w in named:
            if name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0] :].fill_(0)
                continue
            row = "qkv".index(name) * H
            dst = self.qkv.data.narrow(0, row, H)
            if self.mode == "cast":
                dst.copy_(w.float().to(torch.bfloat16))  # a copy from outside the bucket
            elif self.mode == "shard":
                dst[: H // 2].copy_(w.narrow(0, 0, H // 2))  # a TP shard: part of the tensor
                dst[H // 2 :].copy_(w.narrow(0, H // 2, H // 2))
            elif self.mode == "scale":
                dst.copy_(w)
                dst.mul_(2)
            else:
                dst.copy_(w)


def _bucket(seed: int):
    g = torch.Generator().manual_seed(seed)
    named = [(n, torch.randn(H, H, generator=g).to(torch.bfloat16)) for n in "qkv"]
    named.append(("embed", torch.randn(10, H, generator=g).to(torch.bfloat16)))
    (plan,) = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 20)
    buf = alloc_buffer(plan.nbytes)
    buf.fill_(0xAB)
    pack_bucket(plan, named, buf)
    return plan, buf, dict(named)


def _send(model, seq, plan, buf):
    result = torch.zeros(1, sl.RESULT_WORDS, dtype=torch.int64)
    sl.load(model, [(sl.header(seq, plan), buf), (sl.RESULT, result)])
    s, status, s1, s2, how, _, h1, h2, nbytes = result[0].tolist()
    assert s == seq and status == sl.OK, result
    assert (h1, h2, nbytes) == (0, 0, plan.nbytes) or how == sl.BY_TABLE, "a rank reading the whole bucket sums it all"
    s1, s2 = s1 + h1, s2 + h2  # one rank: its common and shard words are the whole bucket
    whole = plan.nbytes - plan.nbytes % 4
    assert from_sums(torch.tensor([s1, s2]), buf[whole : plan.nbytes], plan.nbytes) == bucket_checksum(
        buf[: plan.nbytes]
    )
    return how


def _holds(model, named):
    want = torch.cat([named["q"], named["k"], named["v"]])
    assert torch.equal(model.qkv, want)
    assert torch.equal(model.embed[:10], named["embed"]) and not model.embed[10:].any()


def test_first_bucket_learns_the_table_and_later_ones_are_written_by_it():
    model = Toy()
    plan, buf, named = _bucket(1)
    assert _send(model, 1, plan, buf) == sl.LEARNED
    _holds(model, named)
    (table,) = model._ws_slot_tables.values()
    # the table's regions are views of the parameters: q, k, v rows of the fused qkv, the embedding's first rows
    assert [d.data_ptr() for d in table.dests] == [
        model.qkv.data_ptr(),
        model.qkv[H:].data_ptr(),
        model.qkv[2 * H :].data_ptr(),
        model.embed.data_ptr(),
    ]
    for seed in (2, 3):
        plan, buf, named = _bucket(seed)
        model.load_weights = None  # the table, not the model's loader, writes it
        assert _send(model, seed, plan, buf) == sl.BY_TABLE
        _holds(model, named)


def test_layouts_the_table_cannot_replay_keep_the_models_loader():
    for mode, why in (
        ("cast", "wrote a parameter with copy_ from outside the bucket"),
        ("scale", "wrote a parameter with mul_"),
    ):
        model = Toy(mode)
        plan, buf, named = _bucket(1)
        assert _send(model, 1, plan, buf) == sl.LEARNED
        (table,) = model._ws_slot_tables.values()
        assert table.dests is None and why in table.why, (mode, table.why)
        plan, buf, named = _bucket(2)
        assert _send(model, 2, plan, buf) == sl.BY_SGLANG
        if mode != "scale":
            _holds(model, named)


def test_a_failure_is_reported_in_the_result_not_raised():
    model = Toy()
    plan, buf, _ = _bucket(1)
    result = torch.zeros(2, sl.RESULT_WORDS, dtype=torch.int64)
    sl.load(model, [(sl.header(7, plan), buf[:16]), (sl.header(7, plan), buf), (sl.RESULT, result)])
    assert result[0].tolist()[:2] == [7, sl.FAILED]
    assert result[1].tolist()[:2] == [0, 0], "a bucket after a failed one was written"
    sl.load(model, [(sl.header(8, plan), buf), (sl.RESULT, result)])
    assert result[0].tolist()[:2] == [8, sl.OK]


class ToyTP(torch.nn.Module):
    """One TP rank of `tp`, loading as SGLang's parallel layers do: `col` (column-parallel) keeps its rank's rows,
    `row` (row-parallel) its rank's columns, `norm` is replicated; `cols` wide rows (odd per rank: not words)."""

    def __init__(self, rank: int, tp: int = 2, cols: int = H):
        super().__init__()
        self.rank, self.tp, self.cols = rank, tp, cols

        def param(*shape):
            return torch.nn.Parameter(torch.full(shape, float("nan"), dtype=torch.bfloat16), requires_grad=False)

        self.col = param(2 * H // tp, cols)
        self.row = param(H, cols // tp)
        self.norm = param(cols)

    def load_weights(self, named):
        for name, w in named:
            if name == "col":
                n = 2 * H // self.tp
                self.col.data.copy_(w.narrow(0, self.rank * n, n))
            elif name == "row":
                n = self.cols // self.tp
                self.row.data.copy_(w.narrow(1, self.rank * n, n))
            else:
                self.norm.data.copy_(w)


def _tp_bucket(seed: int, cols: int = H):
    g = torch.Generator().manual_seed(seed)
    shapes = {"col": (2 * H, cols), "row": (H, cols), "norm": (cols,)}
    named = [(n, torch.randn(*shape, generator=g).to(torch.bfloat16)) for n, shape in shapes.items()]
    (plan,) = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 20)
    buf = alloc_buffer(plan.nbytes)
    buf.fill_(0xCD)
    pack_bucket(plan, named, buf)
    return plan, buf, dict(named)


def _send_ranks(models, seq, plan, buf):
    """Every rank's load of one bucket; the bucket's checksum as the rollout combines the ranks' rows."""
    from rollout_svc.engine.sglang_direct import _combined

    rows = []
    for m in models:
        result = torch.zeros(1, sl.RESULT_WORDS, dtype=torch.int64)
        sl.load(m, [(sl.header(seq, plan), buf), (sl.RESULT, result)])
        rows.append(result[0].tolist())
    whole = plan.nbytes - plan.nbytes % 4
    return from_sums(torch.tensor(_combined(plan, rows, seq)), buf[whole : plan.nbytes], plan.nbytes), rows


def test_tp_ranks_write_only_their_shards_and_their_sums_add_up_to_the_buckets():
    models = [ToyTP(0), ToyTP(1)]
    for seed in (1, 2, 3):
        plan, buf, named = _tp_bucket(seed)
        ck, rows = _send_ranks(models, seed, plan, buf)
        assert ck == bucket_checksum(buf[: plan.nbytes]), seed
        assert [r[4] for r in rows] == [sl.LEARNED if seed == 1 else sl.BY_TABLE] * 2
        for r, m in enumerate(models):
            assert torch.equal(m.col, named["col"][r * H : (r + 1) * H])
            assert torch.equal(m.row, named["row"][:, r * H // 2 : (r + 1) * H // 2])
            assert torch.equal(m.norm, named["norm"])
        if seed > 1:
            # each rank read its shards, the replicated norm and the alignment gaps: not the other rank's shards
            shard = (H * H + H * H // 2) * 2
            gaps = plan.nbytes - sum(s.meta.nbytes for s in plan.slots)
            assert [r[8] for r in rows] == [shard + H * 2 + gaps] * 2, (rows, plan.nbytes)
        models[0].load_weights = models[1].load_weights = None  # the tables write from the second bucket on


def test_tp_shards_a_wrong_bucket_or_a_rank_reading_other_bytes_fail_the_checksum():
    models = [ToyTP(0), ToyTP(1)]
    plan, buf, _ = _tp_bucket(1)
    _send_ranks(models, 1, plan, buf)
    plan, buf, _ = _tp_bucket(2)
    want = bucket_checksum(buf[: plan.nbytes])
    other = buf.clone()
    other[plan.slots[1].offset + 2] ^= 1  # a byte of rank 0's column shard of `row`
    rows = []
    for m, b in zip(models, (other, buf)):
        result = torch.zeros(1, sl.RESULT_WORDS, dtype=torch.int64)
        sl.load(m, [(sl.header(2, plan), b), (sl.RESULT, result)])
        rows.append(result[0].tolist())
    from rollout_svc.engine.sglang_direct import _combined

    whole = plan.nbytes - plan.nbytes % 4
    got = from_sums(torch.tensor(_combined(plan, rows, 2)), buf[whole : plan.nbytes], plan.nbytes)
    assert got != want, "rank 0 wrote a byte that is not the trainer's and the combined checksum passed"


def test_a_column_shard_inside_a_word_keeps_the_models_loader():
    models = [ToyTP(0, cols=6), ToyTP(1, cols=6)]  # 3 bf16 columns a rank: 6-byte rows
    plan, buf, named = _tp_bucket(1, cols=6)
    _send_ranks(models, 1, plan, buf)
    (table,) = models[0]._ws_slot_tables.values()
    assert not table.replays and "column shard's rows are not whole 4-byte words" in table.why, table.why
    plan, buf, named = _tp_bucket(2, cols=6)
    ck, rows = _send_ranks(models, 2, plan, buf)
    assert ck == bucket_checksum(buf[: plan.nbytes]) and [r[4] for r in rows] == [sl.BY_SGLANG] * 2
    assert torch.equal(models[1].row, named["row"][:, 3:])


def test_bytes_per_rank_count_each_ranks_reads_and_a_whole_bucket_for_a_rank_on_another_gpu():
    from types import SimpleNamespace

    from rollout_svc.engine.sglang_direct import SglangDirectMixin

    eng = SglangDirectMixin()
    eng.tp_size, eng.opts = 2, SimpleNamespace(base_gpu_id=0)
    assert eng.bytes_per_rank(1000) == [1000, 1000], "no bucket through our loader: SGLang's paths read it whole"
    eng._count_bytes(600, torch.zeros(8, dtype=torch.uint8), [310, 300])
    assert eng.bytes_per_rank(1000) == [310 + 400, 300 + 400], "the other 400 bytes went through SGLang's own path"
    on_gpu0 = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    eng.rank_bytes = None  # begin_apply
    eng._count_bytes(600, on_gpu0, [310, 300])
    # SGLang's worker on GPU 1 moves the bucket from GPU 0 onto its own before our loader reads its shard
    assert eng.bytes_per_rank(600) == [310, 600]
