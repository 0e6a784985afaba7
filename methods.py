"""The drafting methods: each artifact kind declares itself once, in its folder, and every part reads it here.

Every method is one folder whose `__init__.py` holds a `METHOD = Method(...)`: its name (the artifact kind
in `manifest.json`, the proposer spec `NAME:PATH`, `draftsmith train NAME`), its job config class, its
training job (which the one runner trains), how an artifact of it is loaded, turned into a proposer,
exported for each serving stack and sized for `draftsmith plan`. `BUILTIN` names the built-in folders;
adding a method is a folder plus one line there (and the folder in pyproject.toml's package list, for the
wheel), or a `register(Method(...))` call, which is how a test or a plugin adds one without touching any file.

References (`Ref[X]`) are `"module:attribute"` strings naming an X, or the X itself (a method a test or a
plugin registers in code), imported on first use: listing the methods imports none of their code, and decoding
with a head imports its proposer, not its training job. Each is one of:

    config    the job's config dataclass (registered with `@register_config`, so `kind: NAME` presets load)
    job       its `training.job.Job` class (cfg, target, rows=None): the one runner (`runner.train.run`)
              loads the target, trains it through the one loop and evaluates what it wrote
    load      (path, target) -> the artifact's module(s), fingerprint checked against `target`
    proposer  (target, path, **opts) -> a `decoding.proposer.Proposer`
    export    (artifact_dir, stack, out, target, num_speculative_tokens, verify, *, overwrite, verifier)
              -> `layouts.common.ExportResult`; which layout each stack takes, and how each stack launches it,
              is the method's business (layouts/heads.py writes any head layout; distill/export.py a whole
              draft model)
    serving   a `layouts.serving.Serving`: what export/'s drivers ask of its exports (how vLLM serves each
              format, for `draftsmith serve-check`; the target families the measured vLLM refuses), so export/
              names no method
    reimport  (export_dir, guard) -> (config, state, writer or None) of an export of this method (guard:
              its draftsmith.json, {} for another tool's), or None when it is not one; `import_export`
    memory    (path, target_config) -> `memory.serving.ArtifactShape`: parameters and KV cache of the artifact
    tensors   (path) -> (required, optional, problems): the tensor names and shapes `config.json` implies,
              for `draftsmith check` (checks.inspect_artifact)
    train_memory  (job config, target config, activation bytes, learned) -> `memory.training.JobMemory`,
              for `draftsmith plan --config`; `learned`: the loss positions of the planned row (None: every
              one of its max_length tokens), for a method whose steps run on those positions alone
    features  (job config, target) -> {layers, topk, last_hidden, logsumexp}: what the job reads of the frozen
              target per token (capture/online.CaptureSource's arguments), i.e. what an offline capture cache
              must hold for it; the fleet's served states are imported as one (data/served.py). None: the job
              reads no capture, and cannot train from served states
    commands  (subparsers) -> None: adds the method's own subcommands to `draftsmith` (a job only this method
              has, e.g. Medusa-2's `medusa2-drift`); the CLI calls it after its own commands

Besides its name, a method may answer to one `alias` (the draft method's `distill`): `draftsmith ALIAS` is
`draftsmith train NAME` with the same arguments, and wherever a method is named (an artifact kind, a proposer
`ALIAS:PATH`, a bench preset's job) the alias finds it. `train NAME` stays the documented form.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from draftsmith.errors import ConfigError

if TYPE_CHECKING:
    import argparse

T = TypeVar("T")
Ref = str | T  # "package.module:attr" naming a T, imported on first use (`resolve`), or the T itself
Fn = Callable[..., object]  # a function of the method's: its arguments and result are in the module docstring

STACKS = ("vllm", "sglang", "trtllm", "hf")  # the serving stacks an export is written for (`export --to`)

# The folders that declare the built-in methods (each has `METHOD` in its __init__.py), in CLI order.
BUILTIN = (
    "draftsmith.distill",
    "draftsmith.medusa",
    "draftsmith.eagle",
    "draftsmith.dflash",
    "draftsmith.dspark",
)


def import_listed(name: str, listed_in: str) -> Any:
    """Import a module that a list of names (BUILTIN, cli.COMMAND_MODULES, config.CONFIG_MODULES) holds. A name
    that is no module is a one-line error naming the list: a misspelled entry must stop the program, not pass
    as a missing command or config kind. A module that exists but fails to import raises as it is."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # something the module itself imports is missing: its own traceback says what
        raise ConfigError(f"{listed_in} names '{name}', which is not a module (no module named '{e.name}')") from None


