"""`meshlm serve` fuzzed through its own OpenAPI schema (FastAPI publishes it at /openapi.json):
schemathesis draws bodies that fit the schema and bodies that break it, for every operation, against
the real server in a subprocess. No request may get a 5xx, every 4xx carries OpenAI's error body,
and afterwards the server answers a known greedy request with the very text it gave before."""
import json

import pytest
import schemathesis
from conftest import build, tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from servekit import Server

from meshlm.checkpoint import save_model

EXAMPLES = 150  # per operation and generation mode; derandomized, so CI draws the same bodies


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "tiny"
    save_model(build(tiny(spec="1+1R2+1", d_model=32, vocab_size=8192, context_length=64)), folder)
    s = Server(folder, "--max-batch", "4", "--timeout", "30")
    yield s
    s.stop()


def known(server) -> str:
    r = server.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time",
                                             "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def openai_error(body: dict) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and error["message"])


def fuzz(server, op, mode, seen: dict) -> None:
    """`EXAMPLES` drawn bodies of one operation and generation mode against the server."""
    # the served name, most of the time: else nearly every body stops at "model not served"
    @given(case=op.as_strategy(generation_mode=mode), served=st.integers(0, 3))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def call(case, served):
        if served and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"
        response = case.call(base_url=server.url, timeout=60)
        key = (op.path, response.status_code)
        seen[key] = seen.get(key, 0) + 1
        request = f"{case.method} {op.path} {json.dumps(case.body, default=str)}"
        assert response.status_code < 500, f"{request} -> {response.text}"
        if response.status_code >= 400:
            assert openai_error(response.json()), f"{request} -> {response.text}"
    call()


@pytest.mark.slow
def test_fuzzed_requests_never_get_a_5xx_and_every_4xx_is_an_openai_error(server):
    before = known(server)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    seen: dict[tuple[str, int], int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/health", "/v1/models"}
    for op in operations:
        modes = [GenerationMode.POSITIVE]  # a GET without parameters has no wrong form
        modes += [GenerationMode.NEGATIVE] if op.get_request_payload_content_types() else []
        for mode in modes:
            fuzz(server, op, mode, seen)
    for path in ("/v1/completions", "/v1/chat/completions"):  # both sides were reached
        assert seen.get((path, 200), 0) > 0 and seen.get((path, 400), 0) > 0, seen
    assert known(server) == before
