"""Targets: loading from folders and GGUF, caching, fingerprints and mismatch errors."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from draftsmith.errors import FingerprintMismatch, TargetError
from draftsmith.targets import check_compatible, fingerprint, list_targets, load_target


def test_load_hf_folder_is_frozen(tiny_target):
    t = load_target(str(tiny_target.folder))
    assert not t.model.training
    assert all(not p.requires_grad for p in t.model.parameters())
    assert t.vocab_size == len(t.tokenizer)
    assert t.fingerprint() == fingerprint(tiny_target.model, tiny_target.tokenizer)


def test_fingerprint_is_stable_and_dtype_independent(tiny_target):
    fp32 = tiny_target.fingerprint()
    # a copy: a round trip through bf16 would round the shared session fixture's weights for later tests
    bf16 = fingerprint(copy.deepcopy(tiny_target.model).to(torch.bfloat16), tiny_target.tokenizer)
    check_compatible(fp32, bf16)
    assert fp32["weights_hash"] == bf16["weights_hash"]


def test_mismatch_names_the_field(tiny_target, other_target):
    with pytest.raises(FingerprintMismatch, match=r"vocab_size is \d+ there but \d+ for this target"):
        check_compatible(tiny_target.fingerprint(), other_target.fingerprint())


def test_chat_template_change_is_a_mismatch(tiny_target):
    fp = dict(tiny_target.fingerprint())
    fp["chat_template_hash"] = "0" * 64
    with pytest.raises(FingerprintMismatch, match="chat_template_hash"):
        check_compatible(fp, tiny_target.fingerprint())


def test_unknown_and_hub_specs_give_clear_errors(tmp_path):
    with pytest.raises(TargetError, match="unknown target"):
        load_target("no-such-target")
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(TargetError, match="must be a .gguf"):
        load_target(str(tmp_path / "x.bin"))
    with pytest.raises(TargetError, match="no config.json"):
        load_target(str(tmp_path))


def test_list_targets_names_both_embedded():
    names = {row["name"] for row in list_targets()}
    assert names == {"smollm2-135m", "gemma3-270m"}


@pytest.mark.real
def test_real_smollm2_loads_cached_and_generates(real_target):
    fp = real_target.fingerprint()
    assert fp["vocab_size"] == 49152
    assert fp["architecture"] == {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576}
    assert fp["special_tokens"]["eos"] == ["<|im_end|>", 2]
    # Loading again comes from the safetensors cache, far faster than dequantising the GGUF.
    start = time.perf_counter()
    again = load_target("smollm2-135m")
    assert time.perf_counter() - start < 10
    check_compatible(fp, again.fingerprint())
    tok = real_target.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = real_target.model.generate(ids, max_new_tokens=16, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 16 or out[0, -1].item() in real_target.eos_token_ids
    assert "4" in tok.decode(out[0, ids.shape[1]:])


def _allocator_probe(env_extra: dict) -> str:
    """In a fresh process: did tune_cpu_allocator change glibc's settings, and does a large block then
    come from the heap (no mmap: freeing it keeps the pages) — read from mallinfo2's mmap counters."""
    import os
    import subprocess
    import sys

    code = (
        "import ctypes, torch\n"
        "from draftsmith.targets.device import tune_cpu_allocator\n"
        "changed = tune_cpu_allocator()\n"
        "class MI(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena','ordblks','smblks','hblks','hblkhd','usmblks',"
        "'fsmblks','uordblks','fordblks','keepcost')]\n"
        "libc = ctypes.CDLL('libc.so.6'); libc.mallinfo2.restype = MI\n"
        "x = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MB\n"
        "print(changed, libc.mallinfo2().hblkhd >= 64 << 20)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DRAFTSMITH_MALLOC"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc only")
def test_cpu_allocator_keeps_large_blocks_in_the_heap():
    assert _allocator_probe({}) == "True False"  # tuned: the 64 MB tensor is not an mmap'ed block
    assert _allocator_probe({"DRAFTSMITH_MALLOC": "0"}) == "False True"  # glibc's default: mmap per block
    assert _allocator_probe({"MALLOC_TOP_PAD_": "0"}) == "False True"  # the user's own settings win
