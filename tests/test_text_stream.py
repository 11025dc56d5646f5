"""gateway/text.py: incremental detokenization gives, token by token, exactly what decoding the whole output
gives (emitted text, stop strings, held-back tails, split UTF-8), for the bundled byte-level tokenizer and a
SentencePiece-style one (a decoder that strips the leading space of its first token), while each token costs a
short window's decode, not the whole output's."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from gateway.text import TextStream
from infra.paths import default_model_dir as default_model

TEXTS = ["def f(x):\n    return x  # héllo wörld 😀 中文字符\n\tif x:\n", "a" * 50,
         "😀😀🎉 naïve café — “quotes” ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\r\n\n\n  x", "\n", " \u200d\u0301e\u0301 "]


def reference(tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], bool, str]:
    """The text stream by whole decodes: per token its delta, whether a stop string ended it, the flush."""
    stop = [s for s in stop if s]
    hold, sent, out = max((len(s) for s in stop), default=1) - 1, 0, []
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        hits = [i for i in (text.find(s, max(0, sent - hold)) for s in stop) if i >= 0]
        end = min(hits) if hits else max(0, len(text.rstrip("\ufffd")) - hold)   # a placeholder is no character yet
        while not hits and end > sent and text[end - 1] == "\ufffd":
            end -= 1
        out.append(text[sent:end])
        sent = max(sent, end)
        if hits:
            return out, True, ""
    return out, False, tokenizer.decode(ids)[sent:]


def stream(tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], bool, str]:
    s, out = TextStream(tokenizer, stop), []
    for t in ids:
        delta, stopped = s.add([t])
        out.append(delta)
        if stopped:
            return out, True, ""
    return out, False, s.flush()


def metaspace() -> Tokenizer:
    words = ["▁hello", "▁world", "lo", "▁", "▁a", "b", "▁é", "😀", "\n", "▁\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="▁"))
    tok.decoder = decoders.Metaspace()
    return tok


@pytest.mark.parametrize("kind", ["bundled", "metaspace"])
def test_incremental_text_equals_whole_decodes(kind):
    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json")) if kind == "bundled" else metaspace()
    rng, vocab = random.Random(0), tok.get_vocab_size()
    cases = [tok.encode(t).ids for t in TEXTS] if kind == "bundled" else []
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(150)]
    for i, ids in enumerate(cases):
        stop = [[], ["\n"], ["return", "😀"], ["zz", "  "], ["é"]][i % 5]
        assert stream(tok, ids, stop) == reference(tok, ids, stop), (i, ids, stop)


def test_a_stop_string_of_multi_byte_characters_lets_none_of_itself_out():
    """The hold-back counts characters, and an unfinished character's placeholder is none yet: stop "ü ü" let the
    first "ü" out (found probing as a user), as did any stop string of characters the tokenizer splits."""
    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json"))
    for text, stop, before in [("ü ü ü ü", "ü ü", ""), ("x ü ü ü", " ü ü ü", "x"), ("😀😀😀😀", "😀😀😀", ""),
                               ("日トトトト", "トトト", "日")]:
        out, stopped, _ = stream(tok, tok.encode(text).ids, [stop])
        assert stopped and "".join(out) == before, (text, stop, out)


def test_a_token_costs_a_short_decode_not_the_whole_output():
    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json"))

    class Counting:
        decoded = 0

        def decode(self, ids):
            Counting.decoded += len(ids)
            return tok.decode(ids)
    ids = tok.encode(TEXTS[0] * 60).ids                    # ~1500 tokens, emoji and CJK split across tokens
    s = TextStream(Counting(), ["never appears"])
    text = "".join(s.add([t])[0] for t in ids) + s.flush()
    assert text == tok.decode(ids)
    assert Counting.decoded <= 8 * len(ids), (Counting.decoded, len(ids))    # whole decodes: ~len(ids)^2 / 2


def lone_bytes(tok: Tokenizer) -> list[int]:
    """The bundled tokenizer's single-byte tokens that are no character alone (UTF-8 lead and continuation bytes)."""
    return [i for i in range(tok.get_vocab_size()) if tok.decode([i]) == "\ufffd"]


