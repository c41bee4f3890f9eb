"""One plain-text table renderer for every kvquant report (doctor, export, calibrate, eval).

Tables are laid out by `rich <https://rich.readthedocs.io>`_ without colour or
box characters, so the text is the same on a terminal, in a pipe and in a log
file, and fits in the width asked for: columns named in ``wrap`` fold their
long cells onto further lines instead of widening the table. The command line
lays its reports out for the terminal (:func:`output_width`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Collection, Sequence
from typing import TextIO

__all__ = ["MIN_WIDTH", "WIDTH", "output_width", "render_table"]

WIDTH = 100
"""The widest a report is laid out (and its width when the output is no terminal)."""

MIN_WIDTH = 60
"""The narrowest a report is laid out, however narrow the terminal."""


def output_width(stream: TextIO) -> int:
    """The columns to lay a report out for when printing it to ``stream``.

    rich's detection decides: the ``COLUMNS`` environment variable, else the size of
    the terminal. Output that goes to no terminal (a pipe, a file) without
    ``COLUMNS`` is laid out for :data:`WIDTH`. The result is kept within
    :data:`MIN_WIDTH` .. :data:`WIDTH`: wider lines are harder to read.

    Args:
        stream: where the report will be printed (``sys.stdout``).

    Returns:
        A width in columns.
    """
    from rich.console import Console

    console = Console(file=stream)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        return WIDTH
    return max(MIN_WIDTH, min(console.width, WIDTH))


def render_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    wrap: Collection[str] = (),
    right: Collection[str] = (),
    width: int = WIDTH,
) -> str:
    """Lay out ``rows`` under ``header`` as aligned plain text.

    Args:
        header: column titles.
        rows: one sequence of cell strings per row (as many cells as titles).
        wrap: titles of the columns whose long cells wrap onto further lines
            (the others keep their cells on one line; only if those alone are
            wider than ``width`` are they cut, with an ellipsis).
        right: titles of right-aligned columns (numbers).
        width: the widest a line may be.

    Returns:
        The table, one line per row (more where a ``wrap`` cell wraps), no
        trailing spaces; a dashed line under the header.

    Raises:
        ValueError: a row with another number of cells than ``header``.

    Example:
        >>> print(render_table(["layer", "scale"], [["0", "0.02"], ["1", "0.5"]], right={"scale"}))
        layer  scale
        ------ -----
        0       0.02
        1        0.5
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        box=box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True),
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        collapse_padding=True,
        expand=False,
        highlight=False,
    )
    for title in header:
        wraps = title in wrap
        table.add_column(
            title,
            justify="right" if title in right else "left",
            no_wrap=not wraps,
            overflow="fold" if wraps else "ellipsis",
            min_width=min(len(title), 12) if wraps else None,
        )
    for row in rows:
        if len(row) != len(header):
            raise ValueError(
                f"render_table: a row has {len(row)} cells but the header {len(header)}; "
                "expected one cell per column."
            )
        table.add_row(*row)
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        legacy_windows=False,
        highlight=False,
        emoji=False,
        markup=False,
        soft_wrap=False,
    )
    console.print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())
