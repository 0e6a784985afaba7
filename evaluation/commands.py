"""`draftsmith evaluate`: speculative decoding per domain for one proposer on one target.

    draftsmith evaluate --target smollm2-135m --proposer ngram --prompts FILE [FILE ...] \\
        --max-new-tokens 128 --k 4 --temperature 0 --limit-per-domain 6 --out DIR
    draftsmith evaluate --config eval/ngram-smollm2 k=6 limit_per_domain=3
    draftsmith evaluate --proposer medusa:PATH --temperature 0 0.7 1.0      (a temperature sweep)
    draftsmith evaluate --proposer draft:PATH --k 6 --adaptive              (fixed k vs adaptive k)
    draftsmith evaluate --proposer multi:ngram+medusa:PATH --tree auto      (one merged tree)
    draftsmith evaluate --proposer route:policy.json --tree auto            (per-domain routing)
    draftsmith evaluate --proposer eagle:PATH --tree auto --turns first     (first user turns only)

Flags override the `--config` file, which trailing key=value overrides update first.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from draftsmith.formatting import fmt_num

FLAGS = {  # flag -> (EvalConfig field, type), in the order `--help` lists them
    "--target": ("target", str), "--proposer": ("proposer", str), "--split": ("split", str),
    "--limit-per-domain": ("limit_per_domain", int), "--turns": ("turns", str),
    "--max-new-tokens": ("max_new_tokens", int), "--k": ("k", int), "--top-p": ("top_p", float),
    "--top-k": ("top_k", int), "--seed": ("seed", int),
    "--repeats": ("repeats", int), "--remeasure": ("remeasure", int),
    "--cost-context": ("cost_context", int), "--cost-k-max": ("cost_k_max", int),
    "--cost-repeats": ("cost_repeats", int), "--policy-threshold": ("policy_threshold", float),
    "--out": ("out", str), "--device": ("device", str), "--dtype": ("dtype", str),
    "--draft-dtype": ("draft_dtype", str), "--as-served": ("as_served", str),
}


def register(subparsers) -> None:
    from draftsmith.config import field_help
    from draftsmith.evaluation.config import EvalConfig

    p = subparsers.add_parser("evaluate", help="measure acceptance, tau and speedup per domain",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="an eval preset (kind: eval): a shipped preset's name (eval/ngram-smollm2) or a "
                                    "file's path (default: none; the flags' defaults below)")
    # each flag's default stays None, so that only a flag given overrides the --config file; its help is the
    # EvalConfig field's comment and default (evaluation/config.py), the one place both are written
    for flag, (name, tp) in FLAGS.items():
        p.add_argument(flag, type=tp, default=None, help=field_help(EvalConfig, name))
    p.add_argument("--temperature", type=float, nargs="+", default=None,
                   help=field_help(EvalConfig, "temperature") + "; several values run a sweep (one report per "
                   "temperature + sweep.md)")
    p.add_argument("--adaptive", action="store_true",
                   help="also decode with adaptive k (chains up to --k) and compare it with fixed k")
    p.add_argument("--compare", nargs="+", default=None, metavar="PROPOSER",
                   help="more proposers decoded on the same prompts in the same run (side-by-side speedups)")
    p.add_argument("--domains", nargs="+", default=None, metavar="DOMAIN",
                   help="only these domains of the prompt files (e.g. general math code instructions)")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="jsonl prompt files, one domain per file (default: the shipped eval sets of --split)")
    p.add_argument("--tree", type=str, default=None,
                   help="verify a tree instead of a --k chain: draft tokens per depth, e.g. 4,2,1; `auto` = the "
                        "artifact's own tree (Medusa's calibrated tree, EAGLE-2's budget) (default: a chain)")
    p.add_argument("--no-hf-reference", action="store_true",
                   help="skip HF generate: faster, but `lossless` is then not judged (null)")
    p.add_argument("--no-cost-model", action="store_true",
                   help="skip measuring v(k) (the --cost-* flags): no predicted speedup, recommended k or tree cut")
    p.add_argument("--no-prune-tree", action="store_true",
                   help="verify every node a tree proposer returns (default: cut scored trees to the nodes that pay)")
    p.add_argument("--no-gpu-tree", action="store_true",
                   help="with a cut tree, do not also decode with the uncut GPU-sized tree (its τ is reported beside)")
    p.add_argument("overrides", nargs="*",
                   help="key=value overrides of the --config file, any EvalConfig field (evaluation/config.py)")
    p.set_defaults(func=run)


def build_config(args):
    from draftsmith.config import load_config
    from draftsmith.errors import ConfigError
    from draftsmith.evaluation.config import EvalConfig

    overrides = list(args.overrides or [])
    for flag, (name, _) in FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.append(f"{name}={value}")
    temps = getattr(args, "temperature", None)
    if temps and len(temps) == 1:
        overrides.append(f"temperature={temps[0]}")
    elif temps:
        overrides.append("temperatures=[" + ", ".join(str(t) for t in temps) + "]")
    if getattr(args, "compare", None):
        overrides.append("compare=[" + ", ".join(f"'{c}'" for c in args.compare) + "]")
    if getattr(args, "adaptive", False):
        overrides.append("adaptive=true")
    if args.prompts:
        overrides.append("prompts=[" + ", ".join(f"'{p}'" for p in args.prompts) + "]")
    if getattr(args, "domains", None):
        overrides.append("domains=[" + ", ".join(f"'{d}'" for d in args.domains) + "]")
    if args.tree == "auto":
        overrides.append("tree_from_proposer=true")
    elif args.tree:
        try:
            overrides.append("tree=[" + ", ".join(str(int(b)) for b in args.tree.split(",")) + "]")
        except ValueError:
            raise ConfigError(f"--tree {args.tree}: expected comma-separated integers like 4,2,1") from None
    if args.no_hf_reference:
        overrides.append("hf_reference=false")
    if args.no_prune_tree:
        overrides.append("prune_tree=false")
    if args.no_gpu_tree:
        overrides.append("gpu_tree=false")
    if args.no_cost_model:
        overrides.append("cost_model=false")
    return load_config(args.config, overrides, cls=EvalConfig)


def run(args) -> int:
    from draftsmith.locks import output_lock

    cfg = build_config(args)
    with output_lock(cfg.out, "evaluation output"):  # one evaluation per --out folder at a time
        return _run(args, cfg)


def _run(args, cfg) -> int:
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    command = "draftsmith " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
    if cfg.temperatures:
        from draftsmith.evaluation.sweep import render, sweep_temperatures

        summary = sweep_temperatures(cfg, command=command)
        print(render(summary))
        print(f"sweep: {cfg.out}/sweep.md")
        return 0
    report = evaluate(cfg.target, cfg.proposer, config=cfg, command=command)
    out = write_report(report, cfg.out)
    print(summary_line(report))
    print(f"report: {out / 'report.json'}")
    return 0


def summary_line(report: dict) -> str:
    """The printed result; when other processes used the CPU during the run it says its speedups are not valid."""
    o = report["overall"]
    line = (f"overall: alpha {fmt_num(o['alpha'])}, tau {fmt_num(o['tau'])}, {fmt_num(o['tokens_per_s'])} tok/s "
            f"vs {fmt_num(o['baseline_tokens_per_s'])} plain, speedup {fmt_num(o['speedup'])}"
            + (f" ({fmt_num(o['speedup_vs_hf_generate'])} vs HF generate)" if o.get("speedup_vs_hf_generate")
               else "")
            + f", lossless {o['lossless']}"
            + ("" if o.get("timing_valid", True)
               else f" (speedups from {o.get('n_timed')} of {o['n_prompts']} prompts)"))
    busy = report.get("contention") or {}
    if busy.get("speedups_valid") is False:
        line += f"\nSPEEDUPS NOT VALID: {busy['note']}"
    return line
