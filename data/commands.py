"""`draftsmith data ...` subcommands: generate a self-distilled dataset, inspect one, take a domain subset, and print
the `vllm serve` line of a capture replica (`serve-capture`, for `capture.backend: vllm`)."""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from pathlib import Path

from draftsmith.config import MAX_BATCH, TOKENS, Range, ranged


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="prompt sources and self-distilled datasets")
    sub = data.add_subparsers(dest="data_command", required=True)

    gen = sub.add_parser("generate", help="the target writes responses to the configured prompts (resumable)")
    gen.add_argument("--config", required=True, help="a data preset (kind: data): a shipped preset's name "
                                                     "(smollm2-135m/data) or a file's path")
    gen.add_argument("--overwrite", action="store_true", help="replace a finished dataset in output_dir")
    gen.add_argument("--grow", action="store_true", help="add the config's new prompts to the finished dataset in "
                                                         "output_dir, keeping every row it holds and its capture")
    gen.add_argument("--grow-from", metavar="DIR", help="copy the finished dataset DIR into output_dir (a new folder) "
                                                        "and grow the copy; DIR stays as it is")
    gen.add_argument("--resume-from", metavar="PACK", help="first put the rows of a pack (`data pack`) into "
                                                           "output_dir, then generate only what it does not answer")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and cron jobs)")
    gen.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. generation.batch_size=16")
    gen.set_defaults(func=run_generate)

    cap = sub.add_parser("capture", help="teacher-forced capture: the target reads the finished rows once and "
                                         "keeps hidden states + top-k logits for head training (resumable)")
    cap.add_argument("--config", required=True, help="the data preset (its output_dir and capture section)")
    cap.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and cron jobs)")
    cap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. capture.topk=64")
    cap.set_defaults(func=run_capture)

    ins = sub.add_parser("inspect", help="counts per domain, token stats, one example with its loss mask")
    ins.add_argument("path", help="output_dir of `data generate`")
    ins.add_argument("--row", type=ranged(int, Range(ge=0, le=10**12)), default=0,
                     help="which row to show, by index (default: %(default)s)")
    ins.add_argument("--max-length", type=ranged(int, TOKENS),
                     help="also show what a job with this max_length (tokens per row) "
                          "trains on: the learned tokens it keeps, the padding it adds "
                          "(default: not shown)")
    ins.add_argument("--prompt-context", type=ranged(int, Range(ge=2, le=TOKENS.le)),
                     help="with --max-length: keeping at most this many prompt "
                          "tokens, as EAGLE's prompt_context does (default: all)")
    ins.add_argument("--batch-size", type=ranged(int, Range(ge=1, le=MAX_BATCH)), default=8,
                     help="with --max-length: in batches of this many rows (default: %(default)s)")
    ins.set_defaults(func=run_inspect)

    _register_subset(sub)

    mer = sub.add_parser("merge", help="one dataset folder with the rows of several (same target): a mix of "
                                       "sources, or new rollouts next to earlier rows")
    mer.add_argument("paths", nargs="+", help="output_dirs of `data generate` (the first one's row ids are kept)")
    mer.add_argument("--out", required=True, help="the new dataset folder")
    mer.add_argument("--overwrite", action="store_true", help="replace --out even if it is not a draftsmith dataset")
    mer.set_defaults(func=run_merge)

    pk = sub.add_parser("pack", help="the rows generation wrote (finished or not) in one compressed file, with a "
                                     "manifest: what `data generate --resume-from` grows on another machine")
    pk.add_argument("path", help="output_dir of `data generate` (also one whose run was interrupted)")
    pk.add_argument("--out", required=True, help="the pack to write, e.g. rows.jsonl.xz (its manifest goes beside it)")
    pk.set_defaults(func=run_pack)

    _register_serve_capture(sub)


