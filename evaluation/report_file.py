"""report.json's one home: the evaluation report as `evaluate` builds it (`build_report`), and as every
reader reads it back (`read_report`, `check_report`, `report_problem`, `domain_problem`): routing policies
(planning/policy.py), retraining's gate and staleness (retrain/decide.py), the headline blocks
(benchmark/headline.py). evaluation/report.py renders the same dict as report.md and plots.

A report read back is trusted only after `report_problem` found nothing: a proposer spec, a domains map of
rows whose numbers are finite and in range (DOMAIN_NUMBERS), settings whose shape a routing policy accepts
(decoding/routing.py's `route_problem`), mappings where mappings are read. One DataError names the file and
the field.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from draftsmith.decoding.proposer import TreeSpec, side_by_side_entry
from draftsmith.decoding.routing import read_json_file, route_problem
from draftsmith.decoding.served_shape import draftsmith_shape
from draftsmith.errors import ConfigError, DataError, show
from draftsmith.evaluation.decode import all_or_none
from draftsmith.evaluation.setup import Entry, Setup
from draftsmith.layouts.serving import FORMS
from draftsmith.targets import gemm


def build_report(setup: Setup, proposer_name: str, command: str | None, per_prompt: list[dict], domains: dict,
                 overall: dict, cost_model: dict, recommended: dict, policy: dict) -> dict:
    """The report dict: the run's command, machine, target and settings, each domain's and the overall numbers,
    the cost model, recommended k and policy, memory, the outside references and every prompt's record
    (`evaluate` adds `contention`)."""
    cfg, spec, target = setup.cfg, setup.spec, setup.target
    original = setup.original_target
    return {
        "command": command or " ".join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": machine_info(target.device),
        "target": {"name": target.name, "spec": target.spec, "fingerprint": (original or target).fingerprint(),
                   **({"adapted": "the artifact's LoRA adapter merged (Medusa-2)"} if original else {})},
        "proposer": proposer_name,
        # the shape every number of this report was decoded in: an engine's (`--as-served`) or draftsmith's own
        "shape": entry_shape(setup.main, cfg, spec, proposer_name),
        "settings": {
            "max_new_tokens": cfg.max_new_tokens, "k": None if cfg.tree else cfg.k, "tree": cfg.tree,
            "tree_max_nodes": spec.max_nodes, "prune_tree": setup.verify_cost is not None,
            "tree_verified": list(spec.branching) if cfg.tree else None,  # after a cut by the cost model
            "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
            "limit_per_domain": cfg.limit_per_domain, "seed": cfg.seed, "prompt_files": setup.files,
            "split": None if cfg.prompts else cfg.split, "domains": list(cfg.domains), "repeats": cfg.repeats,
            "remeasure": cfg.remeasure,
            "adaptive": cfg.adaptive, "compare": list(cfg.compare),
            "chat_template_kwargs": dict(cfg.chat_template_kwargs),
            "turns": cfg.turns, "turns_cut": list(setup.turns_cut), "left_out": list(setup.left_out),
            "gpu_tree": next(({"tree": list(e.kw["tree"].branching), "tree_max_nodes": e.kw["tree"].max_nodes}
                              for e in setup.entries if e.name == "gpu_tree"), None),
            "draft_dtype": setup.main.draft_dtype,  # None: the proposer has no network to cast
            "compare_settings": {e.name[4:]: {"k": e.kw["k"],
                                              "tree": list(e.kw["tree"].branching) if e.kw.get("tree") else None,
                                              "tree_max_nodes": e.kw["tree"].max_nodes if e.kw.get("tree") else None,
                                              "draft_dtype": e.draft_dtype,
                                              "shape": entry_shape(e, cfg, e.kw.get("tree"), e.name[4:]),
                                              "gpu_tree": next(({"tree": list(g.kw["tree"].branching),
                                                                 "tree_max_nodes": g.kw["tree"].max_nodes}
                                                                for g in setup.compared_gpu_trees
                                                                if g.name[4:] == e.name[4:]), None)}
                                 for e in setup.compared},
        },
        "domains": domains,
        "overall": overall,
        "cost_model": cost_model,
        "recommended_k": recommended,
        "policy": policy,
        "memory": memory_info(target.device),
        "references": _references(setup, per_prompt, overall),
        "prompts": [{k: v for k, v in r.items() if k not in ("base", "spec", "adaptive", "adaptive_k", "compare",
                                                              "gpu_tree", "compare_gpu_tree")} | {
            "alpha": r["spec"].alpha, "tau": r["spec"].tau,
            "tokens_per_s": r["spec"].new_tokens / r["spec"].wall_time if r["spec"].wall_time else None,
            "baseline_tokens_per_s": r["base"].new_tokens / r["base"].wall_time if r["base"].wall_time else None,
        } for r in per_prompt],
    }


def entry_shape(entry: Entry, cfg, spec: TreeSpec | None, proposer: str) -> dict:
    """The `shape` of one run (docs/evaluation.md): the engine's served shape under `as_served`, else draftsmith's
    decoder with the chain or tree it decoded (engine "draftsmith")."""
    if entry.shape is not None:
        return entry.shape.to_json()
    tree = list(spec.branching) if spec is not None and entry.kw.get("tree") is not None else None
    k = entry.kw.get("k") if entry.kw.get("k") is not None else cfg.k
    return draftsmith_shape(k, tree, spec.max_nodes if tree else None, side_by_side_entry(proposer)[0])


def _references(setup: Setup, per_prompt: list[dict], overall: dict) -> dict:
    """Plain decoding's speed, and HF generate (and assisted generation) beside it: speed and same output."""
    references: dict = {"plain_decoding_tokens_per_s": overall["baseline_tokens_per_s"]}
    if not setup.cfg.hf_reference:
        references["lossless_not_judged"] = ("no independent reference in this run (hf_reference off): `lossless` "
                                             "is null; `self_consistent` compares with our own plain decoding")
        return references
    hf_tps = overall["hf_generate_tokens_per_s"]  # over the validly timed prompts, like plain decoding's
    flags = [r.get("hf_matches_baseline") for r in per_prompt]
    references["hf_generate"] = {"tokens_per_s": hf_tps, "matches_plain_decoding": all_or_none(flags),
                                 "n_mismatch": sum(1 for f in flags if f is False),
                                 "role": "the independent reference: `lossless` is equality with its greedy output"}
    references["plain_vs_hf_generate"] = ((overall["baseline_tokens_per_s"] / hf_tps)
        if hf_tps and overall["baseline_tokens_per_s"] else None)
    if setup.assistant is not None:
        a_tok = sum(r.get("assisted_tokens", 0) for r in per_prompt)
        a_time = sum(r.get("assisted_time", 0.0) for r in per_prompt)
        references["hf_assisted_generate"] = {
            "tokens_per_s": a_tok / a_time if a_time > 0 else None,
            "matches_target_greedy": all_or_none([r.get("assisted_matches_baseline") for r in per_prompt]),
        }
    return references


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device),
            "few_row_kernels": gemm.describe()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def memory_info(device: torch.device) -> dict:
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}  # KB on Linux
    try:
        import psutil

        out["rss_mb"] = psutil.Process().memory_info().rss / 2**20
    except ImportError:
        pass
    if device.type == "cuda":
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


