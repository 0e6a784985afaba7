"""Self-distillation: the TARGET writes the responses its heads and drafts will learn from.

`generate_dataset(config)`:
  1. loads the target and the prompts (malformed rows reported with file:line, policy skip/fail);
  2. drops prompts that overlap the held-out eval sets (see data/overlap.py);
  3. formats each prompt with the target's chat template (or plain continuation) and has the engine
     `generation` names answer it (`data.engines.engine_for`: by default the continuous-batching loop,
     data/engines/continuous.py; OpenAI-compatible servers, transformers' generate, or rollouts by a head);
  4. appends finished rows to chunk files in `output_dir/chunks/` (each chunk written atomically), so a
     killed run resumes where it stopped: rerunning skips rows already generated (keyed by `row_id`);
  5. assembles a `datasets` dataset in `output_dir/dataset/` (columns input_ids, loss_mask, domain,
     row_id, source, prompt, response, origin, stopped, n_turns; rollouts by a head, `generation.engine:
     speculative`, add `replay`: data/engines/rollout.py) and `output_dir/provenance.json`.

A row's input_ids are exactly the prompt tokens followed by the tokens the target generated (the stop
token included when it produced one), so they are what the target saw and what captured states index.
Multi-turn rows are decoded turn by turn; earlier turns are re-tokenized with the chat template and
their loss masks come from `tokenize_conversation` (verified by decoding back).

With `capture.enabled` the batched engine also keeps chosen layer outputs / top-k logits for every position
and they are written with `capture.cache.ShardWriter` to `output_dir/capture/`; the rows any other
engine writes are read by the target once afterwards (capture/offline.py).

`capture.backend: vllm`: the servers that write the answers are vLLM capture replicas (extract_hidden_states and
draftsmith's KV connector, fleet/vllm_capture.py), one file per request in `capture.served_dir`. Every request
names its row and turn (`X-Request-Id`, data/engines/remote.py); after generation each row takes the capture of
its last turn's request, whose tokens must be the row's input_ids, and the target runs only its final norm and
lm_head over it (data/served.py). A row with no such capture is captured by the target, counted and named in
provenance.json. With no `generation.base_urls` the caller hands `generate_dataset` a `replica` to start on this
machine: data/capture_replica.py passes the one built on VllmServer (data/engines/vllm_server.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from draftsmith import net
from draftsmith.checksums import sha256_json
from draftsmith.config import load_config, to_dict
from draftsmith.data.chat import build_messages
from draftsmith.data.config import DataConfig
from draftsmith.data.engines import CaptureSpec, Completion, Request, TextEngine, engine_for
from draftsmith.data.masks import end_tokens, resolve_mode, tokenize_conversation, verify_mask
from draftsmith.data.output import (  # noqa: F401  (re-exported: the names every reader of a dataset folder imports)
    CAPTURE_DIR,
    CHUNKS_DIR,
    COLUMNS,
    DATASET_DIR,
    GENERATED,
    PROVENANCE,
    SERVED_DIR,
    claim_output,
    write_rows,
)
from draftsmith.data.overlap import find_overlap, load_eval_texts
from draftsmith.data.reasoning import drop_thinking, thinking_tokens
from draftsmith.data.rows import RowLimits, check_row
from draftsmith.data.sources import PromptRow, load_prompts
from draftsmith.errors import DataError, FileFormatError
from draftsmith.outputs import atomic_write_json, atomic_write_text
from draftsmith.reading import jsonl_records, read_json
from draftsmith.targets import check_compatible, gemm, load_target
from draftsmith.targets.context import answer_room, context_window

log = logging.getLogger(__name__)

# why a generated row was left out (provenance's malformed kinds)
REASONING = "reasoning policy leaves nothing to learn"
TOO_LONG = "a later turn past the target's context"
# starts a capture replica of the target (its HF folder) whose connector keeps vLLM's layer ids (the list) in the
# folder, for as long as the block runs; yields its OpenAI API root (.../v1) and the name it serves the target under
Replica = Callable[[Any, list[int], Path], AbstractContextManager[tuple[str, str]]]


def _generation_key(config: DataConfig, fingerprint: dict, precision: dict | None = None) -> dict[str, Any]:
    """What must match for rows of an earlier (interrupted) run to be reused."""
    gen = config.generation
    chats = {s.name: config.source_chat(s.name).describe() for s in config.sources}
    return {
        "precision": precision,
        "fingerprint": {k: fingerprint.get(k) for k in ("tokenizer_hash", "vocab_size", "special_tokens",
                                                        "chat_template_hash", "config_hash", "weights_hash")},
        "chat": {k: v for k, v in to_dict(config.chat).items() if k not in ("template_kwargs", "think_tags")},
        # each source's template variables and reasoning policy (chat's defaults merged in), where a source sets any:
        # a run.json written before these settings existed still resumes
        **({"sources_chat": chats} if any(c["chat_template_kwargs"] or c["reasoning"] != "keep"
                                          for c in chats.values()) else {}),
        "sampling": {"do_sample": gen.do_sample, "temperature": gen.temperature, "top_p": gen.top_p,
                     "seed": gen.seed, "max_new_tokens": gen.max_new_tokens},
        "capture": {k: v for k, v in to_dict(config.capture).items()
                    if k in ("enabled", "layers", "topk", "last_hidden")},
        # rollouts: the rows are the target's whatever the head, but their replay marks are the head's
        **({"rollout": {"proposer": gen.proposer, "tree": gen.tree, "k": gen.k, "tree_auto": gen.tree_auto}}
           if gen.engine == "speculative" else {}),
    }


class _Formatter:
    """Prompt token ids (and loss masks of earlier turns) for a row's k-th turn, and whole rows, each rendered
    with its source's template variables and reasoning policy (`DataConfig.source_chat`)."""

    def __init__(self, target, config: DataConfig):
        self.tok = target.tokenizer
        self.chat = config.chat
        self.mode = resolve_mode(self.tok, config.chat.mode)
        self.eos_ids = target.eos_token_ids
        self.sources = {s.name: config.source_chat(s.name) for s in config.sources}

    def __call__(self, row: PromptRow, responses: list[str]) -> tuple[list[int], list[int]]:
        return self.tokenize(row, responses, add_generation_prompt=True)

    def tokenize(self, row: PromptRow, responses: list[str], add_generation_prompt: bool = False
                 ) -> tuple[list[int], list[int]]:
        """The row's turns answered by `responses` (one fewer with `add_generation_prompt`: a prompt)."""
        turns = row.turns[: len(responses) + int(add_generation_prompt)]
        messages = build_messages(turns, responses, row.system or self.chat.system)
        sc = self.sources[row.source]
        return tokenize_conversation(self.tok, messages, mode=self.mode, add_generation_prompt=add_generation_prompt,
                                     eos_token_ids=self.eos_ids, plain_separator=self.chat.plain_separator,
                                     add_bos=self.chat.add_bos, template_kwargs=sc.template_kwargs,
                                     reasoning=sc.reasoning, think_tags=sc.think_tags)

    def response(self, row: PromptRow, responses: list[str]) -> str:
        """The row's `response` column: its answers, without their thinking where the source drops it."""
        sc = self.sources[row.source]
        if sc.reasoning == "drop":
            responses = [drop_thinking(r, sc.think_tags) for r in responses]
        return "\n\n".join(responses)