def _register_subset(sub) -> None:
    sel = sub.add_parser("subset", help="a new dataset folder with only the rows of some domains, or a stable "
                                        "fraction of every domain's rows")
    sel.add_argument("path", help="output_dir of `data generate`")
    sel.add_argument("--out", required=True, help="the new dataset folder")
    sel.add_argument("--overwrite", action="store_true", help="replace --out even if it is not a draftsmith dataset")
    group = sel.add_mutually_exclusive_group(required=True)
    group.add_argument("--domains", nargs="+", help="keep these domains")
    group.add_argument("--exclude", nargs="+", help="keep every domain but these")
    group.add_argument("--fraction", type=ranged(float, Range(gt=0, lt=1)),
                       help="keep the rows whose row id falls in this share of the id space (row_id %% 1000 < "
                            "1000·F): about F of every domain, the same rows on every machine")
    sel.set_defaults(func=run_subset)


def run_generate(args: argparse.Namespace) -> int:
    from draftsmith.data.generate import generate_dataset, load_data_config, read_provenance

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = load_data_config(args.config, args.overrides)
    out = generate_dataset(config, progress=not args.no_progress, overwrite=args.overwrite, grow=args.grow,
                           grow_from=args.grow_from, resume_from=args.resume_from)
    prov = read_provenance(out)
    c, t = prov["counts"], prov["timing"]
    print(f"wrote {c['rows']} rows to {out}/dataset ({c['tokens']} tokens, {c['loss_tokens']} learned)")
    print(f"  per domain: {json.dumps(c['per_domain'])}")
    print(f"  malformed skipped: {c['malformed']['count']} {json.dumps(c['malformed']['kinds'])}; "
          f"duplicates: {c['duplicates_dropped']}; eval overlap dropped: {c['overlap'].get('overlapping', 0)}")
    print(f"  generated {t['generated_tokens']} tokens in {t['seconds']} s = {t['tokens_per_s']} tok/s "
          f"({t['resumed_rows']} rows resumed from an earlier run)")
    cap = t.get("capture") or {}
    if cap.get("backend") == "vllm":
        print(f"  capture by vLLM: {cap['from_vllm']} rows from {cap['served_dir']}, {cap['from_target']} captured by "
              f"the target {json.dumps(cap['fallback'])}, {cap['cached_rows']} already stored")
    return 0


def _register_serve_capture(sub) -> None:
    sc = sub.add_parser("serve-capture", help="print the `vllm serve` line of a capture replica for a data preset "
                                              "with capture.backend: vllm (start one per node, list them in "
                                              "generation.base_urls)")
    sc.add_argument("--config", required=True, help="the data preset (its target and capture section)")
    sc.add_argument("--num-layers", type=ranged(int, Range(ge=1, le=4096)), default=None,
                    help="the target's decoder layers (default: read from the target, which is loaded)")
    sc.add_argument("--model", default=None, help="what vllm serve is given (default: the target's folder)")
    sc.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. capture.served_dir=/data/cap")
    sc.set_defaults(func=run_serve_capture)


def serve_capture_line(config, num_layers: int, model: str) -> str:
    """The shell lines that start one capture replica for `config` (capture.backend vllm): vLLM's
    extract_hidden_states keeping the layers capture.layers needs, and draftsmith's connector writing them into
    the served folder; `vllm serve` must import draftsmith.fleet, from this package on its PYTHONPATH."""
    import shlex

    from draftsmith.capture.layers import resolve_layers
    from draftsmith.data.generate import served_dir
    from draftsmith.data.served import serving_config, vllm_layer_ids

    ids = vllm_layer_ids(resolve_layers(list(config.capture.layers), num_layers), num_layers)
    spec, kv = serving_config(ids, served_dir(config).resolve())
    package = Path(__file__).resolve().parents[1]
    return "\n".join([
        f"# capture replica: layers {list(config.capture.layers)} (draftsmith ids) kept as vLLM ids {ids} in "
        f"{served_dir(config)}, a folder draftsmith must read (shared storage in a fleet)",
        f"# vLLM's python must import draftsmith.fleet: a folder holding this package ({package}) under the name "
        "draftsmith on its PYTHONPATH",
        f"vllm serve {shlex.quote(model)} --port 8000 \\",
        f"    --speculative-config {shlex.quote(json.dumps(spec))} \\",
        f"    --kv-transfer-config {shlex.quote(json.dumps(kv))}",
        "# then: generation.base_urls: [http://NODE:8000/v1, ...] and capture.served_dir: the same folder"])