# a domain row's numbers: (lowest, highest, lowest excluded); None is always allowed (not measured)
DOMAIN_NUMBERS = {
    "speedup": (0.0, math.inf, True), "alpha": (0.0, 1.0, False), "tau": (0.0, math.inf, False),
    "verified_nodes_per_step": (0.0, math.inf, False), "target_forwards": (0.0, math.inf, False),
    "proposer_time_s": (0.0, math.inf, False), "tokens_per_s": (0.0, math.inf, False),
    "baseline_tokens_per_s": (0.0, math.inf, False), "hf_generate_tokens_per_s": (0.0, math.inf, False),
    "speedup_vs_plain": (0.0, math.inf, True), "speedup_vs_hf_generate": (0.0, math.inf, True),
}


def in_range(value: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> bool:
    """A finite int or float (never a bool) in [lo, hi] (or (lo, hi] with `lo_open`)."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and (value > lo if lo_open else value >= lo) and value <= hi)


def range_text(lo: float, hi: float = math.inf, lo_open: bool = False) -> str:
    low = f"> {lo:g}" if lo_open else f">= {lo:g}"
    return f"a finite number {low}" if hi == math.inf else f"a finite number in [{lo:g}, {hi:g}]"


def domain_problem(row: Any, where: str, nested: bool = True) -> str | None:
    """Why a report's domain row (or `overall`, or a side-by-side run's row) is not one routing can trust."""
    if not isinstance(row, dict):
        return f"{where} is {show(row)}: expected a JSON object (a domain's measurements)"
    for key, (lo, hi, lo_open) in DOMAIN_NUMBERS.items():
        if row.get(key) is not None and not in_range(row[key], lo, hi, lo_open):
            return f"{where}.{key} is {show(row[key])}, expected {range_text(lo, hi, lo_open)}"
    n = row.get("n_prompts")
    if n is not None and not (in_range(n, 0) and isinstance(n, int)):
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


def shape_problem(shape: Any, where: str) -> str | None:
    """A report's `shape` (which engine and form its numbers were decoded in) as readers use it, or its problem."""
    if not isinstance(shape, dict):
        return f"{where} is {show(shape)}, expected a JSON object (engine, method, form, k)"
    for name in ("engine", "method", "label"):
        if not isinstance(shape.get(name), str):
            return f"{where}.{name} is {show(shape.get(name))}, expected a string"
    if shape.get("form") not in FORMS:
        return f"{where}.form is {show(shape.get('form'))}, expected one of {', '.join(FORMS)}"
    k = shape.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        return f"{where}.k is {show(k)}, expected a whole number >= 0"
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
    if t_step is not None and not in_range(t_step, 0.0, lo_open=True):
        return f"cost_model.t_step_decode_s is {show(t_step)}, expected {range_text(0.0, lo_open=True)}"
    if report.get("settings") is not None and (problem := _settings_problem(report["settings"])):
        return problem
    if report.get("shape") is not None and (problem := shape_problem(report["shape"], "shape")):
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
