"""The traffic middleware as a guest in vLLM's API server (fleet/middleware.py), with the faults injected.

Each fault goes through the writer's narrow seam (`Writer.os_write`, `Writer.os_ftruncate`: a partial write, a
full disk, a stalled disk) or through the file system itself (the traffic file deleted or moved away, a link
in place of the folder or of a file, a shutdown with records queued), never through a mock of the code under
test. One invariant is checked after every one: the records counted `written` are exactly the complete lines
on disk, and every one of them parses as JSON. The bytes the logging path holds are measured with tracemalloc,
queued and in flight. The last test fuzzes the middleware as a plain ASGI app (hypothesis, tests/fuzzing.py's
settings): hostile bodies and headers, streams cut short, clients that go away, apps that raise — the client
sees exactly what the app sent, the middleware raises nothing of its own, and the counts add up.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from draftsmith.fleet.middleware import Counts, Settings, TrafficLog
from tests.fuzzing import RUNS
from tests.test_fleet_traffic import call, vllm_like

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "m", "prompt": "The capital of France", "max_tokens": 5}


def run(coro):
    return asyncio.run(coro)


def on_disk(folder: Path, *, torn_ok: int = 0) -> list[dict]:
    """The records of the complete lines in the folder's traffic files; every complete line must parse as a
    JSON object, except at most `torn_ok` lines that a torn write was ended with (no record in them)."""
    out, torn = [], 0
    for f in sorted(folder.glob("traffic-*.jsonl")):
        data = f.read_bytes()
        for line in data.split(b"\n")[:-1]:  # the text after the last newline is no complete line
            try:
                out.append(json.loads(line))
            except ValueError:
                torn += 1
    assert torn <= torn_ok, f"{torn} complete lines that are no record"
    assert all(isinstance(r, dict) and r.get("endpoint") for r in out)
    return out


def settled(t: TrafficLog) -> dict[str, int]:
    """The counts once the writer has finished what it holds."""
    assert t.writer.drain(10.0)
    return t.counts.snapshot()


@pytest.fixture
def guest(tmp_path):
    """A TrafficLog around `app` (vllm_like) writing into tmp_path/traffic; closed at the end."""
    made = []

    def make(app=vllm_like, **kw):
        t = TrafficLog(app, Settings(str(tmp_path / "traffic"), **kw))
        made.append(t)
        return t

    yield make
    for t in made:
        t.writer.close(1.0)


class Disk:
    """The writer's os_write seam: the real write, with the faults a disk gives at the Nth call (1-based) —
    "partial" (half the bytes, then the call returns), "short_of_newline" (all but the last byte), "enospc"
    (nothing written, ENOSPC), "stall" (waits for `gate`; key "every": each call); `delay` slows each call."""

    def __init__(self, faults: dict[int, str] | None = None, delay: float = 0.0):
        self.faults, self.delay, self.calls = dict(faults or {}), delay, 0
        self.gate = threading.Event()

    def __call__(self, fd: int, data) -> int:
        self.calls += 1
        fault = self.faults.get(self.calls)
        if self.delay:
            time.sleep(self.delay)
        if fault == "stall" or self.faults.get("every") == "stall":
            self.gate.wait(30)
        if fault == "partial":
            return os.write(fd, bytes(data[:max(1, len(data) // 2)]))
        if fault == "short_of_newline":
            return os.write(fd, bytes(data[:-1]))
        if fault == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)


def no_truncate(fd: int, size: int) -> None:
    """The writer's os_ftruncate seam on a file system that cannot truncate."""
    raise OSError(errno.EIO, "Input/output error")


def _requests(t: TrafficLog, n: int, tag: str = "p") -> None:
    for i in range(n):
        out, _ = run(call(t, "/v1/completions", {**BODY, "prompt": f"{tag}{i}"}))
        assert out[-1]["type"] == "http.response.body" and out[0]["status"] == 200


# --- bytes, not items -------------------------------------------------------------------------------------
async def _big_request(app, size: int, chunk: int = 64 << 10) -> list[dict]:
    """One POST of a JSON body of about `size` bytes, its chunks made as the app asks for them (the caller
    holds none of them): the messages the client got."""
    parts = [b'{"model":"m","prompt":"', *(b"x" * min(chunk, size - i) for i in range(0, size, chunk)), b'"}']
    parts.reverse()
    out: list[dict] = []

    async def receive():
        if not parts:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": parts.pop(), "more_body": bool(parts)}

    async def send(message):
        out.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "state": {}}
    await app(scope, receive, send)
    return out