def run_serve_capture(args: argparse.Namespace) -> int:
    from draftsmith.data.generate import load_data_config
    from draftsmith.errors import ConfigError

    config = load_data_config(args.config, args.overrides)
    if config.capture.backend != "vllm":
        raise ConfigError(f"{args.config}: capture.backend is {config.capture.backend}, a capture replica serves "
                          "capture.backend: vllm")
    model, layers = args.model or config.target, args.num_layers
    if layers is None:
        from draftsmith.targets import load_target

        target = load_target(config.target)
        model, layers = args.model or str(target.folder or config.target), target.num_layers
    print(serve_capture_line(config, layers, model))
    return 0


def run_pack(args: argparse.Namespace) -> int:
    from draftsmith.data.generate import pack_rows
    from draftsmith.data.pack import manifest_path

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    m = pack_rows(args.path, args.out)
    print(f"packed {m['rows']} rows ({m['tokens']} tokens, {m['loss_tokens']} learned) into {args.out} "
          f"({m['bytes'] / 1e6:.1f} MB, sha256 {m['sha256'][:12]}); manifest {manifest_path(args.out)}")
    print(f"  rows per domain: {json.dumps(m['rows_per_domain'])}")
    return 0


def run_capture(args: argparse.Namespace) -> int:
    from draftsmith.data.generate import capture_dataset_dir, load_data_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = load_data_config(args.config, args.overrides)
    st = capture_dataset_dir(config, progress=not args.no_progress)
    print(f"captured {st['rows']} rows ({st['cached_rows']} already stored), {st['tokens']} tokens in "
          f"{st['seconds']} s = {st['tokens_per_s']} tok/s ({st['dtype']}) -> {st['dir']}")
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
    if args.max_length:
        from draftsmith.data.batching import batching_report

        r = batching_report(ds["loss_mask"], args.max_length, args.batch_size, args.prompt_context)
        print(f"max_length {args.max_length}"
              + (f", prompt_context {args.prompt_context}" if args.prompt_context else "")
              + f": learned tokens kept {r['learned_kept_window']:.1%} (first {args.max_length} tokens of each row: "
              f"{r['learned_kept_head']:.1%}); {r['positions']} positions per epoch; with padding, in batches of "
              f"{args.batch_size}: {r['padded_random']} in random order, {r['padded_grouped']} grouped by length")
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


def subset_dataset(path: str | Path, out: str | Path, domains: list[str] | None = None,
                   exclude: list[str] | None = None, overwrite: bool = False, fraction: float | None = None) -> Path:
    """Copy the rows of `domains` (or of every domain not in `exclude`, or with `fraction` F the rows whose
    row id, a stable hash of source and row key, has row_id % 1000 < 1000·F: about F of every domain) into a new
    dataset folder whose provenance records the parent and the filter. Unknown domain names are an error, not an
    empty set."""
    from draftsmith.data.generate import (
        DATASET_DIR,
        PROVENANCE,
        inside,
        load_distilled,
        read_provenance,
        same_folder,
    )
    from draftsmith.errors import DataError
    from draftsmith.outputs import atomic_dir, atomic_write_json, check_replaceable

    path, out = Path(path), Path(out)
    if same_folder(out, path) or inside(path, out):
        raise DataError(f"{out}: the subset would replace the dataset it is taken from; choose another --out")
    check_replaceable(out, "dataset", overwrite)
    prov = read_provenance(path)
    ds = load_distilled(path)
    present = set(ds["domain"])
    asked = set(domains or exclude or [])
    if asked - present:
        raise DataError(f"{path}: no rows of domain(s) {sorted(asked - present)}; it has {sorted(present)}")
    keep = asked if domains else present - asked
    cut = round(1000 * fraction) if fraction is not None else None
    sub = ds.filter(lambda r: r["row_id"] % 1000 < cut) if cut is not None else ds.filter(lambda r: r["domain"] in keep)
    keep = set(sub["domain"]) if cut is not None else keep
    if len(sub) == 0:
        raise DataError(f"{path}: the filter leaves no rows")
    prov = {**prov, "subset": {"parent": str(path), "domains": sorted(keep), "rows": len(sub),
                               "parent_rows": len(ds), **({"rule": f"row_id % 1000 < {cut}"} if cut else {})}}
    prov.setdefault("counts", {})["rows"] = len(sub)
    prov["counts"]["per_domain"] = dict(Counter(sub["domain"]))
    with atomic_dir(out, overwrite=overwrite, kind="dataset") as tmp:
        sub.save_to_disk(str(tmp / DATASET_DIR))
        atomic_write_json(tmp / PROVENANCE, prov)
    return out


