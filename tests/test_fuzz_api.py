"""Hostile input to the public API: hypothesis-generated GenerateService requests (Generate and
GenerateStream) and random JSON on the REST API (completions, chat, tokenize, detokenize, raw bytes).

A request either succeeds — token ids in [0, vocab), a finish reason, streams ending in [DONE] — or
is refused by the gateway itself with a client error (gRPC INVALID_ARGUMENT / RESOURCE_EXHAUSTED,
HTTP 4xx): never a 5xx, never a request the gateway accepted and a service then refused. The
configured limits (--max-prompt-tokens, --max-output-tokens, --max-request-bytes) are named in their
errors. Afterwards every process is SERVING and both KV pools are idle.
"""
from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
from hypothesis import event, given, strategies as st

from fuzz_cluster import (sometimes, MAX_OUTPUT, MAX_PROMPT, MAX_REQUEST_BYTES, TIMEOUT, VOCAB, assert_tokens,
                          expect_client_error, fuzz_settings)
from tandem.v1 import generate_pb2 as gen

pytestmark = pytest.mark.slow
SERVICE_FAILED = ("target Prefill failed", "target Verify failed", "draft Propose")


f32 = st.one_of(st.sampled_from([0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3.4e38, 1e39]),
                st.floats(allow_nan=True, allow_infinity=True))
uint32, uint64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
in_vocab = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
# REST bodies are JSON, which can carry a lone UTF-16 surrogate ("\\ud800"): valid JSON, not valid Unicode
rest_words = st.one_of(words, st.tuples(st.text(max_size=10), st.characters(categories=["Cs"]),
                                        st.text(max_size=10)).map("".join))
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | f32 | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=12)


@st.composite
def body(draw, required: dict, optional: dict):
    """A REST body: valid fields (required, some optional), then most times none — else one to three of
    them, or new keys — replaced by any JSON value at all."""
    d = {k: draw(v) for k, v in required.items()}
    d.update({k: draw(v) for k, v in optional.items() if draw(st.booleans())})
    for key in draw(sometimes(st.just([]), st.lists(st.sampled_from([*required, *optional, "extra"]), min_size=1,
                                                   max_size=3))):
        d[key] = draw(JSON)
    return d


@pytest.fixture(scope="module")
def http(fuzz_cluster):
    with httpx.Client(base_url=fuzz_cluster.url, timeout=TIMEOUT) as c:
        yield c


# --- gRPC GenerateService -----------------------------------------------------------------------
HOSTILE = {"max_tokens": uint32, "temperature": f32, "top_p": f32, "top_k": uint32, "seed": uint64,
           "stop": st.lists(st.text(), max_size=30), "num_speculative_tokens": uint32,
           "text": st.sampled_from(["", "x" * 500, "y" * (MAX_REQUEST_BYTES + 10)]),
           "token_ids": st.one_of(st.lists(uint32, max_size=5), st.sampled_from(
               [[], [5] * (MAX_PROMPT + 1), [5] * (MAX_REQUEST_BYTES + 10)]))}


@st.composite
def generate_requests(draw):
    """A valid GenerateRequest, then most times nothing — else one or two fields — made hostile."""
    v = {"max_tokens": draw(st.integers(0, MAX_OUTPUT)), "temperature": draw(st.sampled_from([0.0, 0.7, 1.0])),
         "top_p": draw(st.sampled_from([0.0, 0.9, 1.0])), "top_k": draw(st.sampled_from([0, 5])),
         "stop": draw(st.lists(st.text(min_size=1, max_size=3), max_size=2)), "ignore_eos": draw(st.booleans())}
    if draw(st.booleans()):
        v["seed"] = draw(uint64)
    if draw(st.booleans()):
        v["num_speculative_tokens"] = draw(st.integers(0, 2))
    v.update({"text": draw(words)} if draw(st.booleans()) else {"token_ids": draw(in_vocab)})
    for key in draw(sometimes(st.just([]), st.lists(st.sampled_from(list(HOSTILE)), min_size=1, max_size=2))):
        v.pop("text" if key == "token_ids" else "token_ids" if key == "text" else "", None)
        v[key] = draw(HOSTILE[key])
    ids = v.pop("token_ids", None)
    return gen.GenerateRequest(**v, **({} if ids is None else {"token_ids": gen.TokenIds(ids=ids)}))


@fuzz_settings(150)
@given(req=generate_requests(), stream=st.booleans())
def test_fuzz_generate(fuzz_cluster, req, stream):
    stub = fuzz_cluster.generate
    try:
        msgs = list(stub.GenerateStream(req, timeout=TIMEOUT)) if stream else [stub.Generate(req, timeout=TIMEOUT)]
    except grpc.RpcError as e:
        event(f"{e.code().name} {e.details()[:40]}")
        expect_client_error(e, "Generate")
        assert not e.details().startswith(SERVICE_FAILED), f"accepted, then refused by a service: {e.details()}"
        return
    event("OK")
    ids = [t for m in msgs for t in m.token_ids]
    assert_tokens(ids, "Generate")
    last = msgs[-1]
    assert last.finish_reason in (gen.FINISH_REASON_STOP, gen.FINISH_REASON_LENGTH)
    assert last.usage.completion_tokens == len(ids) <= (req.max_tokens or 8) <= MAX_OUTPUT