def test_the_queue_is_bounded_by_bytes_not_by_count(guest):
    """40 requests of 200 KiB behind a stalled disk: what the logging path keeps stays within its byte budget
    (before: the count-bounded queue kept all 8 MiB)."""
    budget = 1 << 20
    t = guest(queue_bytes=budget, max_body_bytes=256 << 10)
    disk = Disk({"every": "stall"})
    t.writer.os_write = disk
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(40):
            out = run(_big_request(t, 200 << 10))
            assert out[0]["status"] == 200
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    counts = t.counts.snapshot()
    # the budget, plus the one line the stalled writer holds in its hand
    assert held < budget + (512 << 10), f"{held} bytes held behind a stalled disk, the budget is {budget}"
    assert counts["dropped_bytes"] >= 30 and counts["bytes_held"] <= budget
    disk.gate.set()
    counts = settled(t)
    assert counts["written"] + counts["dropped_bytes"] == 40 and counts["bytes_held"] == 0
    assert len(on_disk(Path(t.settings.folder))) == counts["written"]


def test_bodies_held_by_exchanges_in_flight_count_against_the_byte_budget(guest):
    """40 concurrent requests of 200 KiB, all still being answered: the bodies the middleware keeps for them
    stay within the budget; over it an exchange stops keeping, passes through untouched and is counted
    `dropped_bytes` (before: each kept its whole body, 8 MiB in all)."""
    budget = 1 << 20
    gate = asyncio.Event()

    arrived = []

    async def thrifty(scope, receive, send):  # reads the body without keeping it, answers once let go
        while (await receive()).get("more_body"):
            pass
        arrived.append(1)
        await gate.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"id":"cmpl-1","choices":[]}'})

    t = guest(thrifty, queue_bytes=budget, max_body_bytes=256 << 10)

    async def main():
        tasks = [asyncio.create_task(_big_request(t, 200 << 10)) for _ in range(40)]
        for _ in range(10_000):  # until every request is read and waiting for its answer
            if len(arrived) == 40:
                break
            await asyncio.sleep(0)
        assert len(arrived) == 40
        held = tracemalloc.get_traced_memory()[0] - base
        gate.set()
        return held, await asyncio.gather(*tasks)

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held, outs = run(main())
    finally:
        tracemalloc.stop()
    assert held < budget + (1 << 20), f"{held} bytes held by 40 requests in flight, the budget is {budget}"
    assert all(out[0]["status"] == 200 and out[1]["body"] == b'{"id":"cmpl-1","choices":[]}' for out in outs)
    counts = settled(t)
    assert counts["dropped_bytes"] >= 30 and counts["written"] + counts["dropped_bytes"] == 40
    assert counts["bytes_held"] == 0 and len(on_disk(Path(t.settings.folder))) == counts["written"]


def test_the_byte_budget_is_configured_by_environment(tmp_path):
    s = Settings.from_env({"DRAFTSMITH_TRAFFIC_DIR": str(tmp_path)})
    assert s.queue_bytes <= 64 << 20 and s.max_body_bytes <= s.queue_bytes and s.shutdown_s > 0
    s = Settings.from_env({"DRAFTSMITH_TRAFFIC_DIR": str(tmp_path),
                           "DRAFTSMITH_TRAFFIC_QUEUE_BYTES": "2097152",
                           "DRAFTSMITH_TRAFFIC_MAX_BODY_BYTES": "65536",
                           "DRAFTSMITH_TRAFFIC_SHUTDOWN_S": "0.5"})
    assert (s.queue_bytes, s.max_body_bytes, s.shutdown_s) == (2 << 20, 64 << 10, 0.5)
    with pytest.raises(ValueError, match=r"^TrafficLog: DRAFTSMITH_TRAFFIC_MAX_BODY_BYTES=.*QUEUE_BYTES"):
        Settings.from_env({"DRAFTSMITH_TRAFFIC_DIR": str(tmp_path), "DRAFTSMITH_TRAFFIC_QUEUE_BYTES": "1024",
                           "DRAFTSMITH_TRAFFIC_MAX_BODY_BYTES": "4096"})
    for name, value in [("SHUTDOWN_S", "nan"), ("SHUTDOWN_S", "-1"), ("TEST_STALL_S", "1e999")]:
        with pytest.raises(ValueError, match=f"^TrafficLog: DRAFTSMITH_TRAFFIC_{name}="):
            Settings.from_env({"DRAFTSMITH_TRAFFIC_DIR": str(tmp_path), f"DRAFTSMITH_TRAFFIC_{name}": value})


