"""An evaluation's settings resolved into what it runs (`build_setup` -> `Setup`): the target that verifies
(a Medusa-2 artifact brings its own adapted one), the proposer and the shape its main entry decodes (a chain
of k, the configured tree or the proposer's own), the prompts and how many turns of each fit the target's
context, the side-by-side entries (`--compare`), adaptive k's controller, and the trees the cost model
measured here cuts. Nothing is decoded yet: evaluation/decode.py does that.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from draftsmith.decoding import cost
from draftsmith.decoding.budget import VerifyCost
from draftsmith.decoding.factory import build_proposer
from draftsmith.decoding.proposer import Proposer, TreeSpec, draft_dtype, side_by_side_entry
from draftsmith.decoding.served_shape import proposer_spec, served_shape
from draftsmith.errors import ConfigError
from draftsmith.evaluation.config import EvalConfig
from draftsmith.evaluation.domains import EvalPrompt, default_prompt_files, load_prompts, only_domains
from draftsmith.evaluation.limits import check_prompt_files, fit_context, leave_out_long
from draftsmith.layouts.serving import Served
from draftsmith.targets.device import dtype_name

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One proposer decoding every prompt of the run: the main one ("spec"), a side-by-side one
    ("cmp:ENTRY"), or the main one under adaptive k ("adaptive"); `kw` is how `speculative_generate`
    decodes it (k, tree, cost, adaptive)."""

    name: str
    proposer: Proposer
    kw: dict
    draft_dtype: str | None = None  # what its network runs in (None: it has none to cast)
    shape: Served | None = None  # the engine's shape it decodes (`as_served`); None: draftsmith's decoder


@dataclass
class Setup:
    """A run's settings, resolved: the target that verifies, the prompts, the spec tree and every entry."""

    cfg: EvalConfig
    target: object
    original_target: object | None  # the run's target when the proposer brings its own verifier (Medusa-2)
    prop: Proposer
    spec: TreeSpec
    rows: list[EvalPrompt]
    files: list[str]
    gen_kw: dict
    entries: list[Entry]
    assistant: object | None = None  # a draft model for HF assisted generation
    verify_cost: VerifyCost | None = None
    tree_cost: dict | None = None
    turns: list[int] | None = None  # turns measured per row (evaluation/turns.py); None: one each
    turns_cut: list[dict] = dataclasses.field(default_factory=list)  # rows the context cut short, with why
    left_out: list[dict] = dataclasses.field(default_factory=list)  # shipped prompts longer than the context
    # the machine is busy throughout (other processes' CPU share above cost.BUSY_SHARE when the run started, or
    # through two whole rounds of a prompt): each prompt gets one round, for its acceptance and losslessness,
    # until a round is quiet again; the prompts decoded so are counted, their speedups not measured
    busy: bool = False
    busy_prompts: int = 0

    @property
    def main(self) -> Entry:
        return self.entries[0]

    @property
    def compared(self) -> list[Entry]:
        return [e for e in self.entries if e.name.startswith("cmp:")]

    @property
    def compared_gpu_trees(self) -> list[Entry]:
        """The side-by-side entries' GPU-sized trees ("gpu:ENTRY"), decoded untimed for their τ."""
        return [e for e in self.entries if e.name.startswith("gpu:")]


