"""Per-domain routing in the decoder: `RoutedProposer` serves each request with the route its domain has in a
routing policy, and `load_policy` reads and checks a policy file.

A routing policy says which proposer (and k / tree), or none, serves each domain; planning/policy.py builds
one from evaluation reports (`draftsmith route`). The policy file (JSON):

    {"kind": "routing_policy", "threshold": 1.0, "criterion": "speedup", "target": {fingerprint},
     "router": {"kind": "declared", "keywords": {...}},      # how a request without a domain is classified
     "default": "off" | {route},                              # requests of an unknown domain
     "domains": {"code": {"proposer": "ngram", "k": 4, "tree": null, "tree_max_nodes": null,
                          "speedup": 1.33, "alpha": 0.4, "report": "runs/eval/ngram/report.json",
                          "candidates": {"ngram": 1.33, "medusa:...": 0.6}},
                 "general": "off", ...}}

`RoutedProposer` is the decoder mode that follows it: `route(domain=..., text=...)` picks the route of a
request before it is decoded (the evaluator calls it with each prompt's declared domain); the classifier
hook is `router.classify(text)` — the declared domain when there is one, else a keyword router (counts of
per-domain keywords in the request's instruction, not a long passage it quotes; ties and no hits -> the
default route). Sub-proposers are built once per distinct spec.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from draftsmith.decoding.proposer import Proposal, Proposer, TargetFeatures, TreeSpec
from draftsmith.errors import ConfigError, DataError, MissingFile, show
from draftsmith.reading import is_int, read_json

OFF = "off"


# a deliberately small default vocabulary per domain of the shared eval sets; override in the policy
DEFAULT_KEYWORDS = {
    "code": ["def ", "return", "python", "function", "import ", "class ", "code", "```", "script", "(self", "list",
             "string", "array", ">>>"],
    "math": ["how many", "how much", "total", "each", "per ", "calculate", "dollars", "$", "percent", "sum of",
             "times", "half", "twice", "left?"],
    "instructions": ["write a", "make a", "create a", "give me", "suggest", "list of", "email", "plan",
                     "recipe", "tweet"],
    "general": ["what is", "explain", "describe", "why", "who", "tell me"],
    # (math's "sum of", not "sum": every "summary" held it)
    # the broad eval sets' domains (prompts/README.md); multi-turn is a conversation's shape, not its words
    "translation": ["translate", "translation", "into english", "into french", "into german", "into spanish",
                    "into chinese", "into japanese", "how would you say", "mean in english"],
    "summarization": ["summarize", "summarise", "summary", "tl;dr", "in brief", "key points", "sum up", "main points",
                      "condense", "outline", "distill", "synthesize", "concise", "abstract", "in a few words",
                      "boils down", "recap"],
    # "article" is not a rag word: an article is what one summarizes as often as what one asks about
    "rag": ["passage", "context", "according to", "based on the", "the following text", "answer the question",
            "extract the answer", "the following question", "answer to the question", "answer for the question",
            "question:", "paragraph", "movie plot", "background"],
}


# a request's instruction sits at its start or its end; a long passage pasted between them is not the request
EDGE_CHARS = 200


# domains whose keywords open requests of every kind ("write a summary", "what is the answer to the question")
CATCH_ALL = ("general", "instructions")


class KeywordRouter:
    """domain = the one whose keywords occur most often in the request's instruction (lower-cased); None when
    nothing decides.

    Counting over a whole long passage let its body outvote the instruction: a news story's numbers ("each",
    "per ", "$") sent summaries to math. A request that pastes a passage states what it wants in a short line
    before or after it, so the instruction is the shorter of the first and the last line when it has at most
    EDGE_CHARS characters (a passage's edge lines are mostly longer), else the first and last EDGE_CHARS
    characters ("\\n" between them, so no keyword spans the cut); the whole text when it is no longer than both.
    A tie between a catch-all domain (CATCH_ALL: "write a", "what is" open every kind of request) and exactly one
    specific domain goes to the specific one; any other tie, and an instruction with no keyword at all, is
    decided by the whole text, as before."""

    def __init__(self, keywords: dict[str, list[str]] | None = None):
        self.keywords = {d: [k.lower() for k in ks] for d, ks in (keywords or DEFAULT_KEYWORDS).items()}

    def _scores(self, low: str) -> dict[str, int]:
        return {d: sum(low.count(k) for k in ks) for d, ks in self.keywords.items()}

    @staticmethod
    def _winner(scores: dict[str, int]) -> str | None:
        best = max(scores.values(), default=0)
        winners = [d for d, s in scores.items() if s == best]
        return winners[0] if best > 0 and len(winners) == 1 else None

    @staticmethod
    def instruction(low: str) -> str:
        """The part of a (lower-cased) request that says what is asked (see the class docstring)."""
        if len(low) <= 2 * EDGE_CHARS:
            return low
        lines = [line.strip() for line in low.splitlines() if line.strip()]
        shorter = min(lines[0], lines[-1], key=len)
        return shorter if len(shorter) <= EDGE_CHARS else low[:EDGE_CHARS] + "\n" + low[-EDGE_CHARS:]

    def classify(self, text: str) -> str | None:
        low = (text or "").lower()
        asked = self._scores(self.instruction(low))
        best = max(asked.values(), default=0)
        tied = [d for d, s in asked.items() if s == best] if best > 0 else list(asked)
        specific = [d for d in tied if d not in CATCH_ALL]
        if len(tied) == 1 or (best > 0 and len(specific) == 1):
            return (specific or tied)[0]
        whole = self._scores(low)
        return self._winner({d: whole[d] for d in tied})


def read_json_file(path: str | Path, error: type[Exception] = DataError) -> Any:
    """A JSON file read from outside (a report, a policy, a profile): reading.read_json, a missing file an
    `error` of the caller's kind (a policy is configuration, a report data)."""
    try:
        return read_json(path)
    except MissingFile as e:
        raise error(str(e)) from None


def load_policy(path: str | Path) -> dict:
    """A routing policy file, validated as it is read: one ConfigError naming the file and the field the
    decoder could not follow (`policy_problem`)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ConfigError(f"routing policy not found: {path}")
    policy = read_json_file(path, ConfigError)
    if (not isinstance(policy, dict) or policy.get("kind") != "routing_policy"
            or not isinstance(policy.get("domains"), dict)):
        raise ConfigError(f"{path}: not a routing policy (kind: routing_policy with a domains map)")
    problem = policy_problem(policy)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return policy


MAX_ROUTE_K = 64  # a chain longer than this never pays; a larger k is a typo


def route_problem(route, where: str) -> str | None:
    """Why `route` (a policy's domain entry or default) is not "off" or {proposer, k, tree, tree_max_nodes}."""
    if route == OFF:
        return None
    if not isinstance(route, dict):
        return f"{where} is {show(route)}: give \"off\" or a route {{proposer, k, tree}}"
    if not isinstance(route.get("proposer"), str) or not route["proposer"].strip():
        return f"{where}.proposer missing (a proposer spec such as ngram or medusa:PATH)"
    if route["proposer"].startswith("route:"):
        return f"{where}.proposer {route['proposer']!r}: routes do not nest"
    k, tree, nodes = route.get("k"), route.get("tree"), route.get("tree_max_nodes")
    if k is not None and not (is_int(k) and 1 <= k <= MAX_ROUTE_K):
        return f"{where}.k is {show(k)}: an int in 1..{MAX_ROUTE_K} (or null)"
    if tree is not None and not (isinstance(tree, list) and tree and all(is_int(b) and 1 <= b <= MAX_ROUTE_K
                                                                         for b in tree) and len(tree) <= MAX_ROUTE_K):
        return f"{where}.tree is {show(tree)}: a non-empty list of branching factors in 1..{MAX_ROUTE_K} (or null)"
    if nodes is not None and not (is_int(nodes) and nodes >= 1):
        return f"{where}.tree_max_nodes is {show(nodes)}: an int >= 1 (or null)"
    return None


def policy_problem(policy: dict) -> str | None:
    """The first field of a routing policy that decoding could not follow, one line, or None."""
    for name, route in policy["domains"].items():
        problem = route_problem(route, f"domains.{name}")
        if problem:
            return problem
    problem = route_problem(policy.get("default", OFF), "default")
    if problem:
        return problem
    router = policy.get("router") or {}
    if not isinstance(router, dict) or router.get("kind", "declared") not in ("declared", "keyword"):
        return f"router.kind is {show(router.get('kind') if isinstance(router, dict) else router)}: declared or keyword"
    keywords = router.get("keywords")
    if keywords is not None and not (isinstance(keywords, dict) and all(
            isinstance(ks, list) and all(isinstance(k, str) and k for k in ks) for ks in keywords.values())):
        return "router.keywords: a map of domain -> list of non-empty strings"
    target = policy.get("target")
    if target is not None and not (isinstance(target, dict) and isinstance(target.get("fingerprint") or {}, dict)):
        return f"target is {show(target)}: a JSON object with a fingerprint mapping (or null)"
    return None


def route_spec(route: dict, proposer: Proposer) -> TreeSpec:
    if route.get("tree"):
        return TreeSpec(tuple(int(b) for b in route["tree"]), route.get("tree_max_nodes"))
    k = route.get("k")
    own = proposer.default_tree_spec() if k is None else None
    return own or TreeSpec.chain(int(k if k is not None else 4))


class RoutedProposer(Proposer):
    """Delegates each request to the route of its domain (see module docstring)."""

    routes = True

    def __init__(self, policy: dict, proposers: dict[str, Proposer]):
        self.policy = policy
        self.proposers = proposers  # proposer spec -> built proposer
        router = policy.get("router") or {}
        self.router_kind = router.get("kind", "declared")
        self.keyword_router = KeywordRouter(router.get("keywords"))
        self.name = "route"
        self.active: tuple[Proposer, TreeSpec] | None = None
        self.active_entry: dict | str | None = None
        self.active_domain: str | None = None
        self.active_spec: str = OFF
        self.counts: dict[str, int] = {}
        self.cost = None  # the verifier's VerifyCost when it cuts trees (decoding/budget.py)
        self.fitted: dict[tuple[str, TreeSpec], TreeSpec] = {}  # a route's static tree, cut once per cost model
        self.shapes: dict[str, TreeSpec] = {}  # proposer spec -> the tree it decodes with, over the policy's

    def gpu_tree(self) -> tuple[RoutedProposer, TreeSpec] | None:
        """Every route at its GPU-sized budget (its proposer's `gpu_tree`; a route without one, such as n-gram
        lookup, as it is), so a routed evaluation reports per domain the τ a GPU would see."""
        own = {spec: p.gpu_tree() for spec, p in self.proposers.items()}
        if all(g is None for g in own.values()):
            return None
        other = RoutedProposer(self.policy, {spec: g[0] if g else self.proposers[spec] for spec, g in own.items()})
        other.shapes = {spec: g[1] for spec, g in own.items() if g}
        return other, other.default_tree_spec()

    def _own_spec(self, entry: dict, prop: Proposer) -> TreeSpec:
        return self.shapes.get(entry["proposer"]) or route_spec(entry, prop)

    def use_dtype(self, dtype: torch.dtype) -> bool:
        self.fitted.clear()  # a static tree's cut counted the heads' time in the old dtype
        return any([p.use_dtype(dtype) for p in self.proposers.values()])

    def use_cost(self, cost) -> None:
        """Pass the verifier's cost model on: every route's proposer may stop drafting what would be cut
        (EAGLE-2), and a static tree (Medusa's) is cut once per route."""
        if cost is not self.cost:
            self.fitted.clear()
        self.cost = cost
        for prop in self.proposers.values():
            prop.use_cost(cost)
        if self.active is not None:  # the route chosen before this verifier existed gets the cut too
            self.active = (self.active[0], self._route_spec(self.active_entry, self.active[0]))

    def _route_spec(self, entry: dict, prop: Proposer) -> TreeSpec:
        spec = self._own_spec(entry, prop)
        if self.cost is None:
            return spec
        key = (entry["proposer"], spec)
        if key not in self.fitted:
            self.fitted[key] = prop.fit_tree(spec, self.cost)
        return self.fitted[key]

    @classmethod
    def from_file(cls, path: str | Path, target, build_proposer, **opts) -> RoutedProposer:
        """The policy at `path` with a proposer per route, each made by `build_proposer` (decoding/factory.py's,
        handed down so that this module does not import the factory that imports it)."""
        from draftsmith.targets.fingerprint import check_compatible

        policy = load_policy(path)
        if (policy.get("target") or {}).get("fingerprint"):
            check_compatible(policy["target"]["fingerprint"], target.fingerprint(), what=f"routing policy {path}")
        specs = {r["proposer"] for r in list(policy["domains"].values()) + [policy.get("default")]
                 if isinstance(r, dict)}
        opts.pop("k", None)
        proposers = {s: build_proposer(s, target, **opts) for s in sorted(specs)}
        return cls(policy, proposers)

    # --- routing ----------------------------------------------------------------------------------
    def classify(self, domain: str | None, text: str | None) -> str | None:
        """The domain a request is routed by: its declared one (router 'declared'), else the keywords'."""
        if domain and self.router_kind == "declared":
            return domain
        return self.keyword_router.classify(text or "")

    def route(self, domain: str | None = None, text: str | None = None) -> str | None:
        """Choose the route for the next request; returns the domain used (None = the default route)."""
        name = self.classify(domain, text)
        entry = self.policy["domains"].get(name) if name is not None else None
        if entry is None:
            entry = self.policy.get("default", OFF)
        self.active_spec = entry["proposer"] if isinstance(entry, dict) else OFF
        if entry == OFF or entry is None:
            self.active = None
        else:
            prop = self.proposers[entry["proposer"]]
            self.active = (prop, self._route_spec(entry, prop))
        self.active_entry = entry
        self.active_domain = name
        key = f"{name or 'default'}->{entry['proposer'] if isinstance(entry, dict) else OFF}"
        self.counts[key] = self.counts.get(key, 0) + 1
        return name

    def route_name(self) -> str:
        return self.active_spec

    def default_tree_spec(self) -> TreeSpec:
        """A verifier budget wide enough for every route (per-depth max branching, max node count)."""
        specs = [self._own_spec(r, self.proposers[r["proposer"]]) for r in self.policy["domains"].values()
                 if isinstance(r, dict)]
        if not specs:
            return TreeSpec.chain(1)
        depth = max(s.depth for s in specs)
        branching = tuple(max([s.branching[d] for s in specs if d < s.depth] or [1]) for d in range(depth))
        return TreeSpec(branching, max(s.capacity() for s in specs))

    # --- the proposer protocol, delegated ---------------------------------------------------------
    @property
    def needs_last_hidden(self) -> bool:  # read by the verifier at every forward: only the active route's needs
        return bool(self.active and self.active[0].needs_last_hidden)

    @property
    def target_layers(self) -> list[int]:
        return list(self.active[0].target_layers) if self.active else []

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures | None) -> None:
        if self.active:
            self.active[0].begin(prompt_ids, features)

    def propose(self, context, spec: TreeSpec, sampling, generator) -> Proposal:
        if not self.active:
            return Proposal.empty(context.device)
        prop, own = self.active
        depth = min(own.depth, spec.depth)
        if depth == 0:
            return Proposal.empty(context.device)
        # the route's own shape, inside the verifier's budget
        branching = tuple(min(a, b) for a, b in zip(own.branching[:depth], spec.branching[:depth]))
        caps = [c for c in (own.max_nodes, spec.max_nodes) if c is not None]
        return prop.propose(context, TreeSpec(branching, min(caps) if caps else None), sampling, generator)

    def accept(self, result) -> None:
        if self.active:
            self.active[0].accept(result)
