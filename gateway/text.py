"""Incremental detokenization with stop strings: emit only text that can no longer change."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0                          # characters already emitted
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """Append token ids -> (new text safe to emit, whether a stop string ended the text)."""
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        hits = [i for i in (text.find(s, max(0, self.sent - self.hold)) for s in self.stop) if i >= 0]
        if hits:
            return self._emit(text[: min(hits)]), True
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":   # an unfinished UTF-8 sequence
            safe -= 1
        return self._emit(text[:safe]), False

    def flush(self) -> str:
        """The held-back tail, once the request ends for another reason."""
        return self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
