"""How a report's table writes a measured value, so every report reads alike: `–` where nothing was
measured, `yes`/`NO` for a check (a failed one stands out), a format spec for a number; and how outside text
(a domain or category from a prompt file, a model name from /metrics, a proposer's path) enters Markdown: one
cell escaper, `md_cell`, that every Markdown table writer uses, so no text can forge a row or a column."""

from __future__ import annotations

import re
import unicodedata


def fmt_num(v, spec: str = ".3f") -> str:
    """`v` written with `spec` (".3f", ".1f", ...); None or anything not a number as `–`; a bool as yes/NO."""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int | float):
        return format(v, spec)
    return "–"


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
        return "–"
    text = value if isinstance(value, str) else str(value)
    return text if _PLAIN.fullmatch(text) else "".join(_escape(ch) for ch in text)


def md_row(*cells) -> str:
    """One Markdown table row, every cell through `md_cell`."""
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"