def _read_chunks(chunk_dir: Path, limits: RowLimits | None = None) -> dict[int, dict]:
    """The rows an earlier run wrote, by row id, each checked (data/rows.py; against the target where `limits`
    gives it). A chunk file that cannot be read (torn, not UTF-8, not JSON lines) and a row that fails its check are
    named in a warning and left out: those rows are generated again."""
    done: dict[int, dict] = {}
    if not chunk_dir.is_dir():
        return done
    for path in sorted(chunk_dir.glob("chunk-*.jsonl")):
        try:
            records = jsonl_records(path.read_text(encoding="utf-8"), path)
        except (OSError, UnicodeDecodeError, FileFormatError) as e:
            log.warning("%s: cannot be read, its rows are generated again (%s)", path, str(e).splitlines()[0][:200])
            continue
        for n, rec in enumerate(records, 1):
            try:
                check_row(rec, f"{path}:{n}", limits or RowLimits())
            except DataError as e:
                log.warning("%s; the row is generated again", e)
                continue
            done.setdefault(rec["row_id"], rec)
    return done


class _ChunkWriter:
    """Buffers finished rows; every `every` rows writes them as a new chunk file (temp file + rename)."""

    def __init__(self, chunk_dir: Path, every: int, after_flush=None):
        self.dir = chunk_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.dir.glob("chunk-*.jsonl"))
        self.seq = int(existing[-1].name.split("-")[1]) + 1 if existing else 0
        self.every = every
        self.buf: list[dict] = []
        self.after_flush = after_flush

    def add(self, rec: dict) -> None:
        self.buf.append(rec)
        if len(self.buf) >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.buf)
        atomic_write_text(self.dir / f"chunk-{self.seq:06d}-{os.getpid()}.jsonl", text)
        self.seq += 1
        self.buf = []
        if self.after_flush:
            self.after_flush()


def prepare_prompts(config: DataConfig, target,
                    progress: bool = False) -> tuple[list[PromptRow], dict[str, Any], _Formatter]:
    """Load, length-check, dedupe and overlap-filter the prompts. Returns rows, stats and the formatter."""
    fmt = _Formatter(target, config)
    first_ids: dict[int, list[int]] = {}

    def prompt_length(row: PromptRow) -> int:
        ids, _ = fmt(row, [])
        first_ids[row.row_id] = ids
        return len(ids)

    prompts = load_prompts(config, prompt_length=prompt_length, target=target, progress=progress)
    rows = prompts.rows
    overlap_info: dict[str, Any] = {"checked": bool(config.eval_sets)}
    if config.eval_sets:
        evals = load_eval_texts(config.eval_sets, config.overlap_ngram)
        report = find_overlap(rows, evals, config.overlap_ngram, config.overlap_jaccard)
        overlap_info.update(eval_prompts=report.eval_prompts, overlapping=len(report.rows), kinds=report.counts(),
                            examples=[f"{rows[i].origin} ~ {o} ({k}, {s:.2f})" for i, o, k, s in report.hits[:10]])
        if report.hits:
            msg = (f"{len(report.rows)} training prompts overlap the eval sets ({report.counts()}), e.g. "
                   f"{overlap_info['examples'][0]}")
            if config.overlap == "fail":
                raise DataError(msg)
            log.warning("%s; %s", msg, "dropping them" if config.overlap == "drop" else "keeping them (overlap: warn)")
            if config.overlap == "drop":
                bad = report.rows
                rows = [r for i, r in enumerate(rows) if i not in bad]
                if not rows:
                    raise DataError("no prompts left after dropping those that overlap the eval sets")
    stats = {"malformed": {"count": len(prompts.malformed.items), "kinds": prompts.malformed.counts(),
                           "rows": [f"{o}: {r}" for o, r in prompts.malformed.items[:200]]},
             "duplicates_dropped": prompts.duplicates, "loaded_per_source": prompts.per_source,
             "magpie_rejected": prompts.rejected,
             "overlap": overlap_info}
    fmt.first_ids = first_ids
    return rows, stats, fmt


