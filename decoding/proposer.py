"""The proposer interface: every drafting method only PROPOSES; `decoding.verify` verifies.

Protocol for one sequence (the verifier drives it, see `decoding/verify.py`):

    proposer.begin(prompt_ids, features)          once, after the target's prefill of the prompt;
                                                   prompt_ids = prompt + the first token the prefill
                                                   produced (pending), features cover prompt_ids[:-1]
    loop:
        proposal = proposer.propose(context, spec) context = every committed token (prompt + output);
                                                   its last token is "pending": the target has not
                                                   run it yet, the proposal continues after it
        ... one target forward verifies the proposal ...
        proposer.accept(result)                    which nodes were accepted, the new tokens, and the
                                                   target's features at the positions it just cached

A proposal is a token TREE rooted at the pending token: `tokens[i]` is node i, `parents[i]` its parent
(-1 = the root), parents come before children. A chain of k tokens is the tree with parents
[-1, 0, 1, ..., k-2]. `q[i]` is the distribution node i was DRAWN from (the proposer's processed
distribution at its parent, see `sampling.probs_from_logits`); all children of one parent must be i.i.d.
draws from that parent's q for the multi-candidate rule to be lossless. `q = None` declares the
candidates deterministic (n-gram matches, Medusa top-k, greedy drafts): the verifier then uses the
"sample y ~ p, follow the child equal to y" rule, lossless for ANY candidate set (see verify.py).

Target features: a proposer that drafts from the target's hidden states declares them:
    needs_last_hidden = True      post-norm last hidden state (Medusa's input)
    target_layers = [1, 14, 26]   pre-norm outputs of these decoder layers (EAGLE / EAGLE-3; the layer
                                  convention of `capture/layers.py`)
The verifier then captures them in its own forward pass (no extra target forward) and hands the
features of the CACHED positions to `begin` (every prompt position) / `accept`: for `accept`, the root (old
pending token) and every accepted node, in order. The last of these positions is the one whose logits produced
the new pending token (the "bonus position"), which is what Medusa heads and EAGLE's next draft start from.

Building one from a spec string (`ngram`, `METHOD:PATH`, `multi:A+B`, `route:POLICY`) is
`decoding/factory.py`'s `build_proposer`; each trained method's proposer is declared in methods.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.errors import ConfigError, DraftsmithError


@dataclass(frozen=True)
class TreeSpec:
    """The shape budget the verifier allows: depth = len(branching); a proposer may return fewer nodes.

    `branching[d]` is the maximum number of children per node at depth d+1 (chain: all 1). `max_nodes`
    caps the total node count (EAGLE-2 style dynamic trees pick the best `max_nodes` of a wider tree).
    """

    branching: tuple[int, ...]
    max_nodes: int | None = None

    @classmethod
    def chain(cls, k: int) -> TreeSpec:
        return cls((1,) * k)

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def is_chain(self) -> bool:
        return all(b == 1 for b in self.branching)

    def capacity(self) -> int:
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total if self.max_nodes is None else min(total, self.max_nodes)

    def truncated(self, depth: int) -> TreeSpec:
        return TreeSpec(self.branching[: max(depth, 0)], self.max_nodes)


@dataclass
class Proposal:
    """A token tree (see module docstring). tokens/parents: [N] long; q: [N, V] float32 or None; scores:
    [N] float or None, node i's estimated probability of being accepted with its whole root path (never
    larger than its parent's), which lets the verifier cut the tree to the nodes that pay (`decoding.budget`)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    scores: torch.Tensor | None = None  # [N] estimated P(node i's root path is accepted); see decoding/budget.py
    _children: dict[int, list[int]] | None = field(default=None, repr=False)
    _depth: list[int] | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> Proposal:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone(), None)

    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor, q: torch.Tensor | None = None,
              device: torch.device | str = "cpu") -> Proposal:
        t = torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(-1)
        parents = torch.arange(-1, len(t) - 1, dtype=torch.long, device=device)
        return cls(t, parents, q)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @property
    def depths(self) -> list[int]:
        """Depth of each node, 1-based (a child of the root has depth 1)."""
        if self._depth is None:
            d: list[int] = []
            for i, p in enumerate(self.parent_list):
                if p >= i:
                    raise DraftsmithError(f"proposal node {i} has parent {p}: parents must come before children")
                d.append(1 if p < 0 else d[p] + 1)
            self._depth = d
        return self._depth

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def children(self) -> dict[int, list[int]]:
        """parent index (-1 = root) -> child node indices, in proposal order."""
        if self._children is None:
            ch: dict[int, list[int]] = {}
            for i, p in enumerate(self.parent_list):
                ch.setdefault(p, []).append(i)
            self._children = ch
        return self._children

    @property
    def is_chain(self) -> bool:
        return self.parent_list == list(range(-1, len(self) - 1))

    def validate(self, spec: TreeSpec, vocab_size: int) -> None:
        n = len(self)
        if self.parents.numel() != n:
            raise DraftsmithError(f"proposal has {n} tokens but {self.parents.numel()} parents")
        if n and self.depth > spec.depth:
            raise DraftsmithError(f"proposal depth {self.depth} exceeds the allowed {spec.depth}")
        if n > spec.capacity():
            raise DraftsmithError(f"proposal has {n} nodes, more than the allowed {spec.capacity()}")
        if n and (int(self.tokens.min()) < 0 or int(self.tokens.max()) >= vocab_size):
            raise DraftsmithError("proposal token id out of the target's vocabulary")
        if self.q is not None and tuple(self.q.shape) != (n, vocab_size):
            raise DraftsmithError(f"proposal q has shape {tuple(self.q.shape)}, expected {(n, vocab_size)}")
        if self.scores is not None and tuple(self.scores.shape) != (n,):
            raise DraftsmithError(f"proposal scores have shape {tuple(self.scores.shape)}, expected {(n,)}")


