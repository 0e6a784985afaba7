"""The headline numbers of README.md and BENCHMARKS.md, rendered from one committed evaluation report.

    draftsmith bench headline results/headline-smollm2-135m/report.json
    draftsmith bench headline --write

Each file holds the headline between `<!-- headline: REPORT -->` and `<!-- /headline -->` (README.md, which leads
with the headline by engine, benchmark/by_engine.py, holds it between `<!-- headline-overall: REPORT -->` and
`<!-- /headline-overall -->`: the same block without its per-domain table). `--write` renders
the block from REPORT (a report.json of `draftsmith evaluate`, committed beside the numbers) and replaces it;
without `--write` the command prints the block. tests/test_headline.py renders every block from the report it
names and fails on any difference: a published number is always the number its report holds, with the
report's command, machine and date above it.
"""

from __future__ import annotations

import re
from pathlib import Path

from draftsmith.formatting import fmt_num, md_cell, md_row

BEGIN = re.compile(r"<!-- headline: (?P<path>\S+) -->\n")
END = "<!-- /headline -->"
BEGIN_OVERALL = re.compile(r"<!-- headline-overall: (?P<path>\S+) -->\n")  # the block without its per-domain table
END_OVERALL = "<!-- /headline-overall -->"
ROOT = Path(__file__).resolve().parents[1]  # the checkout whose README.md and BENCHMARKS.md `--write` renders
DOCS = ("README.md", "BENCHMARKS.md")

# how a proposer spec of the headline run reads in the table; anything else is shown as its spec
LABELS = {
    "route:results/broad-dev-smollm2-135m/policy.json": "the broad EAGLE-3 head's tree merged with prompt "
        "lookup (the policy the dev split chose, `route:results/broad-dev-smollm2-135m/policy.json`)",
    "eagle:zoo/smollm2-135m/eagle3-broad": "EAGLE-3, the shipped head `eagle:zoo/smollm2-135m/eagle3-broad`",
    "eagle:zoo/smollm2-135m/eagle3": "EAGLE-3 trained on the default set (`zoo/smollm2-135m/eagle3`, since "
        "replaced by the broad head; in git history)",
    "dflash:zoo/smollm2-135m/dflash-broad": "DFlash, the shipped drafter `dflash:zoo/smollm2-135m/dflash-broad`",
    "medusa:zoo/smollm2-135m/medusa": "Medusa-1, the shipped heads `medusa:zoo/smollm2-135m/medusa`",
    "ngram": "n-gram lookup",
}
# the per-domain table's row names where the label up to its first comma does not make one
SHORT = {"route:results/broad-dev-smollm2-135m/policy.json": "EAGLE-3 (broad) merged with lookup",
         "eagle:zoo/smollm2-135m/eagle3-broad": "EAGLE-3 (broad)",
         "eagle:zoo/smollm2-135m/eagle3": "EAGLE-3 (default set)"}


def _label(spec: str, settings: dict) -> str:
    name, _, shape = spec.partition("@")
    base = LABELS.get(name, f"`{name}`")
    tree = settings.get("tree")
    if tree is not None and settings.get("tree_max_nodes") is None and all(b == 1 for b in tree):
        return f"{base}, its own chain of {len(tree)}"  # a shape the drafter brings (DFlash's block), not cut
    if tree is not None:
        return f"{base}, tree cut by the cost model (at most {settings.get('tree_max_nodes')} nodes)"
    return f"{base}, chain of {settings.get('k')}"


def _short(spec: str) -> str:
    name = spec.partition("@")[0]
    return SHORT.get(name) or LABELS.get(name, f"`{name}`").split(",")[0]


def entries(report: dict) -> list[tuple[str, dict, dict, str]]:
    """(label, overall summary, per-domain summaries, short name) of the main proposer and each side-by-side one
    (in that order: `report["proposer"]`, then `settings.compare_settings`'s names)."""
    s = report["settings"]
    main_settings = {"tree": s.get("tree"), "tree_max_nodes": s.get("tree_max_nodes"), "k": s.get("k")}
    out = [(_label(report["proposer"], main_settings), report["overall"],
            {d: r for d, r in report["domains"].items()}, _short(report["proposer"]))]
    for name, cs in (s.get("compare_settings") or {}).items():
        out.append((_label(name, cs), report["overall"]["compare"][name],
                    {d: r["compare"][name] for d, r in report["domains"].items()}, _short(name)))
    return out