def test_lone_utf8_bytes_cost_a_short_decode_and_stream_exactly():
    """A model emitting bytes that never make a character (an untrained or unlucky one): the text ends in U+FFFD
    after every token, yet each token still costs a short decode (it grew with the output: 0.5 ms a token at
    3200 tokens), and the stream equals whole decodes, also where a real character follows the junk."""
    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json"))
    bad, rng = lone_bytes(tok), random.Random(1)
    assert len(bad) > 60
    junk = [bad[j % 7] for j in range(1500)]               # continuation bytes 0xA1..0xA7: never a character

    class Counting:
        decoded, decoder = 0, tok.decoder

        def decode(self, ids):
            Counting.decoded += len(ids)
            return tok.decode(ids)
    s = TextStream(Counting(), ["never appears"])
    text = "".join(s.add([t])[0] for t in junk) + s.flush()
    assert text == tok.decode(junk)
    assert Counting.decoded <= 24 * len(junk), (Counting.decoded, len(junk))     # was ~len(junk)^2 / 2
    cjk = tok.encode("中文 😀 x").ids
    for i in range(60):                                    # junk runs cut into characters split across tokens
        ids = [bad[rng.randrange(len(bad))] for _ in range(rng.randrange(0, 40))] + cjk
        ids = ids[rng.randrange(len(ids)):] + ids
        stop = [[], ["😀"], ["\ufffd"]][i % 3]
        assert stream(tok, ids, stop) == reference(tok, ids, stop), (i, ids, stop)


def test_a_stop_string_longer_than_the_text_so_far_is_never_half_emitted():
    class Chars:                                           # one character a token
        def decode(self, ids):
            return "".join(map(chr, ids))
    s = TextStream(Chars(), ["qabzzz"])
    out = [s.add([ord(c)]) for c in "qabzzz"]
    assert "".join(d for d, _ in out) == "" and out[-1][1]    # was "q": text[:len - hold] went negative


@pytest.mark.parametrize("kind", ["bundled", "metaspace"])
def test_a_round_of_tokens_is_taken_as_one_token_at_a_time_would_be(kind):
    """GenRequest.take detokenizes a round's tokens together and replays them one by one only when a stop string
    ends them: tokens taken, text, finish reason and the EOS it records equal those of taking the same tokens one
    at a time (EOS, stop strings inside and across tokens, max_tokens, the stop string after an EOS in a round)."""
    from gateway.request import GenRequest
    from tandem.v1 import rows_pb2
    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json")) if kind == "bundled" else metaspace()
    rng, vocab, eos = random.Random(1), tok.get_vocab_size(), {3}
    stopped_mid_round = 0
    for case in range(120):
        ids = ([t for t in tok.encode(TEXTS[case % len(TEXTS)]).ids] if kind == "bundled" and case < 10 else
               [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))])
        if case % 7 == 0:
            ids.insert(rng.randrange(len(ids) + 1), 3)                     # an EOS somewhere
        stop = [[], ["\n"], ["return", "😀"], ["zz", "  "], ["é"], ["lo", "b"]][case % 6]
        max_tokens = rng.randrange(5, 70)
        reqs = [GenRequest(f"r{case}-{i}", [1], max_tokens, rows_pb2.SamplingParams(), TextStream(tok, stop))
                for i in range(2)]
        got = []
        for r, rounds in zip(reqs, ([[t] for t in ids], None)):
            if rounds is None:                                              # rounds of 1..5 tokens
                rounds, at = [], 0
                while at < len(ids):
                    n = rng.randrange(1, 6)
                    rounds.append(ids[at:at + n])
                    at += n
            taken, text, finish = [], "", None
            for chunk in rounds:
                new, delta, finish = r.take(chunk, None, eos)
                taken, text = taken + new, text + delta
                if finish:
                    stopped_mid_round += finish == "stop" and len(new) < len(chunk) - (3 in chunk)
                    break
            got.append((taken, text, finish, r.eos, r.output_ids))
        assert got[1] == got[0], (case, stop)
    assert stopped_mid_round > 5                                            # the replay path ran
