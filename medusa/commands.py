"""`draftsmith medusa2-drift ARTIFACT --data DATASET [--target T] [--max-length N]`: how far a Medusa-2
artifact's adapter moved the target, measured again on the dataset's held-out rows (the job records the same
numbers in the manifest's `target_drift` when it trains). Registered through the method (`Method.commands`),
so the command comes and goes with the folder."""

from __future__ import annotations


def register(subparsers) -> None:
    from draftsmith.config import SEED, TOKENS, Range, ranged

    p = subparsers.add_parser("medusa2-drift", help="how far a Medusa-2 adapter moved the target: greedy-token "
                              "agreement and KL(original || adapted) on the dataset's held-out rows")
    p.add_argument("artifact", help="a Medusa-2 artifact folder (heads + adapter)")
    p.add_argument("--data", required=True, help="the self-distilled dataset folder it trained on")
    p.add_argument("--target", default="smollm2-135m",
                   help="the target it was trained on: an embedded name, a GGUF file or an HF model folder "
                        "(default: %(default)s)")
    p.add_argument("--eval-fraction", type=ranged(float, Range(gt=0, lt=1)), default=0.05,
                   help="the fraction of rows the job held out; with --seed, it picks the same rows "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=ranged(int, SEED), default=0, help="the job's seed, which chose the held-out rows "
                                                       "(default: %(default)s)")
    p.add_argument("--max-length", type=ranged(int, Range(ge=8, le=TOKENS.le)), default=384,
                   help="tokens of each row compared, at most (the job's max_length; default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    from draftsmith.medusa.medusa2 import held_out_drift

    d = held_out_drift(args.artifact, args.data, args.target, args.eval_fraction, args.seed, args.max_length)
    print(f"{args.artifact}: {d['rows']} held-out rows, {d['positions']} learned positions: the adapted target's "
          f"greedy token is the original's at {100 * d['agreement']:.1f}% of them; KL(original || adapted) "
          f"{d['kl']:.4f} nats")
    return 0
