"""Token ids to the text a client sees: UTF-8-safe increments, EOS dropped, stop strings matched on the text."""

from __future__ import annotations

from k26jax.tokenizer import StreamDecoder, Tokenizer


class TextStream:
    """Feed tokens one at a time; each call returns the text that may be sent now.

    A multi-byte character split across tokens waits until it is whole (`StreamDecoder`). Stop strings are
    matched on the decoded text: the longest tail that could still begin a stop string is held back, and when
    one matches, the text before it is returned and `stopped` is set (the stop string itself is never sent).
    """

    def __init__(self, tokenizer: Tokenizer, stops=(), hidden_ids=()):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = [s for s in stops if s]
        self.hidden = set(hidden_ids)
        self.held = ""
        self.stopped = False

    def feed(self, token: int) -> str:
        if self.stopped:
            return ""
        return self._release(self.held + ("" if token in self.hidden else self.decoder.feed([token])))

    def finish(self) -> str:
        """The rest, once generation ended without a stop string."""
        if self.stopped:
            return ""
        text, self.held = self.held + self.decoder.flush(), ""
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return text[:cut]
        return text

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _release(self, text: str) -> str:
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = self._partial_stop(text)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def _partial_stop(self, text: str) -> int:
        """The length of the longest tail of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
