"""Prompt sources: jsonl files, Hugging Face `datasets`, code prompts from the Python standard library,
and requests the target writes itself (`type: magpie`, data/magpie.py).

Every source yields `PromptRow`s with a stable integer `row_id` (a hash of source name and row key, so
it survives reruns, reordering and changes to other sources), a `domain` label from the config, and an
`origin` ("file:line") used to report malformed rows. `load_prompts` reads all configured sources,
applies the malformed-row policy, and returns the rows with a report of what was dropped and why.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import random
import re
import string
import sysconfig
import textwrap
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.checksums import sha256_text
from draftsmith.data.config import DataConfig, SourceConfig
from draftsmith.errors import DataError, json_kind
from draftsmith.paths import data_path, open_data
from draftsmith.reading import TooMuch, bounded_lines, gzip_budget

log = logging.getLogger(__name__)


@dataclass
class PromptRow:
    """One prompt: the user turns the target will answer (one for single-turn rows)."""

    row_id: int
    source: str
    domain: str
    turns: list[str]
    origin: str  # "path:line" (or "path[index]" for HF datasets) — where to look when something is wrong
    system: str | None = None
    responses: list[str] | None = None  # the dataset's own assistant turns (ShareGPT / messages rows)
    # a row keyed by its content: the id its line number gave it before content keys (row packs and chunks written
    # then hold it; data/generate.py adopts such a row where it answered this very prompt)
    legacy_id: int | None = None

    @property
    def prompt(self) -> str:
        return "\n\n".join(self.turns)


@dataclass
class MalformedReport:
    """Rows dropped while loading, with where they came from and why."""

    policy: str = "skip"
    items: list[tuple[str, str]] = field(default_factory=list)  # (origin, reason)

    def add(self, origin: str, reason: str) -> None:
        if self.policy == "fail":
            raise DataError(f"{origin}: {reason}")
        self.items.append((origin, reason))

    def counts(self) -> dict[str, int]:
        return dict(Counter(_reason_kind(r) for _, r in self.items))

    def summary(self, show: int = 5) -> str:
        if not self.items:
            return "no malformed rows"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts().items(), key=lambda kv: -kv[1]))
        first = "; ".join(f"{o}: {r}" for o, r in self.items[:show])
        more = f" (+{len(self.items) - show} more)" if len(self.items) > show else ""
        return f"{len(self.items)} malformed rows skipped ({kinds}): {first}{more}"


def _reason_kind(reason: str) -> str:
    return reason.split(" (")[0].split(" '")[0]


def make_row_id(source: str, key: str) -> int:
    """Stable 60-bit id from (source name, row key): the same row gets the same id on every run."""
    return int(sha256_text(f"{source}\x00{key}")[:15], 16)


# --------------------------------------------------------------------------------------------- fields


_MISSING = object()


def get_field(row: Any, path: str) -> Any:
    """`a.b.0.c` indexes dicts by key and lists by position; _MISSING when any step is absent."""
    node = row
    for part in path.split("."):
        if isinstance(node, dict):
            if part not in node:
                return _MISSING
            node = node[part]
        elif isinstance(node, list | tuple) and re.fullmatch(r"-?\d+", part):
            i = int(part)
            if not -len(node) <= i < len(node):
                return _MISSING
            node = node[i]
        else:
            return _MISSING
    return node


class _FieldError(Exception):
    pass


def _text(value: Any, what: str) -> str:
    """`value` as stripped text (possibly empty: the caller says whether that is allowed); anything else, never
    turned into its string ("None", "123"), is a _FieldError naming `what`."""
    if not isinstance(value, str):
        raise _FieldError(f"{what} is not text (got {json_kind(value)})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, from a JSON "\ud800"-style escape
        raise _FieldError(f"not UTF-8 ({what} holds {value[e.start]!r} at character {e.start})") from None
    return value.strip()


ROLE_NAMES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant",
              "bot": "assistant", "model": "assistant", "system": "system"}


def _content(value: Any, i: int) -> str:
    """Message content: text, or OpenAI's list of parts when every part is text."""
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        value = "".join(p["text"] for p in value)
    return _text(value, f"message {i} content")


