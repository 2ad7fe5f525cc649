"""`meshlm serve` end to end: a fresh subprocess on a free loopback port, driven by the real openai
client."""
import asyncio
import json
import signal
import socket
import time

import httpx
import openai
import pytest
import torch
from conftest import build, tiny
from servekit import Server, hang_up
from trainkit import cli

from meshlm.checkpoint import save_model
from meshlm.generate import Sampling, generate
from meshlm.loading import open_model
from meshlm.model.exit import ExitRule
from meshlm.serve.text import DEFAULT_CHAT_TEMPLATE, render_chat

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny"
    save_model(build(tiny(spec="1+1R3+1", d_model=64, vocab_size=8192, context_length=256)), path)
    return path


@pytest.fixture(scope="module")
def server(folder):
    """The module's server prefills prompts of more than 3 tokens 3 at a time while others decode
    (--prefill-chunk), so the concurrent requests below check chunked prefill too."""
    s = Server(folder, "--max-batch", "4", "--prefill-chunk", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def opened(folder):
    return open_model(folder)


def solo(opened, text: str, n: int, **kw) -> str:
    """What meshlm.generate decodes for the request alone (greedy, fp32), as text without EOS."""
    tok = opened.tokenizer
    s = Sampling(max_new_tokens=n, temperature=0)
    if kw.get("exit") is not None:  # the body's text, parsed as the server parses it
        kw["exit"] = ExitRule.parse(kw["exit"])
    with torch.no_grad():
        new = generate(opened.model, [tok.encode(text)], s, eos_id=tok.eos_id, pad_id=tok.pad_id,
                       **kw)[0]
    return tok.decode(t for t in new if t != tok.eos_id)


def complete(server, prompt=PROMPT, n=12, **extra):
    async def go():
        async with server.client() as c:
            r = await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                           **extra)
            return r.choices[0]
    return asyncio.run(go())


def test_completion_equals_meshlm_generate(server, folder, opened):
    choice = complete(server)
    printed = cli("generate", str(folder), PROMPT, "-t", "0", "-n", "12", timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == PROMPT + choice.text + "\n"
    assert choice.text == solo(opened, PROMPT, 12) and choice.finish_reason in ("length", "stop")


@pytest.mark.slow
def test_a_compiled_server_answers_concurrent_requests_as_meshlm_generate_does(folder, opened):
    """`meshlm serve --compile`: compiled before /health answers; concurrent greedy requests, which
    share compiled steps, each get what meshlm.generate decodes alone."""
    s = Server(folder, "--max-batch", "4", "--compile", ready_within=600)
    try:
        prompts = [PROMPT, "The", "It was a dark and stormy night", "Hello there"]

        async def go():
            async with s.client() as c:
                return await asyncio.gather(*(c.completions.create(
                    model="tiny", prompt=p, max_tokens=10, temperature=0) for p in prompts))
        answers = asyncio.run(go())
        assert [a.choices[0].text for a in answers] == [solo(opened, p, 10) for p in prompts]
    finally:
        s.stop()


def test_chat_uses_the_default_template(server, opened):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello"}]

    async def go():
        async with server.client() as c:
            return await c.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                   temperature=0)
    reply = asyncio.run(go())
    rendered = render_chat(DEFAULT_CHAT_TEMPLATE, messages, bos_token="", eos_token="")
    assert rendered == "System: Be brief.\nUser: Say hello\nAssistant:"
    assert reply.choices[0].message.content == solo(opened, rendered, 10).split("\nUser:")[0]
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens <= 10


def test_streaming_sends_the_same_text_in_pieces(server):
    whole = complete(server, n=20).text

    async def go():
        async with server.client() as c:
            pieces, finish = [], None
            async for chunk in await c.completions.create(model="tiny", prompt=PROMPT,
                                                          max_tokens=20, temperature=0,
                                                          stream=True):
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            return pieces, finish
    pieces, finish = asyncio.run(go())
    assert ("".join(pieces) == whole and len([p for p in pieces if p]) >= 5
            and finish in ("length", "stop"))


def test_stop_strings_cut_the_text_before_them(server):
    whole = complete(server, n=20).text
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    choice = complete(server, n=20, stop=[stop, "\u2603never"])
    assert choice.text == whole[:whole.index(stop)] and choice.finish_reason == "stop"


