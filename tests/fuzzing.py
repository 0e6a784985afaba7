"""Fuzzing the readers at draftsmith's boundary (hypothesis): random mutations of a valid file, and the one
property every reader keeps — it reads the file correctly or refuses it in one line (a DraftsmithError)
naming the file; never a raw exception.

A test builds a valid document, draws `mutated_json(doc)` / `mutated_yaml(doc)` (a value's type swapped, a
number out of range or not finite, a key gone, a deep nesting, the bytes cut short or not UTF-8), writes
it with `place` (a file, a dangling symlink or a folder in its place) and runs the reader under
`refuses_cleanly`. `make test` runs `FUZZ` (a fixed, derandomised set of examples: a red CI is a real
finding, never a roll of the dice); `FUZZ_LONG` is the longer run, for tests marked slow (`RUNS`
parametrises a test with both), random only with DRAFTSMITH_FUZZ_RANDOM=1.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from draftsmith.errors import DraftsmithError

EXAMPLES = int(os.environ.get("DRAFTSMITH_FUZZ_EXAMPLES", "40"))
_COMMON = dict(deadline=None, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, **_COMMON)
# the long run is derandomised too, since `make test` runs the tests marked slow: the same 1000 examples each
# time, so CI goes red for a reader's fault and never for a draw; DRAFTSMITH_FUZZ_RANDOM=1 explores new ones
FUZZ_LONG = settings(max_examples=int(os.environ.get("DRAFTSMITH_FUZZ_LONG_EXAMPLES", "1000")),
                     derandomize=os.environ.get("DRAFTSMITH_FUZZ_RANDOM") != "1", **_COMMON)
# a fuzz test run both ways: `@pytest.mark.parametrize("runs", RUNS)`, then `runs(given(...)(check))()`
RUNS = [pytest.param(FUZZ, id="fixed"), pytest.param(FUZZ_LONG, id="long", marks=pytest.mark.slow)]

DEEP = 100_000  # nesting depth of the deep-nesting mutation (past Python's recursion limit)

# values a hostile file puts where a valid one has something else
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.sampled_from([0, -1, 1, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    st.text(max_size=12), st.sampled_from(["", "\x00", "lots", "1e999", "<|im_end|>", "../../etc"]),
    st.just([]), st.just({}), st.lists(st.integers(-5, 10**6), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON-like value (its root first), at most 8 items into each list."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    node = doc
    for part in path[:-1]:
        node = node[part]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@st.composite
def mutated_doc(draw, doc: Any, max_mutations: int = 3) -> Any:
    """`doc` with 1..max_mutations values replaced by a hostile one, removed, or wrapped in a list."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_mutations))):
        path = draw(st.sampled_from(_paths(doc)))
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "wrap"]))
        if op == "delete" and path:
            doc = _set(doc, path, None, delete=True)
        elif op == "wrap":
            node = doc
            for part in path:
                node = node[part]
            doc = _set(doc, path, [node])
        else:
            doc = _set(doc, path, draw(HOSTILE))
    return doc


def _damage(draw, data: bytes) -> bytes:
    """The bytes as they are (mostly), cut short, or with bytes that are not UTF-8 in them."""
    how = draw(st.sampled_from(["as_is", "as_is", "as_is", "truncate", "not_utf8", "empty"]))
    if how == "truncate" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "not_utf8":
        at = draw(st.integers(0, len(data)))
        return data[:at] + b"\xff\xfe\xc3" + data[at:]
    if how == "empty":
        return b""
    return data


@st.composite
def mutated_json(draw, doc: Any) -> bytes:
    """A JSON file that started as `doc`: mutated values, then maybe damaged bytes or a deep nesting."""
    if draw(st.integers(0, 19)) == 0:
        return b"[" * DEEP + b"]" * DEEP
    text = json.dumps(draw(mutated_doc(doc)), allow_nan=True)  # NaN/Infinity: what Python's json reads
    return _damage(draw, text.encode())


@st.composite
def mutated_jsonl(draw, rows: list[Any]) -> bytes:
    """A JSON-lines file of `rows`, one of them mutated, maybe a line that is not JSON, maybe damaged."""
    rows = copy.deepcopy(rows)
    i = draw(st.integers(0, len(rows) - 1))
    rows[i] = draw(mutated_doc(rows[i]))
    lines = [json.dumps(r, allow_nan=True) for r in rows]
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(["{", "[1, 2", "null", "\"x\"", "42"])))
    return _damage(draw, ("\n".join(lines) + "\n").encode())


@st.composite
def mutated_yaml(draw, doc: Any) -> bytes:
    """A YAML file that started as `doc`, or an alias bomb (nine anchors of nine aliases each)."""
    import yaml

    if draw(st.integers(0, 19)) == 0:
        lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
        lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
        return ("\n".join(lines) + "\n").encode()
    text = yaml.safe_dump(draw(mutated_doc(doc)), sort_keys=False)
    return _damage(draw, text.encode())


PLACES = st.sampled_from(["file", "file", "file", "file", "dangling_symlink", "directory"])


def place(path: Path, data: bytes, how: str = "file") -> Path:
    """Put `data` at `path` as a file — or, for `how`, a symlink to nothing or a folder of that name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        import shutil

        shutil.rmtree(path)
    if how == "dangling_symlink":
        path.symlink_to(path.parent / f"missing-{path.name}")
    elif how == "directory":
        path.mkdir()
    else:
        path.write_bytes(data)
    return path


def refuses_cleanly(read: Callable[[], Any], *names: str) -> Any:
    """Run a reader on a hostile input: it returns (what it read), or raises a DraftsmithError of one line
    that names the input (each of `names`, e.g. the file's name). Any other exception fails the test."""
    try:
        return read()
    except DraftsmithError as e:
        message = str(e)
        assert message and "\n" not in message, f"not one line: {message!r}"
        for name in names:
            assert str(name) in message, f"the error does not name {name}: {message}"
        return None