@dataclass
class TargetFeatures:
    """Target hidden states at some positions: last_hidden [T, H] (post-norm), layers {i: [T, H]} (pre-norm)."""

    last_hidden: torch.Tensor | None = None
    layers: dict[int, torch.Tensor] = field(default_factory=dict)

    def concat(self, layers: list[int], who: str) -> torch.Tensor | None:
        """The given layers' features side by side [T, len(layers)·H] (None when there are none); `who` names the
        proposer in the one-line error when a layer is missing."""
        if not len(self):
            return None
        missing = [i for i in layers if i not in self.layers]
        if missing:
            raise ConfigError(f"{who} needs target layers {layers}, got {sorted(self.layers)}")
        return torch.cat([self.layers[i] for i in layers], dim=-1)

    def __len__(self) -> int:
        if self.last_hidden is not None:
            return int(self.last_hidden.shape[0])
        return int(next(iter(self.layers.values())).shape[0]) if self.layers else 0


@dataclass
class AcceptResult:
    """What one verification step decided, as the proposer sees it.

    accepted_nodes: proposal node indices on the accepted path (root excluded), root to leaf.
    new_tokens: tokens appended to the context (accepted node tokens + the target's correction/bonus token,
                possibly truncated at EOS or the budget).
    context: the full committed context after this step (its last token is the new pending token).
    features: target features of the newly cached positions [root, accepted nodes...] (None when the
              proposer declared none).
    """

    proposal: Proposal
    accepted_nodes: list[int]
    new_tokens: list[int]
    context: torch.Tensor
    features: TargetFeatures | None = None


