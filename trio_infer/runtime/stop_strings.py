"""Stop strings: cut generated text at the first stop string. Pure: no trio, no I/O.

Text arrives in pieces (one detokenizer delta per engine step), and a stop string can straddle
pieces: ``"Hel"`` then ``"lo"`` for the stop ``"llo"``. A streaming server must therefore hold back
any tail of the text that could still become a stop string, and release it only once it cannot:
either the next piece breaks the match (the tail is released) or completes it (the tail, and
everything after, is dropped). The held-back tail is shorter than the longest stop string, so the
memory per request is bounded.

As in the OpenAI API, the stop string itself is not part of the output (unless ``include``:
vLLM's ``include_stop_str_in_output``, then the text ends with it). When several stop strings
match, the one that is complete first (at the earliest end position) cuts the text.
"""

from __future__ import annotations

from typing import Iterable


class StopStringMatcher:
    """Feed text pieces; get back the text that is safe to emit, and whether a stop was hit."""

    def __init__(self, stop: Iterable[str] = (), include: bool = False) -> None:
        self._include = include
        self._stops = tuple(dict.fromkeys(s for s in stop))  # ordered, de-duplicated
        if any(not s for s in self._stops):
            raise ValueError("stop strings must not be empty")
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

    def feed(self, text: str) -> str:
        """Add a piece of text; return what can be emitted now.

        After a stop string has been found, ``stopped`` is True and every later call returns "".
        """
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        # The stop string that *completes* first wins (ties: the one starting first), which makes
        # the result independent of how the text was split into pieces. The held tail is shorter
        # than any stop string, so nothing already emitted can be part of a match.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.stopped = True
            self.matched = best[2]
            self._held = ""
            return buf[: best[0] if self._include else best[1]]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The text has ended without a stop string: release the held tail."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
