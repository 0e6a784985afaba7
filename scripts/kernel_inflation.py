"""How much a slow one-row kernel inflated speedups: plain greedy decoding with the kernel choice the code made
before the measured plan (one row through `F.linear`, 2-8 rows through `W @ xᵀ`) and with the plan measured at
load (targets/gemm.py), interleaved prompt by prompt and repeated, same tokens out.

    python scripts/kernel_inflation.py [--split dev] [--limit-per-domain 3] [--max-new-tokens 96] [--repeats 3] \\
        --json results/kernel-inflation-smollm2-135m/report.json

Every earlier speedup measured against the slow plain step is overstated by at most the printed ratio (a
speculative run's verify forwards already took the fast product). The report keeps the command, machine, date,
each prompt's medians and the CPU share other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--split", default="dev", choices=["dev", "test"])
    ap.add_argument("--limit-per-domain", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from draftsmith.decoding.cost import CpuShare
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.evaluation.domains import default_prompt_files, format_prompt, load_prompts
    from draftsmith.evaluation.report_file import machine_info
    from draftsmith.targets import gemm, load_target

    target = load_target(a.target)
    measured = gemm._plan
    plans = {"earlier": gemm._default_plan(), "measured": measured}
    prompts = load_prompts([str(p) for p in default_prompt_files(a.split)], a.limit_per_domain)
    speculative_generate(target, None, [format_prompt(target.tokenizer, prompts[0].text)], 8, k=0)  # warm-up
    per_prompt, tokens = [], {k: 0 for k in plans}
    seconds = {k: 0.0 for k in plans}
    try:
        with CpuShare() as share:
            for i, p in enumerate(prompts):
                ids = format_prompt(target.tokenizer, p.text)
                times: dict[str, list[float]] = {k: [] for k in plans}
                outs: dict[str, list[int]] = {}
                for r in range(a.repeats):
                    for name in (list(plans) if (i + r) % 2 else list(plans)[::-1]):
                        gemm._plan = plans[name]
                        out = speculative_generate(target, None, [ids], a.max_new_tokens, k=0)
                        times[name].append(out.stats.wall_time)
                        outs[name] = out.tokens[0]
                if outs["earlier"] != outs["measured"]:
                    raise SystemExit(f"{p.source}: the two kernel choices wrote different tokens")
                med = {k: statistics.median(v) for k, v in times.items()}
                for k in plans:
                    tokens[k] += len(outs[k])
                    seconds[k] += med[k]
                per_prompt.append({"prompt": p.source, "tokens": len(outs["measured"]), "median_s": med})
    finally:
        gemm._plan = measured
    tps = {k: tokens[k] / seconds[k] for k in plans}
    report = {"command": "python " + " ".join(["scripts/kernel_inflation.py",
                                               *(argv if argv is not None else sys.argv[1:])]),
              "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
              "machine": machine_info(target.device), "target": a.target, "split": a.split,
              "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
              "tokens_per_s": tps, "measured_over_earlier": tps["measured"] / tps["earlier"],
              "other_cpu_share": share.others, "contended": share.busy, "per_prompt": per_prompt}
    print(f"plain decoding, {len(prompts)} prompts: earlier kernel choice {tps['earlier']:.2f} tok/s, measured plan "
          f"{tps['measured']:.2f} tok/s: {report['measured_over_earlier']:.2f}x"
          + (f" (other processes used {100 * share.others:.0f}% of the CPU: not a valid timing)" if share.busy else ""))
    if a.json:
        from draftsmith.outputs import atomic_write_json

        atomic_write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
