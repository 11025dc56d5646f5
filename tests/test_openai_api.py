"""The REST API through the official `openai` client (and plain HTTP for vLLM's extensions) against
the shared local cluster (api_cluster.py): completions, chat, both streaming, n > 1, logprobs
checked against the model computed in this process, and the tokenizer endpoints."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from tokenizers import Tokenizer
import torch
from openai import OpenAI

from models.loader import load_model
from models.model import TargetModel
from models.runner import forward_tokens, new_cache
from tandem.v1 import generate_pb2 as gen
from test_faults import metric

pytestmark = pytest.mark.slow
PROMPT = "def fibonacci(n):\n"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a stack class"}]


@pytest.fixture(scope="module")
def client(api_cluster) -> OpenAI:
    return OpenAI(base_url=api_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(api_cluster):
    with httpx.Client(base_url=api_cluster.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref_model(api_cluster):
    torch.set_num_threads(1)
    return load_model(TargetModel, api_cluster.ckpt)


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T, V] fp32 log-softmax of the target logits at every position of ids."""
    with torch.inference_mode():
        hidden = forward_tokens(model, new_cache(model), {"r": ids})
        return torch.log_softmax(model.compute_logits(hidden).float(), -1)


def test_models_and_tokenizer(api_cluster, client, http):
    assert [m.id for m in client.models.list().data] == [api_cluster.model_name]
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["chat_template"] and info["model_max_length"] > 0
    tok = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == info["model_max_length"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": PROMPT}
    eos = http.post("/tokenize", json={"prompt": "</s>", "add_special_tokens": False}).json()["tokens"]
    assert eos == [2], "lm-eval finds the EOS id by tokenizing eos_token"
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"].endswith("<|assistant|>\n")


def test_the_advertised_context_is_all_usable_with_drafts(api_cluster, http):
    """/v1/models states max_model_len; a prompt and max_tokens that fill it exactly decode with K = 3 (fewer
    drafts a round near the end) and equal plain decoding, and the draft takes every round's tokens up to the end
    (speculation does not degrade: the next round's Propose, sent before the last Verify's tokens are committed,
    may carry all of them); one token more is a 400 naming max_tokens."""
    M = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = dict(model=api_cluster.model_name, prompt=[(7 * i + 3) % 500 for i in range(M - 12)], max_tokens=12,
                temperature=0, ignore_eos=True)
    failures = metric(api_cluster.url, "tandem:draft_failures")
    spec = http.post("/v1/completions", json={**body, "num_speculative_tokens": 3})
    api_cluster.wait_drained()
    assert metric(api_cluster.url, "tandem:draft_failures") == failures
    assert metric(api_cluster.url, "tandem:speculation_active") == 1
    plain = http.post("/v1/completions", json={**body, "num_speculative_tokens": 0})
    assert spec.status_code == plain.status_code == 200, (spec.text, plain.text)
    assert spec.json()["usage"]["completion_tokens"] == 12
    assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    over = http.post("/v1/completions", json={**body, "max_tokens": 13})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens", over.text
    assert f"limit of {M} tokens" in over.json()["error"]["message"]


def test_model_retrieve_and_errors_in_openai_shape(api_cluster, client, http):
    """models.retrieve (GET /v1/models/{id}); an unknown model, route or method answers in the OpenAI error
    shape (never {"detail": ...}); num_speculative_tokens -1 says what is allowed."""
    m = client.models.retrieve(api_cluster.model_name)
    assert m.id == api_cluster.model_name and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found", e.value.body
    for method, path, status in (("GET", "/v1/nothing", 404), ("DELETE", "/v1/completions", 405),
                                 ("GET", "/v1/chat/completions", 405)):
        r = http.request(method, path)
        err = r.json()["error"]
        assert r.status_code == status and "detail" not in r.json() and path in err["message"], r.text
        assert err["type"] == "invalid_request_error" and err["code"] in ("not_found", "method_not_allowed")
    assert "POST" in http.request("DELETE", "/v1/completions").headers.get("allow", "")
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "num_speculative_tokens": -1})
    assert r.status_code == 400 and "must be >= 0, got -1" in r.json()["error"]["message"], r.text


