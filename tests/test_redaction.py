"""One redaction, by parsing (net.redact, net.safe_url): a secret draftsmith holds or a server echoes is
written nowhere, whatever its spelling, and a URL is printed without its credentials.

* A key the caller holds (an Authorization value, the API key of `generation.api_key_env`,
  DRAFTSMITH_API_KEY / OPENAI_API_KEY) is removed raw, percent-encoded (quote and quote_plus, upper- and
  lower-case hex), in base64 (standard and URL-safe, padded or not, alone or inside Basic's `user:key`) and
  JSON-escaped.
* A URL is split as urllib splits it: the userinfo before the netloc's last `@` is dropped (a password holding
  `@`), a password holding `/` (which urllib reads as the start of the path) is cut too, and every query or
  fragment parameter named like a credential has its value replaced; the rest of the URL is kept as it was.
* Every writer of outside text goes through it: the console (draftsmith's loggers, the CLI's error line),
  provenance.json, the `alpha` table and its --out JSON, the retraining run record.

The servers are real HTTP servers on 127.0.0.1 (tests/test_hostile.py's fake_server); each test takes seconds.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import subprocess
import sys
import urllib.parse

import pytest
from test_hostile import _json, data_cfg, fake_server, openai_answer

from draftsmith import net
from draftsmith.data import generate_dataset
from draftsmith.errors import DataError

# a key with the characters every encoding spells differently: + / = " \ a space and a non-ASCII letter
KEY = 'live+K3y/0123456789abcdef=="q\\u" é=='
REDACTED = net.REDACTED


def lower(s: str) -> str:
    """`s` with its percent-escapes in lower-case hex (%2b), as some servers write them."""
    return re.sub(r"%[0-9A-F]{2}", lambda m: m[0].lower(), s)


def _spellings(key: str) -> dict[str, str]:
    """The spellings of `key` a server or a file may carry it in."""
    raw = key.encode()
    return {
        "raw": key,
        "quote": urllib.parse.quote(key, safe=""),
        "quote-default-safe": urllib.parse.quote(key),
        "quote_plus": urllib.parse.quote_plus(key),
        "quote-lower-hex": lower(urllib.parse.quote(key, safe="")),
        "quote_plus-lower-hex": lower(urllib.parse.quote_plus(key)),
        "base64": base64.b64encode(raw).decode(),
        "base64-unpadded": base64.b64encode(raw).decode().rstrip("="),
        "base64-urlsafe": base64.urlsafe_b64encode(raw).decode(),
        "base64-urlsafe-unpadded": base64.urlsafe_b64encode(raw).decode().rstrip("="),
        "json": json.dumps(key)[1:-1],
        "json-unicode": json.dumps(key, ensure_ascii=False)[1:-1],
    }


def _leaks(text: str, key: str = KEY) -> list[str]:
    """The spellings of `key` still in `text`, with the middle of its base64 inside a longer value (Basic's
    user:key): any 12 characters of it."""
    found = [name for name, s in _spellings(key).items() if s in text]
    for prefix in (b"u:", b"us:", b"user:"):
        b64 = base64.b64encode(prefix + key.encode()).decode()
        middle = b64[len(prefix) * 4 // 3 + 2:-4]
        found += [f"base64 of {prefix!r}+key" for i in range(len(middle) - 12)
                  if middle[i:i + 12] in text][:1]
    return found


@pytest.fixture
def held_key(monkeypatch):
    """KEY, held as an environment variable draftsmith knows holds an API key."""
    monkeypatch.setenv("DRAFTSMITH_API_KEY", KEY)
    return KEY


# --- a secret in each of its spellings ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(_spellings(KEY)))
def test_redact_removes_each_spelling_of_a_key_the_caller_holds(name):
    spelled = _spellings(KEY)[name]
    text = f"upstream said: {spelled} (while serving /v1/completions)"
    out = net.redact(text, [KEY])
    assert not _leaks(out), (name, out)
    assert REDACTED in out and out.startswith("upstream said: ")
    assert out.endswith("(while serving /v1/completions)")


def test_redact_removes_the_base64_of_basic_auth_holding_the_key():
    for user in ("u", "us", "user"):
        header = "Basic " + base64.b64encode(f"{user}:{KEY}".encode()).decode()
        for spelled in (header, base64.urlsafe_b64encode(f"{user}:{KEY}".encode()).decode()):
            out = net.redact(f"echo {spelled} done", [KEY])
            assert not _leaks(out), (user, out)


def test_redact_removes_a_held_key_without_being_given_it(held_key):
    for name, spelled in _spellings(held_key).items():
        out = net.redact(f"proxy echo: {spelled}")
        assert not _leaks(out), (name, out)


def test_a_percent_encoded_bearer_of_a_key_no_one_named_is_redacted():
    unknown = "Zm9vYmFy+c2VjcmV0/dG9rZW4=="
    for text in (f"echo Bearer%20{urllib.parse.quote(unknown, safe='')}",
                 f"echo bearer+{urllib.parse.quote_plus(unknown)}",
                 f"echo Authorization%3A%20Bearer%20{urllib.parse.quote(unknown, safe='')}"):
        out = net.redact(text)
        assert "Zm9vYmFy" not in out and "dG9rZW4" not in out and REDACTED in out, out


# --- 1. an API key echoed percent-encoded by a failing server ----------------------------------------------
def test_a_percent_encoded_bearer_echoed_by_a_failing_server_reaches_neither_provenance_nor_the_console(
        tiny_target, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setenv("DS_REDACT_KEY", KEY)

    def echo(method, path, body, headers):  # a proxy that prints, URL-encoded, the header it did not forward
        if path.endswith("/models"):
            return _json({"data": [{"id": "tiny"}]})
        said = f"upstream down; auth {urllib.parse.quote(headers['Authorization'])}"
        return 503, {"Content-Type": "text/plain"}, said.encode()

    good_answer = openai_answer("tiny", lambda req: {"text": " 1 2", "finish_reason": "length"})
    with fake_server(echo) as bad, fake_server(good_answer) as good, caplog.at_level(logging.WARNING):
        out = generate_dataset(data_cfg(tmp_path, [f"{bad}/v1", f"{good}/v1"], api_key_env="DS_REDACT_KEY"),
                               tiny_target, progress=False)
        assert bad.seen and all(h.get("Authorization") == f"Bearer {KEY}" for _, _, h in bad.seen)
    provenance = (out / "provenance.json").read_text()
    left = json.loads(provenance)["timing"]["servers"]["servers"][0]["left"]
    assert "HTTP 503" in left and "auth Bearer%20" + REDACTED in left, left
    printed = caplog.text + "".join(capsys.readouterr())
    assert "left the run" in printed
    files = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".txt", ".md")]
    written = provenance + printed + "".join(p.read_text(errors="replace") for p in files)
    assert not _leaks(written), _leaks(written)
    # the key read from generation.api_key_env is held: any later line of this process is redacted too
    assert not _leaks(net.redact(f"later: {urllib.parse.quote_plus(KEY)}"))


def test_the_cli_error_line_is_redacted(held_key, capsys):
    from draftsmith.cli import run_entry_point

    for spelled in _spellings(held_key).values():
        def fail(spelled=spelled):
            raise DataError(f"http://127.0.0.1:9/v1: HTTP 401: bad key {spelled}")

        assert run_entry_point(fail) == 2
        err = capsys.readouterr().err
        assert err.startswith("draftsmith: error: http://127.0.0.1:9/v1: HTTP 401: bad key "), err
        assert not _leaks(err), err

    def bug():
        raise RuntimeError("connect to https://u:p@ss@host/v1?api_key=q1w2e3 with "
                           + urllib.parse.quote_plus(KEY))

    assert run_entry_point(bug) == 1
    err = capsys.readouterr().err
    assert "https://host/v1?api_key=[redacted]" in err and "q1w2e3" not in err and "ss@" not in err
    assert not _leaks(err), err


def test_draftsmiths_log_lines_are_redacted(held_key, caplog):
    with caplog.at_level(logging.INFO):
        logging.getLogger("draftsmith.data.engines.remote").warning(
            "server %s left: %s", "http://user:pa/ss@127.0.0.1:8000/v1?token=t0k3n",
            f"echo {base64.b64encode(held_key.encode()).decode()}")
    assert "pa/ss" not in caplog.text and "t0k3n" not in caplog.text and not _leaks(caplog.text)
    assert "127.0.0.1:8000/v1?token=[redacted]" in caplog.text


def test_a_log_line_with_no_handler_configured_still_reaches_stderr_redacted(tmp_path):
    # the redaction sits on draftsmith's logger as a handler: Python's last-resort stderr handler must still
    # print a warning where the program configured no logging at all
    code = ("import logging, draftsmith.net; log = logging.getLogger('draftsmith.x'); "
            "log.warning('server http://u:p@ss@127.0.0.1:8000/v1?key=k3y left'); log.info('not printed')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == "server http://127.0.0.1:8000/v1?key=[redacted] left", run.stderr


# --- 2. safe_url by parsing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("url, printed", [
    ("http://u:p@127.0.0.1:8000/metrics", "http://127.0.0.1:8000/metrics"),
    ("http://user:p@ss@127.0.0.1:8000/metrics", "http://127.0.0.1:8000/metrics"),
    ("http://user:p@s@s@gpu-1:8000/v1", "http://gpu-1:8000/v1"),
    ("https://ghp_t0ken@github.example/x", "https://github.example/x"),
    # a password holding '/': urllib reads the netloc up to it, the rest of the password as the path
    ("http://user:pa/ss@127.0.0.1:8000/metrics", f"http://{REDACTED}@127.0.0.1:8000/metrics"),
    ("http://user:p@s/s@gpu-1:8000/v1/models", f"http://{REDACTED}@gpu-1:8000/v1/models"),
    ("http://user:p/a/s@s@gpu-1/v1?model=m", f"http://{REDACTED}@gpu-1/v1?model=m"),
])
def test_safe_url_drops_a_password_holding_at_or_slash(url, printed):
    assert net.safe_url(url) == printed
    assert net.redact(f"GET {url} failed") == f"GET {printed} failed"


CREDENTIAL_NAMES = ["key", "KEY", "token", "Token", "secret", "sig", "signature", "password", "passwd",
                    "pwd", "auth", "credential", "credentials", "session", "sessionid", "api_key", "API-KEY",
                    "apikey", "apiKey", "access_key", "openai_api_key", "x-api-key", "X-Api-Key",
                    "client_secret", "access_token", "X-Amz-Signature", "X-Amz-Credential",
                    "X-Amz-Security-Token", "subscription-key", "authorization", "api%5Fkey"]


@pytest.mark.parametrize("name", CREDENTIAL_NAMES)
def test_safe_url_redacts_each_credential_parameter_in_the_query_and_the_fragment(name):
    url = f"https://gpu-1:8000/v1/metrics?model=m&{name}=S3cr%2Bt_v4lue&limit=5#{name}=F7ag&state=ok"
    printed = f"https://gpu-1:8000/v1/metrics?model=m&{name}={REDACTED}&limit=5#{name}={REDACTED}&state=ok"
    assert net.safe_url(url) == printed
    assert net.redact(f"metrics at <{url}> read") == f"metrics at <{net.safe_url(url)}> read"


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/metrics",
    "https://gpu-node-1:8000/v1/completions?model=llama&max_tokens=5&n=2&author=me&monkeys=3#top",
    "http://[::1]:8000/metrics?format=text",
    "https://registry.example/@scope/pkg?tag=latest",
    "http://host/path;params?a=1&b=&c#frag",
    "runs/fleet/traffic",
])
def test_a_url_with_no_secret_is_unchanged(url):
    assert net.safe_url(url) == url
    assert net.redact(f"read {url} now") == f"read {url} now"


@pytest.mark.parametrize("text", [
    "tokenizer has no pad_token: set one", 'eos_token="<|im_end|>"', "max_tokens=5, n=2", "secret_sauce=x",
    "the row key: domain", "signature: (x, y)",
])
def test_words_that_name_no_secret_are_kept(text):
    assert net.redact(text) == text


def test_redaction_is_idempotent(held_key):
    text = (f"Authorization: Bearer {held_key} http://u:p@ss@h:1/v1?api_key=a&sig=b token=xyz "
            f"{urllib.parse.quote(held_key)} sk-live-0123456789")
    once = net.redact(text)
    assert net.redact(once) == once and not _leaks(once)
    assert net.safe_url(net.safe_url("http://u:p/ss@h/x?key=1")) == net.safe_url("http://u:p/ss@h/x?key=1")


# --- 3. every writer: provenance, the alpha table and its JSON, the retraining record -----------------------
def test_a_password_in_a_base_url_reaches_no_provenance(tiny_target, tmp_path):
    with fake_server(openai_answer("tiny", lambda req: {"text": " 1 2", "finish_reason": "length"})) as good:
        host = good.split("://", 1)[1]
        url = f"http://user:pa@55w0rd@{host}/v1"
        out = generate_dataset(data_cfg(tmp_path, [url]), tiny_target, progress=False)
        assert good.seen[0][2]["Authorization"] == "Basic " + base64.b64encode(b"user:pa@55w0rd").decode()
    provenance = (out / "provenance.json").read_text()
    assert "55w0rd" not in provenance and "user:pa" not in provenance
    prov = json.loads(provenance)
    assert prov["config"]["generation"]["base_urls"] == [f"http://{host}/v1"]
    assert prov["timing"]["servers"]["servers"][0]["url"] == f"http://{host}/v1"


def test_the_alpha_table_and_its_json_carry_no_credential(tmp_path, capsys):
    from draftsmith.cli import main

    dump = "".join(f'vllm:spec_decode_{k}_total{{model_name="m"}} {v}\n'
                   for k, v in (("num_drafts", 10), ("num_draft_tokens", 40), ("num_accepted_tokens", 20)))

    def metrics(method, path, body, headers):
        return 200, {"Content-Type": "text/plain"}, dump.encode()

    with fake_server(metrics) as srv:
        host = srv.split("://", 1)[1]
        url = (f"http://user:pa@55w0rd@{host}/metrics?access_key=AK1secret&sig=SG2secret"
               "&openai_api_key=OK3secret&client_secret=CS4secret&view=all")
        out = tmp_path / "alpha.json"
        assert main(["alpha", url, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    written = out.read_text()
    for secret in ("55w0rd", "AK1secret", "SG2secret", "OK3secret", "CS4secret"):
        assert secret not in printed and secret not in written, secret
    safe = (f"http://{host}/metrics?access_key={REDACTED}&sig={REDACTED}&openai_api_key={REDACTED}"
            f"&client_secret={REDACTED}&view=all")
    assert f"# Production acceptance ({safe})" in printed
    assert json.loads(written)["source"] == safe


def test_a_retraining_run_record_carries_no_credential(tmp_path, held_key):
    from draftsmith.retrain.registry import Registry

    reg = Registry(tmp_path / "reg", "tiny", "eagle")
    record = {"started": "2025-01-01T00:00:00+0000",
              "config": {"measure": {"production": "http://user:p@ss@gpu-1:8000/metrics?token=t0k3n"}},
              "error": f"DataError: HTTP 401 from gpu-1: {urllib.parse.quote(held_key)}"}
    text = reg.write_run_record(record).read_text()
    assert "t0k3n" not in text and "p@ss" not in text and not _leaks(text), text
    production = json.loads(text)["config"]["measure"]["production"]
    assert production == f"http://gpu-1:8000/metrics?token={REDACTED}"
