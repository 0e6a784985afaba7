"""`draftsmith bench`: the whole benchmark, or one timing job of a single stage.

    draftsmith bench --config configs/bench/<target>.yaml [--quick] [--prompts FILE ...] [key=value ...]
    draftsmith bench JOB ...

The jobs (each module's docstring says what it measures and how):

    engine      the decode engines on the same prompts (benchmark/engine.py)
    capture     teacher-forced capture against generation with capture (benchmark/capture.py)
    remote      the embedded engine against an OpenAI-compatible server (benchmark/remote.py)
    eagle-step  one EAGLE training step two ways (benchmark/eagle_step.py)
    train-step  one optimizer step of several jobs, interleaved: the steps each takes at equal time
                (benchmark/train_step.py)
    baseline    is plain decoding's one-token step the fastest this machine can do? (evaluation/baseline.py)
    gemm        F.linear against W @ xᵀ over a few rows, and whole forwards (targets/gemm.py)
    llamacpp    llama.cpp beside our plain decoding on the same GGUF and prompts (benchmark/llamacpp.py)
    headline    the headline blocks of README.md and BENCHMARKS.md from their reports (benchmark/headline.py)

`draftsmith serve-bench` (a command of its own, registered here): served throughput by concurrency in a real
`vllm serve`, with and without each drafter (benchmark/serve_bench.py).

The whole bench runs engine, baseline and llamacpp as stages of its own, through these same commands.
"""

from __future__ import annotations

import argparse

from draftsmith.config import DRAFT_TOKENS, MAX_BATCH, REPEATS, ROWS, SECONDS, TOKENS, Range, ranged

JOBS_HELP = ("a single timing job (engine, capture, remote, eagle-step, train-step, baseline, gemm, llamacpp, "
            "headline); without one, the whole bench, and the words are key=value overrides of its config")


class _JobOrOverride:
    """What argparse checks the first word after `bench` against: a job's name or a key=value override."""

    def __init__(self, jobs: dict):
        self.jobs = jobs

    def __contains__(self, word) -> bool:
        return word in self.jobs or "=" in word

    def __iter__(self):
        return iter(self.jobs)


