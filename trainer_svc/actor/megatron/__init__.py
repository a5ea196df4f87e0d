"""Megatron-core backend of the trainer: CPU compat, model building from HF configs, the
Megatron<->HF rule tables, bounded-memory export, sliced HF loading and the multi-rank actor.

Nothing here is imported by this package's __init__: megatron-core is pulled in only by the
modules that need it, so the control plane and CLI import without it.
"""
