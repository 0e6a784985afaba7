"""The embedded engine against an OpenAI-compatible server on the same prompts, in one run.

    nice python -m draftsmith.data.remote_bench 200 32 [--concurrency 1] [--json OUT]

Starts `transformers serve` (pip install 'transformers[serving]') on 127.0.0.1 with the target's cached HF
folder, then answers N prompts (the first N/2 GSM8K questions and N/2 self-instruct seed tasks) greedily
twice with `draftsmith data generate`: once with the embedded engine (float32, as the server runs), once with
`generation.backend: openai` against the server. Reports each one's generated tokens/s, how many rows have
the same text, the share of generated tokens before the first difference, and checks that every row with
the same text has the same token ids and loss mask. The server is stopped on the way out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from draftsmith.data.bench import TRAIN, emit
from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.generate import generate_dataset, load_distilled, read_provenance
from draftsmith.data.masks import masked_spans
from draftsmith.targets import load_target


def _take(argv: list[str], flag: str, default=None):
    if flag in argv:
        i = argv.index(flag)
        value = argv[i + 1]
        del argv[i:i + 2]
        return value
    return default


def _serve(folder: Path, threads: int = 2) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "transformers"
    proc = subprocess.Popen([str(exe), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", "--log-level", "warning"],
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    end = time.monotonic() + 180
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"transformers serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("transformers serve did not come up in 180 s")


def _first_difference(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str]) -> dict:
    argv = list(argv)
    json_out = _take(argv, "--json")
    concurrency = int(_take(argv, "--concurrency", 1))
    n, max_new = int(argv[0]), int(argv[1])
    spec = argv[2] if len(argv) > 2 else "smollm2-135m"
    target = load_target(spec)
    if target.folder is None:
        raise SystemExit(f"{spec}: no HF folder to serve")
    sources = [SourceConfig(name="gsm8k", path=str(TRAIN / "gsm8k_train.jsonl.gz"), prompt="question", domain="math",
                            limit=n // 2, sample="first"),
               SourceConfig(name="seed", path=str(TRAIN / "self_instruct_seed_tasks.jsonl.gz"), domain="general",
                            prompt_template="{instruction}\n\n{instances[0][input]}", limit=n - n // 2, sample="first")]
    gen = {"max_new_tokens": max_new, "batch_size": 96, "threads": 2, "dtype": "float32"}
    proc, url = _serve(target.folder)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = {}
            for name, extra in (("engine", {}), ("server", {"backend": "openai", "base_urls": [url],
                                                            "concurrency": concurrency, "request_timeout": 600.0})):
                cfg = DataConfig(sources=sources, output_dir=f"{tmp}/{name}", target=spec, dedupe=False,
                                 generation=GenerationConfig(**gen, **extra))
                out = generate_dataset(cfg, target, progress=False)
                runs[name] = (load_distilled(out), read_provenance(out)["timing"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    (eng, te), (srv, ts) = runs["engine"], runs["server"]
    by_id = {r["row_id"]: r for r in srv}
    same_text = same_rows = prefix = total = 0
    for row in eng:
        other = by_id[row["row_id"]]
        a = row["input_ids"][row["loss_mask"].index(1):]
        b = other["input_ids"][other["loss_mask"].index(1):]
        prefix += _first_difference(a, b)
        total += max(len(a), len(b))
        if row["response"] == other["response"]:
            same_text += 1
            same_rows += row["input_ids"] == other["input_ids"] and row["loss_mask"] == other["loss_mask"]
        assert len(masked_spans(other["input_ids"], other["loss_mask"])) == 1
    res = {"target": spec, "rows": len(eng), "max_new_tokens": max_new,
           "engine": {"generated_tokens": te["generated_tokens"], "seconds": te["seconds"],
                      "tok_s": te["tokens_per_s"], "batch": gen["batch_size"], "dtype": "float32"},
           "transformers_serve": {"generated_tokens": ts["generated_tokens"], "seconds": ts["seconds"],
                                  "tok_s": ts["tokens_per_s"], "concurrency": concurrency, "dtype": "float32",
                                  "retokenized_differently": ts["servers"]["servers"][0].get(
                                      "retokenized_differently", 0)},
           "same_text_rows": same_text, "same_text_rows_with_same_ids_and_masks": same_rows,
           "tokens_before_first_difference": round(prefix / max(total, 1), 4)}
    return emit(res, json_out)


if __name__ == "__main__":
    from draftsmith.targets.device import tune_cpu_allocator

    tune_cpu_allocator()
    main(sys.argv[1:])
