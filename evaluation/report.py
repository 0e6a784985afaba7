"""Writing a report: report.json (the dict as is), report.md (one table per domain + summaries) and PNG
plots (matplotlib Agg): acceptance per position, α and speedup per domain, the measured v(k) curve."""

from __future__ import annotations

from pathlib import Path

from draftsmith.formatting import fmt_num, md_cell, md_row
from draftsmith.outputs import atomic_write_json, atomic_write_text, save_figure

FIELDS = ["n_prompts", "alpha", "tau", "tau_predicted_from_alpha", "per_position_acceptance", "conditional_acceptance",
          "n_timed", "tokens_per_s", "baseline_tokens_per_s", "hf_generate_tokens_per_s", "speedup", "fastest_plain",
          "speedup_vs_plain", "speedup_vs_hf_generate", "lossless", "self_consistent", "predicted_speedup",
          "verified_nodes_per_step"]


# a measured v(k) below this for k >= 1 means the one-token step is slower than a larger forward: noise of a
# median of a few forwards stays above it, a slow one-row kernel does not (v(1) read 0.55-0.62 with one)
V_BELOW_ONE = 0.9


PLOTS = ("acceptance_per_position.png", "domains.png", "verify_cost.png", "calibration.png")


def _contention_line(share: float | None, what: str) -> list[str]:
    """The report line saying how quiet the machine was while `what` was timed (cost.CpuShare)."""
    from draftsmith.decoding.cost import contended

    if share is None:
        return ["", f"How busy the machine was while {what} was timed could not be read (no /proc/stat, or a timing "
                    "too short for its clock ticks)."]
    if contended(share):
        return ["", f"**{what} was measured while other processes used {100 * share:.0f}% of the CPU: it overstates "
                    "the cost of larger forwards (trees and k come out too small). Rerun on a quiet machine.**"]
    return ["", f"{what} was measured while other processes used {100 * share:.0f}% of the CPU."]


def _decode_contention(c: dict | None) -> list[str]:
    """A bold warning at the top when some prompts could not be timed validly (timing.contention), with each
    of them and why."""
    if not c or c.get("speedups_valid") is not False:
        return []
    lines = [f"**Speedups are not valid: {c['note']}.**", ""]
    for item in (c.get("invalid") or [])[:20]:
        lines.append(f"- {md_cell(item['prompt'])} ({md_cell(item['domain'])}), {md_cell(item['entry'])}: "
                     f"{md_cell(item['reason'])}")
    if len(c.get("invalid") or []) > 20:
        lines.append(f"- ... {len(c['invalid']) - 20} more in report.json")
    return lines + [""]


def _kernel_lines(k: dict | None) -> list[str]:
    """The few-row kernel plan the run used (targets/gemm.py)."""
    if not k:
        return []
    if not k.get("enabled"):
        return ["- few-row kernels: off (F.linear everywhere)"]
    rows = "; ".join(f"{cls} projections at rows {v}" for cls, v in k.get("transposed_rows", {}).items())
    return [f"- few-row kernels ({k.get('plan')} plan, {k.get('threads')} threads): W @ xᵀ for {rows or 'no rows'}"]


def _header(report: dict) -> list[str]:
    """Where the report comes from: proposer, target, command, settings, machine, contention."""
    s = report["settings"]
    return [
        f"# Evaluation: {md_cell(report['proposer'])} on {md_cell(report['target']['name'])}", "",
        f"- shape: {md_cell(shape_label(report.get('shape')))}",
        f"- date: {report['date']}", f"- command: `{md_cell(report['command'])}`",
        f"- settings: max_new_tokens={s['max_new_tokens']}, k={s['k']}, tree={s['tree']}, "
        f"temperature={s['temperature']}, top_p={s['top_p']}, top_k={s['top_k']}, "
        f"limit_per_domain={s['limit_per_domain']}"
        + (f", trees cut to the nodes that pay (v(n) below; verified tree {s.get('tree_verified')}, at most "
           f"{s.get('tree_max_nodes')} nodes)" if s.get("prune_tree") else "")
        + (f", draft networks in {s['draft_dtype']}" if s.get("draft_dtype") else "")
        + (f", turns={s['turns']}" if s.get("turns") else ""),
        f"- machine: {report['machine'].get('platform')}, {report['machine'].get('cpu_count')} CPUs, "
        f"device {report['machine'].get('device')}", *_kernel_lines(report["machine"].get("few_row_kernels")), "",
        *_decode_contention(report.get("contention")),
    ]


