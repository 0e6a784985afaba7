"""`draftsmith export --artifact PATH --to vllm|sglang|trtllm|hf --out DIR [--target SPEC] [--no-verify]
[--serve-check]`, `draftsmith serve-check --export DIR [--target SPEC] [--prompts FILE ...] [--k 4]` (real vLLM
from .venv-vllm: export/serve_check.py) and `draftsmith import-export --export DIR --out ARTIFACT` (an export
folder, draftsmith's or another tool's in a layout a method reads back, into a draftsmith artifact)."""

from __future__ import annotations

from draftsmith.config import DRAFT_TOKENS, MAX_BATCH, ROWS, SECONDS, TOKENS, Range, ranged
from draftsmith.methods import STACKS


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="export an artifact for a serving stack (verified by reloading)")
    p.add_argument("--artifact", required=True, help="draftsmith artifact directory (any method's)")
    p.add_argument("--to", required=True, choices=STACKS, help="the serving stack whose layout is written")
    p.add_argument("--out", required=True, help="output directory (written beside it, verified, then swapped in; "
                   "an existing folder is replaced only if it is a draftsmith export)")
    p.add_argument("--overwrite", action="store_true", help="replace --out even if it is not a draftsmith export")
    p.add_argument("--target", default=None, help="target spec (default: smollm2-135m); its fingerprint must match")
    p.add_argument("--num-speculative-tokens", type=ranged(int, DRAFT_TOKENS), default=None,
                   help="draft length written into serve.md (default: the method's own; 4 where "
                        "the drafter does not fix it)")
    p.add_argument("--verifier", default=None, metavar="HUB_ID",
                   help="the target's name where it will be served (e.g. meta-llama/Llama-3.1-8B-Instruct): "
                        "written into config.json, serve.md and README.md instead of the local folder")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip verification after writing")
    p.add_argument("--serve-check", action="store_true",
                   help="then load and decode the export in real vLLM (`draftsmith serve-check`; --to vllm only)")
    p.add_argument("--prompts", nargs="*", default=None,
                   help="prompt files for --serve-check (default: the shared sets)")
    p.set_defaults(func=run)

    s = subparsers.add_parser("serve-check", help="load and decode a vLLM export in real vLLM (`make setup-vllm`): "
                              "loaded, lossless, acceptance vs draftsmith's own evaluator, tokens/s")
    s.add_argument("--export", default=None, help="a vLLM export folder (draftsmith export --to vllm); required "
                                                  "unless --ngram")
    s.add_argument("--ngram", action="store_true", help="check vLLM's n-gram lookup instead of an export (a control)")
    s.add_argument("--target", default=None, help="target spec (default: smollm2-135m)")
    s.add_argument("--prompts", nargs="*", default=None, help="prompt files (default: the shared evaluation sets)")
    s.add_argument("--k", type=ranged(int, DRAFT_TOKENS), default=4,
                   help="draft tokens per step (chain length), both decoders (default: %(default)s)")
    s.add_argument("--max-new-tokens", type=ranged(int, TOKENS), default=64,
                   help="tokens generated per prompt, at most (default: %(default)s)")
    s.add_argument("--limit-per-domain", type=ranged(int, ROWS), default=2,
                   help="prompts per domain, to bound the run (default: %(default)s)")
    s.add_argument("--batch", type=ranged(int, Range(ge=1, le=MAX_BATCH)), default=None,
                   help="prompts per batch for the batched tokens/s (default: every prompt at once)")
    s.add_argument("--timeout", type=ranged(float, SECONDS), default=900.0,
                   help="seconds each vLLM engine may run before it is killed (default: %(default)s)")
    s.add_argument("--out", default=None, help="report folder (default: runs/serve-check/EXPORT_NAME)")
    s.add_argument("--no-evaluate", dest="evaluate", action="store_false", help="skip draftsmith's own evaluator")
    s.set_defaults(func=run_serve_check)

    i = subparsers.add_parser("import-export", help="read an export folder back into an artifact")
    i.add_argument("--export", required=True, help="export directory (with draftsmith.json)")
    i.add_argument("--out", required=True, help="artifact directory to write")
    i.add_argument("--overwrite", action="store_true", help="replace --out even if it is not a draftsmith artifact")
    i.set_defaults(func=run_import)


def run(args) -> int:
    from draftsmith.export.api import export_artifact
    from draftsmith.targets import load_target

    target = load_target(args.target)
    result = export_artifact(args.artifact, args.to, args.out, target, args.num_speculative_tokens, args.verify,
                             overwrite=args.overwrite, verifier=args.verifier)
    print(result.summary())
    print(f"launch: see {result.out / 'serve.md'}")
    if args.serve_check:
        if args.to != "vllm":
            from draftsmith.errors import ConfigError

            raise ConfigError(f"--serve-check runs vLLM: export with --to vllm (got --to {args.to})")
        from draftsmith.export.serve_check import serve_check
        from draftsmith.reading import read_json

        k = read_json(result.out / "draftsmith.json")["num_speculative_tokens"]
        return _print_check(serve_check(result.out, target, args.prompts, k=k))
    return 0


def run_serve_check(args) -> int:
    from draftsmith.export.serve_check import serve_check
    from draftsmith.targets import load_target

    report = serve_check(args.export, load_target(args.target), args.prompts, args.out, k=args.k,
                         max_new_tokens=args.max_new_tokens, limit_per_domain=args.limit_per_domain, batch=args.batch,
                         timeout=args.timeout, method="ngram" if args.ngram else None, evaluate=args.evaluate)
    return _print_check(report)


def _print_check(report: dict) -> int:
    """One summary; exit 0 when loaded and lossless (and, with the evaluator, acceptance within tolerance)."""
    from draftsmith.export.serve_check import render

    print(render(report))
    ok = report["loaded"] and report.get("lossless") and report.get("acceptance_matches", True)
    return 0 if ok else 1


def run_import(args) -> int:
    from draftsmith.export.api import import_export

    print(f"artifact: {import_export(args.export, args.out, overwrite=args.overwrite)}")
    return 0
