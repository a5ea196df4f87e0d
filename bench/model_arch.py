"""Architecture configs as data, and the parameter / byte / tensor counts the fleet cost model needs.

Counts are derived from the shapes of the HF checkpoint tensors (what the weight bus moves), split
into the parts that decide who sends what: per layer, expert bytes (owned by expert-parallel
ranks) and the rest ("dense": attention, norms, router, shared experts, dense MLPs), plus the
embedding (first pipeline stage) and the final norm + lm_head (last stage).

fp8-block means the DeepSeek-V3 / Kimi-K2 checkpoint format: every linear weight of a layer is
e4m3 (1 byte) with one fp32 scale per 128x128 block; embedding, lm_head, norms and the MoE router
stay bf16. Pure Python, no torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from bench.model_shapes import CONFIGS as QWEN25_CONFIGS

BF16 = "bf16"
FP8 = "fp8"
DTYPES = (BF16, FP8)
FP8_BLOCK = 128


@dataclass(frozen=True)
class MLA:
    """DeepSeek-V3-style multi-head latent attention dimensions."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Arch:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0  # dense MLP width (dense models, and the first dense layers of a MoE)
    tied: bool = False
    qkv_bias: bool = False  # Qwen2.5
    qk_norm: bool = False  # Qwen3
    experts: int = 0  # routed experts per MoE layer (0 = dense model)
    active_experts: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    first_dense_layers: int = 0  # DeepSeek-V3 / Kimi-K2: leading layers with a dense MLP
    mla: MLA | None = None
    published_total: float = 0.0  # published parameter count, for the check in the tests
    published_active: float = 0.0
    source: str = ""

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    linear: bool  # a 2-D layer weight that fp8-block checkpoints store in e4m3
    expert: bool = False


def _lin(out: int, inp: int, expert: bool = False) -> Tensor:
    return Tensor((out, inp), linear=True, expert=expert)


def _vec(n: int) -> Tensor:
    return Tensor((n,), linear=False)