# what the block prints besides the numbers routing reads: (dotted field, type); a None is printed as "–"
PRINTED = (("date", str), ("command", str), ("machine", dict), ("target.name", str), ("settings.max_new_tokens", int),
           ("overall.n_prompts", int), ("overall.n_timed", int))
ROW_KEYS = ("tokens_per_s", "speedup", "speedup_vs_plain", "speedup_vs_hf_generate", "alpha", "tau", "lossless")


def _field(report: dict, dotted: str):
    node = report
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def headline_problem(report: dict) -> str | None:
    """The first field the headline block prints that `report` (already read by `read_report`, its numbers
    checked) lacks or holds in another type, or None."""
    from draftsmith.errors import show

    for dotted, kind in PRINTED:
        value = _field(report, dotted)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{dotted} is {show(value)}, expected {kind.__name__}"
    for dotted, kind in (("contention", dict), ("settings.gpu_tree", dict), ("overall.fastest_plain", str),
                         ("contention.invalid", list)):
        value = _field(report, dotted)
        if value is not None and not isinstance(value, kind):
            return f"{dotted} is {show(value)}, expected {kind.__name__} or null"
    share = _field(report, "contention.other_cpu_share")
    if share is not None and not (isinstance(share, int | float) and not isinstance(share, bool) and 0 <= share <= 1):
        return f"contention.other_cpu_share is {show(share)}, expected a share in [0, 1] or null"
    if not all(isinstance(i, dict) and {"prompt", "entry", "reason"} <= set(i)
               for i in _field(report, "contention.invalid") or []):
        return "contention.invalid: expected a list of {prompt, entry, reason}"
    names = list(report["settings"].get("compare_settings") or {})
    rows = [("overall", report["overall"])] + [(f"domains.{d}", r) for d, r in report["domains"].items()]
    rows += [(f"{where}.compare.{name}", (row.get("compare") or {}).get(name)) for where, row in rows for name in names]
    for where, row in rows:
        if row is None:
            return f"{where} is missing (a side-by-side run the settings name)"
        missing = next((key for key in ROW_KEYS if key not in row), None)
        if missing:
            return f"{where}.{missing} is missing (printed in the headline)"
    return None


def read_headline_report(path: str | Path) -> dict:
    """The evaluation report a headline block renders: read and checked by the one report reader
    (evaluation/report_file.py's `read_report`), then the fields the block prints (`headline_problem`)."""
    from draftsmith.errors import DataError
    from draftsmith.evaluation.report_file import read_report

    report = read_report(path)
    problem = headline_problem(report)
    if problem:
        raise DataError(f"{report['_path']}: {problem}")
    return report