def shape_label(shape: dict | None) -> str:
    """Which engine and shape a report's numbers were decoded in ("vLLM eagle3 chain k=4"; a report without the field
    was decoded by draftsmith's own decoder)."""
    if not shape:
        return "draftsmith's decoder"
    if shape.get("engine") == "draftsmith":
        return f"{shape.get('label')} (merged trees, routing and cost-model cuts are its own; no engine serves them)"
    return f"{shape.get('label')}, as the engine serves it"


def _domain_table(report: dict) -> list[str]:
    """Every field of FIELDS per domain and overall."""
    lines = [
        f"## Per domain: {md_cell((report.get('shape') or {}).get('label') or 'draftsmith decoder')}", "",
        "Each prompt is decoded by every run several times, interleaved (repeats, median); tokens/s and speedups "
        "count only the prompts timed validly (n_timed: quiet measurements, no speedup above what τ and v allow). "
        "speedup is against the faster plain decoding (fastest_plain): our own (same kernels as the verifier) or "
        "HF `generate` with its stock kernels; both are shown. lossless: the greedy output equals HF `generate`'s "
        "(an independent implementation); self_consistent: it equals our own plain decoding's.", "",
    ]
    names = list(report["domains"]) + ["overall"]
    lines.append(md_row("field", *names))
    lines.append("|---|" + "---|" * len(names))
    for f in FIELDS:
        vals = [(report["domains"].get(n) or report["overall"]).get(f) if n != "overall" else report["overall"].get(f)
                for n in names]
        lines.append(f"| {f} | " + " | ".join(fmt_num(v) for v in vals) + " |")
    return lines


def _routes(doms: list[tuple[str, dict]]) -> list[str]:
    if not any("route" in d for _, d in doms):
        return []
    lines = ["", "## Routes (routing policy)", "", "| domain | route | requests per route |", "|---|---|---|"]
    for n, d in doms:
        routes = ", ".join(f"{k}: {v}" for k, v in d.get("routes", {}).items())
        lines.append(f"| {n} | {fmt_num(d.get('route'))} | {fmt_num(routes)} |")
    return lines


def _branches(doms: list[tuple[str, dict]]) -> list[str]:
    if not any("branches" in d for _, d in doms):
        return []
    lines = ["", "## Multi-proposer tree: accepted branches", "",
             "| domain | proposer | proposed | accepted on its branch | α of its nodes | wins (share of steps) |",
             "|---|---|---|---|---|---|"]
    for n, d in doms:
        for name, b in d.get("branches", {}).items():
            lines.append(f"| {n} | {fmt_num(name)} | {b['proposed']} | {b['accepted']} | "
                         f"{fmt_num(b['alpha'])} | {b['wins']} ({fmt_num(b['win_rate'])}) |")
    return lines


def _calibration(doms: list[tuple[str, dict]]) -> list[str]:
    """The proposer's acceptance estimates against the verifier's decisions (DSpark's confidence head)."""
    if not any("calibration" in d for _, d in doms):
        return []
    lines = ["", "## Calibration of the acceptance estimates (calibration.png)", "",
             "Pairs: every accepted drafted token and the first rejected one of each step (decoding/calibration.py).",
             "", "| domain | pairs | mean estimate | accepted | ECE (10 bins) |", "|---|---|---|---|---|"]
    for n, d in doms:
        c = d.get("calibration")
        if c:
            lines.append(f"| {n} | {c['n']} | {fmt_num(c.get('mean_estimate'))} | "
                         f"{fmt_num(c.get('accepted'))} | {fmt_num(c['ece'])} |")
    return lines


def _gpu_tree(doms: list[tuple[str, dict]], s: dict) -> list[str]:
    if not any("gpu_tree" in d for _, d in doms):
        return []
    g = s.get("gpu_tree") or {}
    lines = ["", f"## τ with the GPU-sized tree (uncut: branching {g.get('tree')}, at most "
                 f"{g.get('tree_max_nodes')} nodes)", "",
             "What a GPU, where verifying 60 nodes costs about one step, would accept per step; the field's τ "
             "are measured so. Its speed here is this CPU's and not a result.", "",
             "| domain | τ cut tree | τ GPU-sized tree | α | verified nodes a step | lossless |",
             "|---|---|---|---|---|---|"]
    for n, d in doms:
        if "gpu_tree" in d:
            x = d["gpu_tree"]
            lines.append(f"| {n} | {fmt_num(d['tau'])} | {fmt_num(x['tau'])} | {fmt_num(x['alpha'])} | "
                         f"{fmt_num(x['verified_nodes_per_step'])} | {fmt_num(x['lossless'])} |")
    return lines


