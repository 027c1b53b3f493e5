"""Stop strings over streamed text, with OpenAI semantics: the output ends right *before* the stop
string that is completed first, which itself is not returned (unless `keep`: then the output ends
right after it, as vLLM's `include_stop_str_in_output` and SGLang's `no_stop_trim` do). "First
completed" (earliest end, then the longest of those) is what a token-by-token stream sees, so the
result does not depend on how the text was chunked: with stops ("a", "xaa") the text "xaa" stops
at "x".

Text arrives in chunks (one per detokenizer push), and a stop string may straddle chunks
("Obs" + "erv" + "ation:"). So the matcher holds back the longest tail of what it has seen that
is a proper prefix of some stop string: that tail is emitted only once the next chunk proves it
is not a stop. Every other character is emitted as soon as it arrives. Each feed searches only the
held tail plus the new chunk, so a stream costs O(total length × number of stops).

Until `min_new_tokens` is reached the caller feeds with `may_stop=False`: nothing can match yet,
but the tail that could start a stop is still held, so a stop that ends after the minimum is found
even when it began before it. A stop counts only if it ends in text fed with `may_stop=True`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopCheck(NamedTuple):
    text: str           # safe to emit now
    stop: str | None    # the stop string that ended the output, once one has


class StopMatcher:
    def __init__(self, stops: Sequence[str], keep: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = tuple(dict.fromkeys(stops))
        self.keep = keep
        self.matched: str | None = None
        self._held = ""
        self._held_quiet = 0   # leading characters of `_held` fed with may_stop=False

    def feed(self, chunk: str, may_stop: bool = True) -> StopCheck:
        """Take the next chunk; return the text that can be emitted and the stop, if one matched.

        After a match the output is over: later chunks return ("", stop).
        """
        if self.matched is not None:
            return StopCheck("", self.matched)
        text = self._held + chunk
        quiet = len(text) if not may_stop else self._held_quiet
        best: tuple[int, int] | None = None  # (end, start) of the first completed stop
        stop = None
        for s in self.stops if may_stop else ():
            # only a stop that ends past the quiet text: start > quiet - len(s)
            at = text.find(s, max(0, quiet - len(s) + 1), len(text) if best is None else best[0])
            if at >= 0 and (best is None or (at + len(s), at) < best):
                best, stop = (at + len(s), at), s
        if best is not None:
            self.matched, self._held, self._held_quiet = stop, "", 0
            return StopCheck(text[:best[0] if self.keep else best[1]], stop)
        cut = len(text) - self._open_prefix(text)
        self._held = text[cut:]
        self._held_quiet = max(0, quiet - cut)
        return StopCheck(text[:cut], None)

    def flush(self) -> str:
        """The stream ended without a stop: release the held tail."""
        held, self._held, self._held_quiet = self._held, "", 0
        return "" if self.matched is not None else held

    def _open_prefix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for size in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:size]):
                    best = size
                    break
        return best
