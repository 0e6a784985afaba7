"""Error types, and how an error line shows a value. Every error a user can cause is a DraftsmithError whose
message is one clear line; the CLI prints it without a traceback. A value from outside appears in that line
one way everywhere: `show` (its repr, cut short) and `json_kind` (its type, as JSON spells it)."""

from __future__ import annotations

import reprlib
from typing import Any

MAX_SHOWN = 120  # characters of a value an error line shows


class DraftsmithError(Exception):
    """Base class for errors caused by input, configuration or environment (not by a bug)."""


class ConfigError(DraftsmithError):
    """A configuration value is missing, unknown or out of range."""


class TargetError(DraftsmithError):
    """A target cannot be found, installed or loaded."""


class FingerprintMismatch(DraftsmithError):
    """An artifact or dataset was made for a different target than the one given."""


class DataError(DraftsmithError):
    """Input data is malformed or empty."""


class TrainingError(DraftsmithError):
    """Training cannot continue (e.g. too many non-finite losses in a row)."""


class ArtifactError(DraftsmithError):
    """An artifact directory is missing files or is of the wrong kind."""


class OutputError(DraftsmithError):
    """An output path holds something draftsmith did not write (or of another kind): it is not replaced."""


class IntegrityError(ArtifactError):
    """A file's content differs from the checksum its manifest recorded when it was written."""


class FileFormatError(DraftsmithError, ValueError):
    """A file draftsmith reads is not in its format (not UTF-8, not JSON); the message names the file."""


class MissingFile(DraftsmithError, FileNotFoundError):
    """A file draftsmith must read is not there (or is a symlink to nothing); the message names it. Still a
    FileNotFoundError, for callers for which a missing file means "not written yet"."""


def show(value: Any) -> str:
    """A value for an error line: its repr cut to MAX_SHOWN characters (then "..."), never walked whole (a
    nested list from YAML aliases would print hundreds of MB). fleet/traffic_record.py keeps a copy of this
    rule: fleet/ imports no draftsmith module."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxtuple, r.maxstring, r.maxother = 3, 8, 8, 8, MAX_SHOWN, 60
    text = r.repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def json_kind(value: Any) -> str:
    """A value's type as the JSON (or YAML) it was read from spells it — `null`, `a boolean`, `a number (3)`,
    `text`, `a list`, `an object` — for the error line of a field that holds the wrong type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({show(value)})"
    return {str: "text", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