def resolve(ref: Any) -> Any:
    """`"package.module:Name.attr"` -> the object; anything else is returned as it is."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Method:
    name: str  # artifact kind, proposer prefix, `draftsmith train NAME`
    summary: str  # one line for `draftsmith train --help`
    # references (module docstring: what each is called with)
    config: Ref[type]  # its job's config dataclass
    job: Ref[type]  # its `training.job.Job` class: the one runner trains it
    load: Ref[Fn]
    proposer: Ref[Fn]
    export: Ref[Fn] | None = None  # None: no serving stack takes it (`draftsmith export` says so)
    reimport: Ref[Fn] | None = None  # None: `import_export` reads none of its exports back
    # a `layouts.serving.Serving`; None: serve-check runs none of its exports, and no vLLM refusal is known
    serving: Ref[object] | None = None
    memory: Ref[Fn] | None = None  # None: `draftsmith plan` counts model.safetensors' parameters and no cache
    tensors: Ref[Fn] | None = None  # None: `draftsmith check` compares no tensor shapes
    train_memory: Ref[Fn] | None = None  # None: `draftsmith plan --config` cannot size its training job
    features: Ref[Fn] | None = None  # None: no capture cache feeds its job (it cannot train from the fleet's states)
    # register(subparsers): jobs only it has, which the CLI adds beside the others; None: it has none
    commands: Ref[Callable[[argparse._SubParsersAction], None]] | None = None
    # plain settings
    alias: str | None = None  # its other name (module docstring): `draftsmith ALIAS` is `train NAME`
    default_config: str | None = None  # the shipped preset, by name, `draftsmith train NAME` uses without --config
    data_key: str = "data"  # the config key naming the self-distilled dataset (retrain and bench set it)
    output_key: str | None = "output"  # the config key naming the artifact folder; None: the job writes
    #                                    <train.output_dir>/artifact
    # its proposer has a shape of its own (a head's tree, DFlash's block chain): the end-of-training evaluation
    # decodes that shape and the proposer's GPU-sized one, not a chain of k
    own_tree: bool = False

    def get(self, what: str) -> Any:
        """The object a reference field names, imported on first use."""
        ref = getattr(self, what)
        if ref is None:
            raise ConfigError(f"method '{self.name}' declares no {what}")
        return resolve(ref)


_METHODS: dict[str, Method] = {}
_loaded = False


def register(method: Method, replace: bool = False) -> Method:
    """Add a method (a name already taken is refused unless `replace`); the built-in ones come first."""
    _load_builtin()
    if method.name in _METHODS and not replace and _METHODS[method.name] != method:
        raise ConfigError(f"method '{method.name}' is already registered")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    _METHODS.pop(name, None)


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for package in BUILTIN:
        method = import_listed(package, "methods.BUILTIN").METHOD
        _METHODS[method.name] = method


def all_methods() -> list[Method]:
    _load_builtin()
    return list(_METHODS.values())


def names() -> list[str]:
    return [m.name for m in all_methods()]


def get(name: str, what: str = "artifact kind") -> Method:
    """The method called `name` (or so aliased); a one-line error naming the known ones."""
    method = find(name)
    if method is None:
        raise ConfigError(f"unknown {what} '{name}' (known: {', '.join(names())})")
    return method


def find(name: str) -> Method | None:
    """The method called `name` (or so aliased), None when there is none."""
    return next((m for m in all_methods() if name in (m.name, m.alias)), None)
