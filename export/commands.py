"""`draftsmith export --artifact PATH --to vllm|sglang|trtllm|hf --out DIR [--target SPEC] [--no-verify]`
and `draftsmith import-export --export DIR --out ARTIFACT` (a vLLM Medusa / speculators EAGLE-3 folder back
into a draftsmith artifact)."""

from __future__ import annotations

from draftsmith.export.common import STACKS


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="export an artifact for a serving stack (verified by reloading)")
    p.add_argument("--artifact", required=True, help="draftsmith artifact directory (draft, medusa or eagle)")
    p.add_argument("--to", required=True, choices=STACKS, help="serving stack")
    p.add_argument("--out", required=True, help="output directory (written beside it, verified, then swapped in; "
                   "an existing folder is replaced only if it is a draftsmith export)")
    p.add_argument("--overwrite", action="store_true", help="replace --out even if it is not a draftsmith export")
    p.add_argument("--target", default=None, help="target spec (default: smollm2-135m); its fingerprint must match")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft length written into serve.md")
    p.add_argument("--verifier", default=None, metavar="HUB_ID",
                   help="the target's name where it will be served (e.g. meta-llama/Llama-3.1-8B-Instruct): "
                        "written into config.json, serve.md and README.md instead of the local folder")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip verification after writing")
    p.set_defaults(func=run)

    i = subparsers.add_parser("import-export", help="read an exported Medusa / EAGLE folder back into an artifact")
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
    return 0


def run_import(args) -> int:
    from draftsmith.export.api import import_export

    print(f"artifact: {import_export(args.export, args.out, overwrite=args.overwrite)}")
    return 0