def generate_dataset(config: DataConfig, target=None, *, progress: bool = True, on_row=None,
                     overwrite: bool = False, grow: bool = False, grow_from: str | Path | None = None,
                     resume_from: str | Path | None = None, replica: Replica | None = None) -> Path:
    """Generate (or finish generating) the self-distilled dataset of `config`; returns `output_dir`.

    `on_row(record)` is called after each finished row (tests use it to simulate a crash).
    With `overwrite` an existing finished dataset is replaced; chunks of an interrupted run are reused.
    With `grow` the finished dataset in output_dir keeps every row (and its captured states) and gains the rows
    of the config's prompts it does not hold yet: a preset that adds sources or raises limits extends a set
    instead of regenerating it (`_grown_rows`).
    With `grow_from` a finished dataset elsewhere is first copied into output_dir, which must not exist yet, and the
    copy grows: the base set stays as it is for the heads and benchmarks that name it (`copy_base_set`).
    With `resume_from` the rows of a pack (data/pack.py) are first put into output_dir, as if an earlier run there
    had written them: only the prompts the pack does not answer are generated.
    With `replica` (`capture.backend: vllm` and no `generation.base_urls`) the capture replica it starts writes
    the answers and their features, and is stopped at the end or on an error (data/capture_replica.py).
    One run writes an output_dir at a time: a second is refused while the first runs (locks.py).
    """
    from draftsmith.locks import output_lock

    with output_lock(Path(config.output_dir).expanduser(), "dataset"):
        if grow_from is not None:  # under the lock: no other run copies or writes here meanwhile
            copy_base_set(Path(grow_from).expanduser(), Path(config.output_dir).expanduser())
            grow = True
        if resume_from is not None:  # the pack's rows are checked against the target before they are stored
            target = target or load_target(config.target)
            unpack_rows(resume_from, Path(config.output_dir).expanduser(),
                        RowLimits.of(target, config.generation.max_new_tokens))
        return _generate_dataset(config, target, progress=progress, on_row=on_row, overwrite=overwrite, grow=grow,
                                 replica=replica)


def same_folder(a: str | Path, b: str | Path) -> bool:
    """Whether two spellings name one folder: `~`, symlinks and `..` resolved, and, where both exist, the same file
    on disk (a case-insensitive file system spells one folder several ways)."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def inside(a: str | Path, b: str | Path) -> bool:
    """Whether folder `a` lies within folder `b` (resolved)."""
    return Path(a).expanduser().resolve().is_relative_to(Path(b).expanduser().resolve())


def copy_base_set(base: Path, out: Path) -> None:
    """Copy the finished dataset `base` (rows, chunks, captured states, provenance) into `out`, a folder that does
    not exist yet, through a temporary sibling renamed at the end: an interrupted copy leaves no half set. A rerun
    whose `out` already holds the copy goes on growing it (the copy is not repeated)."""
    import shutil

    if same_folder(out, base) or inside(out, base):
        raise DataError(f"{out}: output_dir is the grow_from set {base} itself (or a folder in it); grow_from copies "
                        "the set into a new output_dir and leaves it as it is: choose another output_dir")
    if out.exists():
        if (out / PROVENANCE).is_file() or (out / CHUNKS_DIR).is_dir():
            return  # copied by an earlier run: growing resumes in it
        raise DataError(f"{out}: grow_from copies into a new output_dir, and this folder exists without a dataset")
    if not ((base / PROVENANCE).is_file() and (base / DATASET_DIR).is_dir()):
        raise DataError(f"{base}: grow_from needs a finished dataset (no {PROVENANCE} or {DATASET_DIR}/ there)")
    tmp = out.with_name(f".{out.name}.copying")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own half copy from an interrupted run (the name is ours alone)
    shutil.copytree(base, tmp)
    tmp.rename(out)
    log.info("copied the base set %s into %s to grow it", base, out)


def _generate_dataset(config: DataConfig, target=None, *, progress: bool = True, on_row=None,
                      overwrite: bool = False, grow: bool = False, replica: Replica | None = None) -> Path:
    gen = config.generation
    if gen.threads:
        torch.set_num_threads(gen.threads)
    out = Path(config.output_dir).expanduser()
    finished = _finished_here(out, config, overwrite, grow)
    claim_output(out)  # before any work: a user's folder is not written into
    target = target or load_target(config.target)
    t_start = time.time()
    if config.responses == "keep":
        return _keep_dataset(config, target, out, progress, t_start)
    served = config.capture.enabled and config.capture.backend == "vllm"
    with _servers(config, target, out, replica) as gen:
        records, stats, timing, engine = _write_rows(config, gen, target, out, progress, on_row, grow, finished)
        if served:  # while the replica still runs: its connector writes a file just after each answer
            writer, found = _wait_served(config, out, engine.target, records)
    target = engine.target
    if served:
        timing["capture"] = _join_served(config, out, target, records, writer, found)
    elif config.capture.enabled and not engine.captures:  # the target reads the written rows once (capture/offline.py)
        from draftsmith.capture.offline import capture_rows

        timing["capture"] = capture_rows(target, records, out / CAPTURE_DIR, config.capture, progress=progress)
    timing["wall_seconds"] = round(time.time() - t_start, 2)
    _save(out, records, config, target, engine.precision, stats, timing)
    return out


def _write_rows(config: DataConfig, gen, target, out: Path, progress: bool, on_row, grow: bool, finished: bool
                ) -> tuple[list[dict], dict, dict, TextEngine]:
    """Answer every prompt not answered yet with the engine `gen` names (resuming from the chunks); returns the
    finished records, the prompts' stats, the timing and the engine."""
    capture = None
    # a row whose thinking is dropped is not the text the target wrote: the target reads it afterwards instead
    dropping = any(config.source_chat(s.name).reasoning == "drop" for s in config.sources)
    if config.capture.enabled and not dropping and config.capture.backend == "target":
        capture = CaptureSpec(list(config.capture.layers), config.capture.topk, config.capture.last_hidden)
    engine = engine_for(gen, target, chat_mode=resolve_mode(target.tokenizer, config.chat.mode), capture=capture)
    target = engine.target  # locally: the target in the generation dtype
    rows, stats, fmt = prepare_prompts(config, target, progress)
    fp = target.fingerprint()
    done = _resume(out, _generation_key(config, fp, engine.precision), RowLimits.of(target, gen.max_new_tokens))
    _adopt_legacy_rows(rows, done)
    kept: list[dict] = []
    if grow and finished:
        kept, rows = _grown_rows(out, config, target, rows, done, stats)
    wanted = {r.row_id for r in rows} | {r["row_id"] for r in kept}
    resumed = len(wanted & set(done))
    todo = [r for r in rows if r.row_id not in done]
    log.info("%d rows to generate (%d already done)", len(todo), resumed)
    writer = None
    if engine.captures:  # the engine keeps the states as it writes: shards beside the chunks
        writer = _shard_writer(target, config, out, fp, [done[i] for i in sorted(wanted & set(done))
                                                         if "skipped" not in done[i]])
    sink = _Rows(target, fmt, rows, todo, done, _ChunkWriter(out / CHUNKS_DIR, gen.flush_every,
                                                            after_flush=writer.flush if writer else None),
                 writer, _progress(len(todo), progress), on_row)
    t0 = time.perf_counter()
    try:
        _answer_turns(engine, target, gen, todo, fmt, sink)
    finally:
        sink.close()
    seconds = time.perf_counter() - t0
    if writer is not None:
        writer.close()
    records = kept + (_finished_records(rows, done, stats) if rows or not kept else [])
    timing = {"generated_rows": len(todo), "resumed_rows": resumed, "generated_tokens": sink.tokens,
              "seconds": round(seconds, 2), "tokens_per_s": round(sink.tokens / seconds, 2) if seconds > 0 else None}
    if engine.report_as is not None:
        timing[engine.report_as] = engine.describe()
    return records, stats, timing, engine