def extract_conversation(row: Any, field_name: str, sharegpt: bool, roles: dict[str, str] | None = None
                         ) -> tuple[str | None, list[str], list[str]]:
    """(system, user turns, assistant turns) of a ShareGPT `conversations` or OpenAI `messages` row.

    A conversation is an optional leading system message, then user and assistant messages in turn,
    starting with a user message. A trailing user message (asked, never answered) is a turn with no
    response. Unknown roles, empty messages and any other order are _FieldErrors: a row is never
    reshaped into something the data did not say.
    """
    if not isinstance(row, dict):
        raise _FieldError(f"not a JSON object (got {json_kind(row)})")
    convo = get_field(row, field_name)
    if convo is _MISSING or convo is None:
        raise _FieldError(f"missing field '{field_name}'")
    if not isinstance(convo, list) or not convo:
        raise _FieldError(f"not a list of messages (field '{field_name}')")
    role_key, text_key = ("from", "value") if sharegpt else ("role", "content")
    names = {**ROLE_NAMES, **{k.lower(): v for k, v in (roles or {}).items()}}
    system, users, assistants = None, [], []
    for i, msg in enumerate(convo):
        if not isinstance(msg, dict):
            raise _FieldError(f"message {i} is not an object (got {json_kind(msg)})")
        if role_key not in msg or text_key not in msg:
            raise _FieldError(f"message without {role_key}/{text_key} (message {i})")
        name = msg[role_key]
        role = names.get(name.lower()) if isinstance(name, str) else None
        if role is None:
            raise _FieldError(f"unknown role '{name}' (message {i})")
        text = _content(msg[text_key], i)
        if not text:
            raise _FieldError(f"empty turn (message {i}, {name})")
        if role == "system":
            if i != 0:
                raise _FieldError(f"system message after the first message (message {i})")
            system = text
            continue
        want = "user" if len(users) == len(assistants) else "assistant"
        if role != want:
            raise _FieldError(f"turns out of order (message {i} is {name}, expected a {want} message)")
        (users if role == "user" else assistants).append(text)
    if not users:
        raise _FieldError("no user turn")
    return system, users, assistants


def extract_response(row: dict, field_name: str) -> str:
    """The row's own answer under `response: field_name`; _FieldError says what is wrong."""
    value = get_field(row, field_name)
    if value is _MISSING or value is None:
        raise _FieldError(f"missing field '{field_name}' (response)")
    text = _text(value, f"field '{field_name}' (response)")  # text, valid UTF-8, stripped like every turn
    if not text:
        raise _FieldError(f"field '{field_name}' (response) is empty")
    return text


def extract_turns(row: Any, prompt: str | None, template: str | None, turns: str | None) -> list[str]:
    """The user turns of one row under a field mapping; _FieldError says what is wrong."""
    if not isinstance(row, dict):
        raise _FieldError(f"not a JSON object (got {json_kind(row)})")
    if template is not None:
        try:
            text = string.Formatter().vformat(template, (), row)
        except (KeyError, IndexError) as e:
            raise _FieldError(f"missing field {e} (prompt_template)") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise _FieldError(f"prompt_template does not fit this row ({e})") from None
        values = [text]
    elif prompt is not None:
        value = get_field(row, prompt)
        if value is _MISSING or value is None:
            raise _FieldError(f"missing field '{prompt}'")
        values = [value]
    else:
        return _turn_list(get_field(row, turns), turns)
    out = [_text(v, "prompt") for v in values]
    if not out or any(not t for t in out):
        raise _FieldError("empty prompt")
    return out


def _turn_list(value: Any, name: str) -> list[str]:
    """The user turns under field `name`: one text, or a non-empty list of texts, each non-empty. The field and the
    turn are named: `prompt is not text (turns[0] is null)`, `empty prompt (turns[1])`."""
    if value is _MISSING or value is None:
        raise _FieldError(f"missing field '{name}'")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise _FieldError(f"field '{name}' is not a list of turns (got {json_kind(value)})")
    if not value:
        raise _FieldError(f"empty prompt (field '{name}' is an empty list)")
    out = []
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise _FieldError(f"prompt is not text ({name}[{i}] is {json_kind(v)}, expected non-empty text)")
        text = _text(v, f"{name}[{i}]")
        if not text:
            raise _FieldError(f"empty prompt ({name}[{i}] is empty, expected non-empty text)")
        out.append(text)
    return out


