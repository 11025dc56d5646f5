"""Completion and chat responses, whole or as server-sent events, from the scheduler's events.

One Choice per (prompt, n) pair, all running concurrently. Streams send `data: {json}` events and
end with `data: [DONE]`; with stream_options.include_usage the last event before it has
`choices: []` and the usage (continuous_usage_stats as well: every chunk has its choice's usage so far,
as vLLM's). A service failure mid-stream is sent as `data: {"error": ...}`.

Completions logprobs with echo start with the prompt's tokens (the first has none). When EOS
ended a completion, its logprob is the last entry (as vLLM reports it), though neither its text
nor its id is part of the completion: lm-eval's loglikelihood (echo, logprobs, max_tokens 1)
drops exactly one generated entry.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from gateway import openai_api as api
from gateway.core import GenerationError, Gateway
from gateway.openai_logprobs import TextOffsets, chat_logprobs, completion_logprobs, token_bytes
from gateway.scheduler import Event, GenRequest
from infra import tracing


# Characters that line splitters other than SSE's (str.splitlines: httpx's iter_lines) take for line breaks
LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def sse_json(obj) -> str:
    """An event's JSON on one line for any client: UTF-8 as is, but U+2028, U+2029 and U+0085 escaped."""
    return json.dumps(obj, ensure_ascii=False).translate(LINE_BREAKS)


@dataclass
class Choice:
    index: int
    r: GenRequest
    prompt_text: str | None                  # None: the prompt came as token ids
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: str | None = None
    started: bool = False                    # streaming: first chunk sent
    offsets: TextOffsets | None = None        # completions' text_offset, kept across a stream's chunks
    sent_tokens: int = 0                     # streaming: tokens sent so far (continuous_usage_stats)


