"""Request and response bodies of the OpenAI surface (OpenAI's names; extensions say so).

Unknown fields are refused (400 naming them) rather than ignored: a client that sends
`presence_penalty` must learn it had no effect.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from weightsync.http.types import Text

Prompt = Text | list[Text] | list[int] | list[list[int]]
MAX_STOP_STRINGS = 16
#: a stop string is a delimiter; this bounds the matching automaton a request builds (16 x 1024 states)
MAX_STOP_CHARS = 1024


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="a last chunk with `usage` (and empty `choices`) before [DONE]")


class _Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")
    model: Text | None = Field(None, description="the served model id (GET /v1/models); another id is a 404")
    temperature: float = Field(1.0, description="0 = greedy")
    top_p: float = 1.0
    top_k: int = Field(0, description="extension: 0 = off")
    n: int = Field(1, description="completions per prompt")
    seed: int | None = Field(None, description="sampling seed (default 0: a rollout's sampling is reproducible)")
    stop: Text | list[Text] | None = Field(
        None,
        description=f"up to {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters: the text ends "
        "before the first one (needs a tokenizer)",
    )
    stop_token_ids: list[int] = Field(default_factory=list, description="extension: extra stop tokens")
    stream: bool = Field(False, description="server-sent events in OpenAI's chunk format, ending with [DONE]")
    stream_options: StreamOptions | None = None
    user: Text | None = None


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(
        ...,
        description="token ids, a list of token-id lists, text, or a list of texts "
        "(text needs a model with a tokenizer)",
    )
    max_tokens: int = Field(16, description="new tokens per completion, 1..32768")
    logprobs: int | None = Field(None, description="0..5: return the sampled tokens' log-probs (top_logprobs is null)")
    echo: bool = Field(False, description="the prompt's text before each completion's text (not with logprobs)")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    # extra fields (name, tool_call_id, ...) go to the chat template as they are
    model_config = ConfigDict(extra="allow")
    role: Text
    content: Text | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., description="the conversation; rendered with the model's chat template")
    max_completion_tokens: int | None = Field(
        None, description="new tokens per choice; default: the rest of the context, within the rollout's max_new_tokens"
    )
    max_tokens: int | None = Field(None, description="the older name of max_completion_tokens")
    logprobs: bool = Field(False, description="the sampled tokens' log-probs")
    top_logprobs: int | None = Field(None, description="only 0: the engine reports the sampled token's log-prob")
    add_generation_prompt: bool = Field(
        True, description="extension (as vLLM): end the prompt with the assistant's turn header"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


_VERSION = Field(
    ..., description="the weight version every token of this answer came from (also the X-Weight-Version header)"
)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[dict]
    usage: Usage
    weight_version: int = _VERSION


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[dict]
    usage: Usage
    weight_version: int = _VERSION


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "weightsync"
    root: str
    weight_version: int = Field(..., description="the weight version the rollout serves now")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
