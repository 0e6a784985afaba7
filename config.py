"""Typed configuration: dataclasses are the schema, YAML files only mirror them.

`load_config(path, overrides)` reads a YAML preset whose top-level `kind:` names a registered dataclass,
applies dotted `key=value` overrides from the command line, and builds the dataclass recursively. Unknown
keys, wrong types and out-of-range values fail here, at load time, with the dotted path of the bad key.

Every number is checked where it enters: every numeric field carries its range in its annotation —
`batch_size: Annotated[int, Range(ge=1, le=MAX_BATCH)]` —, so the range is written once, beside the field;
a `@validated` config dataclass checks it whenever it is built (from YAML, where the error names the dotted
key, or by Python code), a float is finite, and the `--help` of the flag that sets the field shows it
(tests/test_config_ranges.py refuses a numeric field without a range, or a config class not validated). A
command-line flag that sets no config field takes `ranged(int, Range(...))` as its argparse type: the same
check, the same message.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from draftsmith.errors import MAX_SHOWN, ConfigError, json_kind, show

T = TypeVar("T")
log = logging.getLogger(__name__)

CONFIG_KINDS: dict[str, type] = {}


def register_config(kind: str):
    """Class decorator: YAML files with `kind: <kind>` load into this dataclass."""

    def deco(cls):
        CONFIG_KINDS[kind] = cls
        cls.config_kind = kind
        return cls

    return deco


@functools.cache  # read once per class: every flag of a command asks for its field's comment
def field_docs(cls: type) -> dict[str, str]:
    """Each field of a config dataclass -> the comment that documents it in the source: the `#` lines just
    above the field, then the one beside it ("" where there is none). A flag that sets a field takes this as
    its `--help` (`field_help`), so what the flag says and what the field means cannot drift apart."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            first = node.lineno
            while first > 1 and lines[first - 2].lstrip().startswith("#"):
                first -= 1
            own = [comments[n] for n in range(first, node.end_lineno + 1) if n in comments]
            docs[node.target.id] = " ".join(own)
    return docs


def field_help(cls: type, name: str) -> str:
    """`--help` of a flag that sets field `name` of config dataclass `cls`: its comment, its default (a
    field without a default value, or with None or an empty one, has its comment say what that means) and
    the range its annotation allows."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    shown = [] if default in (None, dataclasses.MISSING, [], {}) else [f"default: {default}"]
    ranges = field_ranges(cls).get(name)
    shown += [str(ranges)] if ranges else []
    text = field_docs(cls)[name] + (f" ({'; '.join(shown)})" if shown else "")
    return text.replace("%", "%%")  # argparse expands % in help


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric config field or flag allows, in annotated-types' words (ge, gt, le, lt); a float
    must also be finite. Written in the field's annotation: `Annotated[float, Range(gt=0, le=1)]`; in a
    list's item type it bounds every item."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def check(self, value: Any, where: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: {value} is not a finite number (expected {self})")
        if ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)):
            raise ConfigError(f"{where}: {show(value)} is out of range (expected {self})")

    def __str__(self) -> str:
        low = f"{_num(self.ge)} <= " if self.ge is not None else f"{_num(self.gt)} < " if self.gt is not None else ""
        high = f" <= {_num(self.le)}" if self.le is not None else f" < {_num(self.lt)}" if self.lt is not None else ""
        return f"{low}x{high}"


# Ranges many fields share. The upper bounds are sanity bounds, past anything a real run uses: a value past
# them is a typo (1e8 rows a batch, 100000 workers) that would otherwise fork, allocate or wait for hours.
MAX_BATCH = 1 << 16  # rows in one batch
SEED = Range(ge=0, le=2**32 - 1)  # what numpy and torch both take
FRACTION = Range(ge=0, le=1)
HELD_OUT = Range(ge=0, lt=1)  # a share of the rows kept out of training (all of them would leave none)
PROBABILITY = Range(gt=0, le=1)  # top_p, decays: 0 would keep nothing
TEMPERATURE = Range(ge=0, le=100)  # 0 = greedy
TOKENS = Range(ge=1, le=1 << 20)  # a count of tokens (new tokens, lengths, contexts)
DRAFT_TOKENS = Range(ge=1, le=64)  # tokens drafted a step, or branches at one depth of a tree
ROWS = Range(ge=1, le=10**12)  # a count of rows or prompts
STEPS = Range(ge=0, le=10**9)  # a count of optimizer steps (0 = "never" where a field says so)
REPEATS = Range(ge=1, le=1000)  # timed repetitions
WEIGHT = Range(ge=0, le=1000)  # a loss weight or a multiplier
LAYER = Range(ge=-1, le=4095)  # a layer index; -1 = the last (capture/layers.py)
VOCAB = Range(ge=1, le=1 << 24)  # a vocabulary size or a token id's bound
SECONDS = Range(gt=0, le=7 * 86400)


MAX_TREE_NODES = 4096  # draft tokens one verify step of a tree holds (a GPU-sized EAGLE-2 tree: 60)


def check_tree(branches: list[int] | None, where: str) -> None:
    """A tree given as branches per depth ([4, 2, 1]: 4 + 8 + 8 nodes) holds at most MAX_TREE_NODES nodes:
    each depth's bound alone lets [64, 64, 64, 64] through, 17 million nodes verified in one forward."""
    if branches is None:
        return
    if not branches:
        raise ValueError(f"{where}: a tree needs at least one depth")
    nodes, width = 0, 1
    for b in branches:
        width *= b
        nodes += width
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"{where}: {branches} is more than {MAX_TREE_NODES} draft tokens a step")


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