def _domain(row: Any, source: SourceConfig) -> str:
    for rule in source.domain_rules:
        value = get_field(row, rule.field) if isinstance(row, dict) else _MISSING
        if value is not _MISSING and value is not None and re.search(rule.pattern, str(value)):
            return rule.domain
    if source.domain:
        return source.domain
    raise _FieldError("no domain rule matches")


# --------------------------------------------------------------------------------------------- readers


MAX_LINE_BYTES = 16 << 20  # one prompt or chat line: a whole book is a few MB


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, parsed object or None, error) for every non-blank line of a prompt file: the one reader
    of prompt lines (training sources, eval sets, the overlap check, evaluation's prompts). A line that is
    not UTF-8 is an error of its own (decoding it with replacement characters would store mangled text), and so
    is a line nested past what the parser can read, and a line past MAX_LINE_BYTES (skipped without being held;
    a `.gz` gives at most reading.gzip_budget). `.gz` files are read decompressed; a file cut short or damaged
    ends with an error at the line where it breaks. The caller decides whether an error skips the line or stops."""
    try:
        f = open_data(path)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    with f:
        lineno = 0
        lines = bounded_lines(f, MAX_LINE_BYTES, gzip_budget(path))
        while True:
            try:
                raw = next(lines, b"")
            except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                yield lineno + 1, None, f"the file is cut short or damaged here ({type(e).__name__}: {e})"
                return
            except TooMuch as e:
                yield lineno + 1, None, (f"the file gives more than {e.args[0]} bytes decompressed (a gzip bomb?); "
                                         "the rest of it is skipped")
                return
            if raw == b"":
                return
            lineno += 1
            if raw is None:  # skipped to its end without being held
                yield lineno, None, f"the line is longer than {MAX_LINE_BYTES} bytes"
                continue
            error, obj = _parse_line(raw)
            if error is not None or obj is not _BLANK:
                yield lineno, obj, error


_BLANK = object()


def _parse_line(raw: bytes) -> tuple[str | None, Any]:
    """(error, object) of one line: _BLANK for a blank one."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})", None
    if not line.strip():
        return None, _BLANK
    try:
        return None, json.loads(line)
    except json.JSONDecodeError as e:
        return f"bad JSON ({e.msg} at column {e.colno})", None
    except RecursionError:
        return "bad JSON (nested too deep to read)", None


def _iter_hf(source: SourceConfig) -> Iterator[tuple[int, Any, str | None]]:
    ds = load_hub_dataset(source) if source.type == "hub" else load_hf_dataset(source.path, source.split)
    for i, row in enumerate(ds):
        yield i, row, None


def load_hub_dataset(source: SourceConfig):
    """A hub dataset by id, config name, split and revision (`datasets.load_dataset`): from the network, or from
    the local datasets cache where it was downloaded before (offline with HF_DATASETS_OFFLINE=1)."""
    import datasets

    try:
        return datasets.load_dataset(source.id, name=source.config, split=source.split, revision=source.revision)
    except Exception as e:  # datasets raises many types for network, cache and missing-split failures
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        where = (f"{source.id}" + (f" (config {source.config})" if source.config else "") +
            (f" at revision {source.revision}" if source.revision else "") + f", split {source.split}")
        raise DataError(f"source '{source.name}': cannot load hub dataset {where}: {msg}") from None


def load_hf_dataset(path: str, split: str = "train"):
    """A `datasets.Dataset` from a save_to_disk folder, a data file, or (where reachable) a hub name."""
    import datasets

    p = data_path(path)
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            # not save_to_disk's layout: a folder of data files, as a hub dataset downloads (data/*.parquet)
            try:
                return datasets.load_dataset(str(p), split=split)
            except Exception as e2:  # datasets raises many types for a folder it cannot read
                raise DataError(f"{path}: neither a `datasets` save_to_disk folder ({e}) nor a folder of data "
                                f"files ({str(e2).splitlines()[0][:160] if str(e2) else type(e2).__name__})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{path}: no split '{split}' (has {', '.join(ds)})")
            ds = ds[split]
        return ds
    if p.is_file():
        suffixes = [s.lower() for s in p.suffixes]
        plain = suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) > 1 else (suffixes or [""])[-1]
        fmt = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(plain)
        if fmt is None:
            raise DataError(f"{path}: unsupported data file type (use .json, .jsonl, .parquet or .csv, "
                            "or .gz of the text ones)")
        return datasets.load_dataset(fmt, data_files=str(p), split="train")
    if p.is_absolute() or path.startswith("."):
        raise DataError(f"{path}: no such file or folder")
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as e:  # datasets raises many types for network / missing-repo failures
        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise DataError(
            f"cannot load dataset '{path}' from the Hugging Face hub ({msg}); "
            "give a local save_to_disk folder or a .jsonl/.parquet/.csv file instead"
        ) from None


