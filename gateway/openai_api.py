"""OpenAI / vLLM request models and response shaping for the REST API (gateway/http.py serves them).

Unknown fields are kept and ignored (`extra="allow"`), but known parameters this server does not implement
(penalties, logit_bias, structured output, tools, beam search, ...) are refused with a 400 naming them unless they
ask for nothing (`UNSUPPORTED`). Defaults follow OpenAI: completions
max_tokens 16, temperature 1, top_p 1; chat max_tokens the gateway's --default-max-tokens; a default max_tokens
shrinks to the room a long prompt leaves (gateway/core.py).

Chat prompts: the checkpoint's `chat_template` from tokenizer_config.json, rendered with jinja2 as
transformers does (sandboxed, trim_blocks, lstrip_blocks, `raise_exception`, `tojson`), else
DEFAULT_CHAT_TEMPLATE: "<|role|>\\ncontent\\n" per message, then "<|assistant|>\\n".
"""
from __future__ import annotations

import json
import re
from typing import Any

import grpc
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.core import RequestError
from gateway.openai_logprobs import chat_logprobs, completion_logprobs  # noqa: F401  (their home before)
from gateway.stubs import ROW_CONTRACT

DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ROLES = ("system", "developer", "user", "assistant", "tool")
GRPC_TO_HTTP = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404,
                "RESOURCE_EXHAUSTED": 503, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}


class _Model(BaseModel):
    # strict: a JSON value of the wrong type is a 400, not coerced ("logprobs": false was top-0 logprobs,
    # "max_tokens": "10" or true a number, "stream": "yes" a stream); a float field takes any JSON number
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Model):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    num_speculative_tokens: int | None = None      # Tandem: draft tokens per round (<= the gateway's K)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Model):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    tokens: list[int]


def parse(cls, body: Any):
    """JSON body -> cls; RequestError naming the first bad field, what it takes and what it got. Of a union's
    errors (prompt: text, ids, ...), the deepest: [1, true] is "prompt.1: ... a valid integer (got true, a boolean)"."""
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        errs = e.errors()
        err = max((x for x in errs if x["loc"][:1] == errs[0]["loc"][:1]), key=lambda x: len(x["loc"]))
        field = ".".join(str(x) for x in err["loc"] if not UNION_TAG.fullmatch(str(x)))  # (not a prefix test)
        if err["type"] == "missing":
            raise RequestError(field, f"{field}: {err['msg']}") from None
        got = err.get("input")
        kind = "" if got is None else f", {JSON_TYPES.get(type(got), type(got).__name__)}"
        raise RequestError(field, f"{field}: {err['msg']} (got {json.dumps(got, default=str)[:80]}{kind})") from None


UNION_TAG = re.compile(r"str|int|float|bool|[\w-]+\[.*\]")       # a union member's name in an error's loc
JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
              dict: "an object"}