class OutOfRange(ConfigError, ValueError):
    """A config field's value is out of its Range, or a string of it holds a NUL byte: `field` names it
    (`tree[2]`), `problem` says how."""

    def __init__(self, cls: type, field: str, problem: str):
        super().__init__(f"{cls.__name__}.{field}: {problem}")
        self.field, self.problem = field, problem


def validated(cls: type[T]) -> type[T]:
    """Class decorator, above `@dataclass`: every construction checks each field against its annotation's
    Range before anything else runs (its `__post_init__`, the code that uses it) — whether the values come
    from a YAML file (from_dict names the dotted key), a flag, or Python code calling the class."""
    hook = "__post_init__" if hasattr(cls, "__post_init__") else "__init__"
    original = getattr(cls, hook)

    @functools.wraps(original)
    def checked(self, *args, **kwargs):
        if hook == "__init__":
            original(self, *args, **kwargs)
        check_fields(self)
        if hook == "__post_init__":
            original(self, *args, **kwargs)

    setattr(cls, hook, checked)
    cls.validated = True
    return cls


def check_fields(obj: Any) -> None:
    """Every ranged field of a config dataclass instance, its items and values included; and no string of any
    field holding a NUL byte (`check_strings`); OutOfRange if not."""
    check_strings(obj)
    for name, bounds in field_ranges(type(obj)).items():
        value = getattr(obj, name)
        items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple)
                 else [(None, value)])
        for key, item in items:
            where = name if key is None else f"{name}.{key}" if isinstance(value, dict) else f"{name}[{key}]"
            if item is None and key is None:
                continue  # an Optional field left unset
            if isinstance(item, bool) or not isinstance(item, int | float):
                raise OutOfRange(type(obj), where, f"expected a number, got {show(item)}")
            try:
                bounds.check(item, where)
            except ConfigError as e:
                raise OutOfRange(type(obj), where, str(e).split(": ", 1)[1]) from None


def check_strings(obj: Any) -> None:
    """No string of a config (a path, a name, a list's item, a mapping's key or value) holds a NUL byte: every
    path-valued field is a string, and the OS refuses the byte far from the key that brought it (`embedded null
    byte` from the first open or mkdir of `output_dir`), so it is refused here, by the field's name. No config
    string is text that could need the byte."""
    names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else list(vars(obj))
    for name in names:
        value = getattr(obj, name, None)
        items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple)
                 else [(None, value)])
        for key, item in items:
            where = name if key is None else f"{name}.{key}" if isinstance(value, dict) else f"{name}[{key}]"
            if any(isinstance(s, str | Path) and "\0" in str(s) for s in (key, item)):
                raise OutOfRange(type(obj), where, "holds a NUL byte (\\0), which no path or name can hold")


