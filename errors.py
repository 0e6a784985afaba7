"""Error types. Every error a user can cause is a DraftsmithError whose message is one clear line;
the CLI prints it without a traceback."""


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
