"""Regexes matched in linear time (RE2), for every pattern a user hands the engine.

Recipe path regexes arrive over the network and model rules name module paths: a backtracking
engine lets one pattern like ``(a+)+$`` stall a worker for minutes. RE2 cannot backtrack, so it
refuses backreferences and lookaround, and counted repetitions over 1000 (nested ones multiplied);
the error names what RE2 found and the advice that fits it.
"""

from __future__ import annotations

import functools
from typing import Any

import re2


@functools.lru_cache(maxsize=1024)
def compile(pattern: str, field: str) -> Any:
    """``pattern`` compiled by RE2 (cached); ``field`` names it in the error ("path_regex").

    Raises:
      TypeError: ``pattern`` is not a str.
      ValueError: not a regex RE2 accepts; the message names what to change.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"{field} must be a str regex, got {type(pattern).__name__}.")
    options = re2.Options()
    options.log_errors = False  # the ValueError says it; RE2 would also print to stderr
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        detail = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(
            f"{field} {pattern!r} is not a valid regex ({detail}); {_advice(detail, field)}"
        ) from None


def _advice(detail: str, field: str) -> str:
    """What to do about RE2's error `detail`."""
    escape = detail.removeprefix("invalid escape sequence: \\")
    if detail.startswith("invalid perl operator") or (escape != detail and escape[:1].isdigit()):
        return (
            f"{field} is matched in linear time (RE2), so backreferences (\\1), lookahead and "
            "lookbehind ((?=, (?!, (?<=, (?<!) are refused: rewrite the pattern without them."
        )
    if detail.startswith("invalid repetition size"):
        return (
            "RE2 allows a counted repetition ({n}, {n,m}) of at most 1000, nested ones "
            "multiplied together (a{100} inside b{100} counts 10000): use smaller counts, or + "
            "and * where the exact count does not matter."
        )
    if detail.startswith("pattern too large"):
        return (
            "the compiled pattern is over RE2's size budget: make it shorter or its counted "
            "repetitions smaller."
        )
    return (
        f"fix what RE2 names; {field} takes Python's regex syntax without backreferences and "
        "lookaround (it is matched in linear time, RE2)."
    )
