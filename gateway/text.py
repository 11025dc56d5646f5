"""Incremental detokenization with stop strings: emit only text that can no longer change.

Each token costs a decode of a short window, not of the whole output (which made a request's text O(n^2) in
its length: at batch 32 the gateway spent most of a round re-decoding outputs). The window starts at `prefix`,
a token boundary at which the text before it was complete; decoding from there gives the new tokens the
context a tokenizer may need (a leading space a decoder strips at the start, a multi-byte character cut
between tokens), and the new text is what the window's decode adds to the decode of its already-read part.
Text is made stable (appended to `done`) when it does not end in U+FFFD (an unfinished UTF-8 sequence), or,
with a byte-level decoder (DeepSeek's, the bundled model's: bytes joined, then decoded as UTF-8 with
replacement, so a character's bytes decide it alone), while it does, up to a token boundary that no character
spans (the window's decode is the decode of the tokens before it plus that of the tokens after) with UTF8_MAX
tokens that carry text after it: a character is at most 4 bytes, so no later byte can change the text before
it. A model emitting lone UTF-8 bytes would otherwise grow the window, and each token's decode, without bound.
(A byte-fallback decoder turns a whole run of byte tokens into U+FFFD when any of it is not UTF-8: no boundary
inside the run is final, so there the window grows as before.)
"""
from __future__ import annotations

from tokenizers import decoders

UTF8_MAX = 4                                   # bytes in the longest UTF-8 character


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0                          # characters already emitted
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.matched: str | None = None        # the stop string that ended the text (vLLM's stop_reason)
        self.done = ""                         # the text of ids[:read], final
        self.prefix = self.read = 0            # the window ids[prefix:] is decoded; ids[prefix:read] already read
        self._read_text: str | None = ""       # decode(ids[prefix:read]), once computed
        self._local = isinstance(getattr(tokenizer, "decoder", None), decoders.ByteLevel)

    def text(self) -> str:
        """The text of all ids so far (its tail may still change while it ends in U+FFFD)."""
        if self._read_text is None:
            self._read_text = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        new = window[len(self._read_text):] if window.startswith(self._read_text) else None
        if new is None:                        # the window's decode rewrote its read part: decode it all
            return self._restart()
        if new and not new.endswith("\ufffd"):
            self.done += new
            self.prefix, self.read, self._read_text = self.read, len(self.ids), None
            return self.done
        cut = self._final_cut() if self._local else None
        if cut is not None:                    # still unfinished: UTF8_MAX byte-carrying tokens back, it is not
            part, rest = self.tokenizer.decode(self.ids[self.prefix:cut]), self.tokenizer.decode(self.ids[cut:])
            if part + rest == window and part.startswith(self._read_text):    # no character spans the cut
                self.done += part[len(self._read_text):]
                self.prefix = self.read = cut
                self._read_text = ""
                return self.done + rest
        return self.done + new

    def _final_cut(self) -> int | None:
        """The index after which UTF8_MAX tokens carry text (a token that decodes to "" alone may carry no
        byte), if it is past `read`: the text of the tokens before it is final. None otherwise."""
        seen = 0
        for j in range(len(self.ids) - 1, self.read, -1):
            seen += self.tokenizer.decode([self.ids[j]]) != ""
            if seen == UTF8_MAX:
                return j
        return None

    def _restart(self) -> str:
        """A tokenizer whose decode of a window is not the whole decode's tail: decode everything once more,
        and make that the stable text (the next window starts one token back, for context)."""
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            n = len(self.ids)
            self.done, self.prefix, self.read, self._read_text = text, max(0, n - 1), n, None
        return text

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """Append token ids -> (new text safe to emit, whether a stop string ended the text)."""
        self.ids += ids
        text = self.text()
        hits = [(i, s) for s in self.stop if (i := text.find(s, max(0, self.sent - self.hold))) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            return self._emit(text[:at]), True
        # the hold counts characters: an unfinished UTF-8 sequence's placeholder at the end is none yet (counted,
        # it let a character that starts a multi-byte stop string out: stop "ü ü" emitted "ü")
        safe = max(0, len(text.rstrip("\ufffd")) - self.hold)  # (a text shorter than the hold emits nothing yet)
        if safe > self.sent:                   # not up to an unfinished UTF-8 sequence (nor a run of junk bytes)
            safe = max(self.sent, len(text[:safe].rstrip("\ufffd")))
        return self._emit(text[:safe]), False

    def mark(self) -> tuple:
        """The stream's state, for `restore`: add() only appends ids and advances these."""
        return len(self.ids), self.sent, self.done, self.prefix, self.read, self._read_text

    def restore(self, mark: tuple) -> None:
        n, self.sent, self.done, self.prefix, self.read, self._read_text = mark
        del self.ids[n:]

    def flush(self) -> str:
        """The held-back tail, once the request ends for another reason."""
        return self._emit(self.text())

    def _emit(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