def served_dir(config: DataConfig) -> Path:
    """capture.backend vllm: the folder the replicas' connector writes into (`capture.served_dir`, else
    `<output_dir>/served`, where the replica draftsmith starts writes)."""
    return Path(config.capture.served_dir or Path(config.output_dir) / SERVED_DIR).expanduser()


@contextlib.contextmanager
def _servers(config: DataConfig, target, out: Path, replica: Replica | None):
    """The generation settings the rows are written with: as configured, or, for capture.backend vllm with no
    base_urls, pointed at the capture replica `replica` starts here (stopped when the block ends, on an error too)."""
    gen = config.generation
    if gen.backend != "openai" or gen.base_urls:
        yield gen
        return
    if replica is None:  # DataConfig allows no base_urls only with capture.backend vllm
        raise DataError("capture.backend vllm with no generation.base_urls: give the capture replicas' addresses "
                        "(`draftsmith data serve-capture` prints their vllm serve line), or generate through "
                        "draftsmith.data.capture_replica.generate_with_local_replica, which starts one here")
    from draftsmith.capture.layers import resolve_layers
    from draftsmith.data.served import vllm_layer_ids

    folder = served_dir(config)
    folder.mkdir(parents=True, exist_ok=True)
    ids = vllm_layer_ids(resolve_layers(list(config.capture.layers), target.num_layers), target.num_layers)
    with replica(target, ids, folder) as (url, name):
        yield dataclasses.replace(gen, base_urls=[url], served_model=name)


def _wait_served(config: DataConfig, out: Path, target, records: list[dict]):
    """The capture cache (its hidden states stored in float32 where capture.dtype says so, else bf16) and the
    replicas' files of the rows it does not hold yet, waited for at most capture.served_wait seconds."""
    from draftsmith.capture.cache import ShardWriter
    from draftsmith.data.engines.remote import request_key
    from draftsmith.data.served import wait_for_captures

    cc = config.capture
    hidden = torch.float32 if cc.dtype == "float32" else torch.bfloat16
    writer = ShardWriter(out / CAPTURE_DIR, list(cc.layers), cc.topk, hidden, fingerprint=target.fingerprint())
    keys = {request_key(r["row_id"], r["n_turns"] - 1) for r in records if int(r["row_id"]) not in writer}
    return writer, wait_for_captures(served_dir(config), keys, cc.served_wait)


def _join_served(config: DataConfig, out: Path, target, records: list[dict], writer, found: dict) -> dict:
    """Each row's features from its capture (data/served.join_captures); the rows without one are captured by
    the target here, one forward each (counted in the stats provenance.json keeps)."""
    from draftsmith.data.served import join_captures

    t0 = time.perf_counter()
    with writer:
        stats, fallback = join_captures(records, served_dir(config), target, config.capture, writer, found)
        _backfill_capture(target, config, writer, fallback)
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    stats["dir"] = str(out / CAPTURE_DIR)
    return stats


def _finished_here(out: Path, config: DataConfig, overwrite: bool, grow: bool) -> bool:
    """Whether output_dir holds a finished dataset; one is refused unless it is to be replaced or grown."""
    finished = (out / PROVENANCE).is_file() and (out / DATASET_DIR).is_dir()
    if finished and not (overwrite or grow):
        raise DataError(f"{out} already holds a finished dataset (pass grow to add the config's new prompts to it, "
                        "overwrite to replace it, or choose another output_dir)")
    if grow and config.responses == "keep":
        raise DataError("grow extends a generated dataset; responses: keep writes its rows in one pass (use overwrite)")
    return finished


def _grown_rows(out: Path, config: DataConfig, target, rows: list[PromptRow], done: dict[int, dict],
                stats: dict) -> tuple[list[dict], list[PromptRow]]:
    """Growing a finished dataset: its records, every one (those that now overlap an eval set only as the config's
    `overlap` policy says), and the config's prompt rows it does not hold, less those repeating a kept prompt.
    Each kept row must still be in the chunks it was assembled from, where its text and ids are read back."""
    from draftsmith.data.sources import normalize_text

    ids = load_distilled(out, target)["row_id"]  # refuses a dataset another target made
    missing = [i for i in ids if i not in done]
    if missing:
        raise DataError(f"{out / CHUNKS_DIR}: row {missing[0]} of {out / DATASET_DIR} is in no chunk "
                        f"({len(missing)} rows): the set cannot grow without them (regenerate with overwrite)")
    kept = [done[i] for i in ids]
    dropped = 0
    if config.eval_sets and config.overlap != "warn":
        prompts = [PromptRow(r["row_id"], r["source"], r["domain"], [r["prompt"]], r["origin"]) for r in kept]
        report = find_overlap(prompts, load_eval_texts(config.eval_sets, config.overlap_ngram), config.overlap_ngram,
                              config.overlap_jaccard)
        if report.hits and config.overlap == "fail":
            i, origin, kind, _ = report.hits[0]
            raise DataError(f"{kept[i]['origin']}: a kept row overlaps eval prompt {origin} ({kind})")
        kept = [r for i, r in enumerate(kept) if i not in report.rows]
        dropped = len(report.rows)
    held = {r["row_id"] for r in kept}
    seen = {normalize_text(r["prompt"]) for r in kept}
    new = [r for r in rows if r.row_id not in held and normalize_text(r.prompt) not in seen]
    stats["grown"] = {"kept_rows": len(kept), "kept_dropped_for_eval_overlap": dropped, "new_rows": len(new),
                      "repeating_a_kept_prompt": sum(r.row_id not in held for r in rows) - len(new)}
    log.info("growing %s: %d rows kept, %d new prompts", out, len(kept), len(new))
    return kept, new


