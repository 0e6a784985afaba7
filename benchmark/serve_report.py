"""serve-bench's report: report.json (what benchmark/serve_bench.py measured, whole), report.md (the same in tables)
and tokens_per_s.png (output tokens/s against concurrency, a line per server), all through the atomic writers."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.formatting import fmt_num, md_cell, md_row
from draftsmith.outputs import atomic_write_json, atomic_write_text, save_figure


def _ms(v: float | None) -> str:
    return fmt_num(None if v is None else v * 1e3, ".1f")


def _throughput(report: dict) -> list[str]:
    lines = ["## Output tokens/s by concurrency (mixed domains)", "",
             md_row("server", *(f"c={c}" for c in report["concurrency"])),
             md_row(*["---"] * (1 + len(report["concurrency"])))]
    for name, res in report["servers"].items():
        runs = {r["concurrency"]: r for r in res["runs"] if r["scope"] == "mixed"}
        lines.append(md_row(name, *(fmt_num(runs.get(c, {}).get("output_tokens_per_s"), ".1f")
                                    for c in report["concurrency"])))
    return lines + [""]


def _latency(report: dict) -> list[str]:
    lines = ["## Latency per request (mixed domains): TTFT and TPOT p50 / p99, ms", "",
             md_row("server", "c", "requests ok", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "errors",
                    "not sent"),
             md_row(*["---"] * 9)]
    for name, res in report["servers"].items():
        for r in res["runs"]:
            if r["scope"] == "mixed":
                lines.append(md_row(name, r["concurrency"], f"{r['ok']}/{r['requests']}", _ms(r["ttft_s"]["p50"]),
                                    _ms(r["ttft_s"]["p99"]), _ms(r["tpot_s"]["p50"]), _ms(r["tpot_s"]["p99"]),
                                    r["errors"], r["not_sent"]))
    return lines + [""]


def _pct(v: float | None) -> str:
    return fmt_num(None if v is None else f"{100 * v:+.0f}%")


def _drafter(name: str, comp: dict) -> list[str]:
    lines = [f"## {md_cell(name)} against plain decoding", "",
             md_row("c", "tok/s plain", "tok/s drafter", "speedup", "predicted", "error", "r(c)", "decode speedup",
                    "decode predicted", "TTFT ratio", "τ (vLLM)", "α (vLLM)", "k", "recommended k"),
             md_row(*["---"] * 14)]
    for c, row in comp["by_concurrency"].items():
        rec = row["recommended_k"]
        lines.append(md_row(c, fmt_num(row["plain_output_tokens_per_s"], ".1f"),
                            fmt_num(row["output_tokens_per_s"], ".1f"), fmt_num(row["speedup"], ".2f"),
                            fmt_num(row["predicted_speedup"], ".2f"), _pct(row["prediction_error"]),
                            fmt_num(row["step_ratio"], ".2f"), fmt_num(row["tpot_speedup"], ".2f"),
                            fmt_num(row["predicted_decode_speedup"], ".2f"), fmt_num(row["ttft_ratio"], ".2f"),
                            fmt_num(row["tau"]), fmt_num(row["alpha"]), row["k"], "off" if rec == 0 else rec))
    lines += ["", f"Recommendation: {md_cell(comp['verdict'])}."]
    if comp["num_speculative_tokens_per_batch_size"]:
        sched = json.dumps(comp["num_speculative_tokens_per_batch_size"])
        lines += ["", f"vLLM: `\"num_speculative_tokens_per_batch_size\": {sched}` in the speculative config "
                      "(a chain shorter than the measured k is priced by linear interpolation of the step cost)."]
    return lines + [""] + _domains(comp)


def _domains(comp: dict) -> list[str]:
    if not comp["by_domain"]:
        return []
    cs = sorted({c for row in comp["by_domain"].values() for c in row}, key=int)
    lines = ["Per domain (homogeneous runs): measured speedup / predicted (r(c) of the mixed run) / τ", "",
             md_row("domain", *(f"c={c}" for c in cs)), md_row(*["---"] * (1 + len(cs)))]
    for d, row in sorted(comp["by_domain"].items()):
        cells = [f"{fmt_num(row[c]['speedup'], '.2f')} / {fmt_num(row[c]['predicted_speedup'], '.2f')} / "
                 f"{fmt_num(row[c]['tau'], '.2f')}" if c in row else None for c in cs]
        lines.append(md_row(d, *cells))
    return lines + [""]


def render(report: dict) -> str:
    """report.md: the run's bounds, throughput and latency per server, each drafter against plain decoding."""
    m, p = report["machine"], report.get("prompts") or {}
    lines = ["# serve-bench: served throughput by concurrency", "",
             f"Target {md_cell(report['target'])}, {report['date']}, {md_cell(m['platform'])}, {m['cpus']} CPUs "
             f"(load average before {m['load_before']}, after {m['load_after']}); {report['seconds']:.0f} s in all.",
             f"Concurrency {report['concurrency']}; {report['requests']} requests per mixed run, "
             f"{report['domain_requests']} per domain run (at least the concurrency); at most {report['max_tokens']} "
             f"output tokens, greedy, streamed chat completions.",
             f"Prompts: {md_cell(p.get('domains'))} ({p.get('left_out_too_long', 0)} left out as too long).", "",
             "Speedup: output tokens/s with the drafter over without, same prompts and concurrency. Decode "
             "predicted: E[tokens | k] from vLLM's per-request acceptance over r(c), the step with the drafter in "
             "plain steps at that concurrency; decode speedup: the measured TPOT p50 ratio. Predicted: the request's "
             "latency ratio, each side's measured time to first token plus its decode steps at the predicted rate "
             "(per domain: r(c) and the plain step of the mixed run, the domain's own acceptance; "
             "decoding/batch_cost.py).", "",
             *_throughput(report), *_latency(report)]
    for name, res in report["servers"].items():
        if res.get("patches_not_applied"):
            lines += [f"{md_cell(name)}: served without serve-check's fixes of vLLM's CPU kernels "
                      f"({md_cell(', '.join(res['patches_not_applied']))}): its acceptance here may differ from "
                      "serve-check's where one of them matters.", ""]
    for name, comp in report["comparisons"].items():
        lines += _drafter(name, comp)
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in report["servers"].items():
        runs = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in res["runs"]
                      if r["scope"] == "mixed" and r["output_tokens_per_s"] is not None)
        if runs:
            ax.plot([c for c, _ in runs], [t for _, t in runs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"serve-bench: {report['target']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", render(report))
    plot(report, out / "tokens_per_s.png")