# --- the writer never loses a record it counted ------------------------------------------------------------
def test_a_partial_write_then_a_full_disk_costs_one_record_counted_lost(guest):
    """The 3rd line is half written, then the disk is full: the half line is taken back, the record counted
    `lost`, and the next record starts a line of its own (before: glued onto the torn one, counted
    written)."""
    t = guest()
    t.writer.os_write = Disk({3: "partial", 4: "enospc"})
    _requests(t, 6)
    counts = settled(t)
    records = on_disk(Path(t.settings.folder))
    assert counts["written"] == len(records) == 5 and counts["lost"] == 1
    assert [r["prompt"] for r in records] == ["p0", "p1", "p3", "p4", "p5"]


def test_a_torn_line_that_cannot_be_taken_back_is_ended_never_glued(guest):
    """The file cannot be truncated either: the torn line is ended by a newline of its own (a line that is no
    record); when even that fails, the file is closed and the next record opens a new one."""
    t = guest()
    t.writer.os_ftruncate = no_truncate
    t.writer.os_write = Disk({2: "partial", 3: "enospc", 6: "partial", 7: "enospc", 8: "enospc"})
    _requests(t, 6)
    counts = settled(t)
    folder = Path(t.settings.folder)
    records = on_disk(folder, torn_ok=1)  # the first torn line, ended by its newline
    assert counts["written"] == len(records) == 4 and counts["lost"] == 2
    assert [r["prompt"] for r in records] == ["p0", "p2", "p4", "p5"]
    assert len(list(folder.glob("traffic-*.jsonl"))) == 2  # the second tear could not be ended: a new file


def test_a_write_that_completes_the_line_after_a_tear_counts_it_written(guest):
    """A line short of only its newline, and the file cannot be truncated: the newline written after it makes
    the record whole, and a whole record on disk is counted written, never lost."""
    t = guest()
    t.writer.os_ftruncate = no_truncate
    t.writer.os_write = Disk({1: "short_of_newline", 2: "enospc"})
    _requests(t, 3)
    counts = settled(t)
    assert counts["written"] == len(on_disk(Path(t.settings.folder))) == 3 and counts["lost"] == 0


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_a_traffic_file_deleted_or_moved_away_is_noticed_and_a_new_one_opened(guest, how):
    """The operator deletes (or log-rotates) the current file: the next record goes into a new file (before:
    every later record was counted written and went into the unlinked file)."""
    t = guest()
    _requests(t, 2, "a")
    assert settled(t)["written"] == 2
    folder = Path(t.settings.folder)
    (first,) = folder.glob("traffic-*.jsonl")
    if how == "deleted":
        first.unlink()
    else:
        first.rename(folder / "rotated.1")
    _requests(t, 3, "b")
    counts = settled(t)
    assert counts["written"] == 5
    assert [r["prompt"] for r in on_disk(folder)] == ["b0", "b1", "b2"]
    if how == "moved":
        assert len((folder / "rotated.1").read_text().splitlines()) == 2


def test_a_deleted_traffic_folder_is_made_again(guest):
    import shutil

    t = guest()
    _requests(t, 1, "a")
    settled(t)
    shutil.rmtree(t.settings.folder)
    _requests(t, 2, "b")
    counts = settled(t)
    assert counts["written"] == 3 and [r["prompt"] for r in on_disk(Path(t.settings.folder))] == ["b0", "b1"]


def test_a_link_in_place_of_the_traffic_file_is_never_written_through(guest, tmp_path):
    """The current file replaced by a link to another file: the writer opens a new file of its own instead of
    writing through the link."""
    t = guest()
    _requests(t, 1, "a")
    settled(t)
    folder = Path(t.settings.folder)
    (current,) = folder.glob("traffic-*.jsonl")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    current.unlink()
    current.symlink_to(victim)
    _requests(t, 2, "b")
    counts = settled(t)
    assert victim.read_text() == "precious\n" and counts["written"] == 3
    assert [r["prompt"] for f in folder.glob("traffic-*.jsonl") if not f.is_symlink()
            for r in map(json.loads, f.read_text().splitlines())] == ["b0", "b1"]


