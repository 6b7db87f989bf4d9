"""Incremental detokenization with stop strings.

The generated ids are decoded as a whole each step (tokenizers merge bytes across
tokens, so decoding token by token is wrong for byte-level BPE); the text already
streamed is subtracted. Text that may still be the beginning of a stop string, or
ends in an incomplete UTF-8 character (U+FFFD), is held back until it is settled."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["Detokenizer"]


class Detokenizer:
    """Per-request text state: ``push(ids)`` returns ``(new_text, hit_stop)``."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.text = ""       # settled text (stop strings cut off)
        self.emitted = 0     # chars of self.text already streamed

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def push(self, ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        """All generated ids so far; returns the text to stream now and whether a stop
        string was found (the text then ends right before it)."""
        full = self._decode(ids)
        hit = False
        if self.stop:
            cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                full, hit, final = full[:cut], True, True
        settled = len(full)
        if not final:
            if full.endswith("\ufffd"):
                settled = len(full.rstrip("\ufffd"))
            for s in self.stop:  # hold back a suffix that could grow into a stop string
                for k in range(min(len(s) - 1, settled), 0, -1):
                    if full[:settled].endswith(s[:k]):
                        settled -= k
                        break
        self.text = full
        new = full[self.emitted:max(settled, self.emitted)]
        self.emitted = max(settled, self.emitted)
        return new, hit
