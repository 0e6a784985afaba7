"""The embedded engine against an OpenAI-compatible server on the same prompts, in one run.

    nice draftsmith bench remote 200 32 [TARGET] [--server transformers|vllm] [--batch 16] [--repeats 2]
                                         [--json OUT]

Answers N prompts (the first N/2 GSM8K questions and N/2 self-instruct seed tasks) greedily with `draftsmith
data generate`: with the embedded engine (float32, `generation.batch_size` = --batch) and with
`generation.backend: openai` against a server on 127.0.0.1 at the same batch (`concurrency` = --batch requests
in flight; vLLM's `max_num_seqs` too) and the same dtype: `transformers serve` (pip install
'transformers[serving]'), or vLLM's OpenAI server from .venv-vllm (`make setup-vllm`,
data/engines/vllm_server.py). The two alternate --repeats times, the server started for its turn only (an idle
server on the same cores would tax the engine's run); each run's rows, generated tokens and seconds come from
its provenance, without the server's start-up. Reports rows/s and tokens/s of each (median over repeats), how
many rows have the same text, the share of generated tokens before the first difference, and checks that every
row with the same text has the same token ids and loss mask.
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith import net
from draftsmith.benchmark.engine import TRAIN, emit
from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.generate import generate_dataset, load_distilled, read_provenance
from draftsmith.data.masks import masked_spans
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.targets import load_target


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
            raise DraftsmithError(f"transformers serve {folder} exited with {proc.returncode}")
        try:
            net.request(f"{url}/models", deadline=2, max_bytes=net.ANSWER_MAX_BYTES)
            return proc, url
        except net.NetError:
            time.sleep(0.5)
    proc.kill()
    raise DraftsmithError(f"transformers serve {folder} did not come up in 180 s")


def _first_difference(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _VllmServe:
    """The vLLM server for one turn, as `_serve` gives transformers serve's: (stop, url)."""

    def __init__(self, folder: Path, batch: int, log: Path):
        from draftsmith.data.engines.vllm_server import VllmServer

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GB: a batch of --batch rows fits without preemption
        self.srv = VllmServer(folder, log, served_name=str(folder), max_num_seqs=batch, max_model_len=2048).start()
        self.url = self.srv.base_url

    def stop(self) -> None:
        self.srv.stop()


def _compare(eng, srv) -> dict:
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
    return {"same_text_rows": same_text, "same_text_rows_with_same_ids_and_masks": same_rows,
            "tokens_before_first_difference": round(prefix / max(total, 1), 4)}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


SERVERS = ("transformers", "vllm")


def _sources(n: int) -> list[SourceConfig]:
    """The first n/2 GSM8K questions and n - n/2 self-instruct seed tasks, as `data generate` sources."""
    return [SourceConfig(name="gsm8k", path=str(TRAIN / "gsm8k_train.jsonl.gz"), prompt="question", domain="math",
                         limit=n // 2, sample="first"),
            SourceConfig(name="seed", path=str(TRAIN / "self_instruct_seed_tasks.jsonl.gz"), domain="general",
                         prompt_template="{instruction}\n\n{instances[0][input]}",
                         limit=n - n // 2, sample="first")]


def _start_server(server: str, target, batch: int, log: Path) -> tuple:
    """The server for one turn: (stop, base url)."""
    if server == "vllm":
        srv = _VllmServe(target.folder, batch, log)
        return srv.stop, srv.url
    proc, url = _serve(target.folder)
    return (lambda: _stop(proc)), url


def _turns(spec: str, target, sources, gen: dict, server: str, batch: int, repeats: int) -> dict[str, list]:
    """Each side's (rows, timing) per repeat: the engine and the server alternate, the server started for its
    turn only (an idle server on the same cores would tax the engine's run)."""
    runs: dict[str, list] = {"engine": [], "server": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name in ("engine", "server") if r % 2 == 0 else ("server", "engine"):
                extra: dict = {}
                stop = None
                if name == "server":
                    stop, url = _start_server(server, target, batch, Path(tmp) / f"vllm-{r}.log")
                    extra = {"backend": "openai", "base_urls": [url], "concurrency": batch, "request_timeout": 900.0}
                try:
                    cfg = DataConfig(sources=sources, output_dir=f"{tmp}/{name}-{r}", target=spec, dedupe=False,
                                     generation=GenerationConfig(**gen, **extra))
                    out = generate_dataset(cfg, target, progress=False)
                    runs[name].append((load_distilled(out), read_provenance(out)["timing"]))
                finally:
                    if stop is not None:
                        stop()
    return runs


def _side(runs: list, rows: int, batch: int, **extra) -> dict:
    """One side's speeds: the median over its repeats."""
    timings = [t for _, t in runs]
    secs = [t["seconds"] for t in timings]
    return {"generated_tokens": timings[0]["generated_tokens"], "seconds": [round(x, 2) for x in secs],
            "tok_s": _median([t["tokens_per_s"] for t in timings]),
            "rows_s": _median([rows / x for x in secs]), "batch": batch, "dtype": "float32", **extra}


def _vllm_version() -> str | None:
    from draftsmith.data.engines.vllm_server import vllm_python

    ver = subprocess.run([str(vllm_python()), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, check=False).stdout.strip()
    return ver or None


def run(n: int, max_new: int, spec: str = "smollm2-135m", server: str = "transformers", batch: int = 16,
        repeats: int = 1, json_out: str | None = None) -> dict:
    """The embedded engine and `server` answer the same n prompts, alternating `repeats` times; the report."""
    if server not in SERVERS:
        raise ConfigError(f"bench remote --server {server}: transformers or vllm")
    target = load_target(spec)
    if target.folder is None:
        raise ConfigError(f"{spec}: no HF folder to serve")
    gen = {"max_new_tokens": max_new, "batch_size": batch, "threads": 2, "dtype": "float32"}
    runs = _turns(spec, target, _sources(n), gen, server, batch, repeats)
    eng_rows, srv_rows = runs["engine"][0][0], runs["server"][0][0]
    label = "vllm" if server == "vllm" else "transformers_serve"
    command = ["draftsmith", "bench", "remote", str(n), str(max_new), spec, "--server", server, "--batch", str(batch),
               "--repeats", str(repeats), *(["--json", json_out] if json_out else [])]
    retokenized = runs["server"][0][1]["servers"]["servers"][0].get("retokenized_differently", 0)
    res = {"target": spec, "rows": len(eng_rows), "max_new_tokens": max_new, "batch": batch, "repeats": repeats,
           "command": " ".join(command),
           "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
           "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "engine": _side(runs["engine"], len(eng_rows), batch),
           label: _side(runs["server"], len(eng_rows), batch, concurrency=batch, retokenized_differently=retokenized),
           **_compare(eng_rows, srv_rows)}
    if server == "vllm":
        res["vllm"]["version"] = _vllm_version()
    res["vllm_over_engine" if server == "vllm" else "server_over_engine"] = res[label]["tok_s"] / res["engine"]["tok_s"]
    return emit(res, json_out)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()