def build_setup(target, proposer: str | Proposer, cfg: EvalConfig) -> Setup:
    """Load what the run needs and decide how each entry decodes: the spec tree (the proposer's own under
    `tree_from_proposer`), the side-by-side entries' shapes and dtypes, adaptive k's controller, and the
    trees cut by the cost model measured here."""
    if isinstance(target, str):
        from draftsmith.targets import load_target

        target = load_target(target, device=cfg.device, dtype=cfg.dtype)
    _check_cost_context(target, cfg)
    shape = None
    if cfg.as_served is not None:  # the engine decides the shape: the proposer is built to draft exactly it
        shape, prop, spec, cfg = _as_served(target, proposer, cfg)
    else:
        prop = proposer if isinstance(proposer, Proposer) else build_proposer(cfg.proposer, target)
    original_target = None
    if prop.verifier_target is not None:
        original_target, target = target, prop.verifier_target
    drafts_in = draft_dtype(cfg.draft_dtype, target.dtype, target.device)
    cast = prop.use_dtype(drafts_in)
    if shape is None:
        spec, cfg = _spec_tree(prop, cfg)
    rows, files, left_out, turns, turns_cut = _eval_rows(target, cfg)
    eos = list(target.eos_token_ids)
    entries = [Entry("spec", prop, dict(tree=spec, k=None) if cfg.tree else dict(k=cfg.k),
                     dtype_name(drafts_in) if cast else None, shape)]
    if cfg.adaptive:
        from draftsmith.decoding.adaptive import AdaptiveK

        log.info("adaptive k: measuring v(k), k = 0..%d, for the controller", cfg.k)
        controller = AdaptiveK(cost.measure_verify_cost(target, cfg.cost_context, cfg.k, 3, cfg.seed)["v"], k_max=cfg.k)
        entries.append(Entry("adaptive", prop, dict(k=cfg.k, adaptive=controller)))
    prop.route(domain=rows[0].domain, text=rows[0].text)  # a routed proposer measures with a route chosen
    entries += [_compare(s, target, cfg, drafts_in) for s in cfg.compare]
    setup = Setup(cfg, target, original_target, prop, spec, rows, files,
                  dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, eos_ids=eos), entries,
                  assistant=prop.assistant_model if cfg.hf_reference else None, turns=turns, turns_cut=turns_cut,
                  left_out=left_out)
    # a chain whose proposer estimates each token's acceptance (DSpark's confidence) is cut like a scored tree, and
    # so is a served shape with adaptive verification
    if ((cfg.prune_tree and (not spec.is_chain or prop.estimates_acceptance))
            or any(e.shape is not None and e.shape.adaptive_verification for e in entries)):
        _cut_trees(setup)
    if cfg.prune_tree:
        _add_gpu_trees(setup, spec, drafts_in)
    return setup


def _as_served(target, proposer: str | Proposer, cfg: EvalConfig) -> tuple[Served, Proposer, TreeSpec, EvalConfig]:
    """The shape `cfg.as_served` serves the proposer in (decoding/served_shape.py), the proposer built to draft it,
    its TreeSpec and the config that decodes it: a chain or block of k, or the engine's tree, uncut and with no
    GPU-sized tree beside it (draftsmith's own); DSpark's adaptive verification is its chain cut by the cost model
    (decoding/budget.py: vLLM's rule, with the verify cost measured here)."""
    engine = cfg.as_served
    mine = [name for name, on in (("--tree", cfg.tree is not None), ("--tree auto", cfg.tree_from_proposer),
                                  ("--adaptive", cfg.adaptive)) if on]
    if mine or not isinstance(proposer, str):
        raise ConfigError(f"--as-served {engine}: the engine decides the shape it serves; drop {mine[0]} "
                          "(draftsmith's own decoder's)" if mine else
                          f"--as-served {engine}: give the proposer by its spec (ngram[:N], METHOD:PATH)")
    shape = _served(engine, cfg.proposer, cfg)
    name, opts = proposer_spec(cfg.proposer, shape)
    prop = build_proposer(name, target, **opts)
    spec, tree = _served_spec(shape)
    log.info("decoding as %s serves it: %s", engine, shape.label())
    return shape, prop, spec, dataclasses.replace(cfg, k=shape.k, tree=tree, gpu_tree=False,
                                                  prune_tree=shape.adaptive_verification)


def _served(engine: str, proposer: str, cfg: EvalConfig) -> Served:
    """The engine's shape of one proposer at the run's k, or at the drafter's own block (a block drafter is served
    only as the block it was trained on, whatever --k says)."""
    own = served_shape(engine, proposer, None, cfg.as_served_options) if proposer.partition(":")[2] else None
    if own is not None and own.form == "block":
        if own.k != cfg.k:
            log.info("%s: %s serves its block of %d draft tokens (k %d not used)", proposer, engine, own.k, cfg.k)
        return own
    return served_shape(engine, proposer, cfg.k, cfg.as_served_options)


def _served_spec(shape: Served) -> tuple[TreeSpec, list[int] | None]:
    """(the TreeSpec the verifier allows, the config's `tree`) of a served shape: a tree with its node budget, a
    chain the confidence cut sizes (adaptive verification) as the chain tree it is, else a chain of k."""
    if shape.form == "tree":
        return TreeSpec(tuple(shape.branching), max_nodes=shape.max_nodes), list(shape.branching)
    if shape.adaptive_verification:
        return TreeSpec.chain(shape.k), [1] * shape.k
    return TreeSpec.chain(shape.k), None


