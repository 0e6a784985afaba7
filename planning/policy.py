"""Routing policies built from evaluation reports: which proposer (and k / tree), or none, serves each domain.

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
reports are read by evaluation/report_file.py, the one reader of report.json; the policy file's format, and
the decoder that follows it, are decoding/routing.py's. `compare_table` sets a routed run beside the single
artifacts it chose between.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from draftsmith.decoding.proposer import side_by_side_entry
from draftsmith.decoding.routing import DEFAULT_KEYWORDS, OFF, read_json_file
from draftsmith.errors import ConfigError, show
from draftsmith.evaluation.report_file import check_report, in_range, range_text, read_report
from draftsmith.formatting import fmt_num, md_cell

CRITERIA = ("speedup", "tau", "predicted")


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


def build_policy(reports: list[dict | str | Path], threshold: float = 1.0, router: str = "declared",
                 keywords: dict[str, list[str]] | None = None, criterion: str = "speedup",
                 profile: str | dict | None = None) -> dict:
    """The routing policy of a set of evaluation reports (dicts or report.json paths) on one target; the
    proposers a report decoded side by side (`evaluate --compare`) are candidates too. Each domain goes to
    the lossless candidate with the highest `criterion` (module docstring), or off below `threshold`
    (ties: the one with fewer verified nodes a step)."""
    if criterion not in CRITERIA:
        raise ConfigError(f"criterion must be one of {', '.join(CRITERIA)}, got {criterion!r}")
    if not in_range(threshold, -math.inf):
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


def _route_entry(report: dict, domain: dict) -> dict:
    """A domain's route: the proposer and shape it decodes in, and what it was measured at. `measured_in`: the shape
    its numbers were decoded in (the report's `shape`: an engine's, `--as-served`, or draftsmith's own decoder's;
    a report from before the field, or a side-by-side run, says draftsmith's decoder)."""
    s = report.get("settings") or {}
    shape = report.get("shape") or s.get("shape") or {"engine": "draftsmith", "label": "draftsmith's decoder"}
    return {"proposer": report["proposer"], "k": s.get("k"), "tree": s.get("tree"),
            "tree_max_nodes": s.get("tree_max_nodes"), "speedup": domain.get("speedup"),
            "alpha": domain.get("alpha"), "tau": domain.get("tau"), "report": report.get("_path"),
            "measured_in": {"engine": shape.get("engine"), "label": shape.get("label")}}


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
        if not in_range(cost, 0.0, lo_open=True):
            return f"v.{key} is {show(cost)}: expected {range_text(0.0, lo_open=True)} (the cost in target steps)"
    if c is not None and not isinstance(c, dict):
        return f"c is {show(c)}: expected a map of proposer kind -> drafting cost"
    for kind, cost in (c or {}).items():
        if not in_range(cost, 0.0):
            return f"c.{kind} is {show(cost)}: expected {range_text(0.0)} (the drafting cost in target steps)"
    if not isinstance(spec.get("name", "custom"), str):
        return f"name is {show(spec['name'])}: expected a string"
    return None


def write_policy(policy: dict, path: str | Path) -> Path:
    from draftsmith.outputs import atomic_write_json

    path = Path(path)
    atomic_write_json(path, policy)
    return path


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
            raise ConfigError("the routed report has no side-by-side runs (evaluate --compare) "
                              "and no reports were given")
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
