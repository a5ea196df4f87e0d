"""Actors: the trainer-side model backends that can export HF-named tensors."""
