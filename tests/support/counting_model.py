"""An engine's model that counts its decode steps, so a test asserts how far a generation went, not how long."""

from __future__ import annotations

from contextlib import contextmanager


class CountingModel:
    """Wraps a transformers model: `decode_steps` counts its forwards of one position per row (a
    decode step of the built-in engine). A prefill of a one-token prompt counts too: use longer prompts."""

    def __init__(self, model):
        self.model, self.decode_steps = model, 0

    def __call__(self, input_ids, **kw):
        if input_ids.shape[1] == 1:
            self.decode_steps += 1
        return self.model(input_ids, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


@contextmanager
def counting(engine):
    """The built-in `engine`'s model counted while the block runs (yields the CountingModel)."""
    counter = engine.model = CountingModel(engine.model)
    try:
        yield counter
    finally:
        engine.model = counter.model
