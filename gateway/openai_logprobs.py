"""OpenAI logprobs of completions and chat (gateway/responses.py puts them into responses).

A token's text (`token_str`: the token decoded alone, U+FFFD for a byte-level piece of a multi-byte character)
is completions' `tokens[i]` and chat's `token`, and keys the top alternatives, as OpenAI's do (a client that
compares the two, lm-eval's is_greedy, needs them alike).

A token's bytes are its real UTF-8 bytes, not those of its decoded text: with a ByteLevel decoder (GPT-2's,
DeepSeek's, the bundled model's) the vocabulary spells each byte as one character of the byte alphabet, mapped
back here, so the bytes of consecutive tokens join into the text (an emoji's four byte tokens: [240], [159], ...;
their decoded texts were U+FFFD each). Added (special) tokens, tokens outside the alphabet and other decoders:
the UTF-8 of the token's decoded text. They give chat's `bytes`, and completions' `text_offset`: the tokens'
bytes decoded incrementally as UTF-8, a token's offset is the number of characters the tokens before it
completed. So a token that completes no character yet has the offset where its character starts (as has the one
that completes it), and no offset points past the end of the text. (vLLM adds up the lengths of the tokens'
strings, which byte pieces make run past the text.)
"""
from __future__ import annotations

import codecs
from functools import lru_cache

from tokenizers import decoders


def _byte_alphabet() -> dict[str, int]:
    """ByteLevel's alphabet (GPT-2's bytes_to_unicode), character -> byte: printable Latin-1 bytes stand for
    themselves, the others, in order, for chr(256), chr(257), ..."""
    own = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, n = {}, 0
    for b in range(256):
        if b in own:
            out[chr(b)] = b
        else:
            out[chr(256 + n)] = b
            n += 1
    return out


BYTE_OF = _byte_alphabet()


class TokenBytes:
    """tid -> the token's UTF-8 bytes (see the module's docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = isinstance(getattr(tokenizer, "decoder", None), decoders.ByteLevel)
        self.added = set(tokenizer.get_added_tokens_decoder()) if self.byte_level else set()

    def __call__(self, tid: int) -> bytes:
        if self.byte_level and tid not in self.added:
            piece = self.tokenizer.id_to_token(tid)
            if piece and all(ch in BYTE_OF for ch in piece):
                return bytes(BYTE_OF[ch] for ch in piece)
        return self.tokenizer.decode([tid], skip_special_tokens=False).encode("utf-8")


@lru_cache(maxsize=4)
def token_bytes(tokenizer) -> TokenBytes:
    return TokenBytes(tokenizer)


class TextOffsets:
    """Completions' text_offset, token by token (a choice's stream keeps one across its chunks)."""

    def __init__(self, token_bytes):
        self.token_bytes = token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.at = 0                           # characters the tokens so far completed

    def next(self, tid: int) -> int:
        at = self.at
        self.at += len(self.utf8.decode(self.token_bytes(tid)))
        return at


def _text_bytes(token_str):
    return lambda tid: token_str(tid).encode("utf-8")


def completion_logprobs(token_ids: list[int], entries: list, token_str, offsets: TextOffsets | None = None) -> dict:
    """Legacy completions logprobs. entries[i]: TokenLogprob of token_ids[i], or None (the first
    prompt token has no logprob). top_logprobs always holds the token itself, as OpenAI's does."""
    offsets = offsets if offsets is not None else TextOffsets(_text_bytes(token_str))
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, e in zip(token_ids, entries):
        s = token_str(tid)
        out["tokens"].append(s)
        out["text_offset"].append(offsets.next(tid))
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(e.logprob)
        top: dict[str, float] = {}
        for alt, lp in zip(e.top_token_ids, e.top_logprobs):   # best first: two ids of one text keep the higher
            top.setdefault(token_str(alt), lp)
        top.setdefault(s, e.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(token_ids: list[int], entries: list, token_str, token_bytes=None) -> list[dict]:
    token_bytes = token_bytes or _text_bytes(token_str)

    def item(tid, lp):
        return {"token": token_str(tid), "logprob": lp, "bytes": list(token_bytes(tid))}
    return [{**item(t, e.logprob), "top_logprobs": [item(a, lp) for a, lp in zip(e.top_token_ids, e.top_logprobs)]}
            for t, e in zip(token_ids, entries)]
