"""The FastAPI app of `meshlm serve`: OpenAI's /v1/completions and /v1/chat/completions (whole or
streamed as server-sent events), /v1/models, /health and Prometheus /metrics, over one Engine
(meshlm.serve.engine).

Every failure a client can cause is an OpenAI-style error body ({"error": {"message", "type",
"param", "code"}}) and the server keeps serving: 400 for invalid JSON, unknown fields, bad values,
an unknown model or a prompt the context cannot hold; 429 when the queue is full; 503 while
draining; 504 when a request ran past the timeout (a stream ends with an error event instead). A
client that disconnects has its request cancelled: its batch row is freed at the next token
boundary.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from meshlm.errors import ConfigError
from meshlm.generate import Sampling, Speculation
from meshlm.model.exit import ExitRule
from meshlm.serve import api
from meshlm.serve.batcher import QueueFull
from meshlm.serve.batcher import Request as Job
from meshlm.serve.engine import Engine
from meshlm.serve.metrics import Metrics
from meshlm.serve.text import DEFAULT_CHAT_STOP, TextStream, render_chat


@dataclass
class Served:
    """What the app serves: the model's name and facts, its tokenizer and chat template, the
    limits."""

    name: str
    tokenizer: object  # meshlm.data.tokenizer.TextTokenizer
    context_length: int
    chat_template: str
    # the folder's template (else meshlm's default, which also stops at "\nUser:")
    own_template: bool
    timeout: float | None  # seconds per request
    info: dict  # /v1/models' "meshlm" entry: spec, scheme, precision


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, api.error_body(message, kind, param, code)


def create_app(engine: Engine, served: Served) -> FastAPI:
    app = FastAPI(title="meshlm serve", docs_url=None, redoc_url=None)
    metrics = Metrics(engine.batcher)
    app.state.engine, app.state.metrics = engine, metrics
    _errors(app, metrics)

    @app.get("/health")
    async def health():
        b = engine.batcher
        body = {"status": "draining" if engine.draining else "ok", "running": b.running,
                "queued": b.queued}
        return JSONResponse(body, status_code=503 if engine.draining else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                             "owned_by": "meshlm", "meshlm": served.info}]}

    @app.post("/v1/completions")
    async def completions(body: api.CompletionBody, http: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"{len(prompt)} prompts in one request; meshlm serves one "
                                    "prompt per request (send them as separate, concurrent "
                                    "requests)",
                               param="prompt")
            prompt = prompt[0]
        ids = served.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await _respond(engine, served, metrics, body, ids, body.stops(), False, http)

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatBody, http: Request):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        eos = served.tokenizer.decode([served.tokenizer.eos_id])
        text = render_chat(served.chat_template, messages, bos_token="", eos_token=eos)
        stops = body.stops() + ([] if served.own_template else list(DEFAULT_CHAT_STOP))
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await _respond(engine, served, metrics, body, served.tokenizer.encode(text), stops,
                              True, http)

    return app


def _errors(app: FastAPI, metrics: Metrics) -> None:
    def reply(status: int, body: dict) -> JSONResponse:
        metrics.refused(status)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return reply(err.status, err.body)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        problems = err.errors()
        if problems and problems[0]["type"] == "json_invalid":
            error = problems[0].get("ctx", {}).get("error", "")
            return reply(400, api.error_body(f"the body is not valid JSON ({error}); send a JSON "
                                             "object"))
        found = _problems(problems)
        message = "; ".join(f"{where or 'body'}: {msg}" for where, msg in found[:4])
        return reply(400, api.error_body(f"invalid request: {message}",
                                         param=found[0][0] if found else None))

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        return reply(err.status_code, api.error_body(str(err.detail), "invalid_request_error"))


def _problems(problems: list[dict]) -> list[tuple[str, str]]:
    """pydantic's errors as (field path, message), one per field: a value that fits none of a
    union's types reports each type tried (`prompt.list[int]`, `prompt.str`…); the path drops
    those tags, and a value error (a lone surrogate) wins over "should be a valid list"."""
    found: dict[str, list[dict]] = {}
    for p in problems:
        loc = p["loc"][1:] if p["loc"][:1] == ("body",) else p["loc"]
        unknown = loc[-1:] if p["type"] == "extra_forbidden" else ()  # the field not permitted
        path = [str(x) for x in loc[:len(loc) - len(unknown)]
                if isinstance(x, int) or x in api.FIELDS] + list(unknown)
        found.setdefault(".".join(path), []).append(p)
    out = []
    for where, group in found.items():
        meant = [p for p in group if not p["type"].endswith("_type")] or group
        out.append((where, " or ".join(dict.fromkeys(p["msg"] for p in meant))))
    return out


def _job(served: Served, body: api.Body, ids: list[int], chat: bool) -> Job:
    """The batcher request of a body, or ApiError (400) naming what is wrong and how to fix it."""
    room = served.context_length - len(ids)
    if not ids:
        raise ApiError(400, "the prompt is empty; send at least one token of text", param="prompt")
    if room < 1:
        raise ApiError(400, f"the prompt is {len(ids)} tokens but the model's context is "
                            f"{served.context_length}; shorten it to at most "
                            f"{served.context_length - 1} tokens",
                       param="prompt",
                       code="context_length_exceeded")
    wanted = (body.max_tokens
              or min(api.CHAT_DEFAULT_TOKENS if chat else api.COMPLETION_DEFAULT_TOKENS, room))
    if wanted > room:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) plus max_tokens={wanted} exceeds the "
                            f"model's context of {served.context_length}; ask for max_tokens <= "
                            f"{room} or shorten the prompt",
                       param="max_tokens", code="context_length_exceeded")
    s = Sampling(max_new_tokens=wanted, temperature=body.temperature, top_k=body.top_k,
                 top_p=body.top_p,
                 seed=body.seed, stop_at_eos=not body.ignore_eos)
    return Job(ids, s, loops=body.loops, exit=_parsed(ExitRule.parse, body.exit, "exit"),
               speculate=_parsed(Speculation.parse, body.speculate, "speculate"),
               timeout=served.timeout)


def _parsed(parse, text: str | None, param: str):
    """A setting's text parsed once, here at the edge (ApiError 400 naming the field)."""
    try:
        return None if text is None else parse(text)
    except ConfigError as err:
        raise ApiError(400, str(err), param=param) from None


