"""Regexes matched in linear time (RE2), for every pattern a user hands the engine.

Recipe path regexes arrive over the network and model rules name module paths: a backtracking
engine lets one pattern like ``(a+)+$`` stall a worker for minutes. RE2 cannot backtrack, so it
refuses backreferences and lookaround; the error says so and what to do instead.
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
            f"{field} {pattern!r} is not a valid regex ({detail}); {field} is matched in linear "
            "time (RE2), so backreferences (\\1), lookahead and lookbehind ((?=, (?!, (?<=, (?<!) "
            "are refused: rewrite the pattern without them."
        ) from None