def _finished_records(rows, done: dict[int, dict], stats) -> list[dict]:
    """The records of every prompt row, in order, less those the reasoning policy skipped (counted in `stats`);
    a row never generated, or nothing left at all, is an error."""
    missing = [r for r in rows if r.row_id not in done]
    if missing:
        raise DataError(f"{len(missing)} rows were not generated (first: {missing[0].origin})")
    records = [done[r.row_id] for r in rows if "skipped" not in done[r.row_id]]
    skipped = [done[r.row_id] for r in rows if "skipped" in done[r.row_id]]
    for kind in (REASONING, TOO_LONG):
        _count_skipped(stats, [f"{s['origin']}: {s['skipped']}" for s in skipped
                               if s.get("skipped_kind", REASONING) == kind], kind)
    if not records:
        raise DataError("no rows left: every generated answer was skipped (see the reasoning policy and the "
                        "target's context)")
    return records


def _resume(out: Path, key: dict[str, Any], limits: RowLimits | None = None) -> dict[int, dict]:
    """The rows an earlier run with the same target, precision and sampling (`key`, kept in run.json) wrote
    into `out`, by row id; a run under another key is refused. A new run records its key."""
    run_file = out / "run.json"
    if run_file.is_file():
        old = read_json(run_file)
        for field_name in key:
            if old.get(field_name) != key[field_name]:
                raise DataError(f"{out} holds rows generated with a different {field_name}; "
                                "use another output_dir or delete it")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_file, key)
    return _read_chunks(out / CHUNKS_DIR, limits)


def _adopt_legacy_rows(rows: list[PromptRow], done: dict[int, dict]) -> int:
    """Rows written before content keys (a pack or chunks whose id-less rows are keyed by line number) stand for
    the prompt rows they answered: each row with no record under its id takes the record under its former id
    (`PromptRow.legacy_id`) where that record answered the very same prompt of the same source, re-keyed in `done`.
    A line that moved or changed since holds another prompt there and is generated again. Returns how many."""
    adopted = 0
    for row in rows:
        rec = done.get(row.legacy_id) if row.legacy_id is not None and row.row_id not in done else None
        if rec is not None and rec.get("source") == row.source and rec.get("prompt") == row.prompt:
            done[row.row_id] = {**rec, "row_id": row.row_id}
            adopted += 1
    if adopted:
        log.info("%d rows written under their former (line-number) ids answer the same prompts: resumed", adopted)
    return adopted


def _shard_writer(target, config: DataConfig, out: Path, fp: dict, resumed: list[dict]):
    """The capture shards the engine's states go to, holding those of the `resumed` rows too."""
    from draftsmith.capture.cache import ShardWriter

    writer = ShardWriter(out / CAPTURE_DIR, config.capture.layers, config.capture.topk, fingerprint=fp)
    _backfill_capture(target, config, writer, resumed)
    return writer


def _answer_turns(engine: TextEngine, target, gen, todo: list[PromptRow], fmt: _Formatter, sink: _Rows) -> None:
    """Turn by turn, every row with a turn left asks the engine for its answer to that turn (the prompt holds
    the row's earlier turns and the answers the target gave them)."""
    turn = 0
    while True:
        active = [r for r in todo if len(r.turns) > turn and r.row_id not in sink.closed]
        if not active:
            break
        reqs, masks = [], {}
        for r in active:
            if turn == 0 and r.row_id in fmt.first_ids:
                ids = fmt.first_ids[r.row_id]
                pmask = [0] * len(ids)
            else:
                ids, pmask = fmt(r, sink.responses[r.row_id])
            masks[r.row_id] = pmask
            # top-k logits are wanted from the position that predicts the first learned token on
            learned = next((i for i, m in enumerate(pmask) if m), len(ids))
            try:
                room = answer_room(target, len(ids), gen.max_new_tokens, f"{r.origin} turn {turn + 1}")
            except DataError as e:  # a later turn past the context: this row is left out, the set still finishes
                sink.skip(r, str(e), TOO_LONG)
                continue
            reqs.append(Request(r.row_id, ids, room, seed=_row_seed(gen.seed, r.row_id, turn),
                                logits_from=max(learned - 1, 0)))
        engine.run(reqs, lambda c, masks=masks: sink.finish(c, masks[c.key]), sink.count)
        turn += 1
    sink.chunks.flush()


