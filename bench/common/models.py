"""The synthetic Qwen2-shaped models the benches build: their config rows, transformers configs and
config directories. Rows are (hidden, intermediate, layers, heads, kv heads, vocab, tied), as in
bench/model_shapes.py."""

from __future__ import annotations

from pathlib import Path

from bench.model_shapes import CONFIGS

# The real shapes (bench/model_shapes.py) and `tiny`, a few MB for CPU runs.
MODELS = {**CONFIGS, "tiny": (256, 1024, 4, 4, 2, 4096, False)}
# Layouts with a real model's tensor count at widths a CPU moves in well under a millisecond: the fixed
# cost of a sync grows with the number of tensors, not their size. 7b-thin: 339 tensors, as 7B.
LAYOUTS = {"7b-thin": (56, 64, 28, 28, 4, 256, False), "tiny-thin": (64, 128, 2, 4, 2, 256, False)}


def row_of(name: str) -> tuple:
    rows = {**MODELS, **LAYOUTS}
    if name not in rows:
        raise ValueError(f"unknown model {name!r}: pick one of {', '.join(rows)}")
    return rows[name]


def qwen2_kwargs(row: tuple, layers: int = 0) -> dict:
    """Qwen2Config keyword arguments of a row; `layers` > 0 cuts its depth (to fit a host's memory)."""
    h, inter, n_layers, heads, kv, vocab, tied = row
    return dict(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers or n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )


def qwen2_config(row: tuple, layers: int = 0):
    """A Qwen2.5-shaped transformers config from a row."""
    from transformers import Qwen2Config

    return Qwen2Config(**qwen2_kwargs(row, layers))


def write_config(name: str, root: Path | str) -> Path:
    """`root/name/config.json` of the model or layout `name`; returns the directory."""
    d = Path(root) / name
    qwen2_config(row_of(name)).save_pretrained(str(d))
    return d


def export_bytes(name: str) -> int:
    """bf16 bytes of a model's HF tensors (bench/model_shapes.py's tensors), without building them."""
    h, inter, layers, heads, kv, vocab, tied = row_of(name)
    kvd = kv * (h // heads)
    layer = 2 * h + (h * h + h) + 2 * (kvd * h + kvd) + h * h + 3 * inter * h
    return 2 * (vocab * h * (1 if tied else 2) + layers * layer + h)