# --- REST ---------------------------------------------------------------------------------------
SAMPLING = {"max_tokens": st.integers(1, MAX_OUTPUT), "temperature": st.sampled_from([0, 0.7, 1.0]),
            "top_p": st.sampled_from([0.5, 1.0]), "top_k": st.sampled_from([-1, 0, 5, 2**40]),
            "seed": st.integers(0, 2**64 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
            "n": st.integers(1, 2), "stream": st.booleans(), "ignore_eos": st.booleans(),
            "num_speculative_tokens": st.integers(0, 2), "model": sometimes(st.just("tiny"), st.just("other")),
            "return_token_ids": st.just(True)}
COMPLETION = body({"prompt": st.one_of(rest_words, in_vocab)}, {**SAMPLING, "echo": st.booleans(),
                                                           "logprobs": st.integers(0, 3)})
MESSAGE = body({"role": st.sampled_from(["system", "user", "assistant"]), "content": rest_words}, {})
CHAT = body({"messages": st.lists(MESSAGE, min_size=1, max_size=3)}, {
    **SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3),
    "max_completion_tokens": st.integers(1, MAX_OUTPUT),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["messages", "add_generation_prompt", "x"]), JSON)})
TOKENIZE = body({}, {"prompt": rest_words, "messages": st.lists(MESSAGE, max_size=2), "add_special_tokens": st.booleans()})
DETOKENIZE = body({"tokens": in_vocab}, {})


def post(http, path: str, body) -> tuple[int, str]:
    """-> (status, whole response text); raw bytes as given, anything else as JSON (NaN / Infinity literals kept)."""
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        return r.status_code, r.read().decode()


def check_rest(status: int, text: str, what: str) -> None:
    event(f"{what} {status}")
    assert status < 500, f"{what}: {status} {text[:300]}"
    if status >= 400:
        err = json.loads(text)["error"]
        assert err["message"] and not err["message"].startswith(SERVICE_FAILED), err
        return
    if text.startswith("data: "):
        assert text.rstrip().endswith("data: [DONE]"), f"{what}: stream did not end with [DONE]: {text[-200:]}"
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    else:
        chunks = [json.loads(text)]
    for c in chunks:
        assert "error" not in c, c
        for choice in c.get("choices", []):
            assert_tokens(choice.get("token_ids") or [], what)


@fuzz_settings(200)
@given(body=COMPLETION)
def test_fuzz_rest_completions(http, body):
    check_rest(*post(http, "/v1/completions", body), "completions")


@fuzz_settings(120)
@given(body=CHAT)
def test_fuzz_rest_chat(http, body):
    check_rest(*post(http, "/v1/chat/completions", body), "chat")


@fuzz_settings(150)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       body=st.one_of(TOKENIZE, DETOKENIZE, JSON, st.binary(max_size=200),
                      st.integers(1, 40_000).map(lambda n: b"[" * n + b"]" * n)))
def test_fuzz_rest_anything(http, path, body):
    check_rest(*post(http, path, body), path)


# --- the limits, by name --------------------------------------------------------------------------
def test_limits_are_enforced_and_named(fuzz_cluster, http):
    def rest(path, body, status, text):
        got, resp = post(http, path, body)
        assert got == status and text in resp, (got, resp[:300])
    rest("/v1/completions", {"prompt": [5] * (MAX_PROMPT + 1), "max_tokens": 1}, 400, "--max-prompt-tokens")
    rest("/v1/completions", {"prompt": "hi", "max_tokens": MAX_OUTPUT + 1}, 400, "--max-output-tokens")
    rest("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_OUTPUT + 1},
         400, "--max-output-tokens")
    rest("/v1/completions", {"prompt": "x" * MAX_REQUEST_BYTES}, 413, "--max-request-bytes")
    rest("/v1/completions", {"prompt": "hi", "temperature": 1e39}, 400, "finite")
    rest("/v1/completions", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p")
    rest("/v1/completions", b"[" * 30_000 + b"]" * 30_000, 400, "RecursionError")      # was a 500
    rest("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 2**40}, 200, "choices")   # was a 500
    rest("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,  # was a 500
                                  "chat_template_kwargs": {"messages": 1, "add_generation_prompt": 0}}, 200, "choices")
    r = http.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True})      # default max_tokens: capped
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == min(16, MAX_OUTPUT)

    stub = fuzz_cluster.generate
    for req, code, text in [
            (gen.GenerateRequest(token_ids=gen.TokenIds(ids=[5] * (MAX_PROMPT + 1))), "INVALID_ARGUMENT",
             "--max-prompt-tokens"),
            (gen.GenerateRequest(text="hi", max_tokens=MAX_OUTPUT + 1), "INVALID_ARGUMENT", "--max-output-tokens"),
            (gen.GenerateRequest(text="hi", temperature=math.inf), "INVALID_ARGUMENT", "finite"),
            (gen.GenerateRequest(text="hi", stop=["a"] * 17), "INVALID_ARGUMENT", "at most 16"),
            (gen.GenerateRequest(text="y" * (MAX_REQUEST_BYTES + 1)), "RESOURCE_EXHAUSTED", "")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req, timeout=TIMEOUT)
        assert e.value.code().name == code and text in e.value.details(), e.value.details()
    ok = stub.Generate(gen.GenerateRequest(text="hi", ignore_eos=True), timeout=TIMEOUT)   # default 8 tokens
    assert len(ok.token_ids) == 8


def test_api_sound_after_fuzzing(fuzz_cluster):
    fuzz_cluster.assert_healthy()
    fuzz_cluster.cluster.wait_drained()