def _attention(a: Arch) -> list[Tensor]:
    h = a.hidden
    out = [_vec(h)]  # input_layernorm
    if a.mla:
        m = a.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        out += [
            _lin(m.q_lora_rank, h),
            _vec(m.q_lora_rank),
            _lin(a.heads * qk, m.q_lora_rank),
            _lin(m.kv_lora_rank + m.qk_rope_head_dim, h),
            _vec(m.kv_lora_rank),
            _lin(a.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            _lin(h, a.heads * m.v_head_dim),
        ]
        return out
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    out += [_lin(q, h), _lin(kv, h), _lin(kv, h), _lin(h, q)]
    if a.qkv_bias:
        out += [_vec(q), _vec(kv), _vec(kv)]
    if a.qk_norm:
        out += [_vec(a.head_dim), _vec(a.head_dim)]
    return out


def _mlp(h: int, inter: int, expert: bool = False) -> list[Tensor]:
    return [_lin(inter, h, expert), _lin(inter, h, expert), _lin(h, inter, expert)]  # gate, up, down


def layer_tensors(a: Arch, i: int) -> list[Tensor]:
    out = _attention(a) + [_vec(a.hidden)]  # + post_attention_layernorm
    if not a.moe or i < a.first_dense_layers:
        return out + _mlp(a.hidden, a.intermediate)
    out.append(Tensor((a.experts, a.hidden), linear=False))  # router: bf16 in fp8 checkpoints
    for _ in range(a.shared_experts):
        out += _mlp(a.hidden, a.moe_intermediate)
    for _ in range(a.experts):
        out += _mlp(a.hidden, a.moe_intermediate, expert=True)
    return out


def embedding_tensors(a: Arch) -> list[Tensor]:
    return [Tensor((a.vocab, a.hidden), linear=False)]


def head_tensors(a: Arch) -> list[Tensor]:
    """Final norm and (unless tied) lm_head: owned by the last pipeline stage."""
    return [_vec(a.hidden)] + ([] if a.tied else [Tensor((a.vocab, a.hidden), linear=False)])


def tensor_bytes(t: Tensor, dtype: str) -> float:
    n = math.prod(t.shape)
    if dtype == BF16 or not t.linear:
        return 2.0 * n
    if dtype == FP8:
        blocks = math.ceil(t.shape[0] / FP8_BLOCK) * math.ceil(t.shape[1] / FP8_BLOCK)
        return n + 4.0 * blocks
    raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")


def tensors_per_item(t: Tensor, dtype: str) -> int:
    """HF tensors on the bus: an fp8 weight travels with its scale tensor."""
    return 2 if dtype == FP8 and t.linear else 1


@dataclass
class Part:
    """Bytes / params / HF tensors of one ownership unit (a layer, the embedding, the head)."""

    dense_bytes: float = 0.0
    expert_bytes: float = 0.0
    dense_tensors: int = 0
    expert_tensors: int = 0
    params: int = 0
    active_params: int = 0

    @property
    def bytes(self) -> float:
        return self.dense_bytes + self.expert_bytes

    @property
    def tensors(self) -> int:
        return self.dense_tensors + self.expert_tensors


def _part(a: Arch, tensors: list[Tensor], dtype: str) -> Part:
    p = Part()
    for t in tensors:
        b, n, c = tensor_bytes(t, dtype), math.prod(t.shape), tensors_per_item(t, dtype)
        p.params += n
        if t.expert:
            p.expert_bytes += b
            p.expert_tensors += c
            p.active_params += n * a.active_experts // max(a.experts, 1)
        else:
            p.dense_bytes += b
            p.dense_tensors += c
            p.active_params += n
    return p


@dataclass
class Footprint:
    """The checkpoint as the bus sees it, in one dtype."""

    arch: Arch
    dtype: str
    embedding: Part
    layers: list[Part] = field(default_factory=list)
    head: Part = field(default_factory=Part)

    def parts(self) -> list[Part]:
        return [self.embedding, *self.layers, self.head]

    @property
    def bytes(self) -> float:
        return sum(p.bytes for p in self.parts())

    @property
    def tensors(self) -> int:
        return sum(p.tensors for p in self.parts())

    @property
    def params(self) -> int:
        return sum(p.params for p in self.parts())

    @property
    def active_params(self) -> int:
        return sum(p.active_params for p in self.parts())


@functools.lru_cache(maxsize=64)  # a 1T MoE has ~70k tensors; the tables and tests reuse each footprint
def footprint(a: Arch, dtype: str = BF16) -> Footprint:
    """The checkpoint as the bus sees it (cached: treat the result as read-only)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return Footprint(
        a,
        dtype,
        _part(a, embedding_tensors(a), dtype),
        [_part(a, layer_tensors(a, i), dtype) for i in range(a.layers)],
        _part(a, head_tensors(a), dtype),
    )


def _qwen25(name: str, cfg: tuple) -> Arch:
    h, inter, layers, heads, kv, vocab, tied = cfg
    return Arch(
        name=f"qwen2.5-{name}",
        hidden=h,
        layers=layers,
        heads=heads,
        kv_heads=kv,
        head_dim=h // heads,
        vocab=vocab,
        intermediate=inter,
        tied=tied,
        qkv_bias=True,
        source="bench/model_shapes.py (the synthetic benchmark models)",
    )


ARCHS: dict[str, Arch] = {
    # the models the GPU benchmarks moved (calibration); 1.5b as in bench/bench_services.py
    "qwen2.5-1.5b": _qwen25("1.5b", (1536, 8960, 28, 12, 2, 151936, True)),
    "qwen2.5-7b": _qwen25("7b", QWEN25_CONFIGS["7b"]),
    "qwen2.5-32b": _qwen25("32b", QWEN25_CONFIGS["32b"]),
    "qwen3-30b-a3b": Arch(
        name="qwen3-30b-a3b",
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
        experts=128,
        active_experts=8,
        moe_intermediate=768,
        published_total=30.5e9,
        published_active=3.3e9,
        source="Qwen3-30B-A3B config.json / model card",
    ),
    "qwen3-235b-a22b": Arch(
        name="qwen3-235b-a22b",
        hidden=4096,
        layers=94,
        heads=64,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
        experts=128,
        active_experts=8,
        moe_intermediate=1536,
        published_total=235e9,
        published_active=22e9,
        source="Qwen3-235B-A22B config.json / model card",
    ),
    "kimi-k2": Arch(
        name="kimi-k2",
        hidden=7168,
        layers=61,
        heads=64,
        kv_heads=64,
        head_dim=128,
        vocab=163840,
        intermediate=18432,
        first_dense_layers=1,
        experts=384,
        active_experts=8,
        moe_intermediate=2048,
        shared_experts=1,
        mla=MLA(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        published_total=1.04e12,
        published_active=32e9,
        source="Kimi-K2 config.json / tech report",
    ),
    "deepseek-v3": Arch(  # main model only (the 14B MTP module is not synced to rollouts)
        name="deepseek-v3",
        hidden=7168,
        layers=61,
        heads=128,
        kv_heads=128,
        head_dim=128,
        vocab=129280,
        intermediate=18432,
        first_dense_layers=3,
        experts=256,
        active_experts=8,
        moe_intermediate=2048,
        shared_experts=1,
        mla=MLA(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        published_total=671e9,
        published_active=37e9,
        source="DeepSeek-V3 config.json / tech report",
    ),
}


def arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"model {name!r}: expected one of {', '.join(ARCHS)}") from None