@functools.cache  # read once per class: every construction checks its fields
def field_ranges(cls: type) -> dict[str, Range]:
    """Each numeric field of a config dataclass -> the Range its annotation (or its items') carries."""
    out = {}
    for name, tp in get_type_hints(cls, include_extras=True).items():
        found = _range_of(tp)
        if found is not None:
            out[name] = found
    return out


def _range_of(tp: Any) -> Range | None:
    if get_origin(tp) is Annotated:
        return next((m for m in get_args(tp)[1:] if isinstance(m, Range)), None)
    for arg in get_args(tp):  # Optional[...], list[...], tuple[...]
        found = _range_of(arg)
        if found is not None:
            return found
    return None


def ranged(tp: type, bounds: Range):
    """An argparse `type=` for a flag that sets no config field: `tp` parsed, finite and within `bounds`,
    refused with argparse's one-line usage error."""
    import argparse

    def parse(text: str):
        try:
            value = tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if tp is int else 'a number'}") from None
        try:
            bounds.check(value, text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
        return value

    parse.__name__ = tp.__name__  # argparse names the type in its messages
    parse.bounds = bounds
    return parse


MAX_YAML_NODES = 1_000_000  # a preset is a few hundred nodes; aliases may not expand a file past this
# a preset nests 3-4 levels; the composer, the alias check and every reader of the values recurse once a level,
# so a document past this would end in a RecursionError (100,000 `[` are 100 KB)
MAX_YAML_DEPTH = 64


class _BoundedLoader(yaml.SafeLoader):
    """safe_load that refuses a document whose aliases expand it past MAX_YAML_NODES nodes (an alias bomb:
    nine anchors of nine aliases each are 9**9 nodes once walked) or that refers to itself."""

    def construct_document(self, node):
        _expanded_size(node, {}, set())
        return super().construct_document(node)


def _expanded_size(node, sizes: dict[int, int], open_: set[int]) -> int:
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise yaml.YAMLError(f"an alias refers to a node that contains it (line {node.start_mark.line + 1})")
    open_.add(key)
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_size(c, sizes, open_) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded_size(k, sizes, open_) + _expanded_size(v, sizes, open_) for k, v in node.value)
    else:
        n = 1
    open_.discard(key)
    if n > MAX_YAML_NODES:
        raise yaml.YAMLError(f"aliases expand the document past {MAX_YAML_NODES} nodes (an alias bomb?)")
    sizes[key] = n
    return n


def yaml_depth(text: str, limit: int = MAX_YAML_DEPTH) -> int:
    """How deep the YAML document `text` nests (mappings and sequences, block or flow style), counted on
    PyYAML's event stream — its parser is a loop over a stack of states, never recursive — before anything is
    composed; a yaml.YAMLError as soon as it passes `limit`. An alias counts as deep as the node it names, so a
    chain of anchors, each one level inside the one before, is as deep as it expands."""
    depth = deepest = 0
    heights: dict[str, int] = {}  # anchor -> the levels of the node it names (0: a scalar)
    anchored: list[list] = []  # the open anchored collections: [anchor, level, the deepest level inside it]
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionEndEvent):
            if anchored and anchored[-1][1] == depth:
                anchor, level, inside = anchored.pop()
                heights[anchor] = inside - level + 1
                if anchored:
                    anchored[-1][2] = max(anchored[-1][2], inside)
            depth -= 1
            continue
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            reach = depth
            if event.anchor is not None:
                anchored.append([event.anchor, depth, depth])
        elif isinstance(event, yaml.AliasEvent):
            reach = depth + heights.get(event.anchor, 0)  # an anchor still open is a cycle: _BoundedLoader's
        elif isinstance(event, yaml.ScalarEvent):
            reach = depth
            if event.anchor is not None:
                heights[event.anchor] = 0
        else:
            continue
        if anchored:
            anchored[-1][2] = max(anchored[-1][2], reach)
        deepest = max(deepest, reach)
        if reach > limit:
            raise yaml.YAMLError(f"nested deeper than {limit} levels (line {event.start_mark.line + 1}"
                                 f"{', through aliases' if isinstance(event, yaml.AliasEvent) else ''})")
    return deepest


