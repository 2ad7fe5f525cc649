"""The OpenAI request bodies meshlm serves, and the response objects it returns.

Bodies are validated strictly: an unknown field, a value of the wrong type or outside its range is a
400 with an OpenAI-style error body (meshlm.serve.app), never silently ignored. Beyond OpenAI's
fields meshlm takes `top_k`, `ignore_eos` and its own compute settings:

    loops      int >= 1: core passes for this request (single-core specs; default: the trained
               count)
    exit       "state:τ" | "kl:τ": per-token adaptive exit (meshlm.model.exit)
    speculate  "auto" | "K_d" | "K_d:γ": lossless self-speculative decoding
               (meshlm.generate.speculative)

(the openai client sends them with `extra_body={...}`).
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's default max_tokens for /v1/completions (or what the context leaves)
COMPLETION_DEFAULT_TOKENS = 16
CHAT_DEFAULT_TOKENS = 256  # chat: up to this many, or what the context leaves


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1  # one choice per request
    user: str | None = None
    ignore_eos: bool = False
    loops: int | None = Field(None, ge=1)
    exit: str | None = None
    speculate: str | None = None

    def stops(self) -> list[str]:
        return ([] if self.stop is None else [self.stop] if isinstance(self.stop, str)
                else list(self.stop))


class CompletionBody(Body):
    prompt: str | list[str] | list[int] = Field(min_length=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


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
