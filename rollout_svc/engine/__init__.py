"""Inference engines behind rollout-svc: the built-in torch engine and the SGLang adapter."""