def test_completion_equals_grpc_and_plain_decoding(api_cluster, client):
    """Greedy REST output == the gRPC API's == plain target decoding (speculation off)."""
    r = client.completions.create(model=api_cluster.model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(c.prompt_token_ids) and r.usage.total_tokens == r.usage.prompt_tokens + 24
    g = api_cluster.cluster.gateways[0].stub.Generate(gen.GenerateRequest(
        text=PROMPT, max_tokens=24, ignore_eos=True, num_speculative_tokens=0), timeout=120)
    assert c.token_ids == list(g.token_ids) and c.text == g.text
    plain = client.completions.create(model=api_cluster.model_name, prompt=c.prompt_token_ids, max_tokens=24,
                                      temperature=0, extra_body={"num_speculative_tokens": 0, "ignore_eos": True})
    assert plain.choices[0].text == c.text


def test_completion_stream(api_cluster, client):
    whole = client.completions.create(model=api_cluster.model_name, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=api_cluster.model_name, prompt=PROMPT, max_tokens=20,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_and_stream(api_cluster, client):
    whole = client.chat.completions.create(model=api_cluster.model_name, messages=CHAT, max_tokens=16, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.object == "chat.completion" and whole.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=api_cluster.model_name, messages=CHAT, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_choices(api_cluster, client):
    """n > 1: indices 0..n-1 per prompt, prompt-major; a seed makes the choices reproducible. On a CPU a row's bits
    depend on the rows batched with it (no batch-invariant GEMMs there, unlike CUDA's: models/layers.dense_linear),
    so each call runs with nothing else in flight: a request another test left finishing would change them."""
    kw = dict(model=api_cluster.model_name, max_tokens=12, temperature=1.0, seed=5, n=3)
    api_cluster.wait_drained()
    a = client.completions.create(prompt=PROMPT, **kw)
    api_cluster.wait_drained()
    b = client.completions.create(prompt=PROMPT, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1, "seeded choices should differ from each other"
    two = client.completions.create(prompt=[PROMPT, "import os\n"], **{**kw, "n": 2})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == a.choices[0].text and two.choices[1].text == a.choices[1].text
    chat = client.chat.completions.create(model=api_cluster.model_name, messages=CHAT, max_tokens=8, n=2,
                                          temperature=1.0, seed=1, stream=True)
    seen = {}
    for ch in chat:
        for c in ch.choices:
            seen.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(seen) == [0, 1] and all(r[-1] in ("stop", "length") for r in seen.values())


def test_echo_logprobs_match_reference(api_cluster, client, ref_model):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1) scores the prompt with the
    target's fp32 log-softmax: compare with the model run in this process."""
    ids = client.completions.create(model=api_cluster.model_name, prompt=PROMPT, max_tokens=1,
                                    extra_body={"return_token_ids": True}).choices[0].prompt_token_ids
    r = client.completions.create(model=api_cluster.model_name, prompt=[ids], max_tokens=1, temperature=0,
                                  echo=True, logprobs=2, extra_body={"return_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    ref = ref_logprobs(ref_model, ids + c.token_ids)
    want = [ref[j - 1, t].item() for j, t in enumerate(ids + c.token_ids) if j > 0]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    last = lp.top_logprobs[-1]          # greedy: the generated token is the top-1 alternative
    assert max(last.values()) == pytest.approx(lp.token_logprobs[-1], abs=1e-6)
    # OpenAI's format keys alternatives by text: two ids of one text (byte-level pieces of one character
    # both decode to U+FFFD) show once, with the higher logprob
    tok = Tokenizer.from_file(str(api_cluster.ckpt / "tokenizer.json"))
    top2 = ref[len(ids) - 1].topk(2)
    want_top: dict[str, float] = {}
    for v, t in zip(top2.values.tolist(), top2.indices.tolist()):
        want_top.setdefault(tok.decode([t], skip_special_tokens=False), v)
    assert last == pytest.approx(want_top, abs=1e-4)
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    score = client.completions.create(model=api_cluster.model_name, prompt=[ids], max_tokens=0, echo=True,
                                      logprobs=0)
    assert score.choices[0].text == PROMPT and score.usage.completion_tokens == 0
    assert score.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want[:-1], abs=1e-4)


def test_generated_logprobs_stream_and_chat(api_cluster, client):
    kw = dict(model=api_cluster.model_name, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    whole = client.completions.create(**kw).choices[0].logprobs
    streamed = [lp for ch in client.completions.create(stream=True, **kw) for lp in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.token_logprobs, abs=1e-6) and len(whole.tokens) >= 1
    chat = client.chat.completions.create(model=api_cluster.model_name, messages=CHAT, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
                           for t in content)


def test_stop_and_finish_reasons(api_cluster, client):
    base = client.completions.create(model=api_cluster.model_name, prompt=PROMPT, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[8:11]
    r = client.completions.create(model=api_cluster.model_name, prompt=PROMPT, max_tokens=30, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" and r.text == base[:base.index(stop)]


def test_stream_disconnect_releases_state(api_cluster, http):
    """A client that goes away mid-stream: its requests are cancelled and both services free them."""
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True, "n": 2}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    api_cluster.cluster.wait_drained(timeout_s=30)
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_stream_events_survive_clients_that_split_lines_like_python(http):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines (httpx's iter_lines): sent raw inside an event's
    JSON they cut it into pieces that are not JSON (found probing as a user); escaped, every line parses."""
    prompt = "s = \"a\u2028b\u2029c\u0085d\"\n"
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events)
    assert text.startswith(prompt), text


def test_default_chat_template():
    """No chat_template in tokenizer_config.json: the documented default."""
    from gateway import openai_api as api
    msgs = [api.ChatMessage(role="system", content="be brief"),
            api.ChatMessage(role="user", content=[{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}])]
    assert api.chat_template({}) == api.DEFAULT_CHAT_TEMPLATE
    assert api.render_chat(api.DEFAULT_CHAT_TEMPLATE, msgs, True, {}) == \
        "<|system|>\nbe brief\n<|user|>\nhi!\n<|assistant|>\n"
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    assert api.render_chat(api.chat_template({"chat_template": named}), msgs, True, {}) == "be brief"


def test_alternatives_of_one_text_keep_the_higher_logprob():
    """completion_logprobs: alternatives keyed by text keep the best of ids that decode alike."""
    from types import SimpleNamespace
    from gateway.openai_api import completion_logprobs
    e = SimpleNamespace(logprob=-0.5, top_token_ids=[7, 8, 9], top_logprobs=[-0.5, -1.0, -2.0])
    out = completion_logprobs([7], [e], lambda t: {7: "\ufffd", 8: "\ufffd", 9: "x"}[t])
    assert out["top_logprobs"] == [{"\ufffd": -0.5, "x": -2.0}]


SPECIAL = ("<s>", "</s>", "<pad>")


def test_logprob_bytes_rebuild_multibyte_characters(api_cluster, http):
    """Chat logprobs' `bytes` are each token's own UTF-8 bytes (a byte-level piece of a multi-byte character has
    its one byte, not U+FFFD's three), so those of consecutive tokens join into the text (found probing as a user:
    an emoji's four tokens each had [239, 191, 189]). Sampled from the tiny model, whose vocabulary is half single
    bytes: its texts are full of pieces of characters (and of invalid UTF-8, which decodes alike)."""
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 48, "temperature": 1.0, "seed": 5,
                                                "n": 4, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    pieces = 0
    for choice in r.json()["choices"]:
        content = choice["logprobs"]["content"]
        joined = bytes(b for t in content if t["token"] not in SPECIAL for b in t["bytes"])
        assert joined.decode("utf-8", "replace") == choice["message"]["content"]
        pieces += sum(len(t["bytes"]) == 1 and t["bytes"][0] >= 0x80 for t in content)
        assert all(isinstance(a["bytes"], list) for t in content for a in t["top_logprobs"])
    assert pieces, "no token was a piece of a multi-byte character: the test checks nothing"


def test_text_offsets_stay_in_the_text(http):
    """Completions' text_offset: a token that completes no character yet has the offset where its character
    starts, so no offset points past the end of the text (one per byte token had run past it); streamed alike."""
    text = "😀😀 é x"
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    choice = r.json()["choices"][0]
    offsets = choice["logprobs"]["text_offset"]
    assert choice["text"] == text and len(offsets) == len(ids) and len(ids) > len(text), (ids, r.text)
    assert offsets == sorted(offsets) and offsets[0] == 0 and max(offsets) < len(text), offsets
    body = {"prompt": ids, "max_tokens": 12, "echo": True, "logprobs": 1, "temperature": 1.0, "seed": 3}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    events = [json.loads(line[6:]) for line in http.post("/v1/completions", json={**body, "stream": True}).text
              .splitlines() if line.startswith("data: {")]
    streamed = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == whole["logprobs"]["text_offset"]
    assert streamed == sorted(streamed) and max(streamed) <= len(whole["text"]), (streamed, whole["text"])


def test_continuous_usage_stats(http):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries its choice's usage so far (it was
    accepted and ignored); the usage chunk at the end is the whole request's."""
    opts = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        r = http.post(path, json={**body, **opts, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10, r.text
        seen = {0: 0, 1: 0}
        for e in chunks:
            u = e["usage"]
            assert u["prompt_tokens"] == last["usage"]["prompt_tokens"]         # (n copies of one prompt)
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            if len(e["choices"]) == 1:
                i = e["choices"][0]["index"]
                assert u["completion_tokens"] >= seen[i]
                seen[i] = u["completion_tokens"]
        assert seen == {0: 5, 1: 5}, r.text
