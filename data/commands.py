"""`draftsmith data ...` subcommands: generate a self-distilled dataset, inspect one."""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from pathlib import Path


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="prompt sources and self-distilled datasets")
    sub = data.add_subparsers(dest="data_command", required=True)

    gen = sub.add_parser("generate", help="the target writes responses to the configured prompts (resumable)")
    gen.add_argument("--config", required=True, help="YAML preset with kind: data")
    gen.add_argument("--overwrite", action="store_true", help="replace a finished dataset in output_dir")
    gen.add_argument("--no-progress", action="store_true")
    gen.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. generation.batch_size=16")
    gen.set_defaults(func=run_generate)

    ins = sub.add_parser("inspect", help="counts per domain, token stats, one example with its loss mask")
    ins.add_argument("path", help="output_dir of `data generate`")
    ins.add_argument("--row", type=int, default=0, help="which row to show")
    ins.set_defaults(func=run_inspect)


def run_generate(args: argparse.Namespace) -> int:
    from draftsmith.data.generate import generate_dataset, load_data_config, read_provenance

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = load_data_config(args.config, args.overrides)
    out = generate_dataset(config, progress=not args.no_progress, overwrite=args.overwrite)
    prov = read_provenance(out)
    c, t = prov["counts"], prov["timing"]
    print(f"wrote {c['rows']} rows to {out}/dataset ({c['tokens']} tokens, {c['loss_tokens']} learned)")
    print(f"  per domain: {json.dumps(c['per_domain'])}")
    print(f"  malformed skipped: {c['malformed']['count']} {json.dumps(c['malformed']['kinds'])}; "
          f"duplicates: {c['duplicates_dropped']}; eval overlap dropped: {c['overlap'].get('overlapping', 0)}")
    print(f"  generated {t['generated_tokens']} tokens in {t['seconds']} s = {t['tokens_per_s']} tok/s "
          f"({t['resumed_rows']} rows resumed from an earlier run)")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from draftsmith.data.generate import load_distilled, read_provenance
    from draftsmith.data.masks import masked_spans
    from draftsmith.errors import DataError

    path = Path(args.path)
    prov = read_provenance(path)
    ds = load_distilled(path)
    lengths = [len(x) for x in ds["input_ids"]]
    learned = [sum(m) for m in ds["loss_mask"]]
    print(f"{path}: {len(ds)} rows, target {prov['target']['name']}")
    for domain, n in sorted(Counter(ds["domain"]).items()):
        print(f"  {domain:16s} {n}")
    srt = sorted(lengths)
    print(f"tokens/row: mean {sum(lengths) / len(lengths):.1f}, median {srt[len(srt) // 2]}, max {srt[-1]}; "
          f"learned/row: mean {sum(learned) / len(learned):.1f}; stopped with EOS: {sum(ds['stopped'])}/{len(ds)}")
    if not 0 <= args.row < len(ds):
        raise DataError(f"--row {args.row} is out of range (0..{len(ds) - 1})")
    row = ds[args.row]
    tok = _tokenizer(prov["target"])
    ids, mask = row["input_ids"], row["loss_mask"]
    pieces, last = [], 0
    for a, b in masked_spans(ids, mask):
        pieces.append(tok.decode(ids[last:a], skip_special_tokens=False))
        pieces.append("\033[7m" + tok.decode(ids[a:b], skip_special_tokens=False) + "\033[0m")
        last = b
    pieces.append(tok.decode(ids[last:], skip_special_tokens=False))
    print(f"--- row {args.row} ({row['domain']}, {row['origin']}); learned tokens in reverse video ---")
    print("".join(pieces))
    return 0


def _tokenizer(target_info: dict):
    """The dataset's tokenizer: from the target's HF folder when recorded, else by loading the target."""
    from transformers import AutoTokenizer

    folder = target_info.get("folder")
    if folder and Path(folder).is_dir():
        return AutoTokenizer.from_pretrained(folder)
    from draftsmith.targets import load_target

    return load_target(target_info["spec"]).tokenizer
