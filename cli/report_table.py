"""Tables of tensor paths that fit the console without splitting a word.

A tensor path (`model.layers.1.mlp.gate_proj.weight/array/qvalue`) has no spaces, so a terminal
table can only fold it somewhere. Folding at a fixed column cut names in two (`gate_proj.we` /
`ight`), which a reader then cannot search for. Here every other column keeps its natural width
and the path column takes what is left of the console's width; a path wider than that is either
elided in the middle at a separator (`model.layers.1.….gate_proj.weight`: the start and the
tensor's own name stay, and never a part that tells the path from another row's), or, where
every path must be whole (`--table full`, a plan, `inspect`), broken onto more lines after a `.`
or `/`. Only a single name wider than the whole column is cut inside itself.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table

ELLIPSIS = "…"
MIN_PATH_WIDTH = 16  # below this a narrow terminal wraps the table instead
_SEPARATED = re.compile(r"[^./]+[./]?|[./]")  # a name and the separator after it


def _pieces(path: str) -> list[str]:
    return _SEPARATED.findall(path)


def elide(path: str, width: int, others: Sequence[str] = ()) -> str:
    """`path` in at most `width` characters, the fewest whole pieces of its middle replaced by
    `…` (its root and its last name stay). Only a name wider than `width` is cut.

    What remains must tell `path` from every one of `others` (the table's other paths): a
    middle whose removal leaves a start and an end that another path also has (`layer.0` /
    `layer.1`: the part that tells rows apart) is not elided; when no elision is unambiguous,
    the path is wrapped whole onto more lines instead.
    """
    if len(path) <= width:
        return path
    budget = width - len(ELLIPSIS)
    pieces = _pieces(path)
    lengths = [len(p) for p in pieces]
    excess = len(path) - budget
    centre = (len(pieces) - 1) / 2
    others = [o for o in others if o != path]

    def unambiguous(head: str, tail: str) -> bool:
        return not any(
            o.startswith(head) and o.endswith(tail) and len(o) > len(head) + len(tail)
            for o in others
        )

    fits = False
    for k in range(1, len(pieces) - 1):  # the fewest pieces dropped, never the first or last
        windows = [i for i in range(1, len(pieces) - k) if sum(lengths[i : i + k]) >= excess]
        # Of those, the one that drops the fewest characters, then the most central.
        windows.sort(key=lambda i: (sum(lengths[i : i + k]), abs(i + (k - 1) / 2 - centre)))
        for i in windows:
            head, tail = "".join(pieces[:i]), "".join(pieces[i + k :])
            if unambiguous(head, tail):
                return head + ELLIPSIS + tail
        fits = fits or bool(windows)
    if fits:  # every elision that fits drops what tells this path from another
        return wrap(path, width)
    # Even root + last name are too wide: cut inside, keeping both ends of the path.
    return path[: budget // 2] + ELLIPSIS + path[len(path) - (budget - budget // 2) :]


def wrap(path: str, width: int) -> str:
    """`path` on as many lines of at most `width` characters as it needs, broken after a `.` or
    `/`; only a piece wider than `width` is cut inside itself."""
    lines: list[str] = [""]
    for piece in _pieces(path):
        while len(piece) > width:  # a name wider than the column: the only forced cut
            if lines[-1]:
                lines.append("")
            lines[-1], piece = piece[:width], piece[width:]
            lines.append("")
        if len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(line for line in lines if line)


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    justify: str = "left"


@dataclasses.dataclass(frozen=True)
class PathTable:
    """A table whose first column is a tensor path, fitted to the width it is printed at.

    `whole` keeps every path whole (wrapped at separators); otherwise long paths are elided in
    the middle so that each row takes one line. The other columns are never wrapped.
    """

    title: str
    columns: Sequence[Column]
    rows: Sequence[tuple[str, ...]]  # (path, *other cells)
    whole: bool = False
    box: box.Box | None = box.SIMPLE_HEAD
    pad_edge: bool = False

    def _path_width(self, width: int) -> int:
        others = [
            max([len(c.header)] + [len(r[i + 1]) for r in self.rows])
            for i, c in enumerate(self.columns)
        ]
        n = len(others) + 1
        # rich's layout: 1 column of padding on each side of a cell (not at the table's edges
        # without pad_edge), 1 per column divider, and 2 for the edges of a box.
        extra = 2 * n - (0 if self.pad_edge else 2) + (n - 1 + 2 if self.box else 0)
        return max(MIN_PATH_WIDTH, width - sum(others) - extra)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = self._path_width(options.max_width)
        longest = max([len("path")] + [len(r[0]) for r in self.rows])
        width = min(width, longest)
        table = Table(title=self.title, title_justify="left", box=self.box, pad_edge=self.pad_edge)
        table.add_column("path", width=width, no_wrap=True)
        for c in self.columns:
            table.add_column(c.header, justify=c.justify, no_wrap=True)  # type: ignore[arg-type]
        paths = [r[0] for r in self.rows]
        for path, *cells in self.rows:
            fitted = wrap(path, width) if self.whole else elide(path, width, paths)
            table.add_row(fitted, *cells)
        yield table
