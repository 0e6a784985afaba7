"""`draftsmith train METHOD --config PATH [key=value ...]`: run any registered method's training job
(methods.py); `draftsmith distill` is the draft method's own command with more options."""

from __future__ import annotations

from draftsmith import methods


def register(subparsers) -> None:
    known = methods.all_methods()
    p = subparsers.add_parser("train", help="train a drafter on a frozen target: "
                              + ", ".join(m.name for m in known))
    p.add_argument("job", choices=[m.name for m in known],
                   help="; ".join(f"{m.name}: {m.summary}" for m in known))
    p.add_argument("--config", default=None, help="YAML preset (default: the method's smollm2-135m preset)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=100")
    p.set_defaults(func=run)


def run(args) -> int:
    method = methods.get(args.job)
    out = method.get("train")(args.config or method.default_config, args.overrides)
    print(f"artifact: {out}")
    return 0
