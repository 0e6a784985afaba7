"""Prompts the target writes itself: a chat-tuned model, given its chat template up to the start of a
user turn and nothing more, writes a plausible user request (the Magpie recipe: Xu et al. 2024,
"Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing").

A `type: magpie` source samples that prefix `limit` times, each row with its own seed, and stops each
request at the token that ends a user turn in the template. The requests then go through the same
path as every other source (length limit, dedupe, the eval-overlap check) and the target answers them.
They cover what the public sets cover thinly here — everyday requests of the kind a chat target
serves — in the target's own words.

The requests are kept in `output_dir/requests/<source>.jsonl` (a header line with what produced them,
then one line per request index), rewritten atomically as they finish: a killed run reuses the
requests it had and writes only the missing ones; a run with other settings refuses the file.
Request i depends only on (target, template, system prompt, sampling, seed, i), so `limit` 12 gives
the first 12 requests of `limit` 1200.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.checksums import sha256_json
from draftsmith.data.chat import build_messages, render_chat
from draftsmith.data.config import DataConfig, SourceConfig
from draftsmith.data.engines.base import Request
from draftsmith.data.engines.continuous import ContinuousBatcher
from draftsmith.data.masks import resolve_mode
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.errors import DataError
from draftsmith.outputs import atomic_write_text
from draftsmith.reading import jsonl_records
from draftsmith.targets.families import pad_token_id

log = logging.getLogger(__name__)

REQUESTS_DIR = "requests"
_SENTINEL = "\x00draftsmith-user-turn\x00"


def user_turn_prefix(tokenizer, system: str | None, template_kwargs: dict | None = None
                     ) -> tuple[list[int], list[int]]:
    """Token ids of the chat template up to where a user's words begin, and the ids that may end them;
    `template_kwargs` are the source's template variables (`enable_thinking`), as its rows are rendered with."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("a magpie source needs a chat-tuned target with a chat template (this tokenizer has none)")
    text = render_chat(tokenizer, build_messages([_SENTINEL], [], system), template_kwargs=template_kwargs)
    if text.count(_SENTINEL) != 1:
        raise DataError("the chat template does not place the user's text verbatim; magpie cannot cut it")
    before, after = text.split(_SENTINEL)
    prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
    after_ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    if not prefix or not after_ids:
        raise DataError("the chat template has no text before or after a user turn; magpie cannot use it")
    if after_ids[0] not in tokenizer.all_special_ids:
        raise DataError(f"the chat template ends a user turn with {after!r}, not with a special token; "
                        "magpie cannot tell where a written request stops")
    return prefix, [after_ids[0]]


def _row_seed(source: SourceConfig, index: int) -> int:
    return int(sha256_json(["magpie", source.seed, source.name, index])[:15], 16)


def _key(source: SourceConfig, system: str | None, fingerprint: dict, template_kwargs: dict, dtype: str) -> dict:
    # the precision the target wrote in (the weights' fingerprint does not say it) is part of the key when it is not
    # float32, so that request files written in float32 before the key named it still resume
    return {**({"dtype": dtype} if dtype != "float32" else {}),
            "fingerprint": {k: fingerprint.get(k) for k in ("tokenizer_hash", "chat_template_hash", "weights_hash",
                                                            "config_hash")},
            "system": system, **({"chat_template_kwargs": template_kwargs} if template_kwargs else {}),
            "temperature": source.temperature, "top_p": source.top_p,
            "max_request_tokens": source.max_request_tokens, "seed": source.seed}


def _read(path: Path, key: dict) -> dict[int, dict]:
    if not path.is_file():
        return {}
    header, records = read_request_file(path)
    if header.get("key") != key:
        raise DataError(f"{path} holds requests written with other settings (target, template, system prompt, "
                        "sampling or seed); delete it or use another output_dir")
    return records


def read_request_file(path: Path) -> tuple[dict, dict[int, dict]]:
    """A magpie request file: its header ({"key": ...}) and its requests by index, each checked (`check_request`)."""
    try:
        lines = jsonl_records(path.read_text(encoding="utf-8"), path)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    header = lines[0] if lines else {}
    if not isinstance(header, dict):
        raise DataError(f"{path}:1: the header is not a JSON object (got {type(header).__name__})")
    return header, {check_request(r, f"{path}:{n}")["index"]: r for n, r in enumerate(lines[1:], 2)}