def _turns(doms: list[tuple[str, dict]], s: dict) -> list[str]:
    """Turn 1 against the later turns of multi-turn prompts, per domain that has them; the rows the context
    cut short."""
    cut = s.get("turns_cut") or []
    if not any(d.get("turns") for _, d in doms) and not cut:
        return []
    lines = ["", "## Per turn (multi-turn prompts)", "",
             "Turn k's prompt holds the user's turns 1..k and the target's own answers (plain decoding of this run) "
             "to turns 1..k-1; every turn is one measured generation, counted in the tables above.", "",
             "| domain | turns | n | mean prompt tokens | α | τ | τ GPU-sized tree | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, d in doms:
        for which, t in (d.get("turns") or {}).items():
            if t:
                lines.append(f"| {n} | {which} | {t['n_prompts']} | {t['mean_prompt_tokens']:.0f} | "
                             f"{fmt_num(t['alpha'])} | {fmt_num(t['tau'])} | "
                             f"{fmt_num(t.get('gpu_tree_tau'))} | {fmt_num(t['speedup'])} | "
                             f"{fmt_num(t['lossless'])} |")
    for c in cut[:20]:
        lines.append(f"- {md_cell(c['prompt'])} ({md_cell(c['domain'])}): measured on {c['measured']} of "
                     f"its {c['turns']} turns: {md_cell(c['reason'])}")
    if len(cut) > 20:
        lines.append(f"- ... {len(cut) - 20} more in report.json (settings.turns_cut)")
    return lines


def _not_lossless(r: dict) -> str:
    """What follows a side-by-side run's number when its output was not the reference's."""
    return "" if r["lossless"] is not False else " NOT LOSSLESS"


def _side_by_side(report: dict, doms: list[tuple[str, dict]]) -> list[str]:
    """The proposers compared in the same run: speedup (α) per domain, then τ and n-α overall."""
    if not any("compare" in d for _, d in doms):
        return []
    names = list(next(d["compare"] for _, d in doms if "compare" in d))
    shapes = (report.get("settings") or {}).get("compare_settings") or {}
    heads = [f"{name} [{(shapes.get(name) or {}).get('shape', {}).get('label', '')}]" for name in names]
    own = (report.get("shape") or {}).get("label", "")
    lines = ["", "## Side by side (same prompts, same run): speedup (α)", "",
             md_row("domain", f"{report['proposer']} [{own}]", *heads), "|---|---|" + "---|" * len(names)]
    for n, d in doms:
        cells = [f"{fmt_num(c['speedup'])} ({fmt_num(c['alpha'])}){_not_lossless(c)}"
                 for c in (d.get("compare") or {}).values()]
        lines.append(f"| {n} | {fmt_num(d['speedup'])} ({fmt_num(d['alpha'])}) | " + " | ".join(cells) + " |")
    ov = report["overall"]
    lines += ["", "Overall: τ, verified nodes per step, and the acceptance at each draft position given the "
              "positions before it were accepted and a token there was tried (n-α):", "",
              "| proposer | τ | nodes per step | n-α by position |", "|---|---|---|---|"]
    for name, c in [(report["proposer"], ov)] + list((ov.get("compare") or {}).items()):
        lines.append(f"| {fmt_num(name)} | {fmt_num(c['tau'])} | {fmt_num(c.get('verified_nodes_per_step'))} "
                     f"| {fmt_num(c.get('conditional_acceptance'))} |")
    return lines + _side_by_side_gpu_trees(report, doms, names)


def _side_by_side_gpu_trees(report: dict, doms: list[tuple[str, dict]], names: list[str]) -> list[str]:
    """τ per domain at each tree proposer's GPU-sized budget (uncut), the run's own and the side-by-side ones."""
    has = [n for n in names if any("gpu_tree" in (d.get("compare") or {}).get(n, {}) for _, d in doms)]
    if not has:
        return []
    own = any("gpu_tree" in d for _, d in doms)
    cols = ([report["proposer"]] if own else []) + has
    lines = ["", "τ with each proposer's GPU-sized tree (uncut; decoded once per prompt for its acceptance, its "
             "speed here is not a result):", "", md_row("domain", *cols), "|---|" + "---|" * len(cols)]
    for n, d in doms:
        cells = ([d.get("gpu_tree")] if own else []) + [(d.get("compare") or {}).get(c, {}).get("gpu_tree")
                                                       for c in has]
        shown = (fmt_num(None) if x is None else fmt_num(x["tau"]) + _not_lossless(x) for x in cells)
        lines.append(f"| {n} | " + " | ".join(shown) + " |")
    return lines


def _adaptive(doms: list[tuple[str, dict]], s: dict) -> list[str]:
    if not any("adaptive" in d for _, d in doms):
        return []
    lines = ["", f"## Fixed k = {s['k']} vs adaptive k (same prompts, same run)", "",
             "| domain | fixed τ | fixed speedup | adaptive τ | adaptive speedup | mean k | plain steps | "
             "adaptive lossless |", "|---|---|---|---|---|---|---|---|"]
    for n, d in doms:
        a = d.get("adaptive")
        if a:
            lines.append(f"| {n} | {fmt_num(d['tau'])} | {fmt_num(d['speedup'])} | {fmt_num(a['tau'])} | "
                         f"{fmt_num(a['speedup'])} | {fmt_num(a['mean_k'])} | "
                         f"{fmt_num(a['plain_step_share'])} | {fmt_num(a['lossless'])} |")
    return lines


def _policy(report: dict) -> list[str]:
    lines = ["", "## Policy", "", "| domain | enable | measured | predicted | recommended k | reason |",
             "|---|---|---|---|---|---|"]
    for n, p in report.get("policy", {}).items():
        lines.append(md_row(n, fmt_num(p["enable"]), fmt_num(p["measured_speedup"]),
                            fmt_num(p["predicted_speedup"]), fmt_num(p.get("recommended_k")), p["reason"]))
    return lines


def _cost_model(report: dict) -> list[str]:
    """c and v(k) as measured in the run, v(n) of the tree mask, and the recommended k per domain."""
    cm = report.get("cost_model", {})
    lines: list[str] = []
    if "v" in cm:
        lines += ["", "## Cost model (measured here)", "",
                  f"c (one proposer step / one target step) = {cm['c']:.4f}; 1-token step = "
                  f"{cm['t_step_s'] * 1000:.1f} ms at context {cm['context_length']}", "",
                  "| k | " + " | ".join(cm["v"]) + " |", "|---|" + "---|" * len(cm["v"]),
                  "| v(k) | " + " | ".join(f"{x:.2f}" for x in cm["v"].values()) + " |"]
        lines += _contention_line(cm.get("other_cpu_share"), "v(k)")
        cheaper = [k for k, x in cm["v"].items() if k != "0" and x < V_BELOW_ONE]
        if cheaper:
            lines += ["", f"**v(k) < {V_BELOW_ONE} at k = {', '.join(cheaper)}: a forward over more tokens measured "
                          "faster than the one-token step, so the one-token step (plain decoding, the baseline of "
                          "every speedup here) is not on this machine's fastest kernel and the speedups are "
                          "inflated. Check `draftsmith bench baseline` and the kernel plan above.**"]
    if cm.get("v_tree"):
        vt = cm["v_tree"]
        lines += ["", "v(n) with the tree mask, used to size the trees (decoding/budget.py):", "",
                  "| n | " + " | ".join(vt) + " |", "|---|" + "---|" * len(vt),
                  "| v(n) | " + " | ".join(f"{x:.2f}" for x in vt.values()) + " |"]
        lines += _contention_line(cm.get("v_tree_other_cpu_share"), "v(n)")
    if report.get("recommended_k"):
        lines += ["", "recommended k: " + ", ".join(f"{md_cell(n)} {r['k']} (predicted speedup "
                                                   f"{r['predicted_speedup']:.2f})"
                                                   for n, r in report["recommended_k"].items())]
    return lines


def _references_and_memory(report: dict) -> list[str]:
    lines = ["", "## References (same run)", ""]
    for name, r in report.get("references", {}).items():
        shown = ", ".join(f"{k}={fmt_num(v)}" for k, v in r.items()) if isinstance(r, dict) else fmt_num(r)
        lines.append(f"- {fmt_num(name)}: {shown}")
    mem = report.get("memory", {})
    return lines + ["", "## Memory", "", ", ".join(f"{k} = {v:.0f}" for k, v in mem.items()), ""]


def render_markdown(report: dict) -> str:
    """report.md: the header, the per-domain table, then each section the report has data for."""
    s = report["settings"]
    # a domain's name comes from the prompt files (their category): escaped once, for every section's rows
    doms = [(md_cell(n), d) for n, d in list(report["domains"].items()) + [("overall", report["overall"])]]
    lines = [*_header(report), *_domain_table(report), *_routes(doms), *_branches(doms), *_calibration(doms),
             *_gpu_tree(doms, s),
             *_turns(doms, s),
             *_side_by_side(report, doms), *_adaptive(doms, s), *_policy(report), *_cost_model(report),
             *_references_and_memory(report)]
    return "\n".join(lines)


def write_plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in list(report["domains"].items()) + [("overall", report["overall"])]:
        acc = d["per_position_acceptance"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name, linewidth=2.5 if name == "overall" else 1.2)
    cond = report["overall"].get("conditional_acceptance") or []
    if any(c is not None for c in cond):
        ax.plot(range(1, len(cond) + 1), [float("nan") if c is None else c for c in cond], color="k",
                linestyle="--", marker="x", label="overall n-α (given the path got there)")
    ax.set_xlabel("draft position d")
    ax.set_ylabel("P(first d drafts accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per position")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:  # nothing was proposed (e.g. the cost model cut every tree to nothing)
        ax.text(0.5, 0.5, "no draft token was verified", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    paths.append(out / "acceptance_per_position.png")
    save_figure(fig, paths[-1], dpi=110)
    plt.close(fig)

    names = list(report["domains"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.6))
    a1.bar(names, [report["domains"][n]["alpha"] or 0 for n in names], color="tab:blue")
    a1.set_title("α per domain")
    a1.set_ylim(0, 1)
    a2.bar(names, [report["domains"][n]["speedup"] or 0 for n in names], color="tab:green")
    a2.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    a2.set_title("speedup per domain")
    for a in (a1, a2):
        a.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    paths.append(out / "domains.png")
    save_figure(fig, paths[-1], dpi=110)
    plt.close(fig)

    v = report.get("cost_model", {}).get("v")
    if v:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        ks = [int(k) for k in v]
        ax.plot(ks, list(v.values()), marker="o")
        ax.set_xlabel("k (draft tokens verified; forward over k+1 tokens)")
        ax.set_ylabel("v(k) = t(k+1 tokens) / t(1 token)")
        ax.set_title(f"Verification cost, context {report['cost_model']['context_length']}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "verify_cost.png")
        save_figure(fig, paths[-1], dpi=110)
        plt.close(fig)
    if report["overall"].get("calibration", {}).get("bins"):
        paths.append(reliability_plot(report["overall"]["calibration"], out / "calibration.png", plt))
    return paths


def reliability_plot(cal: dict, path: Path, plt) -> Path:
    """The reliability diagram: per bin of the estimates, the accepted fraction against the mean estimate (the
    diagonal is a calibrated estimate), the bins' sizes beneath."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    bins = cal["bins"]
    mids = [(b["lo"] + b["hi"]) / 2 for b in bins]
    top.plot([0, 1], [0, 1], color="k", linestyle="--", linewidth=0.8, label="calibrated")
    top.plot([b["mean_estimate"] for b in bins], [b["accepted"] for b in bins], marker="o", label="measured")
    top.set_ylabel("accepted fraction")
    top.set_title(f"Acceptance estimates: ECE {cal['ece']:.3f} over {cal['n']} tokens")
    top.legend(fontsize=8)
    bottom.bar(mids, [b["n"] for b in bins], width=0.09)
    bottom.set_xlabel("estimated P(accepted)")
    bottom.set_ylabel("tokens")
    bottom.set_xlim(0, 1)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def write_report(report: dict, out_dir: str | Path) -> Path:
    """Write report.json, report.md and the plots into `out_dir` (created if needed)."""
    from draftsmith.errors import OutputError
    from draftsmith.outputs import output_kind

    out = Path(out_dir)
    mine = [n for n in ("report.json", "report.md", *PLOTS) if (out / n).exists()]
    if mine and output_kind(out) != "report":  # the user's own report.md is not overwritten
        raise OutputError(f"{out / mine[0]} exists and is not from a draftsmith evaluation: choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", render_markdown(report))
    write_plots(report, out)
    return out