def safe_load(text: str) -> Any:
    """yaml.safe_load with nesting (`yaml_depth`, counted before composing) and alias expansion
    (`_BoundedLoader`) bounded: the one reader of every outside YAML — config files, presets, command-line
    overrides, accelerate files."""
    yaml_depth(text)
    return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader subclass)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """`value` (from YAML or an override) as the annotated type `tp`; a one-line error naming `where`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Annotated:  # its Range is checked when the dataclass is built (`validated`)
        return _coerce(get_args(tp)[0], value, where)
    if origin in (Union, types.UnionType):
        return _coerce_union(tp, value, where)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {show(value)} is not one of {', '.join(map(repr, allowed))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {json_kind(value)}")
        return from_dict(tp, value, where)
    if origin in (list, tuple, typing.Sequence, dict):
        return _coerce_container(tp, origin, value, where)
    if tp in (bool, int, float, str):
        return _coerce_scalar(tp, value, where)
    if tp is Path:
        return Path(value)
    return value


def _coerce_union(tp: Any, value: Any, where: str) -> Any:
    """The first member of the union `value` fits (null only where the union holds None)."""
    args = get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{where}: null is not allowed (expected {_type_name(tp)})")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(arg, value, where)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {show(value)} fits none of {_type_name(tp)}")


def _coerce_container(tp: Any, origin: Any, value: Any, where: str) -> Any:
    """A list, tuple or sequence, item by item; a dict, key and value by key and value."""
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {json_kind(value)}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_coerce(key_tp, k, where): _coerce(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: expected a list, got {json_kind(value)}")
    item_tps = get_args(tp) or (Any,)
    if origin is tuple and Ellipsis not in item_tps:  # tuple[float, float]: exactly two
        if len(value) != len(item_tps):
            raise ConfigError(f"{where}: expected {len(item_tps)} items, got {len(value)}")
    else:
        item_tps = item_tps[:1] * len(value)
    items = [_coerce(item_tp, v, f"{where}[{i}]") for i, (item_tp, v) in enumerate(zip(item_tps, value))]
    return tuple(items) if origin is tuple else items


def _coerce_scalar(tp: type, value: Any, where: str) -> Any:
    """bool, int, float or str: only what YAML could mean by it (no true for 1, no 1 for true)."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {show(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {show(value)}")
    if tp is float:
        if isinstance(value, str):  # YAML reads 1e-4 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer past float's range (10**400)
                raise ConfigError(f"{where}: {show(value)} is out of range for a number") from None
        raise ConfigError(f"{where}: expected a number, got {show(value)}")
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where}: expected a string, got {show(value)}")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a mapping, recursively, checking every key and type."""
    hints = get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields) - {"kind"}, key=str)
    if unknown:
        key = show(f"{where}.{unknown[0]}" if where else unknown[0]).strip("'")
        raise ConfigError(f"unknown config key '{key}' (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        if name == "kind":
            continue
        path = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, path)
    try:
        return cls(**kwargs)
    except OutOfRange as e:  # a value out of its field's Range (`validated`): named by its dotted key
        raise ConfigError(f"{where}.{e.field}: {e.problem}" if where else f"{e.field}: {e.problem}") from None
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where or cls.__name__}: {e}") from None
    except ValueError as e:  # __post_init__ range checks (their values cut: a message is one short line)
        text = str(e) if len(str(e)) <= 4 * MAX_SHOWN else str(e)[:4 * MAX_SHOWN] + "..."
        raise ConfigError(f"{where + ': ' if where else ''}{text}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict (for manifests and YAML), with the registered kind first."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        if hasattr(obj, "config_kind"):
            out["kind"] = obj.config_kind
        for f in dataclasses.fields(obj):
            out[f.name] = to_dict(getattr(obj, f.name))
        return out
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        return key.split("."), safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text[:MAX_SHOWN]}': not a YAML value "
                          f"({str(e).splitlines()[0]})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section")
        node[path[-1]] = value
    return data


# The presets shipped with the package (package data in a wheel; the checkout's configs/ in an editable install).
PRESETS = Path(__file__).resolve().parent / "configs"