REQUEST_FIELDS = {"index": int, "text": str, "stopped": bool, "special_inside": bool, "tokens": int}


def check_request(rec, where: str) -> dict:
    """One written request ({"index", "text", "stopped", "special_inside", "tokens"}), as a request file or a row
    pack holds it; a DataError in one line naming `where` and the field otherwise."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a request is not a JSON object (got {type(rec).__name__})")
    for name, kind in REQUEST_FIELDS.items():
        value = rec.get(name)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            raise DataError(f"{where}: field '{name}' is {value!r:.40}, expected {kind.__name__}"
                            + (" >= 0" if kind is int else ""))
    return rec


def write_request_file(path: Path, key: dict, done: dict[int, dict]) -> None:
    lines = [json.dumps({"key": key})] + [json.dumps(done[i], ensure_ascii=False) for i in sorted(done)]
    atomic_write_text(path, "\n".join(lines) + "\n")


def write_requests(source: SourceConfig, config: DataConfig, target, count: int,
                   progress: bool = False) -> tuple[Path, list[dict]]:
    """Requests 0..count-1 of `source` (written now or read back); returns the file and its records."""
    tok = target.tokenizer
    if resolve_mode(tok, config.chat.mode) == "plain":
        raise DataError(f"source '{source.name}': magpie needs chat formatting (chat.mode is plain for this target)")
    system = source.system or config.chat.system
    kwargs = config.source_chat(source.name).template_kwargs
    prefix, stop = user_turn_prefix(tok, system, kwargs)
    path = Path(config.output_dir).expanduser() / REQUESTS_DIR / f"{source.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    key = _key(source, system, target.fingerprint(), kwargs, str(target.model.dtype).removeprefix("torch."))
    done = _read(path, key)
    todo = [i for i in range(count) if i not in done]
    if todo:
        log.info("source '%s': the target writes %d requests (%d kept from an earlier run)", source.name, len(todo),
                 count - len(todo))
        pad = pad_token_id(target)
        gen = config.generation
        engine = ContinuousBatcher(target.model, stop + list(target.eos_token_ids), pad, gen.batch_size,
                                   SamplingConfig(source.temperature, 0, source.top_p))
        specials = set(tok.all_special_ids)
        pending = []
        bar = tqdm(total=len(todo), unit="request", disable=not progress, dynamic_ncols=True,
                   desc=f"requests ({source.name})")

        def on_done(c) -> None:
            body = c.tokens[:-1] if c.stopped else c.tokens
            done[c.key] = {"index": c.key, "text": tok.decode(body, skip_special_tokens=False).strip(),
                           "stopped": bool(c.stopped and c.tokens[-1] in stop),
                           "special_inside": any(t in specials for t in body), "tokens": len(c.tokens)}
            pending.append(c.key)
            bar.update(1)
            if len(pending) >= gen.flush_every:
                write_request_file(path, key, done)
                pending.clear()

        reqs = [Request(i, list(prefix), source.max_request_tokens, seed=_row_seed(source, i)) for i in todo]
        try:
            engine.run(reqs, on_done)
        finally:
            bar.close()
            write_request_file(path, key, done)
    return path, [done[i] for i in range(count)]


def magpie_rows(source: SourceConfig, config: DataConfig, target, make_row, count: int, progress: bool = False):
    """PromptRows from the first `count` requests of a magpie source (`sources.magpie_share`), and why
    the others fell."""
    if target is None:
        raise DataError(f"source '{source.name}': type magpie needs the target to write its requests")
    path, records = write_requests(source, config, target, count, progress)
    rows, dropped = [], Counter()
    for r in records:
        if not r["stopped"]:
            dropped[f"did not end within {source.max_request_tokens} tokens"] += 1
        elif r["special_inside"]:
            dropped["special token inside the request"] += 1
        elif len(r["text"]) < source.min_request_chars:
            dropped[f"shorter than {source.min_request_chars} characters"] += 1
        else:
            rows.append(make_row(r["index"], r["text"], f"{path}:{r['index'] + 2}"))  # line 1 is the header
    if dropped:
        log.info("source '%s': %d of %d written requests kept (%s)", source.name, len(rows), len(records),
                 ", ".join(f"{n} {why}" for why, n in dropped.most_common()))
    return rows, dict(dropped)