class Proposer(ABC):
    """Base class. Subclasses implement `propose`; `begin`/`accept` keep proposer state in sync.

    Optional abilities are declared here with the behaviour of a proposer that lacks them, so the verifier,
    the evaluator, routing and multi-proposer trees call them on any proposer without probing:
    `default_tree_spec` (a tree of its own), `fit_tree` (a tree cut once, up front), `use_cost` (drafting
    stops where the verifier would cut), `gpu_tree` (the uncut tree of a GPU-sized budget), `use_dtype`,
    `verifier_target` (Medusa-2), `routes`/`route` (per-request routing), `tracks_branches`/`branch_stats`
    (whose branch of a merged tree was accepted).
    """

    name: str = "proposer"
    target_layers: list[int] = []
    needs_last_hidden: bool = False
    # a Target this proposer must be verified by instead of the run's (Medusa-2: the target with the
    # artifact's adapter merged); plain decoding, HF generate and the cost model then use it too
    verifier_target = None
    # an HF model transformers' assisted generation can draft with (a draft model): the evaluator's HF
    # reference then times `generate(assistant_model=...)` beside it
    assistant_model = None
    routes: bool = False  # picks a route per request: call `route` before each (decoding/routing.py)
    tracks_branches: bool = False  # counts whose branch was accepted: `branch_stats` (decoding/multi.py)
    # estimates each drafted token's acceptance: `acceptance_estimates` (DSpark's confidence head), which the
    # evaluator reports as a calibration (decoding/calibration.py)
    estimates_acceptance: bool = False

    @property
    def needs_features(self) -> bool:
        return self.needs_last_hidden or bool(self.target_layers)

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures | None) -> None:
        """Start a new sequence. prompt_ids: [T] long, the prompt plus the target's first (pending) token;
        features cover prompt_ids[:-1], i.e. every prompt position (None if not declared)."""
        return None

    @abstractmethod
    def propose(self, context: torch.Tensor, spec: TreeSpec, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        """Propose a tree continuing `context` ([L] long, last token pending) within `spec`."""

    def accept(self, result: AcceptResult) -> None:
        """Told after every verification step (roll back own caches here)."""
        return None

    def use_dtype(self, dtype: torch.dtype) -> bool:
        """Run the proposer's own network in `dtype` (see `draft_dtype`); False when it has none to cast.

        Whatever the draft computes in, verification by the target keeps decoding lossless: greedy output
        is the target's, and a sampling proposer samples from, and reports, the q it actually computed."""
        return False

    def default_tree_spec(self) -> TreeSpec | None:
        """The proposer's own tree (Medusa's calibrated tree, EAGLE-2's budget); None: it has none, and a
        run decodes it as a chain of k."""
        return None

    def fit_tree(self, spec: TreeSpec, cost) -> TreeSpec:
        """A tree that is the same every step, cut once, up front, to the nodes that pay under `cost` (a
        `decoding.budget.VerifyCost`); a tree that changes every step is cut by the verifier instead."""
        return spec

    def use_cost(self, cost) -> None:
        """The verifier's cost model (None: it cuts nothing), for a proposer that can stop drafting what the
        cut would drop (EAGLE-2)."""
        return None

    def gpu_tree(self) -> tuple[Proposer, TreeSpec] | None:
        """The proposer and tree a GPU verifies uncut (EAGLE-2's defaults; Medusa's whole calibrated tree),
        which is how the field's τ are measured; None: the proposer has no tree of its own."""
        return None

    def route(self, domain: str | None = None, text: str | None = None) -> str | None:
        """Choose the route of the next request (`routes` proposers); returns the domain it was routed by."""
        return None

    def route_name(self) -> str:
        """The route the last `route` chose (`routes` proposers)."""
        return self.name

    def reset_stats(self) -> None:
        """Start counting `branch_stats` / `acceptance_estimates` afresh."""
        return None

    def branch_stats(self) -> dict[str, dict]:
        """Per branch: proposed, accepted, wins, steps since `reset_stats` (`tracks_branches` proposers)."""
        return {}

    def acceptance_estimates(self) -> tuple[list[float], list[int]]:
        """(estimate, accepted 0/1) of every drafted token the verifier judged since `reset_stats`
        (`estimates_acceptance` proposers)."""
        return [], []


class FeatureProposer(Proposer):
    """A proposer that drafts from the target's features of every committed position: EAGLE's heads, DFlash's
    and DSpark's block drafters. `network` is its own module; its config names the `target_layers` the verifier
    captures for it. The features arrive with `begin` (every prompt position) and `accept` (the root and the
    accepted nodes) and wait in `pending` until the next `propose` enters them into the network's own cache
    (`take_pending`); `restart` clears that cache for a new sequence. Its own tree is the top `topk` at every
    one of `depth` levels, cut to `max_nodes` (EAGLE-2's shape); without `tree` it drafts a chain of `depth`."""

    who = "proposer"  # how a one-line error names it ("EAGLE proposer")

    def __init__(self, network: torch.nn.Module, depth: int, tree: bool, topk: int, max_nodes: int):
        self.network = network.eval()
        self.target_layers = list(network.config.target_layers)  # the verifier captures these for us
        self.depth, self.tree, self.topk, self.max_nodes = depth, tree, topk, max_nodes
        self.n_done = 0  # committed positions entered into the network's own cache
        self.pending: list[torch.Tensor] = []  # target features [n, F] of positions not entered yet

    def default_tree_spec(self) -> TreeSpec:
        if not self.tree:
            return TreeSpec.chain(self.depth)
        return TreeSpec((self.topk,) * self.depth, max_nodes=self.max_nodes)

    def use_dtype(self, dtype: torch.dtype) -> bool:
        from draftsmith.targets.precision import cast_parameters

        cast_parameters(self.network, dtype)  # the target's features and embeddings are cast as they come in
        return True

    @property
    def _device(self) -> torch.device:
        return next(self.network.parameters()).device

    def restart(self) -> None:
        """A new sequence begins: clear the network's own cache (the features are cleared by `begin`)."""

    def _features(self, feats: TargetFeatures | None) -> torch.Tensor | None:
        return feats.concat(self.target_layers, self.who) if feats is not None else None

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures | None) -> None:
        self.restart()
        self.n_done = 0
        f = self._features(features)
        self.pending = [f] if f is not None else []

    def accept(self, result: AcceptResult) -> None:
        f = self._features(result.features)
        if f is not None:
            self.pending.append(f)

    def take_pending(self) -> torch.Tensor | None:
        """The features [n, F] that arrived since the last call, on the network's device (None: none did)."""
        if not self.pending:
            return None
        feats = torch.cat(self.pending).to(self._device)
        self.pending = []
        return feats


