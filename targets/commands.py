"""`draftsmith targets`: list / prepare the embedded targets, print a target's fingerprint."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser("targets", help="list the embedded targets; `prepare NAME` caches one")
    p.add_argument("action", nargs="?", choices=["list", "prepare", "fingerprint"], default="list",
                   help="list: the embedded targets, installed and cached or not; prepare: load NAME once, so its "
                        "weights are cached (a GGUF file dequantised); fingerprint: print NAME's target "
                        "fingerprint as JSON (default: %(default)s)")
    p.add_argument("name", nargs="?", help="for prepare / fingerprint: an embedded name, a GGUF file, an HF model "
                                           "folder or a hub id (default: smollm2-135m)")
    p.set_defaults(func=run_targets)



def run_targets(args) -> int:
    from draftsmith.targets import list_targets, load_target

    if args.action == "list":
        rows = list_targets()
        print(f"{'name':<14} {'installed':<10} {'cached':<7} description")
        for r in rows:
            mark = " (default)" if r["default"] else ""
            inst = "yes" if r["installed"] else "no"
            print(f"{r['name']:<14} {inst:<10} {'yes' if r['cached'] else 'no':<7} {r['description']}{mark}")
            if not r["installed"]:
                print(f"{'':<14} install: {r['install']}")
        return 0
    target = load_target(args.name)
    if args.action == "prepare":
        print(f"{target.name}: ready in {target.folder}")
    else:
        print(json.dumps(target.fingerprint(), indent=2))
    return 0
