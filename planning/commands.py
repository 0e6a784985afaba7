"""Operator commands: `draftsmith plan` (memory), `draftsmith route build|compare` (per-domain routing),
`draftsmith alpha` (production acceptance from a serving engine's metrics or request logs, such as the fleet's
traffic folder that fleet/middleware.py writes inside vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from draftsmith.config import DRAFT_TOKENS, MAX_BATCH, PROBABILITY, SECONDS, TOKENS, Range, ranged


def register(subparsers) -> None:
    _register_plan(subparsers)
    _register_route(subparsers)
    _register_alpha(subparsers)


def _register_plan(subparsers) -> None:
    p = subparsers.add_parser("plan", help="memory plan for a target + artifact on a GPU (weights, KV, headroom)")
    p.add_argument("--target", default=None,
                   help="config.json, HF model folder or embedded target name (default: with --config, the job's "
                        "target; without, required)")
    p.add_argument("--config", default=None, help="a training job preset (any method's YAML): plan its training "
                   "memory per GPU (target + trained module + optimizer + activations) instead of serving memory")
    p.add_argument("--accelerate", default=None, help="with --config: the accelerate preset (DDP, FSDP, ZeRO-2/3; "
                                                      "default: one process, no sharding)")
    p.add_argument("--gpus", type=ranged(int, Range(ge=1, le=1 << 16)), default=None,
                   help="with --config: ranks (default: the accelerate preset's)")
    p.add_argument("--learned", type=ranged(int, TOKENS), default=None,
                   help="with --config: loss positions of the longest row (its answer; default: the whole row); "
                        "EAGLE's later TTT steps and logits, and prompt_context's cut, depend on it")
    p.add_argument("overrides", nargs="*", help="with --config: dotted key=value overrides, e.g. max_length=32768")
    p.add_argument("--artifact", default=None, help="a draftsmith artifact, any method's (default: none, the "
                                                    "target alone)")
    p.add_argument("--gpu", default="H100-80GB", help="the device: a name (H100-80GB, A100-40GB, L4-24GB, ...), cpu "
                                                     "(this machine's RAM), or a size in bytes (default: %(default)s)")
    p.add_argument("--batch", type=ranged(int, Range(ge=1, le=MAX_BATCH)), default=32,
                   help="sequences decoded at once (default: %(default)s)")
    p.add_argument("--context", type=ranged(int, TOKENS), default=8192,
                   help="tokens per sequence held in the KV cache, prompt and answer (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", help="dtype of the weights and KV cache: bf16 | fp16 | fp32 | fp8 | "
                                                  "int8 (default: %(default)s)")
    p.add_argument("--k", type=ranged(int, DRAFT_TOKENS), default=4,
                   help="draft tokens verified per step (default: %(default)s)")
    p.add_argument("--utilization", type=ranged(float, PROBABILITY), default=0.9,
                   help="fraction of device memory the engine may use, vLLM's gpu_memory_utilization "
                        "(default: %(default)s)")
    p.add_argument("--prefill-chunk", type=ranged(int, TOKENS), default=8192,
                   help="tokens per prefill forward (chunked prefill) (default: %(default)s)")
    p.add_argument("--measure", action="store_true",
                   help="also build the models on this CPU (fp32) and compare the plan with measured bytes")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)


def _register_route(subparsers) -> None:
    r = subparsers.add_parser("route", help="per-domain routing policy from evaluation reports")
    rs = r.add_subparsers(dest="route_cmd", required=True)
    b = rs.add_parser("build", help="pick the fastest lossless artifact per domain (or off)")
    b.add_argument("--reports", nargs="+", required=True, help="evaluation report.json files or their folders")
    b.add_argument("--out", required=True, help="policy file to write (JSON)")
    b.add_argument("--threshold", type=ranged(float, Range(gt=0, le=1000)), default=1.0,
                   help="route a domain off below this value of the criterion: a speedup ratio, or tau in tokens "
                        "per step (default: %(default)s)")
    b.add_argument("--criterion", choices=["speedup", "tau", "predicted"], default="speedup",
                   help="speedup: measured in the reports (this machine); tau: tau at the GPU-sized budget; "
                        "predicted: tau / (v(n) + c) for --profile (planning/policy.py) (default: %(default)s)")
    b.add_argument("--profile", default=None,
                   help="with --criterion predicted: a verify-cost profile, `gpu` (built in) or a JSON file "
                        "{\"v\": {nodes: cost}, \"c\": {kind: cost}} (default: none)")
    b.add_argument("--router", choices=["declared", "keyword"], default="declared",
                   help="classify requests by their declared domain (keywords when missing) or by keywords only "
                        "(default: %(default)s)")
    b.set_defaults(func=run_route_build)
    c = rs.add_parser("compare", help="the routed run against every single artifact, per domain")
    c.add_argument("--routed", required=True, help="report of `draftsmith evaluate --proposer route:POLICY`")
    c.add_argument("--reports", nargs="+", default=None,
                   help="single-artifact reports from other runs (default: the routed run's own --compare runs)")
    c.add_argument("--out", default=None, help="write the table (markdown) here too (default: printed only)")
    c.set_defaults(func=run_route_compare)


def _register_alpha(subparsers) -> None:
    a = subparsers.add_parser(
        "alpha", help="per-domain acceptance from a vLLM server's /metrics or request logs",
        description="Per-domain acceptance (alpha, tau, per-position) from one of: a running vLLM server's /metrics "
                    "URL or a Prometheus dump of it (spec-decode counters, one row per served model); or a folder "
                    "/ .jsonl(.gz) of request logs whose rows carry per-request counters: vLLM's "
                    "speculative_decoding (the traffic that draftsmith.fleet.middleware.TrafficLog logs with "
                    "--per-request-spec-decode-metrics; a raw response's metrics.speculative_decoding too), a "
                    "gateway's draft_tokens + accepted_tokens, or SGLang's spec_verify_ct + completion_tokens. "
                    "Log rows are grouped by their domain field, else by --policy's classifier, else 'unknown'.")
    a.add_argument("source", help="a running server's /metrics URL (http://127.0.0.1:8000/metrics), a Prometheus "
                                  "text dump of it, or a folder / .jsonl of request logs (e.g. the fleet's "
                                  "traffic folder, DRAFTSMITH_TRAFFIC_DIR)")
    a.add_argument("--policy", default=None, metavar="FILE",
                   help="request logs only: a routing policy (draftsmith route build) whose router classifies a "
                        "row without a domain by its prompt (a chat's last user message) (default: none, such "
                        "rows are 'unknown')")
    a.add_argument("--max-domains", type=ranged(int, Range(ge=1, le=10**6)), default=32, metavar="N",
                   help="request logs only: the N domains with the most requests keep their name, the rest are "
                        "'other' (clients name domains; default: %(default)s)")
    a.add_argument("--since", default=None, help="an earlier dump: report the window between the two (default: "
                                                 "none: the totals so far)")
    a.add_argument("--save", default=None, metavar="FILE",
                   help="keep the metrics read (the --since of the next check; default: not kept)")
    a.add_argument("--model-domain", action="append", default=[], metavar="MODEL=DOMAIN",
                   help="map a served model_name to a domain (repeatable)")
    a.add_argument("--out", default=None, help="write the table as JSON (the shape retraining reads; default: "
                                               "printed only)")
    a.add_argument("--timeout", type=ranged(float, SECONDS), default=30.0, metavar="SECONDS",
                   help="a URL must answer in full within this (a deadline, not per read; default: %(default)s)")
    a.add_argument("--max-mib", type=ranged(float, Range(gt=0, le=1 << 20)), default=64.0, metavar="MIB",
                   help="refuse metrics (a URL's answer or a dump) larger than this (default: %(default)s)")
    a.set_defaults(func=run_alpha)


def run_plan(args) -> int:
    from draftsmith.errors import ConfigError
    from draftsmith.memory import serving

    if args.config:
        from draftsmith.memory.training import format_plan, plan_config

        p = plan_config(args.config, args.target, args.accelerate, args.gpu, args.gpus, args.overrides, args.learned,
                        advise=True)
        print(json.dumps(p, indent=2) if args.json else format_plan(p))
        return 0
    if args.target is None:
        raise ConfigError("plan: give --target (inference memory) or --config (a training job's memory)")

    cfg = serving.load_target_config(args.target)
    shape = serving.artifact_shape(args.artifact, cfg)
    gpu = int(float(args.gpu)) if args.gpu.replace(".", "").replace("e", "").isdigit() else args.gpu
    p = serving.plan(cfg, shape, gpu, args.batch, args.context, args.dtype, args.k, args.prefill_chunk,
                     args.utilization)
    if args.measure:
        # a fresh process, so its peak RSS is this measurement's alone
        code = ("import json,sys; from draftsmith.memory.serving import measure_cpu; "
                "print(json.dumps(measure_cpu(*json.loads(sys.argv[1]))))")
        argv = json.dumps([args.target, args.artifact, args.batch, args.context, args.k])
        # a fixed mmap threshold makes glibc return freed large blocks at once, so RSS tracks live tensors
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run([sys.executable, "-c", code, argv], capture_output=True, text=True, check=False, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"measurement failed: {out.stderr.strip().splitlines()[-1] if out.stderr else '?'}")
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        cpu = serving.plan(cfg, shape, "cpu", args.batch, args.context, "fp32", args.k, args.prefill_chunk, 1.0,
                           overhead_bytes=0)
        p["cpu_check"] = {"planned_fp32": {"weights": sum(cpu["weights_bytes"].values()) if shape.separate_model
                                           else cpu["weights_bytes"]["target"],
                                           "kv": cpu["kv_bytes"]["target"] + cpu["kv_bytes"]["artifact"],
                                           "activations": cpu["activation_bytes"]},
                          "measured": measured}
    if args.json:
        print(json.dumps(p, indent=2))
        return 0
    print(serving.render(p))
    if "cpu_check" in p:
        c = p["cpu_check"]
        pl, me = c["planned_fp32"], c["measured"]
        mib = lambda x: f"{x / 2**20:.1f} MiB"  # noqa: E731
        print(f"CPU check (fp32, batch {args.batch}, context {args.context}): weights planned {mib(pl['weights'])} "
              f"vs counted {mib(me['weights_bytes'])}; KV planned {mib(pl['kv'])} vs counted {mib(me['kv_bytes'])}; "
              f"KV + activations planned {mib(pl['kv'] + pl['activations'])} vs peak RSS increase "
              f"{mib(me['peak_rss_increase_bytes'])}")
    return 0


def run_route_build(args) -> int:
    from draftsmith.planning.policy import build_policy, write_policy

    policy = build_policy(args.reports, args.threshold, args.router, criterion=args.criterion, profile=args.profile)
    path = write_policy(policy, args.out)
    for d, r in policy["domains"].items():
        print(f"{d}: " + ("off" if r == "off" else f"{r['proposer']} ({policy['criterion']} {r['value']:.2f}, "
                                                 f"k={r['k']}, tree={r['tree']})"))
    print(f"policy: {path}")
    return 0


def run_route_compare(args) -> int:
    from pathlib import Path

    from draftsmith.evaluation.report_file import read_report
    from draftsmith.outputs import atomic_write_text
    from draftsmith.planning.policy import compare_table

    md, _ = compare_table(read_report(args.routed), [read_report(p) for p in args.reports] if args.reports else None)
    print(md)
    if args.out:
        atomic_write_text(Path(args.out), md)
    return 0


def run_alpha(args) -> int:
    import math

    from draftsmith import net
    from draftsmith.errors import ConfigError
    from draftsmith.outputs import atomic_write_json
    from draftsmith.planning.production import production_alpha, render

    mapping = {}
    for item in args.model_domain:
        model, sep, domain = item.partition("=")
        if not sep or not model or not domain:
            raise ConfigError(f"--model-domain {item!r}: expected MODEL=DOMAIN")
        mapping[model] = domain
    for flag, value in (("--timeout", args.timeout), ("--max-mib", args.max_mib)):
        if not (math.isfinite(value) and 0 < value <= 1e6):
            raise ConfigError(f"{flag} {value}: expected a number in (0, 1e6]")
    table = production_alpha(args.source, args.since, mapping, save=args.save, timeout=args.timeout,
                             max_bytes=int(args.max_mib * (1 << 20)), policy=args.policy,
                             max_domains=args.max_domains)
    table = net.redact_all(table)  # its source URL, the logs' lines: outside text, shown and written redacted
    print(render(table))
    if args.out:
        atomic_write_json(args.out, table)
    return 0