class _JobOrOverrides(argparse._SubParsersAction):
    """The words after `bench`: a job's name runs that job; key=value words are overrides of the whole bench's
    config, with its options before, between or after them (as every other command takes them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.choices = _JobOrOverride(self._name_parser_map)

    def __call__(self, parser, namespace, values, option_string=None):
        if values[0] in self._name_parser_map:
            return super().__call__(parser, namespace, values, option_string)
        namespace.overrides = [*getattr(namespace, "overrides", []), values[0]]
        _, rest = parser.parse_known_args(values[1:], namespace)  # the next override comes back here
        if rest:
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(rest)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="train every artifact, evaluate everything, regenerate BENCHMARKS.md; "
                              "or one timing job (`bench JOB --help`)")
    p.add_argument("--config", default="configs/bench/smollm2-135m.yaml",
                   help="a bench preset (kind: bench): its data, artifacts, baselines and budgets "
                        "(default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="the preset's quick budget (a smoke run: minutes, not hours) instead of its full one")
    p.add_argument("--out", default=None, help="results folder (default: the preset's out/<date>[-quick]); give "
                                               "an earlier one to resume it, its finished stages kept")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="extra jsonl prompt files, evaluated beside the shipped sets (default: none)")
    p.add_argument("--no-update", action="store_true",
                   help="leave BENCHMARKS.md as it is (default: its block for this target and budget is rewritten)")
    p.add_argument("--redo", nargs="+", default=None, metavar="STAGE",
                   help="run these finished stages again when resuming (e.g. eval/medusa after a decoder change; "
                        "default: none)")
    p.set_defaults(func=run)
    jobs = p.add_subparsers(dest="bench_job", metavar="[JOB]", action=_JobOrOverrides, help=JOBS_HELP)
    _register_engine_jobs(jobs)
    _register_training_jobs(jobs)
    _register_kernel_jobs(jobs)
    _register_headline(jobs)
    _register_serve_bench(subparsers)


def _register_engine_jobs(jobs) -> None:
    e = jobs.add_parser("engine", help="the decode engines on the same prompts (benchmark/engine.py)")
    e.add_argument("n", type=ranged(int, ROWS), metavar="PROMPTS",
                   help="how many prompts: the first N/2 GSM8K questions and N/2 self-instruct seed tasks")
    e.add_argument("max_new_tokens", type=ranged(int, TOKENS), metavar="MAX_NEW_TOKENS",
                   help="tokens generated per prompt, at most")
    e.add_argument("engines", help="comma-separated KIND:BATCH[:PRECISION], KIND one of cb, np, sd, cap, capall, "
                                   "hf; PRECISION bf16 or bf16-all (default float32), e.g. cb:32,cap:32,hf:16,cb:1")
    e.add_argument("target", nargs="?", default="smollm2-135m",
                   help="the target: an embedded name, a GGUF file or an HF model folder (default: %(default)s)")
    e.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON here (default: none)")
    e.set_defaults(func=run_engine)

    c = jobs.add_parser("capture", help="teacher-forced capture against generation with capture "
                                        "(benchmark/capture.py)")
    c.add_argument("n", type=ranged(int, ROWS), metavar="PROMPTS",
                   help="how many prompts: the first N/2 GSM8K questions and N/2 self-instruct seed tasks")
    c.add_argument("max_new_tokens", type=ranged(int, TOKENS), metavar="MAX_NEW_TOKENS",
                   help="tokens generated per prompt, at most")
    c.add_argument("target", nargs="?", default="smollm2-135m",
                   help="the target: an embedded name, a GGUF file or an HF model folder (default: %(default)s)")
    c.add_argument("--batch", type=ranged(int, Range(ge=1, le=MAX_BATCH)), default=96,
                   help="rows the generating engine decodes at once (default: %(default)s)")
    c.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON here (default: none)")
    c.set_defaults(func=run_capture)

    r = jobs.add_parser("remote", help="the embedded engine against an OpenAI-compatible server on the same "
                                       "prompts (benchmark/remote.py)")
    r.add_argument("n", type=ranged(int, ROWS), metavar="PROMPTS",
                   help="how many prompts: the first N/2 GSM8K questions and N/2 self-instruct seed tasks")
    r.add_argument("max_new_tokens", type=ranged(int, TOKENS), metavar="MAX_NEW_TOKENS",
                   help="tokens generated per prompt, at most")
    r.add_argument("target", nargs="?", default="smollm2-135m",
                   help="the target: an embedded name, a GGUF file or an HF model folder (default: %(default)s)")
    r.add_argument("--server", choices=["transformers", "vllm"], default="transformers",
                   help="the OpenAI-compatible server: `transformers serve`, or vLLM from .venv-vllm "
                        "(default: %(default)s)")
    r.add_argument("--batch", "--concurrency", dest="batch", type=ranged(int, Range(ge=1, le=MAX_BATCH)), default=16,
                   help="the engine's batch, the requests in flight (and vLLM's max_num_seqs) (default: %(default)s)")
    r.add_argument("--repeats", type=ranged(int, REPEATS), default=1,
                   help="runs of each side, alternating; the median is reported (default: %(default)s)")
    r.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON here (default: none)")
    r.set_defaults(func=run_remote)


def _register_training_jobs(jobs) -> None:
    s = jobs.add_parser("eagle-step", help="one EAGLE training step two ways (benchmark/eagle_step.py)")
    s.add_argument("overrides", nargs="*", metavar="[CONFIG] key=value",
                   help="the EAGLE job's preset (default configs/smollm2-135m/eagle3.yaml) and its overrides")
    s.add_argument("--batches", type=ranged(int, Range(ge=1, le=10**6)), default=6,
                   help="length-sorted batches of the job's training split, each timed both ways "
                        "(default: %(default)s)")
    s.add_argument("--repeats", type=ranged(int, REPEATS), default=2,
                   help="passes over the batches (default: %(default)s)")
    s.add_argument("--compare", choices=["skip", "precision"], default="skip",
                   help="skip: the head skipping the bases no loss reaches against computing every one; "
                        "precision: float32 against bf16 autocast (default: %(default)s)")
    s.set_defaults(func=run_eagle_step)

    t = jobs.add_parser("train-step", help="one optimizer step of several training jobs, interleaved: their "
                                          "cost ratio and the steps each takes at equal time "
                                          "(benchmark/train_step.py)")
    t.add_argument("configs", nargs="+", metavar="[NAME=]CONFIG", help="job presets (NAME defaults to the kind)")
    t.add_argument("--set", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                   help="overrides for the job NAME (repeatable)")
    t.add_argument("--batches", type=ranged(int, Range(ge=1, le=10**6)), default=6,
                   help="length-sorted batches of each job's training split, one full optimizer step each "
                        "(default: %(default)s)")
    t.add_argument("--repeats", type=ranged(int, REPEATS), default=3,
                   help="passes over the batches, the jobs interleaved (default: %(default)s)")
    t.add_argument("--reference-steps", type=ranged(int, Range(ge=1, le=10**9)),
                   help="the first job's steps, converted to the steps each other job takes in the same time "
                        "(default: none, no conversion)")
    t.add_argument("--out", help="folder for report.json (default: printed only)")
    t.set_defaults(func=run_train_step)


def _register_kernel_jobs(jobs) -> None:
    b = jobs.add_parser("baseline", help="is plain decoding's one-token step not slower than a two-token forward? "
                                         "(evaluation/baseline.py; exit 1 when it is)")
    b.add_argument("target", nargs="?", default=None,
                   help="the target: an embedded name, a GGUF file or an HF model folder (default: smollm2-135m)")
    b.add_argument("--context", type=ranged(int, TOKENS), default=256,
                   help="cached tokens the timed forwards attend to (default: %(default)s)")
    b.add_argument("--repeats", type=ranged(int, REPEATS), default=9,
                   help="timed forwards of each kind, interleaved; the median is kept (default: %(default)s)")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON here (default: none)")
    b.add_argument("--record-only", action="store_true", help="exit 0 whatever the verdict (the bench reports it)")
    b.set_defaults(func=run_baseline)

    g = jobs.add_parser("gemm", help="F.linear vs W @ x^T over a few rows: the plan measured at load, and whole "
                                     "target forwards with the path off and on (targets/gemm.py)")
    g.add_argument("target", nargs="?", default=None,
                   help="the target: an embedded name, a GGUF file or an HF model folder (default: smollm2-135m)")
    g.add_argument("--rows", default="1,2,3,4,5,8,12,16,32",
                   help="comma-separated token counts of the forwards compared (default: %(default)s)")
    g.add_argument("--context", type=ranged(int, TOKENS), default=256,
                   help="cached tokens the timed forwards attend to (default: %(default)s)")
    g.add_argument("--repeats", type=ranged(int, REPEATS), default=7,
                   help="timed forwards of each row count and path; the median is kept (default: %(default)s)")
    g.set_defaults(func=run_gemm)

    ll = jobs.add_parser("llamacpp", help="llama.cpp beside our plain decoding on the same GGUF and prompts "
                                          "(benchmark/llamacpp.py; `make setup-llamacpp`)")
    ll.add_argument("target", nargs="?", default=None,
                    help="a target from a GGUF file: an embedded name or a .gguf path (default: smollm2-135m)")
    ll.add_argument("--limit-per-domain", type=ranged(int, ROWS), default=2,
                    help="prompts per domain of the shipped eval sets (default: %(default)s)")
    ll.add_argument("--max-new-tokens", type=ranged(int, TOKENS), default=96,
                    help="tokens generated per prompt, at most (default: %(default)s)")
    ll.add_argument("--split", default="dev", choices=["dev", "test"],
                    help="which eval split's prompts (default: %(default)s)")
    ll.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON here (default: none)")
    ll.set_defaults(func=run_llamacpp)


def _register_headline(jobs) -> None:
    h = jobs.add_parser("headline", help="the headline numbers of README.md and BENCHMARKS.md, rendered from "
                                         "their committed reports (benchmark/headline.py)")
    h.add_argument("report", nargs="?", help="print the block rendered from this report.json")
    h.add_argument("--write", action="store_true", help="rewrite the headline blocks of README.md and BENCHMARKS.md "
                                                        "(and their by-engine blocks, benchmark/by_engine.py)")
    h.add_argument("--root", default=None, help="the checkout holding them (default: this package's)")
    h.set_defaults(func=run_headline)


def _register_serve_bench(subparsers) -> None:
    s = subparsers.add_parser("serve-bench", help="served throughput by concurrency in a real `vllm serve`, with and "
                              "without each drafter: tokens/s, TTFT/TPOT, speedup per domain, k per batch size "
                              "(benchmark/serve_bench.py)")
    s.add_argument("target", nargs="?", default=None,
                   help="the target: an embedded name, a GGUF file or an HF model folder (default: smollm2-135m; "
                        "with --url only given ones are loaded, for the prompt-length check)")
    s.add_argument("--drafter", action="append", default=[], metavar="EXPORT",
                   help="a vLLM export folder (`draftsmith export ... --to vllm`) served as the speculator; "
                        "repeatable (default: none, plain decoding only)")
    s.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="a running vLLM server instead of starting one: `plain=` the one without a drafter, any "
                        "other NAME a drafter's (run it with --per-request-spec-decode-metrics detailed); repeatable")
    s.add_argument("--out", required=True, help="report folder: report.json, report.md, tokens_per_s.png, logs/")
    s.add_argument("--k", type=ranged(int, DRAFT_TOKENS), default=None,
                   help="num_speculative_tokens of every started drafter server (default: each export's own, from "
                        "its draftsmith.json; 4 where it names none)")
    s.add_argument("--concurrency", default="1,4,16",
                   help="comma-separated requests in flight, one run each (default: %(default)s)")
    s.add_argument("--requests", type=ranged(int, ROWS), default=32,
                   help="requests per mixed-domain run, at least the concurrency (default: %(default)s)")
    s.add_argument("--domain-requests", type=ranged(int, Range(ge=0, le=10**6)), default=16,
                   help="requests per homogeneous run of one domain, at least the concurrency; 0: no per-domain "
                        "runs (default: %(default)s)")
    s.add_argument("--max-tokens", type=ranged(int, TOKENS), default=64,
                   help="output tokens per request, at most (default: %(default)s)")
    s.add_argument("--prompts", nargs="+", default=None, help="jsonl prompt files (default: the shipped eval sets)")
    s.add_argument("--split", default="dev", choices=["dev", "test"],
                   help="which shipped eval split without --prompts (default: %(default)s)")
    s.add_argument("--limit-per-domain", type=ranged(int, ROWS), default=4,
                   help="prompts per domain (default: %(default)s)")
    s.add_argument("--max-model-len", type=ranged(int, TOKENS), default=2048,
                   help="the started servers' context; longer prompts are left out (default: %(default)s)")
    s.add_argument("--request-timeout", type=ranged(float, SECONDS), default=300.0,
                   help="seconds one request may take in all (default: %(default)s)")
    s.add_argument("--run-timeout", type=ranged(float, SECONDS), default=1800.0,
                   help="seconds after which a run sends no more requests; the unsent are counted "
                        "(default: %(default)s)")
    s.set_defaults(func=run_serve_bench)


def _bench_servers(args) -> list:
    """The configurations to measure: plain + each --drafter (started here), or the --url servers."""
    from pathlib import Path

    from draftsmith.benchmark.serve_bench import Server
    from draftsmith.errors import ConfigError
    from draftsmith.export.serve_check import speculative_config, vllm_serving
    from draftsmith.layouts.common import read_guard

    if args.url and args.drafter:
        raise ConfigError("serve-bench: --url points at running servers, --drafter starts them; give one of the two")
    if args.url:
        pairs = [u.partition("=") for u in args.url]
        bad = next((u for u, (name, eq, url) in zip(args.url, pairs, strict=True) if not (name and eq and url)), None)
        if bad is not None:
            raise ConfigError(f"--url {bad!r}: expected NAME=URL (plain=http://host:8000 for the server without a "
                              "drafter)")
        return [Server(name, url=url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1")
                for name, _, url in pairs]
    servers = [Server("plain")]
    for d in map(Path, args.drafter):
        k = args.k or read_guard(d).get("num_speculative_tokens") or 4
        unapplied = [patch.name for patch in vllm_serving(d).patches]
        servers.append(Server(d.name, speculative_config(d, k), patches_not_applied=unapplied))
    return servers


def run_serve_bench(args) -> int:
    from draftsmith.benchmark.serve_bench import Plan, load_plan_prompts, serve_bench
    from draftsmith.errors import ConfigError
    from draftsmith.targets import load_target

    servers = _bench_servers(args)
    try:
        concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        raise ConfigError(f"--concurrency {args.concurrency!r}: expected comma-separated whole numbers") from None
    if not concurrency or concurrency[0] < 1 or concurrency[-1] > MAX_BATCH:
        raise ConfigError(f"--concurrency {args.concurrency!r}: each must be in 1..{MAX_BATCH}")
    target = load_target(args.target or "smollm2-135m") if args.target or not args.url else None
    if target is not None and not args.url and target.folder is None:
        raise ConfigError(f"target {target.name}: vLLM needs an HF folder of the target")
    # the server's context holds the prompt, the answer and a chain drafted past it
    room = args.max_model_len - args.max_tokens - max([args.k or 0] + [s.k for s in servers]) - 8
    by_domain, info = load_plan_prompts(args.prompts, args.split, args.limit_per_domain,
                                        target.tokenizer if target is not None else None, room)
    plan = Plan(by_domain, concurrency, args.requests, args.domain_requests, args.max_tokens, args.request_timeout,
                args.run_timeout, info)
    report = serve_bench(target, servers, plan, args.out, args.max_model_len)
    print(f"report: {args.out}/report.md")
    for name, comp in report["comparisons"].items():
        print(f"{name}: {comp['verdict']}")
    return 0


def run(args) -> int:
    from draftsmith.benchmark.run import run_bench

    summary = run_bench(args.config, getattr(args, "overrides", []), args.quick, args.out, args.prompts,
                        not args.no_update, redo=args.redo)
    print(f"results: {summary['results']}/summary.md")
    return 0


def run_engine(args) -> int:
    from draftsmith.benchmark.engine import run as engine

    engine(args.n, args.max_new_tokens, args.engines, args.target, args.json)
    return 0


def run_capture(args) -> int:
    from draftsmith.benchmark.capture import run as capture

    capture(args.n, args.max_new_tokens, args.target, args.batch, args.json)
    return 0


def run_remote(args) -> int:
    from draftsmith.benchmark.remote import run as remote

    remote(args.n, args.max_new_tokens, args.target, args.server, args.batch, args.repeats, args.json)
    return 0


def run_eagle_step(args) -> int:
    from draftsmith.benchmark.eagle_step import run as eagle_step

    words = list(args.overrides)
    config = words.pop(0) if words and "=" not in words[0] else None
    eagle_step(config, words, args.batches, args.repeats, args.compare)
    return 0


def run_train_step(args) -> int:
    from draftsmith.benchmark.train_step import run as train_step

    sets: dict[str, list[str]] = {}
    for name, *pairs in args.set:
        sets.setdefault(name, []).extend(pairs)
    train_step(args.configs, sets, args.batches, args.repeats, args.reference_steps, args.out)
    return 0


def run_baseline(args) -> int:
    from draftsmith.evaluation.baseline import check_plain_step, describe
    from draftsmith.outputs import atomic_write_json
    from draftsmith.targets import load_target

    target = load_target(args.target)
    r = check_plain_step(target, args.context, args.repeats)
    print(describe(target.name, r))
    if args.json:
        atomic_write_json(args.json, r)
    return 0 if r["ok"] or args.record_only else 1


def run_gemm(args) -> int:
    from draftsmith.targets import gemm, load_target

    target = load_target(args.target)  # measures the plan (freeze -> calibrate)
    print(gemm.report(target, [int(r) for r in args.rows.split(",")], args.context, args.repeats))
    return 0


def run_llamacpp(args) -> int:
    from draftsmith.benchmark.llamacpp import describe
    from draftsmith.benchmark.llamacpp import run as llamacpp
    from draftsmith.outputs import atomic_write_json
    from draftsmith.targets import load_target

    r = llamacpp(load_target(args.target), args.limit_per_domain, args.max_new_tokens, split=args.split)
    print(describe(r))
    if args.json:
        atomic_write_json(args.json, r)
    return 0


def run_headline(args) -> int:
    from pathlib import Path

    from draftsmith.benchmark import by_engine, headline
    from draftsmith.errors import ConfigError

    if args.write:
        root = Path(args.root) if args.root else headline.ROOT
        for name in headline.DOCS:
            print(f"{name}: {headline.rewrite(root / name, root)} headline block(s), "
                  f"{by_engine.rewrite(root / name, root)} by-engine block(s) rendered")
        return 0
    if not args.report:
        raise ConfigError("bench headline: give a report.json, or --write")
    print(headline.render(headline.read_headline_report(args.report), args.report))
    return 0
