"""The OpenAI request bodies meshlm serves, and the response objects it returns.

Bodies are validated strictly: an unknown field, a value of the wrong type (no bool or float for an
int, no number for a bool), outside the range the code can execute (a seed is a 64-bit integer) or a
string that is not Unicode text (a lone surrogate such as "\ud800") is a 400 with an OpenAI-style
error body (meshlm.serve.app), never silently ignored or coerced. Beyond OpenAI's
fields meshlm takes `top_k`, `ignore_eos` and its own compute settings:

    loops      int >= 1: core passes for this request (single-core specs; default: the trained
               count), at most the server's --max-loops
    exit       "state:τ" | "kl:τ": per-token adaptive exit (meshlm.model.exit)
    speculate  "auto" | "K_d" | "K_d:γ": lossless self-speculative decoding
               (meshlm.generate.speculative)

(the openai client sends them with `extra_body={...}`).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from meshlm.generate import SEED_RANGE

# OpenAI's default max_tokens for /v1/completions (or what the context leaves)
COMPLETION_DEFAULT_TOKENS = 16
CHAT_DEFAULT_TOKENS = 256  # chat: up to this many, or what the context leaves


def _unicode(text: str) -> str:
    """A JSON string may hold a lone surrogate ("\ud800"): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"holds a lone surrogate ({text[err.start]!r} at character "
                         f"{err.start}), which is not Unicode text; send valid UTF-8") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Body(Strict):
    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = None  # OpenAI's limit
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice per request
    user: Text | None = None
    ignore_eos: bool = False
    loops: int | None = Field(None, ge=1)
    exit: Text | None = None
    speculate: Text | None = None

    def stops(self) -> list[str]:
        return ([] if self.stop is None else [self.stop] if isinstance(self.stop, str)
                else list(self.stop))


class CompletionBody(Body):
    prompt: Text | list[Text] | list[int] = Field(min_length=1)


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text
    name: Text | None = None


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# every field name of the bodies above (error paths keep these and drop pydantic's union tags)
FIELDS = frozenset(name for m in (CompletionBody, ChatBody, Message, StreamOptions)
                   for name in m.model_fields)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Reply:
    """Builds the completion or chat response objects (whole, or as stream chunks) of one
    request."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict:
        kind = (("chat.completion.chunk" if chunk else "chat.completion") if self.chat
                else "text_completion")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat
                      else {"text": text})
        return {**self._base(False), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> dict:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return {**self._base(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