class CompletionShaper:
    def __init__(self, gw: Gateway, choices: list[Choice], req, chat: bool, num_prompts: int):
        self.gw, self.choices, self.chat = gw, choices, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.echo = not chat and req.echo
        self.want_lp = bool(req.logprobs) if chat else req.logprobs is not None
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk has the usage of its choice so far (else usage: null)
        self.continuous_usage = self.include_usage and req.stream_options.continuous_usage_stats
        self.token_bytes = token_bytes(gw.tokenizer)
        self.return_ids = req.return_token_ids
        self.n, self.num_prompts = req.n, num_prompts

    # --- pieces -----------------------------------------------------------------------------------
    def _prompt_text(self, c: Choice) -> str:
        return c.prompt_text if c.prompt_text is not None else self.gw.decode(c.r.prompt_ids)

    def _logprobs(self, c: Choice, ids: list[int], entries: list, first: bool, last: bool):
        """Logprobs of one chunk (or the whole choice): prompt part when echoing on the first, EOS on the last."""
        if not self.want_lp:
            return None
        if last and not self.chat and c.r.eos is not None and c.r.eos[1] is not None:
            ids, entries = ids + [c.r.eos[0]], entries + [c.r.eos[1]]
        if self.chat:
            return {"content": chat_logprobs(ids, entries, self.gw.token_str, self.token_bytes)}
        if first and self.echo:
            ids, entries = list(c.r.prompt_ids) + ids, [None] + list(c.r.prompt_lps) + entries
        c.offsets = c.offsets or TextOffsets(self.token_bytes)
        return completion_logprobs(ids, entries, self.gw.token_str, c.offsets)

    def usage(self) -> dict:
        firsts = [self.choices[p * self.n].r for p in range(self.num_prompts)]
        return api.usage(sum(len(r.prompt_ids) for r in firsts), sum(len(c.r.output_ids) for c in self.choices),
                         sum(r.cached_tokens for r in firsts))

    def finish_span(self, span) -> None:
        u = self.usage()
        tracing.finish(span, **{"gen_ai.usage.input_tokens": u["prompt_tokens"],
                                "gen_ai.usage.output_tokens": u["completion_tokens"], "gen_ai.response.id": self.id,
                                "gen_ai.response.finish_reasons": [c.finish or "error" for c in self.choices],
                                "tandem.spec.num_drafts": sum(c.r.stats.num_drafts for c in self.choices),
                                "tandem.spec.num_accepted_tokens": sum(c.r.stats.num_accepted_tokens
                                                                        for c in self.choices)})

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.gw.model_name,
                "choices": choices}

    # --- whole response ---------------------------------------------------------------------------
    async def _drain(self, c: Choice) -> None:
        async for ev in self.gw.events(c.r):
            c.text.append(ev.text)
            c.token_ids += ev.token_ids
            c.logprobs += ev.logprobs
            c.finish = ev.finish_reason or c.finish

    async def collect(self) -> dict:
        try:
            async with asyncio.TaskGroup() as tg:
                for c in self.choices:
                    tg.create_task(self._drain(c))
        except* GenerationError as eg:
            raise eg.exceptions[0] from None
        out = []
        for c in self.choices:
            text = "".join(c.text)
            lp = self._logprobs(c, c.token_ids, c.logprobs, first=True, last=True)
            if self.chat:
                d = {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                     "finish_reason": c.finish, "stop_reason": _stop_reason(c)}
            else:
                d = {"index": c.index, "text": (self._prompt_text(c) if self.echo else "") + text, "logprobs": lp,
                     "finish_reason": c.finish, "stop_reason": _stop_reason(c)}
                if self.return_ids:
                    d["prompt_token_ids"] = list(c.r.prompt_ids)
            if self.return_ids:
                d["token_ids"] = list(c.token_ids)
            out.append(d)
        resp = {**self._envelope(out, chunk=False), "usage": self.usage()}
        if self.chat and self.return_ids:
            resp["prompt_token_ids"] = list(self.choices[0].r.prompt_ids)
        return resp

    # --- stream -----------------------------------------------------------------------------------
    def _chunk(self, c: Choice, ev: Event) -> dict | None:
        first, c.started = not c.started, True
        c.sent_tokens += len(ev.token_ids)
        if not (ev.text or ev.token_ids or ev.finish_reason or (first and self.echo)):
            return None
        lp = self._logprobs(c, list(ev.token_ids), list(ev.logprobs), first, last=bool(ev.finish_reason))
        if self.chat:
            d = {"index": c.index, "delta": {"content": ev.text} if ev.text else {}, "logprobs": lp,
                 "finish_reason": ev.finish_reason}
        else:
            d = {"index": c.index, "text": (self._prompt_text(c) if first and self.echo else "") + ev.text,
                 "logprobs": lp, "finish_reason": ev.finish_reason}
            if self.return_ids and first:
                d["prompt_token_ids"] = list(c.r.prompt_ids)
        if self.return_ids:
            d["token_ids"] = list(ev.token_ids)
        c.finish = ev.finish_reason or c.finish
        if ev.finish_reason:
            d["stop_reason"] = _stop_reason(c)
        return d

    def _data(self, choices: list[dict], c: Choice | None = None) -> str:
        """A chunk's event; `c`: the choice whose usage so far it carries with continuous_usage_stats."""
        obj = self._envelope(choices, chunk=True)
        if self.include_usage:
            obj["usage"] = None
            if self.continuous_usage and c is not None:
                obj["usage"] = api.usage(len(c.r.prompt_ids), c.sent_tokens, c.r.cached_tokens)
        return f"data: {sse_json(obj)}\n\n"

    async def sse(self, span):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            try:
                async for ev in self.gw.events(c.r):
                    queue.put_nowait((c, ev, None))
            except GenerationError as e:
                queue.put_nowait((c, None, e))
        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            if self.chat:
                yield self._data([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None} for c in self.choices],
                                 self.choices[0])
            done = 0
            while done < len(self.choices):
                c, ev, err = await queue.get()
                if err is not None:
                    status = api.GRPC_TO_HTTP.get(err.code.name, 500)
                    body = api.error_body(str(err), status, code=api.error_code(err.code, str(err)))
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                d = self._chunk(c, ev)
                if d is not None:
                    yield self._data([d], c)
                done += bool(ev.finish_reason)
            else:
                if self.include_usage:
                    yield f"data: {json.dumps({**self._envelope([], chunk=True), 'usage': self.usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            self.finish_span(span)


def _stop_reason(c: Choice) -> str | None:
    """vLLM's stop_reason: the stop string that ended the choice (None: EOS, max_tokens, or still running)."""
    return getattr(c.r.text, "matched", None) if c.finish == "stop" else None