def render(report: dict, path: str, domain_table: bool = True) -> str:
    """The headline block for `report` (kept at `path`): where it comes from, then the tables (the per-domain one
    unless `domain_table` is False)."""
    o, s, m = report["overall"], report["settings"], report["machine"]
    c = report.get("contention") or {}
    gpu = s.get("gpu_tree") or {}
    n = o["n_prompts"]
    per_domain = s.get("limit_per_domain")
    share = c.get("other_cpu_share")
    plain_vs_hf = ((o["baseline_tokens_per_s"] or 0) / o["hf_generate_tokens_per_s"]
                   if o.get("hf_generate_tokens_per_s") else None)
    hf_vs_plain = (o["hf_generate_tokens_per_s"] / o["baseline_tokens_per_s"]
                   if o.get("hf_generate_tokens_per_s") and o["baseline_tokens_per_s"] else None)
    lines = [
        f"From [{path}]({path}) ({report['date'][:10]}): `{report['command']}`",
        "",
        f"Machine: {m.get('platform')}, {m.get('cpu_count')} CPUs, torch {m.get('torch')}, transformers "
        f"{m.get('transformers')}, device {m.get('device')}. Target `{report['target']['name']}`; "
        f"{n} prompts of the eval **{s.get('split') or 'given'}** split"
        + (f" ({per_domain} per domain)" if per_domain else "")
        + f", {s['max_new_tokens']} new tokens, greedy; each prompt decoded {s.get('repeats')} times by every run, "
        f"interleaved (median); speeds from the {o['n_timed']} of {n} prompts timed validly"
        + (f"; other processes used {100 * share:.1f}% of the CPU over the run" if share is not None else "")
        + ". `speedup` is against the faster plain decoding (here "
        + {"draftsmith": "our own", "hf_generate": "HF `generate`"}.get(o.get("fastest_plain"), "–")
        + "); lossless = the greedy output equals HF `generate`'s on every prompt.",
        "",
        "| decoding | tokens/s | speedup | vs our plain | vs HF `generate` | α | τ | τ (GPU-sized tree) | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| plain decoding (ours: measured kernel plan) | {fmt_num(o['baseline_tokens_per_s'], '.1f')} | – | 1.00 | "
        f"{fmt_num(plain_vs_hf, '.2f')} "
        f"| – | 1.00 | – | – |",
        f"| HF `generate` (stock kernels) | {fmt_num(o.get('hf_generate_tokens_per_s'), '.1f')} | – | "
        f"{fmt_num(hf_vs_plain, '.2f')} "
        f"| 1.00 | – | 1.00 | – | – |",
    ]
    runs = entries(report)
    for i, (label, e, _, _) in enumerate(runs):
        tau_gpu = ((o if i == 0 else e).get("gpu_tree") or {}).get("tau")  # side-by-side trees have their own
        lines.append(f"| {md_cell(label)} | {fmt_num(e['tokens_per_s'], '.1f')} | **{fmt_num(e['speedup'], '.2f')}** "
                     f"| {fmt_num(e['speedup_vs_plain'], '.2f')} | {fmt_num(e['speedup_vs_hf_generate'], '.2f')} "
                     f"| {fmt_num(e['alpha'], '.3f')} | {fmt_num(e['tau'], '.2f')} | {fmt_num(tau_gpu, '.2f')} "
                     f"| {'yes' if e['lossless'] else ('no' if e['lossless'] is False else '–')} |")
    if gpu:
        lines += ["", f"τ (GPU-sized tree): the same prompts decoded with the uncut tree of "
                      f"{gpu.get('tree_max_nodes')} nodes (branching {gpu.get('tree')}), what a GPU verifies in "
                      "about one step."]
    if domain_table:
        lines += _per_domain(list(report["domains"]), runs)
    invalid = c.get("invalid") or []
    if invalid:
        lines += ["", f"Left out of the speeds ({len(invalid)}): "
                  + "; ".join(f"{md_cell(i['prompt'])} {md_cell(i['entry'])}: {md_cell(i['reason'])}"
                              for i in invalid[:6])
                  + (" ..." if len(invalid) > 6 else "")]
    return "\n".join(lines) + "\n"


def _per_domain(domains: list[str], runs: list[tuple[str, dict, dict, str]]) -> list[str]:
    lines = ["", "Per domain, speedup (τ):", "", md_row("decoding", *domains), "|---|" + "---|" * len(domains)]
    for _, _, per, short in runs:
        lines.append(f"| {md_cell(short)} | " + " | ".join(
            f"{fmt_num(per[d]['speedup'], '.2f')} ({fmt_num(per[d]['tau'], '.2f')})" for d in domains) + " |")
    return lines


def blocks(text: str, begin: re.Pattern = BEGIN, end_marker: str = END) -> list[tuple[int, int, str]]:
    """(start of the block's body, end of the body, the path its marker names) for every block in `text` between
    `begin` and `end_marker` (the headline's by default; benchmark/by_engine.py's markers too)."""
    out = []
    for mt in begin.finditer(text):
        end = text.find(end_marker, mt.end())
        if end < 0:
            raise ValueError(f"block for {mt['path']} has no {end_marker}")
        out.append((mt.end(), end, mt["path"]))
    return out


def all_blocks(text: str) -> list[tuple[int, int, str, bool]]:
    """(start, end, report path, with its per-domain table) of every headline block in `text`, full or overall."""
    found = [(*b, True) for b in blocks(text)] + [(*b, False) for b in blocks(text, BEGIN_OVERALL, END_OVERALL)]
    return sorted(found)


def rewrite(doc: Path, root: Path) -> int:
    """Replace every headline block of `doc` by the rendering of its report; returns the number of blocks."""
    text = doc.read_text(encoding="utf-8")
    found = all_blocks(text)
    for start, end, path, per_domain in reversed(found):
        report = read_headline_report(root / path)
        text = text[:start] + render(report, path, per_domain) + text[end:]
    doc.write_text(text, encoding="utf-8")
    return len(found)