def run_subset(args: argparse.Namespace) -> int:
    out = subset_dataset(args.path, args.out, args.domains, args.exclude, args.overwrite, args.fraction)
    from draftsmith.data.generate import read_provenance

    s = read_provenance(out)["subset"]
    print(f"wrote {s['rows']} of {s['parent_rows']} rows ({', '.join(s['domains'])}) to {out}")
    return 0


def merged_row_id(provenance: dict, row_id: int) -> int:
    """The id a row of a merge's later dataset takes: a hash of that dataset's creation record and the row's
    own id, 60 bits like the ids generation gives (data/sources.py). Two datasets that answered the same
    prompt (rollouts of two rounds) keep distinct rows; the same dataset merged twice repeats ids (refused)."""
    from draftsmith.checksums import sha256_json

    return int(sha256_json(["merge", provenance.get("created"), provenance.get("counts", {}).get("tokens"),
                            int(row_id)])[:15], 16)


def refuse_repeats(paths: list[Path], provs: list[dict]) -> None:
    """The same dataset given twice (the same folder by another spelling, through a symlink, or a copy: the
    same creation record) is refused: merged, its rows would each be written twice under new ids."""
    from draftsmith.checksums import sha256_json
    from draftsmith.errors import DataError

    seen: dict = {}
    for p, prov in zip(paths, provs):
        keys = [("folder", str(p.resolve()))]
        if prov.get("created"):  # a dataset's creation record: its time, counts and parents
            keys.append(("record", sha256_json([prov["created"], prov.get("counts"), prov.get("merge")])))
        for key in keys:
            if key in seen:
                how = "the same folder" if key[0] == "folder" else "the same dataset (an identical creation record)"
                raise DataError(f"{p}: {how} as {seen[key]}, given twice to data merge; each row would be written "
                                "twice under new ids")
            seen[key] = p