def test_a_stalled_disk_never_holds_a_request(guest):
    t = guest(queue_size=4)
    disk = Disk({"every": "stall"})
    t.writer.os_write = disk
    start = time.monotonic()
    _requests(t, 12)
    assert time.monotonic() - start < 5.0
    counts = t.counts.snapshot()
    assert counts["dropped_queue_full"] >= 7 and counts["written"] == 0
    disk.gate.set()
    counts = settled(t)
    assert counts["written"] + counts["dropped_queue_full"] == 12 == sum(counts[k] for k in Counts.OUTCOMES)
    assert len(on_disk(Path(t.settings.folder))) == counts["written"]


# --- shutdown ---------------------------------------------------------------------------------------------
async def _lifespan_app(scope, receive, send):
    """vllm_like, plus the ASGI lifespan protocol (startup, shutdown) as Starlette's router answers it."""
    if scope["type"] != "lifespan":
        return await vllm_like(scope, receive, send)
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _serve(t: TrafficLog, n: int) -> list[dict]:
    """A server's life: lifespan startup, `n` requests, lifespan shutdown; the lifespan messages sent."""
    inbox: asyncio.Queue = asyncio.Queue()
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    life = asyncio.create_task(t({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, send))
    await inbox.put({"type": "lifespan.startup"})
    for i in range(n):
        await call(t, "/v1/completions", {**BODY, "prompt": f"p{i}"})
    await inbox.put({"type": "lifespan.shutdown"})
    await life
    return sent


def test_lifespan_shutdown_writes_what_is_queued(guest):
    """The server shuts down with records queued behind a slow disk: lifespan.shutdown writes them before the
    app's shutdown completes (before: a daemon thread's queue, lost at exit)."""
    t = guest(_lifespan_app, shutdown_s=10.0)
    t.writer.os_write = Disk(delay=0.03)
    sent = run(_serve(t, 10))
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    counts = t.counts.snapshot()  # no drain: shutdown itself must have written them
    assert counts["written"] == 10 == len(on_disk(Path(t.settings.folder)))
    assert counts["lost_at_shutdown"] == 0


def test_shutdown_counts_what_it_could_not_write_in_time_as_lost_at_shutdown(guest):
    """A disk stalled past DRAFTSMITH_TRAFFIC_SHUTDOWN_S: shutdown returns on time, and what it could not
    write is counted `lost_at_shutdown` — the record stuck in the stalled write too, which is taken back if
    the write completes after all. A request after shutdown is counted the same."""
    t = guest(_lifespan_app, shutdown_s=1.0)
    disk = Disk({3: "stall"})
    t.writer.os_write = disk
    start = time.monotonic()
    run(_serve(t, 6))
    assert time.monotonic() - start < 5.0
    counts = t.counts.snapshot()
    assert counts["written"] == 2 and counts["lost_at_shutdown"] == 4
    _requests(t, 1)
    disk.gate.set()  # the stalled write completes after shutdown gave it up
    t.writer.thread.join(5.0)
    counts = t.counts.snapshot()
    assert counts["written"] == 2 == len(on_disk(Path(t.settings.folder))) and counts["lost_at_shutdown"] == 5
    assert sum(counts[k] for k in Counts.OUTCOMES) == 7


def test_records_queued_at_exit_are_written_by_atexit(tmp_path):
    """A process that exits (no lifespan: a plain script) with records queued behind a slow writer: atexit
    writes them within the shutdown time (before: a daemon thread, killed at exit)."""
    folder = tmp_path / "traffic"
    script = (
        "import asyncio, sys\n"
        "from draftsmith.fleet.middleware import Settings, TrafficLog\n"
        "from tests.test_fleet_traffic import call, vllm_like\n"
        "t = TrafficLog(vllm_like, Settings.from_env())\n"
        "for i in range(15):\n"
        "    asyncio.run(call(t, '/v1/completions', {'model': 'm', 'prompt': f'p{i}'}))\n"
        "print(t.counts.snapshot()['written'])\n"
    )
    env = {**os.environ, "DRAFTSMITH_TRAFFIC_DIR": str(folder), "DRAFTSMITH_TRAFFIC_TEST_STALL_S": "0.1",
           "DRAFTSMITH_TRAFFIC_SHUTDOWN_S": "20"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 15  # some were still queued when the script ended
    assert [r["prompt"] for r in on_disk(folder)] == [f"p{i}" for i in range(15)]


def test_warnings_reach_the_log_when_the_host_sets_the_root_logger_to_error(guest):
    """vLLM's API server runs with the root logger at ERROR (its model_hosting_container_standards dependency
    sets it so): the middleware's warnings — a drop, a loss, the shutdown summary — must still be emitted
    (before: none of them ever reached vLLM's log)."""
    import logging

    seen: list[str] = []
    catcher = logging.Handler()
    catcher.emit = lambda record: seen.append(record.getMessage())
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    root.addHandler(catcher)
    try:
        t = guest(max_body_bytes=64, queue_bytes=1024)
        run(call(t, "/v1/completions", {**BODY, "prompt": "y" * 200}))
        t.writer.close(1.0)
    finally:
        root.removeHandler(catcher)
        root.setLevel(level)
    assert any("over_cap 1 times" in m for m in seen), seen
    assert any("closed;" in m and "'over_cap': 1" in m for m in seen), seen


# --- the folder -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["file", "symlink", "dangling_symlink", "unwritable", "under_a_file"])
def test_a_traffic_dir_that_is_no_writable_folder_is_one_line_naming_the_variable(tmp_path, how):
    real = tmp_path / "real"
    real.mkdir()
    folder = tmp_path / "traffic"
    if how == "file":
        folder.write_text("x")
    elif how == "symlink":
        folder.symlink_to(real)
    elif how == "dangling_symlink":
        folder.symlink_to(tmp_path / "missing")
    elif how == "under_a_file":
        (tmp_path / "f").write_text("x")
        folder = tmp_path / "f" / "traffic"
    elif os.geteuid() == 0:  # root writes through a folder's mode bits: a folder nobody may create files in
        folder = Path("/proc/1")
    else:
        folder.mkdir(mode=0o500)
    with pytest.raises(ValueError) as e:
        TrafficLog(vllm_like, Settings.from_env({"DRAFTSMITH_TRAFFIC_DIR": str(folder)}))
    message = str(e.value)
    assert message.startswith(f"TrafficLog: DRAFTSMITH_TRAFFIC_DIR={folder}") and "\n" not in message, message
    assert real.is_dir() and list(real.iterdir()) == []  # nothing written through a link


# --- fuzz: the middleware as a plain ASGI app --------------------------------------------------------------
class Boom(Exception):
    pass


BODIES = {
    "json": json.dumps(BODY).encode(),
    "chat": json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "domain": "d"}).encode(),
    "not_json": b"model=m&prompt=hello",
    "huge": b'{"prompt":"' + b"y" * 9000 + b'"}',
    "deep": b'{"prompt":' + b"[" * 1500 + b"]" * 1500 + b"}",
    "bad_utf8": b'{"prompt":"\xff\xfe\xc3"}',
    "surrogate": b'{"model":"m","prompt":"\\ud800 and \\udfff"}',
    "request_id": b'{"model":"m","prompt":"x","request_id":"mine"}',
    "array": b"[1, 2, 3]",
    "empty": b"",
}
ANSWERS = ["json", "stream", "cut_short", "raise_before", "raise_after_start", "raise_after_end", "surrogate",
           "not_json", "status_500", "no_read", "huge"]
