"""The model directory's tokenizer and chat template, for the text side of the OpenAI surface.

Loaded on first use, off the event loop; None when the model has none (the tiny built-in models
are names, not directories): token ids still work, text and chat get a 400 that says what to do.
It is read from the model directory rather than asked of the engine, so the built-in engine and
SGLang share it and the text a client gets is what `AutoTokenizer` gives for that directory.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from weightsync.http.errors import ApiError

log = logging.getLogger(__name__)
_FIX = "start the rollout with --model <HF directory that contains a tokenizer>"


class ModelTokenizer:
    def __init__(self, model: str):
        self.model, self._tok, self._loaded, self._lock = model, None, False, threading.Lock()

    def get(self):
        with self._lock:
            if not self._loaded:
                self._loaded = True
                if Path(self.model, "config.json").is_file():  # a model directory; tiny built-in names have none
                    try:
                        from transformers import AutoTokenizer

                        self._tok = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
                    except Exception as exc:  # no (usable) tokenizer files there: token ids only, said once
                        log.info(
                            "model %s: no usable tokenizer (%s: %s); the OpenAI surface takes token ids only",
                            self.model,
                            type(exc).__name__,
                            exc,
                        )
                        self._tok = None
            return self._tok

    def require(self, param: str, what: str, instead: str):
        tok = self.get()
        if tok is None:
            raise ApiError(
                400, f"{param}: {what} needs a tokenizer and model {self.model!r} has none; {instead}, or {_FIX}", param
            )
        return tok

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        tok = self.require("prompt", "text", 'send token ids instead ("prompt": [1, 2, 3] or [[1, 2], [3, 4]])')
        return [tok.encode(t, add_special_tokens=False) or [] for t in texts]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The token ids of `messages` rendered with the model's chat template (as vLLM and SGLang do:
        render to text, then tokenize without adding special tokens: the template has its own)."""
        tok = self.require("messages", "chat", "use /v1/completions with token ids")
        if not getattr(tok, "chat_template", None):
            raise ApiError(
                400,
                f"messages: model {self.model!r} has a tokenizer but no chat template "
                "(tokenizer_config.json has no chat_template); use /v1/completions, or add the "
                "template to the model directory",
                "messages",
            )
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        except Exception as exc:  # the template's own checks (roles must alternate, ...) or text it cannot encode
            raise ApiError(
                400, f"messages: the model's chat template refused them: {type(exc).__name__}: {exc}", "messages"
            ) from None