def preset_names() -> list[str]:
    """Every shipped preset by the name `preset_path` takes: `smollm2-135m/eagle3`, `retrain`, ..."""
    return sorted(p.relative_to(PRESETS).with_suffix("").as_posix() for p in PRESETS.rglob("*.yaml"))


def preset_path(ref: str | Path) -> Path:
    """A preset as a user names it: a YAML file's path, relative to the working directory, or a preset shipped
    with the package by name — `smollm2-135m/eagle3`, `smollm2-135m/eagle3.yaml` or
    `configs/smollm2-135m/eagle3.yaml` — so that an installed draftsmith runs from any folder.

    One rule for every spelling: a file in the working directory comes first (a checkout, or the user's own copy
    of a preset, which is what they edited), the name as given and then with `.yaml` added, and only then the
    shipped preset, tried the same two ways; so `NAME` and `NAME.yaml` read the same file. Where a file here
    shadows a shipped preset of the same name, a warning names the file read."""
    path = Path(ref).expanduser()
    if path.is_absolute():
        return path
    local = next((p for p in _spellings(path) if p.is_file()), None)
    rel = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) and len(path.parts) > 1 else path
    shipped = next((p for p in _spellings(rel, PRESETS)
                    if p.is_file() and p.resolve().is_relative_to(PRESETS.resolve())), None)
    if local is not None and shipped is not None and local.resolve() != shipped.resolve():
        log.warning("config %s: reading the file %s, not the shipped preset %s of the same name", ref,
                    local.resolve(), shipped)
    return local or shipped or path


def _spellings(path: Path, base: Path | None = None) -> list[Path]:
    """`path` (under `base`, if given), then with `.yaml` added where it has no YAML suffix."""
    here = base / path if base is not None else path
    if not path.name or path.suffix in (".yaml", ".yml"):
        return [here]
    return [here, here.with_name(f"{path.name}.yaml")]


def _not_found(ref: str | Path) -> ConfigError:
    stem = Path(ref).with_suffix("").name
    near = [n for n in preset_names() if Path(n).name == stem or stem in n]
    hint = f"; shipped presets of that name: {', '.join(near[:8])}" if near else (
        f"; shipped presets are named like {', '.join(preset_names()[:3])} ({PRESETS})")
    return ConfigError(f"config file not found: {ref} (neither a file here nor a shipped preset{hint})")


def read_yaml(path: str | Path) -> dict[str, Any]:
    ref, path = path, preset_path(path)
    if not path.is_file():
        raise _not_found(ref)
    try:
        data = safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None, cls: type[T] | None = None) -> T:
    """Load a YAML preset (or start empty), apply overrides, build its dataclass.

    The dataclass is `cls` if given, else the one registered for the file's `kind:`.
    """
    _import_config_modules()
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    if cls is None:
        kind = data.get("kind")
        if not isinstance(kind, str) or kind not in CONFIG_KINDS:
            raise ConfigError(
                f"{path}: 'kind: {show(kind)}' is not a known config kind (known: {', '.join(sorted(CONFIG_KINDS))})"
            )
        cls = CONFIG_KINDS[kind]
    elif "kind" in data and getattr(cls, "config_kind", None) != data["kind"]:
        raise ConfigError(f"{path}: kind is {show(data['kind'])}, expected '{cls.config_kind}'")
    try:
        return from_dict(cls, data)
    except ConfigError as e:  # the key is named; the file it came from too (or the overrides)
        source = " + ".join(([str(path)] if path is not None else []) + (["overrides"] if overrides else []))
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


# Modules that register config kinds besides the methods' job configs (methods.py); imported lazily so
# `draftsmith.config` stays light.
CONFIG_MODULES = [
    "draftsmith.data.config",
    "draftsmith.training.config",
    "draftsmith.evaluation.config",
    "draftsmith.retrain.config",
    "draftsmith.benchmark.config",
]


def _import_config_modules() -> None:
    from draftsmith import methods

    for name in CONFIG_MODULES:
        methods.import_listed(name, "config.CONFIG_MODULES")
    for method in methods.all_methods():
        cls = method.get("config")
        if getattr(cls, "config_kind", None) is None:  # a job config without @register_config: its method's name
            register_config(method.name)(cls)