def test_concurrent_requests_equal_solo_ones(server, opened):
    prompts = ["To be, or not to be", "The king", "Once", "A long time ago in a land far", "And"]
    settings = [{}, {"exit": "state:0.3"}, {"speculate": "1:2"}, {"loops": 2}, {},
                {"speculate": "auto"}]

    async def go():
        async with server.client() as c:
            calls = [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                          extra_body=kw)
                     for kw in settings for p in prompts]
            return [r.choices[0].text for r in await asyncio.gather(*calls)]
    texts = asyncio.run(go())
    expected = [solo(opened, p, 16, **{k: v for k, v in kw.items() if k != "speculate"})
                for kw in settings for p in prompts]
    assert texts == expected
    assert server.metric("meshlm_batch_rows_mean") > 1  # they were batched


ADVERSARIAL = [  # bodies that once failed, stalled or were coerced (docs/serve.md)
    {"seed": 1180591620717411303424, "temperature": 1.0}, {"loops": 5000}, {"max_tokens": True},
    {"prompt": "\ud800"}, {"temperature": 5e-324}, {"top_p": 5e-324, "temperature": 1.0},
    {"loops": 12, "max_tokens": 24}, {"loops": 12, "exit": "kl:0.001"}, {"stream": 1},
    {"bogus": 1}, {"loops": 79278744457110323200}, {"speculate": "9"},
]


@pytest.mark.slow
def test_good_requests_beside_adversarial_ones_finish_and_decode_as_alone(server, opened):
    """N good requests (plain, loops, exit, speculation) run concurrently with N adversarial ones
    and clients that hang up: no good request fails and each one's text is what it is alone."""
    good = [({}, "To be, or not to be"), ({"loops": 2}, "The king"),
            ({"exit": "state:0.3"}, "Once"), ({"speculate": "1:2"}, "A long time ago"),
            ({}, "And"), ({"loops": 5}, "Upon the hill")] * 2

    async def bad(c, extra: dict):
        body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 8, **extra}
        async with httpx.AsyncClient(trust_env=False, timeout=60) as h:
            r = await h.post(server.url + "/v1/completions", content=json.dumps(body),
                             headers={"content-type": "application/json"})
        assert r.status_code < 500, (extra, r.text)

    async def go():
        async with server.client() as c:
            calls = [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                          extra_body=kw) for kw, p in good]
            noise = [bad(c, extra) for extra in ADVERSARIAL]
            noise += [hang_up(c, "tiny", PROMPT, 40, after=2) for _ in range(3)]
            out = await asyncio.gather(*calls, *noise)
            return [r.choices[0].text for r in out[:len(good)]]
    texts = asyncio.run(go())
    expected = [solo(opened, p, 16, **{k: v for k, v in kw.items() if k != "speculate"})
                for kw, p in good]
    assert texts == expected


