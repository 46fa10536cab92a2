"""Stop strings: cut at the first stop string, hold back partial matches, any split of the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_infer.runtime.stop_strings import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut at the stop string that is complete first (ties: the one starting first)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return (text, False) if best is None else (text[: best[1]], True)


def run(pieces: list[str], stops: list[str]) -> tuple[list[str], bool, int]:
    m = StopStringMatcher(stops)
    out, most_held = [], 0
    for p in pieces:
        out.append(m.feed(p))
        most_held = max(most_held, len(m.held))
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped, most_held


def test_cuts_at_the_stop_string_and_drops_it() -> None:
    m = StopStringMatcher(["world", "zzz"])
    assert m.feed("Hello wor") + m.feed("ld! Bye") == "Hello "
    assert m.stopped and m.matched == "world"


def test_holds_back_a_partial_match_until_it_breaks() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "  # "ST" might be the start of "STOP"
    assert m.held == "ST"
    assert m.feed("ay") == "STay"  # it was not
    assert m.feed("S") == "" and m.feed("TO") == "" and m.feed("P tail") == ""
    assert m.stopped


def test_flush_releases_the_held_tail_when_the_text_ends() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.feed("line\n") == "line"
    assert m.flush() == "\n"


def test_no_stop_strings_passes_text_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_output_after_a_stop_is_dropped() -> None:
    m = StopStringMatcher(["x"])
    assert m.feed("ax") == "a"
    assert m.feed("more") == "" and m.flush() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_any_split_gives_the_same_result_as_the_whole_text(text, stops, cuts) -> None:
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped, most_held = run(pieces, stops)
    assert ("".join(out), stopped) == reference(text, stops)
    # Memory per request stays bounded: less held back than the longest stop string.
    assert most_held < max(map(len, stops))