def content_key(obj: Any, seen: Counter) -> str:
    """A row's key from what its line says, not where it stands: a line deleted or added between two runs changes no
    other row's id (with line numbers, the rows after it took their neighbours' ids, and a rerun kept a deleted
    row and lost another). The whole record counts, so a row keeps its id whichever fields a config reads of it
    (regenerated or kept responses); the n-th repeat of the same record is told apart by n."""
    content = sha256_text(json.dumps(obj, ensure_ascii=False, sort_keys=True, default=str))
    seen[content] += 1
    return f"content:{content}:{seen[content]}"


def _select(items: list, source: SourceConfig) -> list:
    if source.limit is None or len(items) <= source.limit:
        return items
    if source.sample == "first":
        return items[: source.limit]
    rng = random.Random(f"{source.seed}:{source.name}")
    keep = sorted(rng.sample(range(len(items)), source.limit))
    return [items[i] for i in keep]


def _records_source(source: SourceConfig, report: MalformedReport, keep: bool = False) -> list[PromptRow]:
    if source.type == "jsonl":
        path = data_path(source.path)
        if not path.is_file():
            raise DataError(f"source '{source.name}': no such file {path}")
        records = iter_jsonl(path)
        where = lambda i: f"{path}:{i}"  # noqa: E731
    else:
        records = _iter_hf(source)
        label = source.id if source.type == "hub" else source.path
        where = lambda i: f"{label}[{i}]"  # noqa: E731
    rows = []
    seen: Counter = Counter()
    for index, obj, error in records:
        origin = where(index)
        if error is not None:
            report.add(origin, error)
            continue
        system, responses = source.system, None
        try:
            if source.conversations or source.messages:
                own, turns, responses = extract_conversation(
                    obj, source.conversations or source.messages, bool(source.conversations), source.roles)
                system = own or system
                if keep and len(responses) < len(turns):
                    turns = turns[: len(responses)]  # the unanswered last question: nothing to keep
                    if not turns:
                        raise _FieldError("no assistant turn to keep")
            else:
                turns = extract_turns(obj, source.prompt, source.prompt_template, source.turns)
                if source.response is not None:
                    responses = [extract_response(obj, source.response)]
            domain = _domain(obj, source)
        except _FieldError as e:
            report.add(origin, str(e))
            continue
        keyed = bool(source.id_field) and source.id_field in obj
        key = str(obj[source.id_field]) if keyed else content_key(obj, seen)
        rows.append(PromptRow(make_row_id(source.name, key), source.name, domain, turns, origin, system,
                              responses if keep else None, None if keyed else make_row_id(source.name, str(index))))
    return _select(rows, source)


# --------------------------------------------------------------------------------------------- stdlib

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
              "turtledemo", "ensurepip", "config-3", "__phello__"}


def _stdlib_files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel[:-1]):
            continue
        if rel[-1].startswith("test_"):
            continue
        out.append(p)
    return out


