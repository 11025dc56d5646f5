"""Bad input on the REST API gets a 4xx with an OpenAI-style error naming the field, and the server
keeps serving; the API key guards /v1/*; /health says whether the cluster can serve."""
from __future__ import annotations

import json

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from api_cluster import API_KEY

pytestmark = pytest.mark.slow
OK = {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
MSGS = [{"role": "user", "content": "hi"}]

# (case, path, body (dict, or raw bytes), status, param named in the error (None: not a field), text in the message)
BAD = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, None, "not valid JSON"),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("prompt missing", "/v1/completions", {"max_tokens": 2}, 400, "prompt", "prompt"),
    ("prompt wrong type", "/v1/completions", {**OK, "prompt": 123}, 400, "prompt", "prompt"),
    ("max_tokens wrong type", "/v1/completions", {**OK, "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("temperature wrong type", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "number"),
    ("stop wrong type", "/v1/completions", {**OK, "stop": 5}, 400, "stop", "stop"),
    ("negative max_tokens", "/v1/completions", {**OK, "max_tokens": -1}, 400, "max_tokens", ">= 0"),
    ("temperature < 0", "/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("top_p > 1", "/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", "[0, 1]"),
    ("top_k < -1", "/v1/completions", {**OK, "top_k": -3}, 400, "top_k", "top_k"),
    ("n = 0", "/v1/completions", {**OK, "n": 0}, 400, "n", ">= 1"),
    ("logprobs too many", "/v1/completions", {**OK, "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("empty prompt list", "/v1/completions", {**OK, "prompt": []}, 400, "prompt", "empty"),
    ("token id out of range", "/v1/completions", {**OK, "prompt": [5, 512]}, 400, "prompt", "vocab_size is 512"),
    ("prompt over the limit", "/v1/completions", {**OK, "prompt": [5] * 3000}, 400, "prompt", "limit of"),
    ("max_tokens over the limit", "/v1/completions", {**OK, "max_tokens": 10 ** 6}, 400, "max_tokens", "limit of"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("chat: messages wrong type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    ("chat: empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "empty"),
    ("chat: more messages than positions", "/v1/chat/completions", {"messages": MSGS * 5000}, 400, "messages",
     "5000 messages cannot fit"),
    ("tokenize: more messages than positions", "/tokenize", {"messages": MSGS * 5000}, 400, "messages",
     "cannot fit"),
    ("chat: bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "wizard"),
    ("chat: negative max_tokens", "/v1/chat/completions", {"messages": MSGS, "max_tokens": -2}, 400,
     "max_tokens", ">= 1"),
    ("chat: temperature < 0", "/v1/chat/completions", {"messages": MSGS, "temperature": -1}, 400,
     "temperature", ">= 0"),
    ("chat: unknown model", "/v1/chat/completions", {"messages": MSGS, "model": "nope"}, 404, "model", "nope"),
    # known parameters this server does not implement: refused unless they ask for nothing (were silently ignored)
    ("frequency_penalty set", "/v1/completions", {**OK, "frequency_penalty": 0.5}, 400, "frequency_penalty",
     "not supported"),
    ("presence_penalty set", "/v1/completions", {**OK, "presence_penalty": -1}, 400, "presence_penalty", "got -1"),
    ("logit_bias set", "/v1/completions", {**OK, "logit_bias": {"5": 100}}, 400, "logit_bias", "not supported"),
    ("best_of over n", "/v1/completions", {**OK, "best_of": 3}, 400, "best_of", "n is 1"),
    ("min_tokens set", "/v1/completions", {**OK, "min_tokens": 4}, 400, "min_tokens", "not supported"),
    ("suffix set", "/v1/completions", {**OK, "suffix": "\n"}, 400, "suffix", "not supported"),
    ("chat: json mode", "/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_object"}}, 400,
     "response_format", "json_object"),
    ("chat: tools", "/v1/chat/completions", {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}, 400, "tools", "not supported"),
    ("chat: guided_json", "/v1/chat/completions", {"messages": MSGS, "guided_json": {"type": "object"}}, 400,
     "guided_json", "not supported"),
    ("prompt of max_model_len scored", "/v1/completions", {"prompt": [5] * 2048, "max_tokens": 0, "echo": True,
                                                          "logprobs": 0}, 400, "prompt", "limit of 2047 prompt tokens"),
    # refused before tokenizing (seconds of a core for megabytes, which had stalled every stream)
    ("text longer than the limit can hold", "/v1/completions", {"prompt": "ab cd " * 200_000, "max_tokens": 1}, 400,
     "prompt", "bytes of text are more than 2047 tokens"),
    # more generations than the queue ever holds: not a 429 (retrying cannot help)
    ("prompts over --max-waiting", "/v1/completions", {"prompt": [[5]] * 257, "max_tokens": 1}, 400, "prompt",
     "--max-waiting"),
    ("seed out of range", "/v1/completions", {**OK, "seed": -1}, 400, "seed", "[0, 2**64)"),
    ("stream_options without stream", "/v1/completions", {**OK, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream: true"),
    ("chat: top_logprobs too many", "/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "[0, 20]"),
    ("chat: negative max_completion_tokens", "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": -5},
     400, "max_completion_tokens", ">= 1"),
    ("chat: max_completion_tokens over the limit", "/v1/chat/completions",
     {"messages": MSGS, "max_completion_tokens": 10 ** 6}, 400, "max_completion_tokens", "limit of"),
    ("tokenize: neither prompt nor messages", "/tokenize", {}, 400, "prompt", "prompt"),
    ("detokenize: id out of range", "/detokenize", {"tokens": [1, 99999]}, 400, "tokens", "out of range"),
    # a lone UTF-16 surrogate is valid JSON but not valid Unicode: no tokenizer takes it (was: 500)
    ("prompt: lone surrogate", "/v1/completions", b'{"prompt": "abc\\ud800", "max_tokens": 4}', 400, "prompt",
     "surrogate (U+D800) at character 3"),
    ("chat: lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', 400, "messages", "surrogate (U+DFFF)"),
    ("tokenize: lone surrogate", "/tokenize", b'{"prompt": "\\ud83d"}', 400, "prompt", "surrogate"),
    # in stop too (was accepted, though it can match nothing)
    ("stop: lone surrogate", "/v1/completions", b'{"prompt": "x", "stop": ["ab", "\\ud800"], "max_tokens": 3}', 400,
     "stop", "string 1 holds an unpaired UTF-16 surrogate (U+D800)"),
    ("stop string: lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "stop": "a\\udfff"}', 400, "stop",
     "surrogate (U+DFFF) at character 1"),
    # wrong JSON types are refused, not coerced (lax pydantic had made "logprobs": false top-0 logprobs, true 1, "10"
    # 10, "yes" a stream, [true, false] token ids)
    ("logprobs false", "/v1/completions", {**OK, "logprobs": False}, 400, "logprobs",
     "valid integer (got false, a boolean)"),
    ("max_tokens true", "/v1/completions", {**OK, "max_tokens": True}, 400, "max_tokens",
     "integer (got true, a boolean)"),
    ("max_tokens a numeric string", "/v1/completions", {**OK, "max_tokens": "10"}, 400, "max_tokens",
     'valid integer (got "10", a string)'),
    ("max_tokens 10.0", "/v1/completions", {**OK, "max_tokens": 10.0}, 400, "max_tokens", "(got 10.0, a number)"),
    ("n a numeric string", "/v1/completions", {**OK, "n": "2"}, 400, "n", "integer"),
    ("seed a numeric string", "/v1/completions", {**OK, "seed": "7"}, 400, "seed", "integer"),
    ("top_k a numeric string", "/v1/completions", {**OK, "top_k": "5"}, 400, "top_k", "integer"),
    ("temperature a numeric string", "/v1/completions", {**OK, "temperature": "0.5"}, 400, "temperature",
     'valid number (got "0.5", a string)'),
    ("top_p true", "/v1/completions", {**OK, "top_p": True}, 400, "top_p", "number (got true, a boolean)"),
    ("stream yes", "/v1/completions", {**OK, "stream": "yes"}, 400, "stream", 'valid boolean (got "yes", a string)'),
    ("stream 1", "/v1/completions", {**OK, "stream": 1}, 400, "stream", "boolean (got 1, an integer)"),
    ("echo a string", "/v1/completions", {**OK, "echo": "false"}, 400, "echo", "boolean"),
    ("ignore_eos a string", "/v1/completions", {**OK, "ignore_eos": "no"}, 400, "ignore_eos", "boolean"),
    ("include_usage a string", "/v1/completions", {**OK, "stream": True, "stream_options": {"include_usage": "yes"}},
     400, "stream_options.include_usage", "boolean"),
    ("prompt of booleans", "/v1/completions", {**OK, "prompt": [True, False]}, 400, "prompt.0",
     "integer (got true, a boolean)"),
    ("prompt lists with a boolean", "/v1/completions", {**OK, "prompt": [[5, 6], [7, True]]}, 400, "prompt.1.1",
     "integer"),
    ("detokenize: a boolean", "/detokenize", {"tokens": [True]}, 400, "tokens.0", "integer (got true, a boolean)"),
    ("chat: logprobs 1", "/v1/chat/completions", {"messages": MSGS, "logprobs": 1}, 400, "logprobs", "boolean"),
    ("chat: add_generation_prompt a string", "/v1/chat/completions",
     {"messages": MSGS, "add_generation_prompt": "no"}, 400, "add_generation_prompt", "boolean"),
    ("chat: top_logprobs a string", "/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": "2"},
     400, "top_logprobs", "integer"),
    # a text part's text must be a string (null and objects were rendered as "None" and their repr)
    ("chat: text part null", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": None}]}]}, 400, "messages.0.content.1.text",
     "must be a string, got null"),
    ("chat: text part an object", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": {"a": 1}}]}]}, 400, "messages.0.content.0.text", 'got {"a": 1}'),
    ("tokenize: text part missing", "/tokenize", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0.text", "must be a string"),
    # continuous_usage_stats is per-chunk usage: without include_usage it would do nothing
    ("continuous_usage_stats without include_usage", "/v1/completions",
     {**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats", "needs include_usage: true"),
]


@pytest.fixture(scope="module")
def http(api_cluster):
    with httpx.Client(base_url=api_cluster.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input(http, case):
    _, path, body, status, param, text = case
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and text in err["message"], err
    if param:
        assert param.split(".")[0] in err["message"], "the message names the field"


def test_still_serving_after_bad_input(http):
    for _, path, body, *_ in BAD:                        # once more, back to back
        http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_fields_tolerated(http, api_cluster):
    r = http.post("/v1/completions", json={**OK, "model": api_cluster.model_name, "user": "u1", "logit_bias": {},
                                           "presence_penalty": 0, "frequency_penalty": 0.0, "suffix": None,
                                           "best_of": 1, "repetition_penalty": 1.0, "min_tokens": 0,
                                           "some_future_field": [1, 2]})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "name": "me"}],
                                                "max_tokens": 2, "tools": None, "parallel_tool_calls": False,
                                                "response_format": {"type": "text"}, "functions": []})
    assert r.status_code == 200, r.text


def test_what_users_leave_implicit(http):
    """A default max_tokens shrinks to the room a long prompt leaves (an explicit one that does not fit is refused,
    above); top_p 0 is the smallest nucleus, the most probable token (not "off"); stop_reason names the stop string
    that ended a choice (vLLM's), streamed too; HEAD answers where GET does."""
    r = http.post("/v1/completions", json={"prompt": [5] * 2040, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    greedy = http.post("/v1/completions", json={**OK, "max_tokens": 12}).json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={**OK, "max_tokens": 12, "temperature": 1.0, "top_p": 0, "n": 4})
    assert [c["text"] for c in r.json()["choices"]] == [greedy] * 4, r.text
    stop = greedy[3:6]
    for stream in (False, True):
        r = http.post("/v1/completions", json={**OK, "max_tokens": 12, "stop": ["zzz", stop], "stream": stream})
        ends = [c for c in (r.json()["choices"] if not stream else [
            json.loads(line[6:])["choices"][0] for line in r.text.splitlines()
            if line.startswith("data: {")]) if c["finish_reason"]]
        assert [(c["finish_reason"], c["stop_reason"]) for c in ends] == [("stop", stop)], r.text
    r = http.post("/v1/completions", json={**OK, "max_tokens": 3})
    assert r.json()["choices"][0]["stop_reason"] is None
    for path in ("/health", "/v1/models", "/metrics", "/ping"):
        r = http.head(path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)


def test_api_key(api_cluster):
    with httpx.Client(base_url=api_cluster.keyed_url, timeout=60) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                                 ("POST", "/v1/chat/completions")):
                r = c.request(method, path, json=OK, headers=headers)
                assert r.status_code == 401, (headers, path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        r = c.post("/v1/completions", json=OK, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        for scheme in ("bearer", "BEARER"):                  # the scheme in any case (RFC 9110)
            assert c.post("/v1/completions", json=OK, headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
        assert c.post("/v1/completions", json=OK, headers={"Authorization": f"Basic {API_KEY}"}).status_code == 401
    bad = OpenAI(base_url=api_cluster.keyed_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    good = OpenAI(base_url=api_cluster.keyed_url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=api_cluster.model_name, prompt="x", max_tokens=2).choices


def test_health(http, api_cluster):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def test_health_503_when_the_target_is_down(api_cluster):
    """In process: the app over a target that does not answer says 503 and why."""
    import grpc
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from gateway.core import Gateway, Limits
    from gateway.http import build_app
    from gateway.metrics import GatewayMetrics
    from gateway.scheduler import Scheduler

    class Down:
        async def GetInfo(self, request, timeout=None):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="connection refused")

    metrics = GatewayMetrics("tiny")
    scheduler = Scheduler(Down(), None, {2})
    metrics.attach(scheduler, {"target": Down()})
    tok = Tokenizer.from_file(str(api_cluster.ckpt / "tokenizer.json"))
    gw = Gateway(str(api_cluster.ckpt), "tiny", tok, scheduler, Limits(512, 2048, 0, 16))
    with TestClient(build_app(gw, metrics, None, "")) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert "target unreachable" in r.json()["reason"] and "UNAVAILABLE" in r.json()["reason"]
        assert 'tandem:service_up{model_name="tiny",service="target"} 0.0' in c.get("/metrics").text


def test_json_numbers_where_floats_go(http):
    """Strict types still take an integer where a float goes (temperature 1, top_p 1), as JSON has one number type."""
    r = http.post("/v1/completions", json={**OK, "temperature": 1, "top_p": 1, "seed": 3, "stream": False,
                                           "echo": False, "logprobs": 0, "n": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"], r.text
