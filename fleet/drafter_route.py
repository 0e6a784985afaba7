"""The authenticated trigger of an in-place drafter swap, inside vLLM's API server (an ASGI middleware), and the
label every logged request carries of the drafter that served it.

    DRAFTSMITH_PROMOTE_TOKEN=<secret> DRAFTSMITH_DRAFTER_VERSION=v0001 vllm serve MODEL \\
        --speculative-config '{...}' --worker-extension-cls draftsmith.fleet.drafter_swap.DrafterSwap \\
        --middleware draftsmith.fleet.drafter_route.DrafterRoute \\
        --middleware draftsmith.fleet.middleware.TrafficLog

Routes (only with DRAFTSMITH_PROMOTE_TOKEN set: no token, no route — the path then goes to vLLM, which
answers 404; every call carries `Authorization: Bearer <token>`, compared in constant time, else 401):
    GET  /draftsmith/drafter    what each worker serves (drafter_swap.DrafterSwap.draftsmith_drafter_info) and
                                this server's label
    POST /draftsmith/drafter    {"path": an export folder the server can read, "version": its label}: the
                                swap — check on every worker, then commit on every worker (a failed commit
                                reverts them all), then forget; 200 with each phase's results, 409 while
                                another swap runs, 422 when a check refused (the old drafter serves on), 500
                                when a commit failed and was reverted, 504 past DRAFTSMITH_PROMOTE_TIMEOUT_S
                                (default 300 s; the label is then unknown until a GET reads it back)
A body is at most 64 KiB, JSON; anything else is 400 with one line. DRAFTSMITH_PROMOTE_ROOTS (folders separated by
`:`) limits the exports a swap may read to those under them (resolved, links followed once here); unset, any
folder the server can read.

The label: `STATE` holds the version and a generation counter, bumped when a swap starts and when it ends.
fleet/middleware.py's TrafficLog reads it when a request arrives and when it ends; a request during which
the generation moved (served partly by each drafter, or while the swap was under way) is logged with
`drafter_swapped: true` and no version, so acceptance read per version never mixes two drafters. With several
API server processes (`--api-server-count`), each keeps its own label: send the swap to one of them, which then
knows it; the others' labels are refreshed by a GET to each.

Runs inside vLLM's environment: the standard library only (scripts/check_imports.py, rule 5). Never raises
into the server: a failure is an answer with its status and one line.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import threading
import time

from draftsmith.fleet.traffic_record import MAX_VERSION, is_version_label

log = logging.getLogger("draftsmith.fleet.drafter_route")
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)  # vLLM's API server runs the root logger at ERROR (see fleet/middleware.py)

PATH = "/draftsmith/drafter"
MAX_BODY = 64 << 10
TOKEN_ENV, TIMEOUT_ENV = "DRAFTSMITH_PROMOTE_TOKEN", "DRAFTSMITH_PROMOTE_TIMEOUT_S"
ROOTS_ENV = "DRAFTSMITH_PROMOTE_ROOTS"
VERSION_ENV = "DRAFTSMITH_DRAFTER_VERSION"


class DrafterState:
    """The version label and the swap generation of this API server process (module docstring)."""

    def __init__(self, version: str | None = None):
        self._lock = threading.Lock()
        self.version = version
        self.generation = 0  # odd while a swap runs

    def snapshot(self) -> tuple[int, str | None]:
        with self._lock:
            return self.generation, self.version

    def begin(self) -> None:
        with self._lock:
            self.generation += 1 if self.generation % 2 == 0 else 0

    def end(self, version: str | None) -> None:
        with self._lock:
            self.version = version
            self.generation += 1 if self.generation % 2 == 1 else 2

    @staticmethod
    def label(start: tuple[int, str | None], end: tuple[int, str | None]) -> dict:
        """What a logged request says of its drafter: its version, or that a swap happened while it ran."""
        if start[0] != end[0] or start[0] % 2 == 1:
            return {"drafter_swapped": True}
        return {"drafter_version": start[1]} if start[1] is not None else {}


STATE = DrafterState(os.environ.get(VERSION_ENV) or None)


def _timeout(env) -> float:
    raw = env.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else 300.0
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected seconds (a number)") from None
    if not (math.isfinite(value) and 0 < value <= 3600):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected seconds in (0, 3600]")
    return value


async def _answer(send, status: int, doc: dict) -> None:
    body = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class DrafterRoute:
    """`vllm serve --middleware draftsmith.fleet.drafter_route.DrafterRoute` (module docstring)."""

    def __init__(self, app, env=None):
        env = os.environ if env is None else env
        self.app = app
        self.token = (env.get(TOKEN_ENV) or "").strip().encode() or None
        self.timeout = _timeout(env)
        self.roots = [os.path.realpath(r) for r in (env.get(ROOTS_ENV) or "").split(":") if r.strip()]
        self.busy = asyncio.Lock()

    async def __call__(self, scope, receive, send):
        if self.token is None or scope.get("type") != "http" or scope.get("path") != PATH:
            return await self.app(scope, receive, send)
        try:
            status, doc = await self._handle(scope, receive)
        except Exception as e:  # noqa: BLE001 - never into the server
            status, doc = 500, {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        await _answer(send, status, doc)

    def _authorised(self, scope) -> bool:
        for key, value in scope.get("headers") or []:
            if key.lower() == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)
        return False

    async def _handle(self, scope, receive) -> tuple[int, dict]:
        if not self._authorised(scope):
            return 401, {"ok": False, "error": "unauthorised: Authorization: Bearer <DRAFTSMITH_PROMOTE_TOKEN>"}
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if engine is None:
            return 503, {"ok": False, "error": "the server's engine client is not up yet"}
        if scope.get("method") == "GET":
            return await self._info(engine)
        if scope.get("method") != "POST":
            return 405, {"ok": False, "error": "GET (what is served) or POST (a swap) only"}
        body, problem = await _body(receive)
        if problem:
            return 400, {"ok": False, "error": problem}
        if self.roots and not any(os.path.commonpath([os.path.realpath(body["path"]), r]) == r for r in self.roots):
            return 403, {"ok": False, "error": f"path: not under {ROOTS_ENV} ({':'.join(self.roots)})"}
        if self.busy.locked():
            return 409, {"ok": False, "error": "another swap is under way"}
        async with self.busy:
            return await self._swap(engine, body["path"], body["version"])

    async def _rpc(self, engine, name: str, *args) -> list[dict]:
        results = await asyncio.wait_for(engine.collective_rpc(f"draftsmith_drafter_{name}", args=args),
                                         self.timeout)
        return [r if isinstance(r, dict) else {"ok": False, "error": f"a worker answered {type(r).__name__}"}
                for r in (results if isinstance(results, list) else [results])]

    async def _info(self, engine) -> tuple[int, dict]:
        try:
            workers = await self._rpc(engine, "info")
        except asyncio.TimeoutError:
            return 504, {"ok": False, "error": f"the workers did not answer within {self.timeout:.0f} s"}
        versions = {w.get("version") for w in workers if w.get("ok")}
        generation, label = STATE.snapshot()
        if generation % 2 == 0 and len(versions) == 1 and label != next(iter(versions)):
            STATE.end(next(iter(versions)))  # the workers know: a timed-out swap's outcome, or another server's
        generation, label = STATE.snapshot()
        ok = all(w.get("ok") for w in workers)
        return (200 if ok else 500), {"ok": ok, "version": label, "generation": generation, "workers": workers}

    async def _swap(self, engine, path: str, version: str) -> tuple[int, dict]:
        start, (_, before) = time.perf_counter(), STATE.snapshot()
        phases: dict[str, list[dict]] = {}
        STATE.begin()
        after, status, error = before, 200, None
        try:
            phases["check"] = await self._rpc(engine, "check", path, version)
            if not all(r.get("ok") for r in phases["check"]):
                status, error = 422, _first_error(phases["check"])
            else:
                phases["commit"] = await self._rpc(engine, "commit")
                if all(r.get("ok") for r in phases["commit"]):
                    after = version
                else:
                    status, error = 500, _first_error(phases["commit"])
                    phases["revert"] = await self._rpc(engine, "revert")
            phases["forget"] = await self._rpc(engine, "forget")
        except asyncio.TimeoutError:
            after, status = None, 504
            error = (f"the workers did not finish within {self.timeout:.0f} s (phase {', '.join(phases) or 'check'} "
                     "done): GET this route to read which drafter serves")
        finally:
            STATE.end(after)
        seconds = round(time.perf_counter() - start, 4)
        log.info("draftsmith drafter swap to %s (%s): %s in %.3f s%s", version, path, status, seconds,
                 f": {error}" if error else "")
        # the error first: a client that keeps only the head of a failed answer still reads why
        return status, {"ok": status == 200, "error": error, "version": after, "previous": before,
                        "seconds": seconds, "phases": phases}


def _first_error(results: list[dict]) -> str:
    return next((str(r.get("error")) for r in results if not r.get("ok")), "a worker failed")


async def _body(receive) -> tuple[dict | None, str | None]:
    """The request's JSON body ({"path", "version"}), read up to MAX_BODY bytes, or (None, one line)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return None, "the client left"
        chunk = message.get("body") or b""
        size += len(chunk)
        if size > MAX_BODY:
            return None, f"a body over {MAX_BODY} bytes"
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        return None, "the body is not JSON"
    if not isinstance(body, dict):
        return None, "the body is not a JSON object {path, version}"
    path, version = body.get("path"), body.get("version")
    if not (isinstance(path, str) and path.startswith("/") and "\x00" not in path):
        return None, "path: expected the export folder's absolute path, as the server reads it"
    if not is_version_label(version):
        return None, f"version: expected a label of at most {MAX_VERSION} printable characters"
    return {"path": path, "version": version}, None