def _function_prompts(tree: ast.Module, lines: list[str]) -> list[tuple[int, str, str]]:
    """(line, prompt, whole function) for every function with a docstring and a body after it: the prompt is
    its signature + docstring."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(doc.strip()) < 20 or len(node.body) < 2:
            continue
        head_end = node.body[0].end_lineno  # the docstring's last line
        start = node.lineno - 1
        text = textwrap.dedent("\n".join(lines[start:head_end]))
        if len(text) > 1500:
            continue
        out.append((node.lineno, text, textwrap.dedent("\n".join(lines[start:node.end_lineno]))))
    return out


def stdlib_code_rows(source: SourceConfig, root: str | Path | None = None, keep: bool = False) -> list[PromptRow]:
    """Code prompts from the standard library, deterministic for a given seed and Python version.

    Function completion: "complete this function" with the signature and docstring. Module continuation:
    `chunk_lines` consecutive lines of a module, to be continued. Files are visited in a seeded order and
    each contributes at most two functions and one chunk, so the prompts spread over many modules.
    With `keep` (responses: keep) each row's response is the code itself, as a fenced block: the whole
    function, or the module's next `chunk_lines` lines (existing text for teacher-forced capture).
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    limit = source.limit or 200
    n_completion = round(limit * source.completion_fraction)
    n_continuation = limit - n_completion
    rng = random.Random(f"{source.seed}:{source.name}:stdlib")
    files = _stdlib_files(root)
    rng.shuffle(files)
    completions: list[PromptRow] = []
    continuations: list[PromptRow] = []
    domain = source.domain or "code"
    for path in files:
        if len(completions) >= n_completion and len(continuations) >= n_continuation:
            break
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        rel = path.relative_to(root).as_posix()
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        if len(completions) < n_completion:
            funcs = _function_prompts(tree, lines)
            for lineno, body, whole in rng.sample(funcs, min(2, len(funcs))):
                if len(completions) >= n_completion:
                    break
                prompt = f"Complete this Python function from the `{module}` module.\n\n```python\n{body}\n```"
                completions.append(PromptRow(make_row_id(source.name, f"{rel}:{lineno}:fn"), source.name,
                                             domain, [prompt], f"{path}:{lineno}", source.system,
                                             [f"```python\n{whole}\n```"] if keep else None))
        if len(continuations) < n_continuation and len(lines) > 2 * source.chunk_lines:
            start = rng.randrange(0, len(lines) - source.chunk_lines)
            chunk = "\n".join(lines[start:start + source.chunk_lines]).strip("\n")
            after = "\n".join(lines[start + source.chunk_lines:start + 2 * source.chunk_lines]).strip("\n")
            if len(chunk.strip()) >= 80 and (not keep or after.strip()):
                prompt = f"Continue this code from the Python module `{module}`.\n\n```python\n{chunk}\n```"
                continuations.append(PromptRow(make_row_id(source.name, f"{rel}:{start + 1}:chunk"), source.name,
                                               domain, [prompt], f"{path}:{start + 1}", source.system,
                                               [f"```python\n{after}\n```"] if keep else None))
    rows = completions + continuations
    if not rows:
        raise DataError(f"source '{source.name}': found no Python code under {root}")
    return rows


# --------------------------------------------------------------------------------------------- all


@dataclass
class PromptSet:
    rows: list[PromptRow]
    malformed: MalformedReport
    duplicates: int = 0
    per_source: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)  # magpie requests dropped, by source and reason

    def domain_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(r.domain for r in self.rows).items()))


def normalize_text(text: str) -> str:
    """Lower-case, punctuation dropped, whitespace collapsed: the form prompts are compared in."""
    text = re.sub(r"[^\w\s]", " ", text.lower())
    return " ".join(text.split())


def load_source(source: SourceConfig, report: MalformedReport, keep: bool = False) -> list[PromptRow]:
    """The rows of one source; with `keep` they carry the dataset's own responses."""
    if source.type == "stdlib":
        return stdlib_code_rows(source, source.path, keep)
    return _records_source(source, report, keep)


def magpie_share(limit: int, max_rows: int | None, pool: int) -> int:
    """How many requests a magpie source writes: its limit, or under max_rows its share of a sample of
    max_rows from `pool` candidate rows (every source's rows, magpie sources at their limits). Each request
    costs a generation, so requests the sample would drop are not written."""
    if max_rows is None or pool <= max_rows:
        return limit
    return max(1, math.ceil(limit * max_rows / pool))


