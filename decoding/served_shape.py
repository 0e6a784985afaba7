"""Engine profiles: the exact shape a serving engine drafts and verifies a drafter in, so that draftsmith's decoder
can decode it the same way (`evaluate --as-served ENGINE`) and every number says which shape it is.

    vllm     one speculative method per engine (vLLM removed tree speculation): an EAGLE/EAGLE-3 chain of
             `num_speculative_tokens`, a draft model's chain, Medusa's top-1 chain (one token per head), a DFlash or
             DSpark block of k (DSpark's verified prefix sized by its confidence head under
             `enable_adaptive_verification`), n-gram lookup; draft tokens are the draft's argmax
             (`draft_sample_method: greedy`), verified by the target's rejection sampler
    sglang   EAGLE's tree from `--speculative-eagle-topk`, `--speculative-num-steps`,
             `--speculative-num-draft-tokens` (a beam of topk per step, the best num_draft_tokens - 1 nodes verified);
             a draft model's chain; DFlash's block
    trtllm   what export/ writes for TensorRT-LLM: EAGLE's chain of `max_draft_len`, Medusa's `medusa_choices` tree, a
             draft model's chain

Each method declares how each engine serves its artifacts (`Serving.shape` in its export.py, returning a
`layouts.serving.Served`); this module adds the proposers no method owns (n-gram lookup) and refuses the shapes
no engine serves: draftsmith's merged trees (`multi:`) and per-domain routing (`route:`) are its own decoder's.
Without a profile, a report's numbers are "draftsmith's decoder" (DRAFTSMITH).
"""

from __future__ import annotations

from pathlib import Path

from draftsmith import methods
from draftsmith.errors import ConfigError
from draftsmith.layouts.serving import ENGINE_NAMES, Served

ENGINES = tuple(ENGINE_NAMES)  # vllm, sglang, trtllm
DRAFTSMITH = "draftsmith"  # the `shape.engine` of a run decoded by draftsmith's own decoder (no --as-served)
NGRAM_MAX = 3  # the n-gram sizes vLLM is given for draftsmith's `ngram` (prompt_lookup_max; min 1)
DEFAULT_K = 4  # the draft length an engine is given where the drafter fixes none (export's default)


def check_engine(engine: str, field: str = "as_served") -> None:
    if engine not in ENGINES:
        raise ConfigError(f"{field}: unknown engine {engine!r} (known: {', '.join(ENGINES)})")


def served_shape(engine: str, proposer: str, k: int | None = None, options: dict | None = None) -> Served:
    """How `engine` serves the drafter named by the proposer spec (`ngram[:N]`, `METHOD:PATH`), at `k` draft tokens
    (None: the drafter's own, else DEFAULT_K); `options`: the engine settings an export may set (SGLang's `topk`,
    `num_steps`, `num_draft_tokens`; vLLM's `adaptive_verification`). A shape the engine cannot serve is one
    ConfigError line naming the engine and why."""
    check_engine(engine)
    name = ENGINE_NAMES[engine]
    kind, _, arg = proposer.partition(":")
    kind = kind.strip().lower()
    if kind in ("multi", "route"):
        what = "merges several proposers' trees into one" if kind == "multi" else "routes each domain to a proposer"
        raise ConfigError(f"--as-served {engine}: '{proposer}' {what}, which is draftsmith's own decoder: {name} "
                          "serves one speculative method per engine; evaluate each drafter as served on its own")
    if kind in ("none", "plain"):
        raise ConfigError(f"--as-served {engine}: proposer '{proposer}' drafts nothing; there is no served shape")
    if kind == "ngram":
        return _ngram(engine, arg, k)
    method = methods.find(kind)
    if method is None or not arg:
        raise ConfigError(f"--as-served {engine}: proposer '{proposer}' is not ngram[:N] or METHOD:PATH")
    serving = method.get("serving") if method.serving is not None else None
    if serving is None or serving.shape is None:
        raise ConfigError(f"--as-served {engine}: no engine profile is known for {method.name} artifacts")
    from draftsmith.artifact import resolve_path

    shape = serving.shape(engine, Path(resolve_path(arg)), k, dict(options or {}))
    if k is not None and shape.k != k and not shape.form == "tree":
        raise ConfigError(f"--as-served {engine}: {proposer} serves {shape.k} draft tokens a step, not k {k}")
    return shape


def _ngram(engine: str, arg: str, k: int | None) -> Served:
    """vLLM's n-gram proposer: the longest n-gram (up to N) ending the context, at its EARLIEST earlier occurrence
    (vllm/v1/spec_decode/ngram_proposer.py), the tokens after it drafted as a chain."""
    if engine != "vllm":
        raise ConfigError(f"--as-served {engine}: {ENGINE_NAMES[engine]}'s n-gram speculation builds its drafts "
                          "from a trie of many matches, which draftsmith does not model; use --as-served vllm")
    try:
        n = int(arg) if arg else NGRAM_MAX
    except ValueError:
        raise ConfigError(f"--as-served {engine}: ngram:N needs an integer N, got {arg!r}") from None
    k = DEFAULT_K if k is None else k
    return Served("vllm", "ngram", "chain", k,
                  params={"num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": 1},
                  opts={"max_ngram": n, "min_ngram": 1, "earliest": True})


def proposer_spec(proposer: str, shape: Served) -> tuple[str, dict]:
    """(the proposer spec, the options `build_proposer` gets) that draft `shape` (n-gram's N is in the options)."""
    kind = proposer.partition(":")[0].strip().lower()
    return ("ngram" if kind == "ngram" else proposer), dict(shape.opts)


def draftsmith_shape(k: int | None, tree: list[int] | None, max_nodes: int | None, proposer: str) -> dict:
    """The report's `shape` of a run with no engine profile: draftsmith's own decoder, labelled so (merged trees,
    routing, cost-model cuts and GPU-sized trees are its own, no engine serves them as such)."""
    form = "tree" if tree and any(b > 1 for b in tree) else "chain"
    depth = len(tree) if tree else (k or 0)
    out = {"engine": DRAFTSMITH, "method": proposer.partition(":")[0], "form": form, "k": depth,
           "label": f"draftsmith's decoder {form} k={depth}"}
    if tree:
        out.update(tree=list(tree), tree_max_nodes=max_nodes)
    return out