def _check_cost_context(target, cfg: EvalConfig) -> None:
    """The cost model's timed forwards read `cost_context` cached positions and up to cost_k_max + 1 new ones: all
    must lie inside the target's context, or v(k) is measured on positions the target never reads. Refused at
    the start, before anything is decoded."""
    from draftsmith.targets.context import context_window

    ctx = context_window(target)
    if ctx is not None and cfg.cost_context + cfg.cost_k_max + 1 > ctx:
        raise ConfigError(f"cost_context {cfg.cost_context} (+ cost_k_max {cfg.cost_k_max} + 1 verified positions) is "
                          f"more than the target's context of {ctx} positions (max_position_embeddings): lower "
                          "cost_context")


def _spec_tree(prop: Proposer, cfg: EvalConfig) -> tuple[TreeSpec, EvalConfig]:
    """The shape the main entry decodes: the proposer's own tree under `tree_from_proposer` (written back into
    the config, so the report names it), else the configured tree, else a chain of k."""
    if cfg.tree_from_proposer:
        spec = prop.default_tree_spec()
        if spec is None:
            raise ConfigError(f"proposer '{cfg.proposer}' has no tree of its own: give tree branching factors")
        return spec, dataclasses.replace(cfg, tree=list(spec.branching))
    return (TreeSpec(tuple(cfg.tree)) if cfg.tree else TreeSpec.chain(cfg.k)), cfg


def _eval_rows(target, cfg: EvalConfig) -> tuple[list, list[str], list[dict], list, list[dict]]:
    """The prompts the run decodes and what it leaves out of them: (rows, prompt files, prompts left out for
    the target's context, each row's turns, the rows measured on fewer turns than they have)."""
    files = cfg.prompts or [str(p) for p in default_prompt_files(cfg.split)]
    check_prompt_files(files)
    rows = only_domains(load_prompts(files, cfg.limit_per_domain, cfg.seed), cfg.domains, files)
    left_out: list[dict] = []
    if not cfg.prompts:  # the shipped sets: a short-context target is measured on what it can read
        rows, left_out = leave_out_long(target, rows, cfg.max_new_tokens, cfg.chat_template_kwargs)
        if left_out:
            log.warning("%d shipped prompts left out: longer than the target's context (%s, ...)", len(left_out),
                        left_out[0]["reason"])
        if not rows:
            raise ConfigError(f"no shipped eval prompt fits the target's context with max_new_tokens "
                              f"{cfg.max_new_tokens} ({left_out[0]['reason']}, ...)")
    turns, turns_cut = fit_context(target, rows, cfg.max_new_tokens, cfg.chat_template_kwargs, cfg.turns)
    for c in turns_cut:
        log.warning("prompt %s: measured on %d of its %d turns: %s", c["prompt"], c["measured"], c["turns"],
                    c["reason"])
    return rows, files, left_out, turns, turns_cut


def _add_gpu_trees(setup: Setup, spec: TreeSpec, drafts_in: torch.dtype) -> None:
    """Beside the proposer's own shape, tree or chain (DFlash's own shape is its block's chain), and beside
    every side-by-side tree, the GPU-sized tree uncut: what a GPU verifies, decoded here for its τ (its speed
    is this CPU's), so several heads' τ at a GPU's budget come from one run. `spec`: the main entry's shape
    as decided, before the cost model cut it."""
    cfg, prop, target = setup.cfg, setup.prop, setup.target
    if not cfg.gpu_tree:
        return
    if not spec.is_chain or cfg.tree_from_proposer:
        gpu = prop.gpu_tree()
        if gpu is not None:
            gpu[0].use_dtype(drafts_in)
            setup.entries.append(Entry("gpu_tree", gpu[0], dict(tree=gpu[1], k=None), setup.main.draft_dtype))
    for e in setup.compared:
        _, shape, own_dtype = side_by_side_entry(e.name[4:])
        decodes_a_tree = shape == "tree" or isinstance(shape, TreeSpec) or (shape is None and cfg.tree_from_proposer)
        other = e.proposer.gpu_tree() if decodes_a_tree and e.kw.get("tree") is not None else None
        if other is not None:  # cast as _compare cast the entry itself
            other[0].use_dtype(draft_dtype(own_dtype, target.dtype, target.device) if own_dtype else drafts_in)
            setup.entries.append(Entry(f"gpu:{e.name[4:]}", other[0], dict(tree=other[1], k=None), e.draft_dtype))