def load_prompts(config: DataConfig, tokenizer=None, prompt_length=None, target=None,
                 progress: bool = False) -> PromptSet:
    """Read every source, apply the malformed policy and (optionally) the prompt-length limit.

    `target` writes the requests of magpie sources (data/magpie.py); other sources do not need it.

    `prompt_length(row) -> int` gives the token length of a row's formatted prompt; rows longer than
    `config.generation.max_prompt_tokens` are malformed ("prompt too long"). Exact duplicate prompts
    (after normalisation) are dropped when `config.dedupe`. An empty result is a DataError.
    """
    report = MalformedReport(policy=config.malformed)
    got, rejected = _read_sources(config, report, target, progress)
    rows: list[PromptRow] = []
    per_source = {}
    for source in config.sources:  # config order
        per_source[source.name] = len(got[source.name])
        rows.extend(got[source.name])
    if prompt_length is not None:
        rows = _within_length(rows, prompt_length, config.generation.max_prompt_tokens, report)
    duplicates = 0
    if config.dedupe:
        rows, duplicates = _dedupe(rows)
    ids = Counter(r.row_id for r in rows)
    clash = [i for i, n in ids.items() if n > 1]
    if clash:
        first = next(r for r in rows if r.row_id == clash[0])
        raise DataError(f"{first.origin}: row key repeats within source '{first.source}' (check id_field)")
    if config.max_rows is not None and len(rows) > config.max_rows:
        rows = _sample_rows(rows, config, {s.name for s in config.sources if s.type == "magpie"})
    if report.items:
        log.warning("%s", report.summary())
    if not rows:
        read = ", ".join(f"{s.name} ({s.path or s.id or s.type})" for s in config.sources)
        raise DataError(f"no prompts left after filtering ({report.summary()}); sources read: {read}")
    return PromptSet(rows, report, duplicates, per_source, rejected)


def _read_sources(config: DataConfig, report: MalformedReport, target, progress: bool
                  ) -> tuple[dict[str, list[PromptRow]], dict[str, dict[str, int]]]:
    """Every source's rows by name, and what each magpie source's requests had rejected."""
    got: dict[str, list[PromptRow]] = {}
    rejected: dict[str, dict[str, int]] = {}
    # files first: under max_rows a magpie source writes only its share of the sample, which needs their count
    for source in config.sources:
        if source.type != "magpie":
            got[source.name] = load_source(source, report, config.responses == "keep")
    magpie = [s for s in config.sources if s.type == "magpie"]
    pool = sum(map(len, got.values())) + sum(s.limit for s in magpie)
    for source in magpie:
        from draftsmith.data.magpie import magpie_rows

        def make_row(index: int, text: str, origin: str, source=source) -> PromptRow:
            try:
                domain = _domain({"text": text}, source)  # rules may look at the request's `text`
            except _FieldError:
                domain = "general"
            return PromptRow(make_row_id(source.name, str(index)), source.name, domain, [text], origin,
                             source.system)

        got[source.name], rejected[source.name] = magpie_rows(
            source, config, target, make_row, magpie_share(source.limit, config.max_rows, pool), progress)
    return got, rejected


def _within_length(rows: list[PromptRow], prompt_length, limit: int, report: MalformedReport) -> list[PromptRow]:
    """The rows whose formatted prompt fits `limit` tokens; the others are malformed ("prompt too long")."""
    kept = []
    for row in rows:
        n = prompt_length(row)
        if n > limit:
            report.add(row.origin, f"prompt too long ({n} tokens > max_prompt_tokens {limit})")
        else:
            kept.append(row)
    return kept


def _dedupe(rows: list[PromptRow]) -> tuple[list[PromptRow], int]:
    """The rows without exact repeats of an earlier prompt (after normalisation), and how many were dropped."""
    seen, kept = set(), []
    for row in rows:
        key = normalize_text(row.prompt)
        if key not in seen:
            seen.add(key)
            kept.append(row)
    return kept, len(rows) - len(kept)


def _sample_rows(rows: list[PromptRow], config: DataConfig, written: set[str]) -> list[PromptRow]:
    """`config.max_rows` of the rows, drawn with the config's seed, in their order. The rows of the sources in
    `written` (magpie: written at their share of the sample already) are all kept unless they alone fill it."""
    fixed = [i for i, r in enumerate(rows) if r.source in written]
    if len(fixed) >= config.max_rows:
        fixed = []
    rest = sorted(set(range(len(rows))) - set(fixed))
    rng = random.Random(f"{config.seed}:max_rows")
    keep = sorted(fixed + rng.sample(rest, config.max_rows - len(fixed)))
    return [rows[i] for i in keep]
