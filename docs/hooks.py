"""Build-time helpers for the docs site: an mkdocs hook and a Griffe extension.

mkdocs hook (``hooks:`` in mkdocs.yml): render the Sphinx roles kvquant's
docstrings use as links.

kvquant's docstrings are Google style, but cross-references inside them are
written as Sphinx roles (``:class:`~kvquant.errors.ScaleFormatError```,
``:func:`resolve_scales```). mkdocstrings' Google parser leaves those as text
(``:class:<code>...</code>``). This hook turns every such role into an
optional autorefs link (resolved against the API pages, plain code when the
target is not documented) and drops the ``.. code-block::`` lines that precede
indented code.

Griffe extension (:class:`RstSimpleTables`, ``extensions:`` of the mkdocstrings
handler): rewrite reST "simple tables" (``====  ====`` borders) in docstrings as
Markdown tables before they are rendered.

Both run at build time only; kvquant never imports this file.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):<code>(?P<target>[^<]+)</code>"
)
_CODE_BLOCK_DIRECTIVE = re.compile(r"<p>\.\. code-block::[^<]*</p>\s*")
_ANCHOR = re.compile(r'id="(?P<id>kvquant(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"')

_ids: set[str] = set()
_page_ids: dict[str, set[str]] = {}


def _resolve(name: str, local: set[str]) -> str | None:
    """The documented object id a (possibly short) role target names, if unique."""
    if name in _ids:
        return name
    suffix = "." + name
    for pool in (local, _ids):
        hits = sorted(i for i in pool if i.endswith(suffix))
        if len(hits) == 1:
            return hits[0]
    return None


def _rewrite(html: str, page_key: str) -> str:
    local = _page_ids.get(page_key, set())

    def link(match: re.Match[str]) -> str:
        written = match["target"].strip()
        short = written.startswith("~")
        name = written.lstrip("~").rstrip("()")
        title = name.rsplit(".", 1)[-1] if short else name
        target = _resolve(name, local)
        if target is None:
            return f"<code>{title}</code>"
        return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'

    html = _CODE_BLOCK_DIRECTIVE.sub("", html)
    return _ROLE.sub(link, html)


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Collect the ids of documented objects on each page."""
    found = {m["id"] for m in _ANCHOR.finditer(html)}
    _ids.update(found)
    _page_ids[page.file.src_uri] = found
    return html


def on_env(env: Any, config: Any, files: Any, **kwargs: Any) -> Any:
    """Rewrite the roles once every page's ids are known (before autorefs resolves links)."""
    for file in files.documentation_pages():
        page = file.page
        if page is not None and page.content:
            page.content = _rewrite(page.content, file.src_uri)
    return env


_BORDER = re.compile(r"^(?P<indent>\s*)=+(?: +=+)+\s*$")


def _columns(border: str) -> list[int]:
    return [m.start() for m in re.finditer(r"=+", border)]


def _cells(line: str, starts: list[int]) -> list[str]:
    text = line.strip()
    parts = re.split(r"\s{2,}", text, maxsplit=len(starts) - 1)
    if len(parts) == len(starts) and not line[: starts[0]].strip():
        return [p.strip() for p in parts]
    ends = [*starts[1:], None]
    return [line[a:b].strip() for a, b in zip(starts, ends, strict=True)]


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def rst_simple_tables_to_markdown(text: str) -> str:
    """Rewrite every reST simple table (border, header, border, rows, border) as a Markdown table."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        top = _BORDER.match(lines[i])
        if top is None or i + 2 >= len(lines) or not _BORDER.match(lines[i + 2]):
            out.append(lines[i])
            i += 1
            continue
        end = next((j for j in range(i + 3, len(lines)) if _BORDER.match(lines[j])), None)
        if end is None:
            out.append(lines[i])
            i += 1
            continue
        starts = _columns(lines[i])
        indent = top["indent"]
        header = _cells(lines[i + 1], starts)
        rows: list[list[str]] = []
        for line in lines[i + 3 : end]:
            if not line.strip():
                continue
            cells = _cells(line, starts)
            if rows and not cells[0]:  # continuation line: extends the cells above
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
            else:
                rows.append(cells)
        out.append(indent + "| " + " | ".join(_md_cell(c) for c in header) + " |")
        out.append(indent + "|" + "---|" * len(header))
        out.extend(indent + "| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows)
        i = end + 1
    return "\n".join(out)


class RstSimpleTables(griffe.Extension):
    """Griffe extension: reST simple tables in docstrings become Markdown tables."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the tables of one object's docstring (modules, classes, functions)."""
        if obj.docstring is not None and "==" in obj.docstring.value:
            obj.docstring.value = rst_simple_tables_to_markdown(obj.docstring.value)