@pytest.mark.parametrize("body, message", [
    ({"model": "tiny", "prompt": "x", "bogus": 1}, "bogus: Extra inputs are not permitted"),
    ({"model": "tiny", "prompt": "x", "temperature": -1},
     "temperature: Input should be greater than or equal to 0"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p: Input should be greater than 0"),
    ({"model": "other", "prompt": "x"}, "model 'other' is not served here"),
    ({"model": "tiny", "prompt": "x " * 300}, "shorten it to at most 255 tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 300}, "ask for max_tokens <= 255"),
    ({"model": "tiny", "prompt": "x", "exit": "state"}, "is not CRITERION:THRESHOLD"),
    ({"model": "tiny", "prompt": "x", "speculate": "7"}, "must be in 1 … 2"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    # values the code cannot execute, and types that were once coerced
    ({"model": "tiny", "prompt": "x", "seed": 1180591620717411303424},
     "seed: Input should be less than or equal to 18446744073709551615"),
    ({"model": "tiny", "prompt": "x", "loops": 5000}, "loops=5000 is more than this model decodes "
                                                      "with (at most 12: 4x the trained 3)"),
    ({"model": "tiny", "prompt": "x", "max_tokens": True}, "max_tokens: Input should be a valid "
                                                           "integer"),
    ({"model": "tiny", "prompt": "x", "loops": 2.0}, "loops: Input should be a valid integer"),
    ({"model": "tiny", "prompt": "x", "stream": 1}, "stream: Input should be a valid boolean"),
    ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
     "stop: List should have at most 4 items after validation, not 5"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage: Input should be a valid boolean"),
    ({"model": "tiny", "prompt": "\ud800"},
     "prompt: Value error, holds a lone surrogate ('\\ud800' at character 0)"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "a\udfffb"}]},
     "messages.0.content: Value error, holds a lone surrogate ('\\udfff' at character 1)"),
])
def test_bad_requests_are_400_with_an_openai_error_body(server, body, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    # sent as JSON with escapes, as a client's json.dumps sends a lone surrogate
    r = server.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_invalid_json_is_400_and_the_server_keeps_serving(server):
    r = server.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        complete(server, n=300)
    assert complete(server).text  # still serving
    assert server.get("/health").json()["status"] == "ok"
    models = server.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"] and models[0]["meshlm"]["precision"] == "fp32"


def test_full_queue_is_429_and_a_disconnect_frees_its_slot(folder):
    server = Server(folder, "--max-batch", "1", "--max-queue", "1")
    try:
        async def one(c):
            try:
                r = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=240,
                                               temperature=0,
                                               extra_body={"ignore_eos": True})
                return r.choices[0].text
            except openai.RateLimitError as err:
                assert err.status_code == 429 and "max_queue=1" in err.message
                return 429

        async def crowd():
            async with server.client() as c:
                return await asyncio.gather(*[one(c) for _ in range(6)])
        results = asyncio.run(crowd())
        served = [r for r in results if r != 429]
        assert results.count(429) >= 3 and len(served) >= 1 and len(set(served)) == 1

        async def leave_early():
            async with server.client() as c:
                await hang_up(c, "tiny", PROMPT, 240, after=3)
        asyncio.run(leave_early())
        deadline = time.monotonic() + 5
        while server.get("/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.get("/health").json()["running"] == 0
        assert server.metric('meshlm_requests_finished_total{reason="cancelled"}') == 1
        # a whole (not streamed) request whose client gives up
        with pytest.raises(httpx.TimeoutException):
            server.post("/v1/completions",
                        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 240,
                              "ignore_eos": True}, timeout=0.1)
        deadline = time.monotonic() + 5
        while (server.metric('meshlm_requests_finished_total{reason="cancelled"}') < 2
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert server.metric('meshlm_requests_finished_total{reason="cancelled"}') == 2
        assert server.metric('meshlm_requests_refused_total{status="429"}') == results.count(429)
    finally:
        server.stop()


def test_sigterm_stops_admitting_drains_running_requests_and_exits_0(folder):
    server = Server(folder, "--max-batch", "2", "--grace", "30")
    try:
        async def drained():
            async with server.client() as c:
                streams = [await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=200,
                                                      stream=True,
                                                      temperature=0,
                                                      extra_body={"ignore_eos": True})
                           for _ in range(2)]
                firsts = [await s.__anext__() for s in streams]
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                health = server.get("/health")  # a new connection: still answered
                assert health.status_code == 503 and health.json()["status"] == "draining"
                with pytest.raises(openai.APIStatusError) as refused:  # no longer admitted
                    await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
                assert refused.value.status_code == 503
                rest = []
                for s in streams:
                    rest.append([chunk async for chunk in s])
                return firsts, rest
        firsts, rest = asyncio.run(drained())
        for chunks in rest:
            assert chunks[-1].choices[0].finish_reason == "length"
        code, err = server.proc.wait(timeout=60), server.proc.stderr.read()
        assert code == 0, err
    finally:
        server.stop()


def test_a_stream_the_grace_period_cuts_ends_with_an_error_event_and_a_quiet_log(folder):
    server = Server(folder, "--grace", "0.5")
    try:
        r = httpx.stream("POST", server.url + "/v1/completions", trust_env=False, timeout=60,
                         json={"model": "tiny", "prompt": PROMPT, "max_tokens": 250,
                               "stream": True, "ignore_eos": True, "loops": 12})
        with r as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            events = [json.loads(line[6:]) for line in lines
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["error"]["code"] == "server_shutdown", events[-1]
        code, err = server.proc.wait(timeout=60), server.proc.stderr.read()
        assert code == 0 and "Traceback" not in err and "CancelledError" not in err, err
    finally:
        server.stop()


def test_a_port_in_use_is_a_one_line_error(folder):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = cli("serve", str(folder), "--port", str(taken.getsockname()[1]), timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert ("meshlm serve: error: cannot listen on 127.0.0.1:" in done.stderr
            and "pass another --port" in done.stderr)


def test_a_hugging_face_folder_is_served_with_its_own_chat_template(folder, tmp_path):
    from meshlm.hf import save_hf

    opened = open_model(folder)
    save_hf(opened.model, tmp_path / "hf")
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor "
                "%}[assistant]")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    server = Server(tmp_path / "hf")
    try:
        messages = [{"role": "user", "content": "Say hello"}]

        async def go():
            async with server.client() as c:
                return await c.chat.completions.create(model="tiny", messages=messages,
                                                       max_tokens=8, temperature=0)
        reply = asyncio.run(go())
        assert server.get("/v1/models").json()["data"][0]["meshlm"]["chat_template"] == "folder"
        assert reply.choices[0].message.content == solo(opened, "[user] Say hello\n[assistant]", 8)
    finally:
        server.stop()