def draft_dtype(setting: str | torch.dtype, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype proposers' networks run in: `auto` = bf16 next to a float32 target on a CPU with native bf16
    (a draft step there reads its weights from memory, and bf16 halves the bytes it reads), else the target's
    dtype; anything else names a dtype."""
    from draftsmith.targets.device import select_dtype
    from draftsmith.targets.precision import cpu_native_bf16

    if setting != "auto":
        return select_dtype(device, setting)
    if device.type == "cpu" and target_dtype == torch.float32 and cpu_native_bf16():
        return torch.bfloat16
    return target_dtype


class NullProposer(Proposer):
    """Proposes nothing: plain autoregressive decoding through the speculative code path (k = 0)."""

    name = "none"

    def propose(self, context, spec, sampling, generator) -> Proposal:
        return Proposal.empty(context.device)


def as_model(obj) -> torch.nn.Module:
    """The HF model of a `Target`, or the object itself when it already is a module (an HF causal LM has
    its own `.model` attribute, the inner decoder, so `getattr(x, "model", x)` would be wrong)."""
    return obj if isinstance(obj, torch.nn.Module) else obj.model


_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def side_by_side_entry(entry: str) -> tuple[str, int | str | TreeSpec | None, str | None]:
    """`PROPOSER[@SHAPE][@DTYPE]` -> (proposer spec, how it decodes in the side-by-side run, its draft dtype).

    SHAPE: chain | chain=K | tree | tree=B1,B2,... -> "chain" (a chain of the run's --k), K, "tree" (the
    proposer's own tree) or that TreeSpec; None = the run's own shape. DTYPE: float32 | bfloat16 | float16,
    None = the run's draft_dtype. One run can so put a head's chain next to its tree, or its bf16 next to its
    float32 (`--proposer eagle:P --tree auto --compare eagle:P@chain=4 eagle:P@float32`). An '@' followed by
    anything else is part of the proposer spec (a path may hold one).
    """
    name, shape, dtype = entry, None, None
    while True:
        head, sep, opt = name.rpartition("@")
        kind, eq, arg = opt.partition("=")
        if not sep or not (kind in ("chain", "tree") or opt in _DTYPE_NAMES):
            return name, shape, dtype
        if opt in _DTYPE_NAMES:
            if dtype is not None:
                break
            dtype = opt
        elif shape is not None:
            break
        elif not eq:
            shape = kind
        else:
            try:
                sizes = tuple(int(b) for b in arg.split(","))
            except ValueError:
                sizes = ()
            if not sizes or min(sizes) < 1 or (kind == "chain" and len(sizes) != 1):
                break
            shape = sizes[0] if kind == "chain" else TreeSpec(sizes)
        name = head
    raise ConfigError(f"compare '{entry}': after '@' give one shape (chain, chain=K, tree or tree=B1,B2,..., whole "
                      f"numbers >= 1) and/or one dtype ({', '.join(_DTYPE_NAMES)})")
