"""Per-domain routing: which proposer (and k / tree), or none, serves each domain.

A routing policy is built from evaluation reports of several artifacts on the same target
(`build_policy`): for each domain the lossless run that scores highest by the policy's `criterion` wins,
and a domain whose best score stays below `threshold` is routed "off" (plain decoding). Criteria:

    speedup     the speedup measured in the reports, on the machine that ran them (a CPU's verify cost);
    tau         τ at the GPU-sized budget (the report's `gpu_tree` τ; a run without one, such as n-gram
                lookup's chain, its own τ): what a GPU, where verifying 60 nodes costs about one step, accepts;
    predicted   the cost model's speedup τ / (v(n) + c) for a verify-cost profile (`VerifyProfile`: v(n) of the
                serving hardware, c per proposer kind), n the verified nodes a step at that same budget.

so a GPU user's choice is not made by this CPU's timing. The candidates are the runs of the reports and the
runs they decoded side by side (`evaluate --compare`): the head's tree, the head merged with lookup
(`multi:ngram+eagle:...`), lookup alone; the policy records the criterion and every candidate's value. The
policy file (JSON):

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

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from draftsmith.decoding.proposer import Proposal, Proposer, TargetFeatures, TreeSpec, side_by_side_entry
from draftsmith.errors import ConfigError, DataError, MissingFile, show
from draftsmith.formatting import fmt_num, md_cell
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


CRITERIA = ("speedup", "tau", "predicted")


class VerifyProfile:
    """A verify-cost profile for the `predicted` criterion: v(n), the cost of verifying n nodes in target steps
    (linear between the given points, flat before the first, growing past the last at its last slope), and c,
    a proposer kind's drafting time a step in target steps (`c` by the spec's kind, e.g. {"eagle": 0.2,
    "ngram": 0}; a kind not given takes what the report measured). `gpu`: v(n) = 1 up to 64 nodes, then
    n / 64 (a GPU verifies EAGLE-2's 60 nodes for about the price of one step)."""

    BUILTIN = {"gpu": {"name": "gpu", "v": {"0": 1.0, "64": 1.0, "128": 2.0}, "c": {"ngram": 0.0}}}

    def __init__(self, spec: dict, where: str = "verify profile"):
        problem = profile_problem(spec)
        if problem:
            raise ConfigError(f"{where}: {problem}")
        self.name = spec.get("name", "custom")
        self.points = sorted((int(n), float(v)) for n, v in spec["v"].items())
        self.c = {k: float(v) for k, v in (spec.get("c") or {}).items()}

    @classmethod
    def load(cls, what: str | dict | None) -> VerifyProfile | None:
        if what is None or isinstance(what, dict):
            return None if what is None else cls(what)
        if what in cls.BUILTIN:
            return cls(cls.BUILTIN[what])
        path = Path(what)
        if not os.path.lexists(path):
            raise ConfigError(f"verify profile {what!r}: not a built-in ({', '.join(cls.BUILTIN)}) nor a JSON file")
        spec = read_json_file(path, ConfigError)
        return cls({"name": path.stem, **spec} if isinstance(spec, dict) else spec, str(path))

    def v(self, n: float) -> float:
        pts = self.points
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
            if n <= n1:
                return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
        (n0, v0), (n1, v1) = pts[-2], pts[-1]
        return v1 + max(v1 - v0, 0.0) / (n1 - n0) * (n - n1)

    def draft_cost(self, proposer: str, measured: float | None) -> tuple[float, str]:
        """c of a proposer spec (a `multi:` spec: the sum of its parts'), and where it came from."""
        kinds = [p.partition(":")[0].strip().lower() for p in
                 (proposer.partition(":")[2].split("+") if proposer.startswith("multi:") else [proposer])]
        if all(k in self.c for k in kinds):
            return sum(float(self.c[k]) for k in kinds), f"profile {self.name}"
        return (measured or 0.0), "measured in the report" if measured is not None else "unknown (0)"


_NODE_COUNT = 10**6  # a verify profile's node counts: a GPU verifies at most a few thousand nodes a step


def _number(value: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> bool:
    """A finite int or float (never a bool) in [lo, hi] (or (lo, hi] with `lo_open`)."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and (value > lo if lo_open else value >= lo) and value <= hi)


def _range(lo: float, hi: float = math.inf, lo_open: bool = False) -> str:
    low = f"> {lo:g}" if lo_open else f">= {lo:g}"
    return f"a finite number {low}" if hi == math.inf else f"a finite number in [{lo:g}, {hi:g}]"


def profile_problem(spec: Any) -> str | None:
    """Why `spec` is not a verify profile {"v": {node count: cost > 0}, "c": {kind: cost >= 0}}, or None."""
    if not isinstance(spec, dict):
        return f"expected a JSON object {{\"v\": {{nodes: cost}}, \"c\": {{kind: cost}}}}, got {show(spec)}"
    v, c = spec.get("v"), spec.get("c")
    if not isinstance(v, dict) or not v:
        return "`v` needs at least one node count -> positive cost, e.g. {\"0\": 1.0}"
    seen = set()
    for key, cost in v.items():
        digits = str(key)
        if not (digits.isascii() and digits.isdigit() and int(digits) <= _NODE_COUNT):
            return f"v key {show(key)} is not a node count (an int in 0..{_NODE_COUNT})"
        if int(digits) in seen:
            return f"v has node count {int(digits)} twice"
        seen.add(int(digits))
        if not _number(cost, 0.0, lo_open=True):
            return f"v.{key} is {show(cost)}: expected {_range(0.0, lo_open=True)} (the cost in target steps)"
    if c is not None and not isinstance(c, dict):
        return f"c is {show(c)}: expected a map of proposer kind -> drafting cost"
    for kind, cost in (c or {}).items():
        if not _number(cost, 0.0):
            return f"c.{kind} is {show(cost)}: expected {_range(0.0)} (the drafting cost in target steps)"
    if not isinstance(spec.get("name", "custom"), str):
        return f"name is {show(spec['name'])}: expected a string"
    return None


def read_json_file(path: str | Path, error: type[Exception] = DataError) -> Any:
    """A JSON file read from outside (a report, a policy, a profile): reading.read_json, a missing file an
    `error` of the caller's kind (a policy is configuration, a report data)."""
    try:
        return read_json(path)
    except MissingFile as e:
        raise error(str(e)) from None


# ---- evaluation reports: what routing (and retraining) reads of `evaluate`'s report.json --------------------

# a domain row's numbers: (lowest, highest, lowest excluded); None is always allowed (not measured)
DOMAIN_NUMBERS = {
    "speedup": (0.0, math.inf, True), "alpha": (0.0, 1.0, False), "tau": (0.0, math.inf, False),
    "verified_nodes_per_step": (0.0, math.inf, False), "target_forwards": (0.0, math.inf, False),
    "proposer_time_s": (0.0, math.inf, False), "tokens_per_s": (0.0, math.inf, False),
    "baseline_tokens_per_s": (0.0, math.inf, False), "hf_generate_tokens_per_s": (0.0, math.inf, False),
    "speedup_vs_plain": (0.0, math.inf, True), "speedup_vs_hf_generate": (0.0, math.inf, True),
}


def domain_problem(row: Any, where: str, nested: bool = True) -> str | None:
    """Why a report's domain row (or `overall`, or a side-by-side run's row) is not one routing can trust."""
    if not isinstance(row, dict):
        return f"{where} is {show(row)}: expected a JSON object (a domain's measurements)"
    for key, (lo, hi, lo_open) in DOMAIN_NUMBERS.items():
        if row.get(key) is not None and not _number(row[key], lo, hi, lo_open):
            return f"{where}.{key} is {show(row[key])}, expected {_range(lo, hi, lo_open)}"
    n = row.get("n_prompts")
    if n is not None and not (_number(n, 0) and isinstance(n, int)):
        return f"{where}.n_prompts is {show(n)}, expected an int >= 0"
    if row.get("lossless") is not None and not isinstance(row["lossless"], bool):
        return f"{where}.lossless is {show(row['lossless'])}, expected true, false or null"
    if row.get("route") is not None and not isinstance(row["route"], str):
        return f"{where}.route is {show(row['route'])}, expected a proposer spec (a string)"
    gpu = row.get("gpu_tree")
    if gpu is not None:
        problem = domain_problem(gpu, f"{where}.gpu_tree", nested=False)
        if problem:
            return problem
    side = row.get("compare")
    if side is not None and not (nested and isinstance(side, dict)):
        return f"{where}.compare is {show(side)}, expected a map of side-by-side run -> its measurements"
    return next((p for name, r in (side or {}).items() if (p := domain_problem(r, f"{where}.compare.{name}", False))),
                None)


def _settings_problem(settings: Any) -> str | None:
    if not isinstance(settings, dict):
        return f"settings is {show(settings)}, expected a JSON object"
    shape = {k: settings.get(k) for k in ("k", "tree", "tree_max_nodes")}
    problem = route_problem({"proposer": "x", **shape}, "settings")
    side = settings.get("compare_settings")
    if problem or side is None:
        return problem
    if not isinstance(side, dict):
        return f"settings.compare_settings is {show(side)}, expected a map of side-by-side run -> its settings"
    for name, each in side.items():
        try:
            side_by_side_entry(name)
        except ConfigError as e:
            return f"settings.compare_settings: {e}"
        if not isinstance(each, dict):
            return f"settings.compare_settings.{name} is {show(each)}, expected a JSON object"
        shape = {k: each.get(k) for k in ("k", "tree", "tree_max_nodes")}
        if problem := route_problem({"proposer": "x", **shape}, f"settings.compare_settings.{name}"):
            return problem
    return None


def report_problem(report: Any) -> str | None:
    """The first field of an evaluation report that routing and retraining could not trust, one line, or None:
    a proposer spec, a domains map of rows whose numbers are finite and in range (DOMAIN_NUMBERS), settings
    whose shape a routing policy accepts (route_problem), mappings where mappings are read."""
    if not isinstance(report, dict):
        return f"expected a JSON object (an evaluation report), got {show(report)}"
    proposer = report.get("proposer")
    if proposer is None:
        return "proposer is missing (an evaluation report names the proposer it measured)"
    if not isinstance(proposer, str) or not proposer.strip():
        return f"proposer is {show(proposer)}, expected a proposer spec (a non-empty string)"
    target = report.get("target")
    if target is not None and not (isinstance(target, dict) and isinstance(target.get("fingerprint") or {}, dict)):
        return f"target is {show(target)}, expected a JSON object with a fingerprint mapping"
    cost = report.get("cost_model")
    if cost is not None and not isinstance(cost, dict):
        return f"cost_model is {show(cost)}, expected a JSON object"
    t_step = (cost or {}).get("t_step_decode_s")
    if t_step is not None and not _number(t_step, 0.0, lo_open=True):
        return f"cost_model.t_step_decode_s is {show(t_step)}, expected {_range(0.0, lo_open=True)}"
    if report.get("settings") is not None and (problem := _settings_problem(report["settings"])):
        return problem
    domains = report.get("domains")
    if not isinstance(domains, dict):
        return f"domains is {show(domains)}, expected a map of domain -> its measurements"
    if report.get("overall") is not None and (problem := domain_problem(report["overall"], "overall")):
        return problem
    return next((p for name, row in domains.items() if (p := domain_problem(row, f"domains.{name}"))), None)


def check_report(report: Any, where: str) -> dict:
    """`report` when `report_problem` finds nothing, else one DataError naming `where` and the field."""
    problem = report_problem(report)
    if problem:
        raise DataError(f"{where}: {problem}")
    return report


def read_report(path: str | Path) -> dict:
    """An evaluation report (report.json, or the folder holding one), validated as it is read (`check_report`),
    with its path kept under `_path`."""
    path = Path(path)
    path = path / "report.json" if path.is_dir() else path
    if not os.path.lexists(path):
        raise ConfigError(f"evaluation report not found: {path}")
    return {**check_report(read_json_file(path), str(path)), "_path": str(path)}


def _route_entry(report: dict, domain: dict) -> dict:
    s = report.get("settings") or {}
    return {"proposer": report["proposer"], "k": s.get("k"), "tree": s.get("tree"),
            "tree_max_nodes": s.get("tree_max_nodes"), "speedup": domain.get("speedup"),
            "alpha": domain.get("alpha"), "tau": domain.get("tau"), "report": report.get("_path")}


def _at_gpu_budget(domain: dict) -> tuple[float | None, float | None]:
    """τ and verified nodes a step with the GPU-sized tree where the run decoded one, else the run's own."""
    g = domain.get("gpu_tree") or {}
    if g.get("tau") is not None:
        return g["tau"], g.get("verified_nodes_per_step")
    return domain.get("tau"), domain.get("verified_nodes_per_step")


def _measured_c(report: dict, domain: dict) -> float | None:
    """The proposer's time a verify step in target steps, as the run measured it (None where not kept)."""
    t_step = (report.get("cost_model") or {}).get("t_step_decode_s")
    forwards, spent = domain.get("target_forwards"), domain.get("proposer_time_s")
    if not t_step or not forwards or spent is None:
        return None
    return spent / forwards / t_step


def criterion_value(criterion: str, report: dict, domain: dict, profile: VerifyProfile | None) -> dict:
    """A candidate's score under `criterion` ({"value": ...} and what it was computed from)."""
    if criterion == "speedup":
        return {"value": domain.get("speedup")}
    tau, nodes = _at_gpu_budget(domain)
    if criterion == "tau":
        return {"value": tau, "gpu_tree": bool((domain.get("gpu_tree") or {}).get("tau"))}
    if tau is None:
        return {"value": None}
    c, source = profile.draft_cost(str(report["proposer"]), _measured_c(report, domain))
    v = profile.v(nodes or 0.0)
    return {"value": tau / (v + c), "tau": tau, "nodes": nodes, "v": v, "c": c, "c_from": source}


def build_policy(reports: list[dict | str | Path], threshold: float = 1.0, router: str = "declared",
                 keywords: dict[str, list[str]] | None = None, criterion: str = "speedup",
                 profile: str | dict | None = None) -> dict:
    """The routing policy of a set of evaluation reports (dicts or report.json paths) on one target; the
    proposers a report decoded side by side (`evaluate --compare`) are candidates too. Each domain goes to
    the lossless candidate with the highest `criterion` (module docstring), or off below `threshold`
    (ties: the one with fewer verified nodes a step)."""
    if criterion not in CRITERIA:
        raise ConfigError(f"criterion must be one of {', '.join(CRITERIA)}, got {criterion!r}")
    if not _number(threshold, -math.inf):
        raise ConfigError(f"threshold is {show(threshold)}: expected a finite number")
    prof = VerifyProfile.load(profile if profile is not None else ("gpu" if criterion == "predicted" else None))
    loaded = _load_reports(reports)
    if router not in ("declared", "keyword"):
        raise ConfigError(f"router must be 'declared' or 'keyword', got {router!r}")
    domains = {name: _best_route(name, loaded, criterion, prof, threshold)
               for name in sorted({d for r in loaded for d in r["domains"]})}
    return {"kind": "routing_policy", "threshold": threshold, "criterion": criterion,
            **({"profile": {"name": prof.name, "v": {str(n): v for n, v in prof.points}, "c": prof.c}} if prof else {}),
            "target": loaded[0].get("target") or {},
            "router": {"kind": router, "keywords": keywords or DEFAULT_KEYWORDS}, "default": OFF,
            "domains": domains}


def _best_route(name: str, loaded: list[dict], criterion: str, prof: VerifyProfile | None,
                threshold: float) -> dict | str:
    """Domain `name`'s route: the lossless candidate with the highest criterion value (ties: fewer verified
    nodes a step, then the first by proposer and report path: `loaded` is in that order), or OFF."""
    cands = []
    for r in loaded:
        d = r["domains"].get(name)
        if d is None or d.get("lossless") is False:
            continue  # a run that was not lossless never serves traffic
        score = criterion_value(criterion, r, d, prof)
        if score["value"] is not None:
            cands.append((score["value"], -(d.get("verified_nodes_per_step") or 0.0), r, d, score))
    if not cands:
        return OFF
    value, _, r, d, score = max(cands, key=lambda c: (c[0], c[1]))
    if value < threshold:
        return OFF
    table = {c[2]["proposer"]: c[0] for c in cands}
    return {**_route_entry(r, d), "value": value, **({"basis": score} if criterion != "speedup" else {}),
            "candidates": dict(sorted(table.items()))}


def _load_reports(reports: list[dict | str | Path]) -> list[dict]:
    """The reports (each validated as it is read: `read_report`, `check_report`) and their side-by-side runs as
    report-shaped dicts, all of one target (routed runs left out: routes do not nest), in the order of their
    proposer and path, so that no choice depends on the order they were given in."""
    loaded = [check_report(r, str(r.get("_path") or f"report {i + 1}")) if isinstance(r, dict) else read_report(r)
              for i, r in enumerate(reports)]
    if not loaded:
        raise ConfigError("routing needs at least one evaluation report")
    loaded = [x for r in loaded for x in [r, *_compared(r)] if not str(x["proposer"]).startswith("route:")]
    loaded.sort(key=lambda r: (str(r["proposer"]), str(r.get("_path") or "")))
    hashes = {json.dumps((r.get("target") or {}).get("fingerprint") or {}, sort_keys=True) for r in loaded}
    if len(hashes) > 1:
        raise ConfigError("the reports were measured on different targets (fingerprints differ): route one target")
    return loaded


def _compared(report: dict) -> list[dict]:
    """The proposers an evaluation decoded side by side (`evaluate --compare`), as report-shaped dicts: each
    under its proposer spec (an entry's `@tree` / `@chain=K` / dtype suffix is how it decoded there, which its
    settings keep), with its GPU-sized tree's τ per domain where the run decoded one."""
    specs = (report.get("settings") or {}).get("compare_settings") or {}
    out = []
    for name, settings in specs.items():
        domains = {d: v["compare"][name] for d, v in report["domains"].items() if name in (v.get("compare") or {})}
        out.append({"proposer": side_by_side_entry(name)[0], "target": report.get("target") or {}, "settings": settings,
                    "domains": domains,
                    "_path": f"{report.get('_path', '')} (--compare {name})"})
    return out


def write_policy(policy: dict, path: str | Path) -> Path:
    from draftsmith.outputs import atomic_write_json

    path = Path(path)
    atomic_write_json(path, policy)
    return path


def load_policy(path: str | Path) -> dict:
    """A routing policy file, validated as it is read: one ConfigError naming the file and the field the
    decoder could not follow (`policy_problem`)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ConfigError(f"routing policy not found: {path}")
    policy = read_json_file(path, ConfigError)
    if not isinstance(policy, dict) or policy.get("kind") != "routing_policy" or not isinstance(policy.get("domains"), dict):
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


def short_name(spec: str) -> str:
    """`medusa:runs/medusa/smollm2-135m` -> `medusa:smollm2-135m` (table headers)."""
    kind, sep, arg = spec.partition(":")
    return f"{kind}:{Path(arg).name}" if sep and "/" in arg else spec


def compare_table(routed: dict, singles: list[dict] | None = None, noise: float = 0.03) -> tuple[str, dict]:
    """Markdown: per domain, the routed run's speedup next to every single artifact's and the best choice
    among them and plain decoding (speedup 1.0, what an "off" route gets). The singles are the proposers the
    routed evaluation decoded side by side (`evaluate --compare ...`, same prompts, same run) unless
    `singles` (separate reports) are given. `ratio` = routed / best; a ratio in [1 - noise, 1) is reported
    as "within noise". Returns (markdown, {domain: {"routed", "route", "best", "best_choice", "ratio",
    "verdict"}})."""
    if singles:
        names = [s["proposer"] + ("" if not s.get("settings", {}).get("tree") else " (tree)") for s in singles]
        lookup = lambda dom, i: singles[i]["domains"].get(dom, {}).get("speedup")  # noqa: E731
    else:
        first = next((d["compare"] for d in routed["domains"].values() if d.get("compare")), None)
        if not first:
            raise ConfigError("the routed report has no side-by-side runs (evaluate --compare) and no reports were given")
        names = list(first)
        lookup = lambda dom, i: (routed["domains"][dom].get("compare") or {}).get(names[i], {}).get("speedup")  # noqa: E731
    headers = [short_name(n) for n in names]
    lines = ["| domain | routed (route) | " + " | ".join(md_cell(h) for h in headers) +
             " | best choice | routed / best | |", "|" + "---|" * (len(names) + 5)]
    out = {}
    for dom, d in sorted(routed["domains"].items()):
        single = [lookup(dom, i) for i in range(len(names))]
        choices = [(v, n) for v, n in zip(single, headers) if v is not None] + [(1.0, "plain")]
        best_v, best_n = max(choices, key=lambda c: c[0])
        r = d.get("speedup")
        ratio = r / best_v if r is not None else None
        verdict = "–" if ratio is None else ("yes" if ratio >= 1.0 else "within noise" if ratio >= 1 - noise else "no")
        route = short_name(d.get("route", "?"))
        out[dom] = {"routed": r, "route": route, "best": best_v, "best_choice": best_n, "ratio": ratio,
                    "verdict": verdict}
        lines.append(f"| {md_cell(dom)} | {fmt_num(r, '.2f')} ({md_cell(route)}) | "
                     + " | ".join(fmt_num(v, '.2f') for v in single)
                     + f" | {md_cell(best_n)} {fmt_num(best_v, '.2f')} | {fmt_num(ratio, '.2f')} "
                     + f"| {verdict} |")
    return "\n".join(lines) + "\n", out
