"""`draftsmith train medusa|eagle --config PATH [key=value ...]`."""

from __future__ import annotations

import importlib

from draftsmith.errors import DraftsmithError

JOBS = {
    "medusa": ("draftsmith.heads.medusa_job", "run_train_medusa", "configs/smollm2-135m/medusa.yaml"),
    "eagle": ("draftsmith.heads.eagle_job", "run_train_eagle", "configs/smollm2-135m/eagle3.yaml"),
}


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train Medusa or EAGLE heads on a frozen target")
    p.add_argument("job", choices=sorted(JOBS))
    p.add_argument("--config", default=None, help="YAML preset (default: the smollm2-135m preset)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=100")
    p.set_defaults(func=run)


def run(args) -> int:
    module_name, fn, default_config = JOBS[args.job]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise DraftsmithError(f"'{args.job}' training is not available in this build") from None
        raise
    out = getattr(module, fn)(args.config or default_config, args.overrides)
    print(f"artifact: {out}")
    return 0