HEADER_NAMES = st.sampled_from([b"x-request-id", b"X-Request-Id", b"x-draftsmith-domain", b"content-type",
                                b"user-agent"])
HEADER_VALUES = st.one_of(st.binary(max_size=12),
                          st.sampled_from(["é中".encode(), b"\xff\x00", "ключ".encode()]))
HEADERS = st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4)


@st.composite
def exchanges(draw) -> dict:
    return {"path": draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models"])),
            "method": draw(st.sampled_from(["POST", "POST", "POST", "GET"])),
            "body": draw(st.sampled_from(sorted(BODIES))), "headers": draw(HEADERS),
            "chunk": draw(st.integers(1, 4096)), "answer": draw(st.sampled_from(ANSWERS)),
            "disconnect_after": draw(st.none() | st.integers(0, 3)),
            "send_fails_after": draw(st.none() | st.integers(0, 4))}


def _hostile_app(case: dict, log: dict):
    """An app answering `case["answer"]`; everything it received and sent goes into `log`."""

    async def app(scope, receive, send):
        log["received"], log["sent"], log["raised"] = [], [], None
        try:
            await answer(scope, receive, send)
        except BaseException as e:
            log["raised"] = e
            raise

    async def answer(scope, receive, send):
        if case["answer"] != "no_read":
            while True:
                m = await receive()
                log["received"].append(m)
                if m["type"] != "http.request" or not m.get("more_body"):
                    break
        if case["answer"] == "raise_before":
            raise Boom("before")

        async def out(message):
            log["sent"].append(message)
            await send(message)

        stream = case["answer"] in ("stream", "cut_short", "raise_after_start")
        kind = b"text/event-stream" if stream else b"application/json"
        status = 500 if case["answer"] == "status_500" else 200
        await out({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
        if case["answer"] == "raise_after_start":
            event = b'data: {"id":"x","choices":[]}\n\n'
            await out({"type": "http.response.body", "body": event, "more_body": True})
            raise Boom("after start")
        if stream:
            for w in ["a", "b\ud800", "c"]:
                event = json.dumps({"id": "cmpl-s", "choices": [{"index": 0, "text": w}]}).encode()
                body = b"data: " + event + b"\n\n"
                await out({"type": "http.response.body", "body": body, "more_body": True})
            if case["answer"] == "cut_short":
                return
            await out({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        body = {"json": b'{"id":"cmpl-j","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}',
                "surrogate": b'{"id":"cmpl-u","choices":[{"index":0,"text":"\\udc00"}]}',
                "not_json": b"<html>oops</html>", "huge": b'{"id":"h","x":"' + b"z" * 9000 + b'"}',
                "status_500": b'{"error":{"message":"boom"}}'}.get(case["answer"], b"{}")
        await out({"type": "http.response.body", "body": body})
        if case["answer"] == "raise_after_end":
            raise Boom("after end")

    return app


async def _client(t: TrafficLog, case: dict) -> tuple[list, list, BaseException | None]:
    """One request as the server hands it over: (the messages offered to the app, those the client got, what
    the middleware raised)."""
    raw = BODIES[case["body"]]
    parts = [raw[i:i + case["chunk"]] for i in range(0, len(raw), case["chunk"])] or [b""]
    offered = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
               for i, p in enumerate(parts)]
    if case["disconnect_after"] is not None and case["disconnect_after"] < len(offered):
        offered = offered[:case["disconnect_after"]] + [{"type": "http.disconnect"}]
    queue = list(offered)
    got: list[dict] = []

    async def receive():
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):
        if case["send_fails_after"] is not None and len(got) >= case["send_fails_after"]:
            raise OSError(errno.EPIPE, "the client went away")
        got.append(message)

    scope = {"type": "http", "method": case["method"], "path": case["path"], "headers": list(case["headers"]),
             "state": {}}
    try:
        await t(scope, receive, send)
    except BaseException as e:  # noqa: BLE001 - whatever the middleware lets out is what the test looks at
        return offered, got, e
    return offered, got, None


@pytest.mark.parametrize("runs", RUNS)
def test_fuzzed_exchanges_pass_through_untouched_and_the_counts_add_up(tmp_path_factory, runs):
    runs(given(cases=st.lists(exchanges(), min_size=1, max_size=6))(
        lambda cases: _fuzz_check(tmp_path_factory.mktemp("fuzz") / "traffic", cases)))()


def _fuzz_check(folder: Path, cases: list[dict]) -> None:
    log: dict = {}
    current: dict = {}

    async def app(scope, receive, send):
        return await _hostile_app(current, log)(scope, receive, send)

    t = TrafficLog(app, Settings(str(folder), max_body_bytes=4096, queue_bytes=1 << 16, queue_size=4))
    try:
        logged = 0
        for case in cases:
            current.clear()
            current.update(case)
            offered, got, raised = run(_client(t, case))
            # the client got exactly the messages the app sent (the same objects), up to a send that failed
            assert len(got) <= len(log["sent"])
            assert all(a is b for a, b in zip(got, log["sent"], strict=False))
            if case["send_fails_after"] is None:
                assert len(got) == len(log["sent"])
            # the app received exactly what the client offered, in order
            assert all(a is b for a, b in zip(log["received"], offered, strict=False))
            # the middleware raised what the app raised (the very exception), and nothing of its own
            assert raised is log["raised"], (repr(raised), repr(log["raised"]))
            logged += case["method"] == "POST" and case["path"] != "/v1/models"
        counts = settled(t)
        assert sum(counts[k] for k in Counts.OUTCOMES) == logged, counts
        assert counts["bytes_held"] == 0
        assert len(on_disk(folder)) == counts["written"]
    finally:
        t.writer.close(1.0)