def _compare(entry: str, target, cfg: EvalConfig, drafts_in: torch.dtype) -> Entry:
    """A side-by-side entry `PROPOSER[@SHAPE][@DTYPE]` (see `side_by_side_entry`) as it decodes in this run."""
    name, shape, own_dtype = side_by_side_entry(entry)
    if cfg.as_served is not None:
        return _compare_served(entry, name, shape, own_dtype, target, cfg, drafts_in)
    other = build_proposer(name, target)
    if other.verifier_target is not None:
        raise ConfigError(f"compare '{entry}': a Medusa-2 artifact is verified by its own adapted target, not by "
                          f"the target of this run; evaluate it in a run of its own")
    other_dtype = draft_dtype(own_dtype, target.dtype, target.device) if own_dtype else drafts_in
    other_cast = other.use_dtype(other_dtype)
    if shape is None:  # the run's own shape: the proposer's tree under --tree auto, else a chain of --k
        own = other.default_tree_spec() if cfg.tree_from_proposer else None
    elif shape == "tree":
        own = other.default_tree_spec()
        if own is None:
            raise ConfigError(f"compare '{entry}': proposer '{name}' has no tree of its own: give @tree=B1,B2,...")
    elif isinstance(shape, TreeSpec):
        own = shape
    else:  # "chain" (of --k) or a chain of K tokens
        own = None
    kw = dict(tree=own, k=None) if own is not None else dict(k=shape if isinstance(shape, int) else cfg.k)
    return Entry(f"cmp:{entry}", other, kw, dtype_name(other_dtype) if other_cast else None)


def _compare_served(entry: str, name: str, shape, own_dtype: str | None, target, cfg: EvalConfig,
                    drafts_in: torch.dtype) -> Entry:
    """A side-by-side entry under `as_served`: decoded in the shape the engine serves it (no @SHAPE of its own)."""
    if shape is not None:
        raise ConfigError(f"compare '{entry}': --as-served {cfg.as_served} decodes every proposer as the engine "
                          "serves it; drop the @shape")
    served = _served(cfg.as_served, name, cfg)
    spec_name, opts = proposer_spec(name, served)
    other = build_proposer(spec_name, target, **opts)
    other_dtype = draft_dtype(own_dtype, target.dtype, target.device) if own_dtype else drafts_in
    other_cast = other.use_dtype(other_dtype)
    tree_spec, tree = _served_spec(served)
    kw = dict(tree=tree_spec, k=None) if tree else dict(k=served.k)
    return Entry(f"cmp:{entry}", other, kw, dtype_name(other_dtype) if other_cast else None, served)


def _cut_trees(setup: Setup) -> None:
    """Scored trees (Medusa, EAGLE-2) are cut every step to the nodes that pay: v(n) with a tree mask,
    measured here before decoding, over every node count a tree of this run can have. A tree that is the
    same every step (Medusa's) is cut once, up front."""
    # an engine's tree is verified whole; of the served shapes only adaptive verification is cut
    cfg, trees = setup.cfg, [e for e in setup.entries if e.kw.get("tree") is not None
                             and (e.shape is None or e.shape.adaptive_verification)]
    if not trees:  # every entry decodes a chain of --k (no --tree): nothing to cut, nothing to measure for it
        return
    n_max = max(e.kw["tree"].capacity() for e in trees)
    log.info("measuring v(n), n = 0..%d tree nodes, to size the trees", n_max)
    setup.tree_cost = cost.measure_verify_cost(setup.target, cfg.cost_context, n_max, min(cfg.cost_repeats, 5),
                                               cfg.seed, tree_mask=True)
    setup.verify_cost = VerifyCost.from_measurement(setup.tree_cost)
    for e in trees:
        e.kw["cost"] = setup.verify_cost
        e.kw["tree"] = e.proposer.fit_tree(e.kw["tree"], setup.verify_cost)
    if setup.main.kw.get("tree") is None:  # the main entry is a chain of --k; side-by-side trees were cut
        return
    setup.spec = setup.main.kw["tree"]
    log.info("tree cut to at most %d nodes, branching %s, by the cost model", setup.spec.capacity(),
             list(setup.spec.branching))