def merge_datasets(paths: list[str | Path], out: str | Path, overwrite: bool = False) -> Path:
    """Concatenate the rows of datasets one target wrote into a new dataset folder, one of each (`one_of_each`).

    Row ids stay unique and stable: the first dataset keeps its own (so the rows it held out for evaluation
    stay held out, data/batching.py `split_rows`), each later one's are rehashed (`merged_row_id`), so a
    merged dataset merged again keeps its ids and a repeated id is refused. Rollout
    marks (`replay`, data/engines/rollout.py) are kept; rows without them get zeros (no draft rejected there).
    Captured states are not carried over: `draftsmith data capture` reads the merged rows once."""
    import datasets

    from draftsmith.data.generate import (
        DATASET_DIR,
        PROVENANCE,
        inside,
        load_distilled,
        read_provenance,
        same_folder,
    )
    from draftsmith.errors import DataError
    from draftsmith.outputs import atomic_dir, atomic_write_json, check_replaceable
    from draftsmith.targets import check_compatible

    paths, out = [Path(p) for p in paths], Path(out)
    if len(paths) < 2:
        raise DataError("data merge needs two or more datasets")
    if any(same_folder(out, p) or inside(p, out) for p in paths):
        raise DataError(f"{out}: the merge would replace a dataset it reads; choose another --out")
    check_replaceable(out, "dataset", overwrite)
    provs = [read_provenance(p) for p in paths]
    refuse_repeats(paths, provs)
    fp0 = (provs[0].get("target") or {}).get("fingerprint")
    parts = []
    for k, (p, prov) in enumerate(zip(paths, provs)):
        fp = (prov.get("target") or {}).get("fingerprint")
        if not isinstance(fp, dict):
            raise DataError(f"{p / PROVENANCE}: missing field 'target.fingerprint' (which target made the rows)")
        check_compatible(fp0, fp, what=f"dataset {p} (merged with {paths[0]})")
        ds = load_distilled(p)
        if k:
            ds = ds.map(lambda r, prov=prov: {"row_id": merged_row_id(prov, r["row_id"])})
        parts.append(ds)
    if any("replay" in d.column_names for d in parts):
        parts = [d if "replay" in d.column_names else
                 d.add_column("replay", [[0] * len(x) for x in d["input_ids"]]).cast_column(
                     "replay", datasets.Sequence(datasets.Value("int8"))) for d in parts]
    columns = sorted(set.intersection(*(set(d.column_names) for d in parts)))
    merged = datasets.concatenate_datasets([d.select_columns(columns) for d in parts])
    ids = merged["row_id"]
    if len(set(ids)) != len(ids):  # a later dataset's own rows under the ids a merge already gave them
        raise DataError(f"{paths[0]}: a row id repeats after merging (a dataset given twice, or one already in "
                        "a merged one)")
    merged, repeats = one_of_each(merged)
    prov = _merged_provenance(paths, provs, [len(d) for d in parts], merged, repeats)
    with atomic_dir(out, overwrite=overwrite, kind="dataset") as tmp:
        merged.save_to_disk(str(tmp / DATASET_DIR))
        atomic_write_json(tmp / PROVENANCE, prov)
    return out


def one_of_each(ds):
    """The rows of `ds` without repeats, and how many were dropped: a row is its content (ids, loss mask and rollout
    marks), so a dataset merged with a merge that already holds it contributes each row once, while a rollout of a
    prompt that marks where drafts were rejected stays beside the same text without marks."""
    from draftsmith.checksums import sha256_json

    seen: set[str] = set()
    keep = []
    replay = ds["replay"] if "replay" in ds.column_names else [None] * len(ds)
    for i, content in enumerate(zip(ds["input_ids"], ds["loss_mask"], replay)):
        key = sha256_json(content)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return (ds if len(keep) == len(ds) else ds.select(keep)), len(ds) - len(keep)


def _merged_provenance(paths: list[Path], provs: list[dict], rows: list[int], merged, repeats: int) -> dict:
    """The merge's provenance: the first parent's, with the parents, their row counts and the merged counts."""
    prov = {**provs[0], "merge": {"parents": [str(p) for p in paths], "rows": rows, "repeated_rows_dropped": repeats,
                                  "row_ids": "the first dataset's own, the others' merged_row_id"},
            "capture": None}
    prov["counts"] = {"rows": len(merged), "per_domain": dict(sorted(Counter(merged["domain"]).items())),
                      "tokens": sum(len(x) for x in merged["input_ids"]),
                      "loss_tokens": sum(sum(m) for m in merged["loss_mask"])}
    prov["timing"] = {"parents": [p.get("timing") for p in provs]}
    return prov


def run_merge(args: argparse.Namespace) -> int:
    out = merge_datasets(args.paths, args.out, args.overwrite)
    from draftsmith.data.generate import read_provenance

    prov = read_provenance(out)
    m = prov["merge"]
    dropped = m.get("repeated_rows_dropped", 0)
    print(f"wrote {prov['counts']['rows']} rows ({' + '.join(map(str, m['rows']))}"
          + (f", {dropped} repeated rows dropped" if dropped else "") + f") to {out}; "
          "capture them with `draftsmith data capture` before offline training")
    return 0


def _tokenizer(target_info: dict):
    """The dataset's tokenizer: from the target's HF folder when recorded, else by loading the target."""
    from transformers import AutoTokenizer

    folder = target_info.get("folder")
    if folder and Path(folder).is_dir():
        return AutoTokenizer.from_pretrained(folder)
    from draftsmith.targets import load_target

    return load_target(target_info["spec"]).tokenizer
