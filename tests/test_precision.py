"""The target in bfloat16 for forward-only work (targets/precision.py) and data generation's precision."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import build_tiny_llama

from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.generate import generate_dataset, load_distilled
from draftsmith.errors import DataError
from draftsmith.targets import precision
from draftsmith.targets.precision import Float32Logits, cpu_native_bf16, inference_copy, inference_dtype


def _cpuinfo(tmp_path, flags: str):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
    return str(p)


def test_cpu_native_bf16_reads_the_flags(tmp_path, monkeypatch):
    assert cpu_native_bf16() is False  # conftest: DRAFTSMITH_CPU_BF16=0
    monkeypatch.setenv("DRAFTSMITH_CPU_BF16", "1")
    assert cpu_native_bf16() is True
    monkeypatch.delenv("DRAFTSMITH_CPU_BF16")
    assert cpu_native_bf16(_cpuinfo(tmp_path, "avx2 avx512f avx512_bf16")) is True
    assert cpu_native_bf16(_cpuinfo(tmp_path / "..", "avx2 amx_tile amx_bf16")) is True
    (tmp_path / "c").mkdir()
    assert cpu_native_bf16(_cpuinfo(tmp_path / "c", "avx2 avx512f avx512_vnni")) is False
    assert cpu_native_bf16(str(tmp_path / "missing")) is False


def test_inference_dtype(monkeypatch):
    cpu = torch.device("cpu")
    assert inference_dtype(cpu, "float32") == torch.float32
    assert inference_dtype(cpu, "bfloat16") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: True)
    assert inference_dtype(cpu, "auto") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
    assert inference_dtype(cpu, "auto") == torch.float32


@pytest.mark.parametrize("tied", [True, False])
def test_inference_copy_leaves_the_model_and_keeps_fp32_logits(tied):
    model = build_tiny_llama(96, tie_word_embeddings=tied).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert inference_copy(model, torch.float32) is model
    fast = inference_copy(model, torch.bfloat16)
    assert fast is not model
    # the caller's model is untouched: still float32, same weights, its own head
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)
    head = fast.get_output_embeddings()
    assert isinstance(head, Float32Logits) and head.weight.dtype == torch.float32
    assert torch.equal(head.weight, model.get_output_embeddings().weight)
    assert fast.get_input_embeddings().weight.dtype == torch.bfloat16
    # the rotary frequencies stay float32: bf16 ones would turn the angles wrong at long positions
    assert [b.dtype for n, b in fast.named_buffers() if "inv_freq" in n] == [torch.float32] * 2
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref, got = model(ids).logits, fast(ids).logits
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 body: close, not equal
    plain = inference_copy(model, torch.bfloat16, fp32_logits=False)
    assert not isinstance(plain.get_output_embeddings(), Float32Logits)
    with torch.no_grad():
        assert plain(ids).logits.dtype == torch.bfloat16


def _cfg(tmp_path, name, dtype):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"q": f"Question {i}: what is {i} plus {i}?"}) + "\n" for i in range(4)))
    return DataConfig(sources=[SourceConfig(name="p", path=str(p), prompt="q", domain="general")],
                      output_dir=str(tmp_path / name),
                      generation=GenerationConfig(max_new_tokens=8, batch_size=2, flush_every=1, dtype=dtype))


def test_generation_dtype_is_recorded_and_resume_refuses_another(tmp_path, tiny_target):
    out = generate_dataset(_cfg(tmp_path, "bf", "bfloat16"), tiny_target, progress=False)
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["precision"] == {"dtype": "bfloat16", "logits": "float32"}
    assert tiny_target.dtype == torch.float32  # the caller's target is not cast
    ds = load_distilled(out, tiny_target)  # the fingerprint is that of the target as loaded
    assert len(ds) == 4
    out32 = generate_dataset(_cfg(tmp_path, "fp", "float32"), tiny_target, progress=False)
    assert json.loads((out32 / "provenance.json").read_text())["precision"] == {"dtype": "float32",
                                                                                "logits": "float32"}
    # an interrupted bf16 run is not finished in float32: its rows would mix two precisions
    (out / "provenance.json").unlink()
    with pytest.raises(DataError, match="different precision"):
        generate_dataset(_cfg(tmp_path, "bf", "float32"), tiny_target, progress=False)


def test_generation_dtype_is_validated():
    with pytest.raises(ValueError, match="generation.dtype"):
        GenerationConfig(dtype="int8")
