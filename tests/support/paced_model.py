"""A config-only model large enough for a paced bus proxy (tests/support/bus_proxy.py) to hold a stream."""

from __future__ import annotations


def paced_model(path) -> str:
    """Write to `path` a Qwen2 config of about 9.6 M parameters (some 19 MB in bf16; both sides start from
    random weights): several times the loopback sockets' buffers, so the bytes a proxy paces are mostly
    still on the trainer during the stream. Returns the path, as a `model` setting."""
    from transformers import Qwen2Config

    Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=16384,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ).save_pretrained(str(path))
    return str(path)
