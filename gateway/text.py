"""Incremental detokenization with stop strings: emit only text that can no longer change.

Each token costs a decode of a short window, not of the whole output (which made a request's text O(n^2) in
its length: at batch 32 the gateway spent most of a round re-decoding outputs). The window starts at `prefix`,
a token boundary at which the text before it was complete; decoding from there gives the new tokens the
context a tokenizer may need (a leading space a decoder strips at the start, a multi-byte character cut
between tokens), and the new text is what the window's decode adds to the decode of its already-read part.
Text is made stable (appended to `done`) only when it does not end in U+FFFD (an unfinished UTF-8 sequence).
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0                          # characters already emitted
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.done = ""                         # the text of ids[:read], final
        self.prefix = self.read = 0            # the window ids[prefix:] is decoded; ids[prefix:read] already read
        self._read_text: str | None = ""       # decode(ids[prefix:read]), once computed

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
        return self.done + new

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
        hits = [i for i in (text.find(s, max(0, self.sent - self.hold)) for s in self.stop) if i >= 0]
        if hits:
            return self._emit(text[: min(hits)]), True
        safe = max(0, len(text) - self.hold)   # (a text shorter than the hold emits nothing yet)
        while safe > self.sent and text[safe - 1] == "\ufffd":   # an unfinished UTF-8 sequence
            safe -= 1
        return self._emit(text[:safe]), False

    def flush(self) -> str:
        """The held-back tail, once the request ends for another reason."""
        return self._emit(self.text())

    def _emit(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
