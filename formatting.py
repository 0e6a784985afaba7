"""How a report's table writes a measured value, so every report reads alike (evaluate's report.md and
printed line, alpha's table, the model card, the sweep, serve-check, the benchmark tables): one formatter,
`fmt_num` — `–` where nothing was measured, `yes`/`NO` for a check (a failed one stands out), a count whole, a
format spec for any other number, a list as its first values; and how outside text (a domain or category from
a prompt file, a model name from /metrics, a proposer's path) enters Markdown: one cell escaper, `md_cell`,
that every Markdown table writer uses, so no text can forge a row or a column."""

from __future__ import annotations

import re
import unicodedata

NO_VALUE = "–"  # what a table writes where nothing was measured (an en dash, in every table)
LIST_SHOWN = 8  # values of a list a cell shows before "…"


def fmt_num(v, spec: str = ".3f") -> str:
    """`v` as a table cell: a float written with `spec` (".3f", ".2f", ...), an int whole (a count: prompts,
    tokens, k), a bool as yes/NO, None as `–`, a list as its first LIST_SHOWN values (`[0.812, 0.600, …]`), and
    anything else (a route, a proposer's name) as text through `md_cell`."""
    if v is None:
        return NO_VALUE
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format(v, spec)
    if isinstance(v, list | tuple):
        more = ", …" if len(v) > LIST_SHOWN else ""
        return "[" + ", ".join(fmt_num(x, spec) for x in v[:LIST_SHOWN]) + more + "]"
    return md_cell(v)


# printable ASCII that means nothing to a Markdown table: the common case, returned as it is
_PLAIN = re.compile(r"[ !-;=-\[\]-{}~]*")
# `|` ends a cell and `\` escapes the next character (a cell ending in `\` would swallow the `|` after it);
# `<` opens HTML (`<!--` hides every row after it); a line break ends the row
_MARKDOWN = {"|": "\\|", "\\": "\\\\", "<": "&lt;", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# controls (NUL, ESC, ...), format characters (the bidi overrides U+202A-U+202E and isolates U+2066-U+2069,
# zero-width ones), line and paragraph separators, lone surrogates: shown as escapes, never written raw
_HIDDEN = ("Cc", "Cf", "Zl", "Zp", "Cs")


def _escape(ch: str) -> str:
    if ch in _MARKDOWN:
        return _MARKDOWN[ch]
    if unicodedata.category(ch) in _HIDDEN:
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
    return ch


def md_cell(value) -> str:
    """`value` as the text of one Markdown table cell (or any inline Markdown: a heading, a list item): None
    as `–`, anything else as its str with every character that could end the cell or the row, open HTML, or
    reorder or hide what is shown escaped visibly (`\\|`, `\\n`, `\\u202e`). Markdown's own emphasis and code
    spans are left alone: they cannot cross a cell."""
    if value is None:
        return NO_VALUE
    text = value if isinstance(value, str) else str(value)
    return text if _PLAIN.fullmatch(text) else "".join(_escape(ch) for ch in text)


def md_row(*cells) -> str:
    """One Markdown table row, every cell through `md_cell`."""
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"