def check_unicode(text: str, param: str, what: str = "") -> None:
    """A 400 naming `param` when `text` holds a lone UTF-16 surrogate (valid JSON, not valid Unicode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(param, f"{param}: {what}holds an unpaired UTF-16 surrogate (U+{ord(text[e.start]):04X}) "
                                  f"at character {e.start}: not valid Unicode") from None


# OpenAI / vLLM parameters this server does not implement -> the values that ask for nothing (what it does anyway)
UNSUPPORTED = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
               "min_tokens": (0,), "min_p": (0,), "suffix": ("",), "use_beam_search": (False,),
               "response_format": ({"type": "text"},), "tools": ([],), "functions": ([],), "guided_json": (),
               "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": ()}


def refuse_unsupported(req: _Sampling) -> None:
    """A known parameter this server does not implement, set to anything but its neutral value (or null): 400
    naming it, rather than an answer that silently ignored it. best_of: only as many as n."""
    extra = req.model_extra or {}
    for field, neutral in UNSUPPORTED.items():
        v = extra.get(field)
        if v is not None and v not in neutral:
            ok = " or ".join(json.dumps(x) for x in (None, *neutral))
            raise RequestError(field, f"{field}: not supported by this server (got {json.dumps(v)[:80]}); send {ok} "
                               "or leave it out")
    best_of = extra.get("best_of")
    if best_of is not None and best_of != req.n:
        raise RequestError("best_of", f"best_of: not supported by this server beyond n (got {json.dumps(best_of)[:80]}, "
                           f"n is {req.n}); leave it out")


def sampling_args(req: _Sampling, max_tokens: int | None) -> dict:
    """Common keyword arguments of Gateway.new_request, with OpenAI's defaults."""
    refuse_unsupported(req)
    if req.n < 1:
        raise RequestError("n", f"n: must be >= 1, got {req.n}")
    if req.n > 16:
        raise RequestError("n", f"n: at most 16, got {req.n}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 16:
        raise RequestError("stop", f"stop: at most 16 strings, got {len(stop)}")
    for i, s in enumerate(stop):
        check_unicode(s, "stop", f"string {i} " if isinstance(req.stop, list) else "")
    if req.seed is not None and not 0 <= req.seed < 2 ** 64:     # (choice j of n uses seed + j, wrapping)
        raise RequestError("seed", f"seed: must be in [0, 2**64), got {req.seed}")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options", "stream_options: only with stream: true")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats \
            and not req.stream_options.include_usage:      # (vLLM ignores it then; here it would do nothing)
        raise RequestError("stream_options.continuous_usage_stats", "stream_options.continuous_usage_stats: "
                           "needs include_usage: true")
    top_k = req.top_k if req.top_k is not None else 0
    if top_k == -1:
        top_k = 0
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0:                        # the smallest nucleus: the most probable token (to the services 0 is off)
        top_p, top_k = 1.0, 1
    return dict(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=top_p, top_k=top_k, stop=stop, ignore_eos=req.ignore_eos, k=req.num_speculative_tokens)


def completion_prompts(req: CompletionRequest, encode) -> list[tuple[list[int], str | None]]:
    """prompt: a string, token ids, or a list of either -> [(token ids, text or None)]."""
    p = req.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items:
        raise RequestError("prompt", "prompt: empty (give text or token ids)")
    out = []
    for x in items:
        if isinstance(x, str):
            if not x:
                raise RequestError("prompt", "prompt: empty string")
            out.append((encode(x), x))
        else:
            out.append((list(x), None))
    return out


# --- chat ------------------------------------------------------------------------------------------
def chat_template(tokenizer_config: dict) -> str:
    t = tokenizer_config.get("chat_template")
    if isinstance(t, list):           # [{"name": ..., "template": ...}]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t or DEFAULT_CHAT_TEMPLATE


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def render_chat(template: str, messages: list[ChatMessage], add_generation_prompt: bool, special: dict,
                kwargs: dict | None = None) -> str:
    msgs = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise RequestError(f"messages.{i}.role", f"messages.{i}.role: must be one of {list(ROLES)}, got {m.role!r}")
        content = m.content
        if isinstance(content, list):
            bad = [p.get("type") for p in content if p.get("type") != "text"]
            if bad:
                raise RequestError(f"messages.{i}.content", f"messages.{i}.content: only text parts are "
                                   f"supported, got type {bad[0]!r}")
            for j, p in enumerate(content):    # (str() of null or an object was sent as "None" or its repr)
                if not isinstance(p.get("text"), str):
                    f = f"messages.{i}.content.{j}.text"
                    raise RequestError(f, f"{f}: must be a string, got {json.dumps(p.get('text'), default=str)[:80]}")
            content = "".join(p["text"] for p in content)
        msgs.append({**m.model_dump(exclude_none=True), "role": m.role, "content": content or ""})
    if not msgs:
        raise RequestError("messages", "messages: empty (give at least one message)")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    try:
        # the request's chat_template_kwargs may not replace messages or add_generation_prompt (nor
        # collide with them: a duplicate keyword was a TypeError, a 500)
        return env.from_string(template).render(**{**special, **(kwargs or {}), "messages": msgs,
                                                   "add_generation_prompt": add_generation_prompt})
    except jinja2.exceptions.TemplateError as e:
        raise RequestError("messages", f"messages: the chat template failed: {e}") from None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def error_code(code: grpc.StatusCode, message: str) -> str:
    """The REST error's `code` for a failed generation: the broken contract by name, else the gRPC status."""
    return "hidden_rows_contract" if ROW_CONTRACT in message else code.name.lower()


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        code = code or "invalid_api_key"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
