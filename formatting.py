"""How a report's table writes a measured value, so every report reads alike: `–` where nothing was
measured, `yes`/`NO` for a check (a failed one stands out), a format spec for a number."""

from __future__ import annotations


def fmt_num(v, spec: str = ".3f") -> str:
    """`v` written with `spec` (".3f", ".1f", ...); None or anything not a number as `–`; a bool as yes/NO."""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int | float):
        return format(v, spec)
    return "–"