class _Rows:
    """Where the engine's completions go: each answer is decoded and kept until its row's last turn is
    answered; then the row's record (checked to decode back) goes to the chunks, its captured states to the
    shards, and `on_row` is told."""

    def __init__(self, target, fmt: _Formatter, rows: list[PromptRow], todo: list[PromptRow], done: dict[int, dict],
                 chunks: _ChunkWriter, writer, bar, on_row):
        self.tok = target.tokenizer
        self.fmt = fmt
        self.eos_texts = dict(end_tokens(self.tok, target.eos_token_ids))
        self.by_id = {r.row_id: r for r in rows}
        self.responses: dict[int, list[str]] = {r.row_id: [] for r in todo}
        self.done, self.chunks, self.writer, self.bar, self.on_row = done, chunks, writer, bar, on_row
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.limits = RowLimits.of(target)  # every engine's row is held to the target's vocabulary and context
        self.closed: set[int] = set()  # rows skipped before their last turn

    def count(self, n: int) -> None:
        self.tokens += n

    def skip(self, row: PromptRow, why: str, kind: str) -> None:
        """Leave `row` out (recorded as skipped, with why, so a rerun does not try it again)."""
        log.warning("%s; the row is skipped", why)
        self.closed.add(row.row_id)
        self._keep({"row_id": row.row_id, "origin": row.origin, "skipped": why, "skipped_kind": kind})

    def finish(self, c: Completion, prompt_mask: list[int]) -> None:
        row = self.by_id[c.key]
        toks = c.tokens
        body = toks[:-1] if c.stopped else toks
        text = self.tok.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        self.responses[row.row_id].append(text)
        if len(self.responses[row.row_id]) < len(row.turns):
            return  # more turns to answer
        tokens = self._tokens(row, c, body, text, prompt_mask)
        if isinstance(tokens, str):  # the reasoning policy leaves nothing to learn: kept as skipped, with why
            self._keep({"row_id": row.row_id, "origin": row.origin, "skipped": tokens})
            return
        ids, mask = tokens
        rec = {"row_id": row.row_id, "source": row.source, "domain": row.domain, "prompt": row.prompt,
               "response": self.fmt.response(row, self.responses[row.row_id]), "input_ids": ids, "loss_mask": mask,
               "origin": row.origin, "stopped": bool(c.stopped), "n_turns": len(row.turns)}
        if c.replay is not None:
            rec["replay"] = list(c.replay)
        check_row(rec, row.origin, self.limits)
        if self.writer is not None and c.capture is not None:
            cap = c.capture
            self.writer.add(row.row_id, cap["layers"], cap["topk_values"], cap["topk_indices"], cap["last_hidden"],
                            cap["topk_logsumexp"])
        self._keep(rec)

    def _tokens(self, row: PromptRow, c: Completion, body: list[int], text: str,
                prompt_mask: list[int]) -> tuple[list[int], list[int]] | str:
        """The row's ids and loss mask under its source's reasoning policy (or why it has nothing to learn).

        keep and mask: the prompt and the tokens the target wrote, as it saw them; mask learns only what follows
        the thinking span. drop: the conversation again with each answer's thinking removed (no longer the text
        the target wrote, so a row cut before its answer ended cannot be rebuilt)."""
        sc = self.fmt.sources[row.source]
        toks = list(c.tokens)
        eos_text = self.eos_texts.get(toks[-1], "") if c.stopped else ""
        if sc.reasoning == "drop":
            if not c.stopped:
                return "cut by max_new_tokens; reasoning: drop keeps finished answers only"
            try:  # tokenize_conversation checks every span decodes back
                return self.fmt.tokenize(row, self.responses[row.row_id])
            except DataError as e:
                return str(e)
        thought = thinking_tokens(self.tok, body, sc.think_tags) if sc.reasoning == "mask" else 0
        learned = [0] * thought + [1] * (len(toks) - thought)
        if not any(learned) or thought and sc.think_tags[1] not in text:
            return f"all thinking (no {sc.think_tags[1]!r} closes it): reasoning: mask leaves nothing to learn"
        # earlier turns' spans were verified by tokenize_conversation; check the generated span decodes back
        answer = text if not thought else self.tok.decode(body[thought:], skip_special_tokens=False,
                                                          clean_up_tokenization_spaces=False)
        verify_mask(self.tok, toks, learned, [answer + eos_text],
                    forbidden=sc.think_tags if sc.reasoning == "mask" else ())
        return list(c.prompt_ids) + toks, list(prompt_mask) + learned

    def _keep(self, rec: dict) -> None:
        self.chunks.add(rec)
        self.done[rec["row_id"]] = rec
        self.bar.update(1)
        elapsed = time.perf_counter() - self.t0
        self.bar.set_postfix_str(f"{self.tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        if self.on_row is not None:
            self.on_row(rec)

    def close(self) -> None:
        """Keep what was finished, also when the run stops on an error."""
        self.bar.close()
        self.chunks.flush()
        if self.writer is not None:
            self.writer.flush()


def _keep_dataset(config: DataConfig, target, out: Path, progress: bool, t_start: float) -> Path:
    """`responses: keep`: rows are the dataset's own conversations, masked on every assistant turn; nothing is
    generated. With `capture.enabled` the target then reads them once (capture/offline.py)."""
    rows, stats, fmt = prepare_prompts(config, target, progress)
    records, bad, too_long = [], [], []
    ctx = context_window(target)
    for row in rows:
        try:
            ids, mask = fmt.tokenize(row, row.responses)
        except DataError as e:  # e.g. a template that rewrites an assistant turn, so it cannot be masked
            if config.malformed == "fail":
                raise DataError(f"{row.origin}: {e}") from None
            bad.append(f"{row.origin}: {e}")
            continue
        if ctx is not None and len(ids) > ctx:  # the target never reads past its context: not a row to train on
            why = f"{row.origin}: {len(ids)} tokens, more than the target's context of {ctx} positions"
            if config.malformed == "fail":
                raise DataError(why)
            too_long.append(why)
            continue
        records.append({"row_id": row.row_id, "source": row.source, "domain": row.domain, "prompt": row.prompt,
                        "response": fmt.response(row, row.responses), "input_ids": ids, "loss_mask": mask,
                        "origin": row.origin, "stopped": True, "n_turns": len(row.turns)})
    for kind, skipped in (("chat template cannot mask", bad), ("longer than the target's context", too_long)):
        _count_skipped(stats, skipped, kind)
    if not records:
        raise DataError("no rows left to keep")
    out.mkdir(parents=True, exist_ok=True)
    timing = {"generated_rows": 0, "kept_rows": len(records), "resumed_rows": 0, "generated_tokens": 0,
              "seconds": 0.0, "tokens_per_s": None}
    precision = None
    if config.capture.enabled:
        from draftsmith.capture.offline import capture_rows

        cap = capture_rows(target, records, out / CAPTURE_DIR, config.capture, progress=progress)
        timing["capture"] = cap
        precision = {"capture_dtype": cap["dtype"]}
    timing["wall_seconds"] = round(time.time() - t_start, 2)
    _save(out, records, config, target, precision, stats, timing)
    return out


def _count_skipped(stats: dict, skipped: list[str], kind: str) -> None:
    """Rows left out for `kind` go into provenance's malformed counts (the first 200 with where and why)."""
    if not skipped:
        return
    m = stats["malformed"]
    m["count"] += len(skipped)
    m["kinds"][kind] = len(skipped)
    m["rows"] += skipped[: max(0, 200 - len(m["rows"]))]
    log.warning("%d rows skipped: %s (first: %s)", len(skipped), kind, skipped[0])


def _row_seed(seed: int, row_id: int, turn: int) -> int:
    return int(sha256_json([seed, row_id, turn])[:15], 16)


@torch.inference_mode()
def _backfill_capture(target, config: DataConfig, writer, records: list[dict]) -> None:
    """Rows generated before a crash whose captured states never reached a shard: recompute them."""
    from draftsmith.capture.forward import capture_forward, topk_with_logsumexp

    cc = config.capture
    for rec in records:
        if rec["row_id"] in writer:
            continue
        ids = torch.tensor([rec["input_ids"]])
        cap = capture_forward(target.model, ids, layers=cc.layers)
        topv = topi = lse = None
        if cc.topk:
            topv, topi, lse = topk_with_logsumexp(cap.logits[0], cc.topk)
        writer.add(rec["row_id"], {i: h[0] for i, h in cap.layers.items()}, topv, topi,
                   cap.last_hidden[0] if cc.last_hidden else None, lse)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", disable=not enabled, dynamic_ncols=True, desc="generate")


def _save(out: Path, records: list[dict], config: DataConfig, target, precision: dict, stats: dict,
          timing: dict) -> None:
    write_rows(out, records)
    lengths = [len(r["input_ids"]) for r in records]
    learned = [sum(r["loss_mask"]) for r in records]
    provenance = {
        "target": {"name": target.name, "spec": target.spec, "folder": str(target.folder) if target.folder else None,
                   "fingerprint": target.fingerprint()},
        "config": to_dict(config),
        # each source's chat-template variables and reasoning policy as the rows were built with them
        "sources_chat": {s.name: config.source_chat(s.name).describe() for s in config.sources},
        "sampling": _generation_key(config, target.fingerprint())["sampling"],
        "precision": precision,
        "few_row_kernels": gemm.describe(),  # the products the timing below ran on (targets/gemm.py)
        "counts": {
            "rows": len(records), "per_domain": dict(sorted(Counter(r["domain"] for r in records).items())),
            "per_source": dict(sorted(Counter(r["source"] for r in records).items())),
            "stopped": sum(r["stopped"] for r in records), "truncated": sum(not r["stopped"] for r in records),
            "tokens": sum(lengths), "loss_tokens": sum(learned),
            "loss_tokens_per_domain": _sums(records, "domain"), "loss_tokens_per_source": _sums(records, "source"),
            "mean_length": round(sum(lengths) / len(lengths), 1),
            **stats,
        },
        "timing": timing,
        "capture": (str(out / CAPTURE_DIR) if config.capture.enabled else None),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # the config's server URLs, the servers' own words in `timing`: outside text, written redacted (net.py)
    atomic_write_json(out / PROVENANCE, net.redact_all(provenance))


def _sums(records: list[dict], key: str) -> dict[str, int]:
    """Learned tokens per value of `key` (domain, source)."""
    out: Counter = Counter()
    for r in records:
        out[r[key]] += sum(r["loss_mask"])
    return dict(sorted(out.items()))


def pack_rows(out_dir: str | Path, pack: str | Path) -> dict[str, Any]:
    """`draftsmith data pack`: the rows generation has written into `out_dir` (finished or interrupted), its
    resume key and magpie requests, into one pack (data/pack.py); returns the pack's manifest."""
    from draftsmith.data.magpie import REQUESTS_DIR, read_request_file
    from draftsmith.data.pack import write_pack

    out = Path(out_dir).expanduser()
    if not (out / "run.json").is_file():
        raise DataError(f"{out}: no run.json there, so no generated rows to pack (is it a `data generate` output_dir?)")
    requests = {}
    for path in sorted((out / REQUESTS_DIR).glob("*.jsonl")):
        header, records = read_request_file(path)
        requests[path.stem] = {"key": header.get("key"), "records": [records[i] for i in sorted(records)]}
    manifest = write_pack(pack, read_json(out / "run.json"), requests, _read_chunks(out / CHUNKS_DIR))
    log.info("packed %d rows (%d learned tokens) of %s into %s (%.1f MB)", manifest["rows"], manifest["loss_tokens"],
             out, pack, manifest["bytes"] / 1e6)
    return manifest


def unpack_rows(pack: str | Path, out_dir: str | Path, limits: RowLimits | None = None) -> dict[str, int]:
    """Put the rows of `pack` into the generation folder `out_dir` (new, or one whose run.json holds the pack's
    resume key): its run.json, magpie requests and a chunk with the rows the folder does not hold yet, so that
    generation resumes there as after an interruption. Returns how many rows and requests were added."""
    from draftsmith.data.magpie import REQUESTS_DIR, read_request_file, write_request_file
    from draftsmith.data.pack import read_pack

    header, rows = read_pack(pack, limits)  # every row checked, against the target's limits where given
    out = Path(out_dir).expanduser()
    claim_output(out)
    key = header["run"]
    run_file = out / "run.json"
    if run_file.is_file():
        old = read_json(run_file)
        diff = next((k for k in sorted(set(key) | set(old)) if old.get(k) != key.get(k)), None)
        if diff is not None:
            raise DataError(f"{pack}: its rows were generated with another {diff} than those in {out} (run.json)")
    else:
        atomic_write_json(run_file, key)
    added_requests = 0
    for name, packed in header["requests"].items():
        path = out / REQUESTS_DIR / f"{name}.jsonl"
        have_header, have = read_request_file(path) if path.is_file() else ({"key": packed["key"]}, {})
        if have_header.get("key") != packed["key"]:
            raise DataError(f"{pack}: source '{name}' requests were written with other settings than {path}")
        merged = {int(r["index"]): r for r in packed["records"]}
        added_requests += len(set(merged) - set(have))
        write_request_file(path, packed["key"], {**merged, **have})
    done = _read_chunks(out / CHUNKS_DIR)
    new = [r for r in rows if int(r["row_id"]) not in done]
    if new:
        writer = _ChunkWriter(out / CHUNKS_DIR, every=len(new) + 1)
        for r in new:
            writer.add(r)
        writer.flush()
    log.info("unpacked %s into %s: %d rows added (%d there already), %d magpie requests added", pack, out, len(new),
             len(rows) - len(new), added_requests)
    return {"rows_added": len(new), "rows_there": len(rows) - len(new), "requests_added": added_requests}


def read_provenance(path: str | Path) -> dict:
    path = Path(path)
    if not (path / PROVENANCE).is_file():
        raise DataError(f"{path}: not a distilled dataset (no {PROVENANCE}; did generation finish?)")
    return read_json(path / PROVENANCE)


def load_distilled(path: str | Path, target=None):
    """Reopen a generated dataset (`datasets.Dataset`); with `target`, check it was made by that target."""
    import datasets

    path = Path(path).expanduser()
    prov = read_provenance(path)
    if target is not None:
        fp = (prov.get("target") or {}).get("fingerprint") if isinstance(prov, dict) else None
        if not isinstance(fp, dict):
            raise DataError(f"{path / PROVENANCE}: missing field 'target.fingerprint' (which target made the rows)")
        check_compatible(fp, target.fingerprint(), what=f"dataset {path}")
    try:
        ds = datasets.load_from_disk(str(path / DATASET_DIR))
    except (OSError, ValueError) as e:  # pyarrow's errors for a torn or changed file are of these kinds
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"{path / DATASET_DIR}: cannot be read, damaged or incomplete ({type(e).__name__}: "
                        f"{first})") from None
    if target is not None:
        check_columns(ds, path / DATASET_DIR, RowLimits.of(target))
    return ds


def check_columns(ds, where: Path, limits: RowLimits) -> None:
    """A finished dataset's training columns against the target, whole columns at once (Arrow compute, not
    row by row: a million rows take a second): `input_ids` token ids of its vocabulary and rows within its
    context, `loss_mask` 0s and 1s as long as the ids; one line naming the folder and column otherwise. The
    same rules as data/rows.py's check of one row, for the set a training job or `data capture` opens."""
    import pyarrow as pa
    import pyarrow.compute as pc

    missing = [c for c in ("input_ids", "loss_mask") if c not in ds.column_names]
    if missing:
        raise DataError(f"{where}: no column '{missing[0]}'")
    table = ds.data.table
    ids, mask = table.column("input_ids"), table.column("loss_mask")
    if not (pa.types.is_list(ids.type) and pa.types.is_integer(ids.type.value_type)):
        raise DataError(f"{where}: column 'input_ids' is {ids.type}, expected lists of token ids")
    if not (pa.types.is_list(mask.type) and pa.types.is_integer(mask.type.value_type)):
        raise DataError(f"{where}: column 'loss_mask' is {mask.type}, expected lists of 0s and 1s")
    lengths = pc.list_value_length(ids)
    if len(ids) and (pc.min(lengths).as_py() or 0) < 1:
        raise DataError(f"{where}: column 'input_ids' has an empty row")
    if len(ids) and not pc.all(pc.equal(lengths, pc.list_value_length(mask))).as_py():
        raise DataError(f"{where}: column 'loss_mask' is not as long as 'input_ids' in every row")
    for name, column, low, high in (("input_ids", ids, 0, limits.vocab_size), ("loss_mask", mask, 0, 2)):
        values = pc.min_max(pc.list_flatten(column))
        lo, hi = values["min"].as_py(), values["max"].as_py()
        if lo is not None and (lo < low or (high is not None and hi >= high)):
            bad = lo if lo < low else hi
            raise DataError(f"{where}: column '{name}' holds {bad}, expected values in [{low}, {high})")
    longest = pc.max(lengths).as_py()
    if longest is not None and limits.context is not None and longest > limits.context:
        raise DataError(f"{where}: column 'input_ids' has a row of {longest} tokens, more than the target's "
                        f"context of {limits.context}")


def load_data_config(path: str | Path | None, overrides: list[str] | None = None) -> DataConfig:
    return load_config(path, overrides, cls=DataConfig)


def capture_dataset_dir(config, target=None, *, progress: bool = True, on_batch=None) -> dict:
    """`draftsmith data capture`: capture every row of the finished dataset in `config.output_dir` into its
    `capture/` folder, checked against the target's fingerprint; records the run in provenance.json."""
    from draftsmith.capture.offline import capture_rows
    from draftsmith.outputs import atomic_write_json
    from draftsmith.reading import read_json
    from draftsmith.targets import load_target

    if config.generation.threads:
        torch.set_num_threads(config.generation.threads)
    out = Path(config.output_dir).expanduser()
    target = target or load_target(config.target)
    ds = load_distilled(out, target)  # refuses a dataset another target's tokenizer made
    records = ds.select_columns(["row_id", "input_ids", "loss_mask"]).to_list()
    stats = capture_rows(target, records, out / CAPTURE_DIR, config.capture, progress=progress, on_batch=on_batch)
    prov = read_json(out / PROVENANCE)
    prov["capture"] = str(out / CAPTURE_DIR)
    prov.setdefault("timing", {})["capture"] = stats
    atomic_write_json(out / PROVENANCE, prov)
    return stats