async def _respond(engine: Engine, served: Served, metrics: Metrics, body: api.Body, ids: list[int],
                   stops: list[str], chat: bool, http: Request):
    if body.model != served.name:
        raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                            f"{served.name!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if engine.draining:
        raise ApiError(503, "the server is shutting down and takes no new requests", "server_error")
    job = _job(served, body, ids, chat)
    try:
        tokens = engine.open(job)
    except ConfigError as err:
        raise ApiError(400, str(err)) from err
    except QueueFull as err:
        raise ApiError(429, str(err), "rate_limit_error", code="rate_limit_exceeded") from err
    text = TextStream(served.tokenizer.decode, stops, served.tokenizer.eos_id)
    reply = api.Reply(chat, served.name)
    timing = metrics.timing()
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(engine, job, tokens, text, reply, timing, usage)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watch = asyncio.create_task(_cancel_on_disconnect(engine, job, http))
    try:
        async for new in tokens:
            timing.arrived(len(new))
            text.add(new)
            if text.stopped:
                engine.batcher.cancel(job, "stop")
                break
    finally:
        watch.cancel()
        await tokens.aclose()
    text.finish()
    if not text.stopped and job.finish in ("timeout", "error", "cancelled", "shutdown"):
        raise _failure(job)
    return reply.whole(text.text, _finish_reason(job, text), len(ids), len(job.tokens))


def _finish_reason(job: Job, text: TextStream) -> str:
    return "stop" if text.stopped or job.finish == "stop" else "length"


def _failure(job: Job) -> ApiError:
    if job.finish == "timeout":
        return ApiError(504, f"the request ran past the server's timeout of {job.timeout:g} s",
                        "timeout_error",
                        code="timeout")
    if job.finish == "shutdown":
        return ApiError(503, "the server shut down before the request finished (its --grace "
                             "period ran out); send it again", "server_error",
                        code="server_shutdown")
    if job.finish == "cancelled":
        return ApiError(499, "the client disconnected", "cancelled")
    return ApiError(500, f"decoding failed: {job.error}", "server_error")


async def _cancel_on_disconnect(engine: Engine, job: Job, http: Request) -> None:
    while not job.done.is_set():
        if await http.is_disconnected():
            engine.batcher.cancel(job)
            return
        await asyncio.sleep(0.05)


async def _events(engine: Engine, job: Job, tokens, text: TextStream, reply: api.Reply, timing,
                  usage: bool):
    """The SSE stream: a chunk per text delta, a last chunk with the finish reason (or an error
    event), [DONE]. Leaving early (the client disconnected, a stop string) cancels the job."""
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if reply.chat:
            yield event(reply.chunk(None, first=True))
        async for new in tokens:
            timing.arrived(len(new))
            delta = text.add(new)
            if delta:
                yield event(reply.chunk(delta))
            if text.stopped:
                engine.batcher.cancel(job, "stop")
                break
        tail = text.finish()
        if tail:
            yield event(reply.chunk(tail))
        if not text.stopped and job.finish in ("timeout", "error", "shutdown"):
            yield event(_failure(job).body)
        else:
            yield event(reply.chunk(None, _finish_reason(job, text)))
        if usage:
            yield event(reply.usage_chunk(len(job.prompt), len(job.tokens)))
        yield "data: [DONE]\n\n"
    finally:
        await tokens.aclose()

