"""A draft model's export layout, the same for every stack: an HF causal-LM folder (`Method.export` of the
draft method), and what `draftsmith check` expects in an artifact (`draft_artifact_tensors`).

A draft artifact already is an HF folder (save_pretrained + tokenizer + manifest.json). The export copies
the weights and config, takes the tokenizer files from the TARGET's folder (two-model speculative decoding
needs token ids to mean the same thing on both sides: identical vocabulary, identical special tokens),
and sets `num_assistant_tokens` in generation_config.json (transformers' assisted generation reads it).
The same folder serves vLLM (`method: draft_model`), SGLang (`STANDALONE`) and TensorRT-LLM
(`DraftTarget`); only serve.md differs.

Verification: (1) spec — the tensor names/shapes transformers will ask for, derived by instantiating the
architecture named in config.json on the meta device (no weights, no draftsmith classes); (2) vocab_size
and the tokenizer hash equal the target fingerprint's; (3) with the target at hand, the real consumer:
transformers loads the folder and `generate(assistant_model=draft)` reproduces the target's own greedy
output token for token.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from draftsmith.artifact import load_manifest, verify_weights
from draftsmith.errors import ArtifactError
from draftsmith.layouts.card import write_card
from draftsmith.layouts.common import (
    ExportResult,
    check_stack,
    copy_tokenizer_files,
    fenced,
    record_checksums,
    verifier_ref,
    write_guard,
    write_serve,
)
from draftsmith.layouts.serving import ENGINE_NAMES, Served, Serving, VllmServe, sglang_serve, trtllm_serve, vllm_serve
from draftsmith.layouts.verify import (
    Spec,
    VerificationError,
    check,
    compare,
    read_header,
    register_verifier,
    run_verifier,
    st_dtype,
)
from draftsmith.outputs import atomic_dir, atomic_write_json
from draftsmith.reading import read_json
from draftsmith.targets.families import pad_token_id
from draftsmith.targets.fingerprint import check_compatible, tokenizer_hash

FORMAT = "hf-draft"
SKIP = {"manifest.json", "draftsmith.json", "serve.md", "README.md"}


def export_draft(artifact_dir: str | Path, out: str | Path, stack: str, target=None,
                 num_speculative_tokens: int | None = None, verify: bool = True, *, overwrite: bool = False,
                 verifier: str | None = None) -> ExportResult:
    artifact_dir, out = Path(artifact_dir), Path(out)
    check_stack(stack)
    num_speculative_tokens = 4 if num_speculative_tokens is None else num_speculative_tokens
    manifest = load_manifest(artifact_dir, kind="draft")
    verify_weights(artifact_dir, manifest)
    if target is not None:
        check_compatible(manifest["target"], target.fingerprint(), what=f"artifact {artifact_dir}")
    if not (artifact_dir / "config.json").is_file():
        raise ArtifactError(f"{artifact_dir}: a draft artifact must be an HF folder (no config.json)")
    cfg = read_json(artifact_dir / "config.json")
    want_vocab = manifest["target"].get("vocab_size")
    if cfg.get("vocab_size") != want_vocab:
        raise ArtifactError(f"{artifact_dir}: draft vocab_size {cfg.get('vocab_size')} != target vocab_size "
                            f"{want_vocab}")

    result = ExportResult(out, stack, FORMAT)

    def verified(tmp: Path) -> None:  # the folder is swapped in only after this passes
        result.files = sorted(p.name for p in tmp.iterdir())
        if verify:
            result.checks = run_verifier(tmp, FORMAT, target, shown=out)

    with atomic_dir(out, overwrite=overwrite, kind="export", verify=verified) as tmp:
        for f in artifact_dir.iterdir():
            if f.is_file() and f.name not in SKIP and not f.name.startswith("."):
                shutil.copy2(f, tmp / f.name)
        tok_src = Path(target.folder) if target is not None and target.folder is not None else artifact_dir
        copy_tokenizer_files(tok_src, tmp)
        gen_path = tmp / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else {}
        gen["num_assistant_tokens"] = int(num_speculative_tokens)
        gen["num_assistant_tokens_schedule"] = "constant"
        atomic_write_json(gen_path, gen)
        write_guard(tmp, manifest, stack, FORMAT, {"num_speculative_tokens": int(num_speculative_tokens)})
        body = serve_text(stack, out, verifier_ref(target, verifier), num_speculative_tokens)
        if stack in ENGINE_NAMES:  # the shape that engine serves, which `evaluate --as-served` decodes
            body += "\n" + served(stack, artifact_dir, num_speculative_tokens, {}).text() + "\n"
        write_serve(tmp, f"Serving this draft with {stack}", body)
        write_card(tmp, manifest, "a distilled draft model", "draft", stack, FORMAT, verifier_ref(target, verifier),
                   body)
        record_checksums(tmp)
    return result


def serve_text(stack: str, out: Path, tgt: str, k: int) -> str:
    """serve.md's body: how `stack` launches the draft beside its target."""
    if stack == "vllm":
        return f"vLLM two-model speculative decoding (draft model):\n\n{vllm_serve(tgt, 'draft_model', out, k)}\n"
    if stack == "sglang":
        flags = f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
        return ("SGLang standalone (draft-model) speculative decoding:\n\n"
                f"{sglang_serve(tgt, 'STANDALONE', out, flags)}\n")
    if stack == "trtllm":
        return trtllm_serve(tgt, out, ["decoding_type: DraftTarget", f"max_draft_len: {k}"])
    code = (f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"tok = AutoTokenizer.from_pretrained('{tgt}')\n"
            f"target = AutoModelForCausalLM.from_pretrained('{tgt}')\n"
            f"draft = AutoModelForCausalLM.from_pretrained('{out}')  "
            f"# num_assistant_tokens={k} in its generation_config\n"
            f"ids = tok.apply_chat_template([{{'role': 'user', 'content': 'Hi'}}], add_generation_prompt=True, "
            "return_tensors='pt')\n"
            f"out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=64)")
    return f"Hugging Face assisted generation:\n\n{fenced(code, 'python')}\n"


def served(engine: str, artifact_dir: Path, k: int | None, options: dict) -> Served:
    """`Serving.shape`: every engine drafts a draft model's argmax chain of k (vLLM's `draft_model` with greedy draft
    sampling, SGLang's STANDALONE with topk 1, TensorRT-LLM's DraftTarget); sampling or not, the draft proposes its
    argmax (`greedy`), which the target's rejection sampler treats as one-hot."""
    k = 4 if k is None else k
    method, params = {"vllm": ("draft_model", {"num_speculative_tokens": k}),
                      "sglang": ("STANDALONE", {"num_steps": k, "topk": 1, "num_draft_tokens": k + 1}),
                      "trtllm": ("DraftTarget", {"max_draft_len": k})}[engine]
    return Served(engine, method, "chain", k, params=params, opts={"greedy": True})


def draft_proposer(export_dir: Path) -> str:
    """The export folder is itself an HF draft model: draftsmith decodes it as one, no read-back needed."""
    return f"draft:{export_dir}"


SERVING = Serving(vllm={FORMAT: VllmServe("draft_model", proposer=draft_proposer)}, shape=served)  # `Method.serving`


# --- verification ------------------------------------------------------------------------------------
def expected_draft_tensors(config: dict) -> tuple[Spec, Spec]:
    """(required, optional) tensors transformers asks for, from the architecture in config.json.

    The model is built on the meta device: names and shapes come from transformers alone. A tied
    lm_head is optional (transformers re-ties it from the embeddings)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    dtype = st_dtype(_config_dtype(config))
    required, optional = {}, {}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in checkpoint_state(model).items():
        entry = (tuple(t.shape), dtype)
        (optional if tied and name.startswith("lm_head.") else required)[name] = entry
    return required, optional


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The state dict under the names save_pretrained writes: transformers 5 fuses a mixture-of-experts
    layer's experts into one tensor in memory (Qwen3-MoE, DeepSeek-V3) and splits them back into one tensor per
    expert on save, the layout vLLM and older transformers load."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions: memory and checkpoint names agree
        return model.state_dict()
    return revert_weight_conversion(model, model.state_dict())


def draft_artifact_tensors(path: str | Path) -> tuple[dict, dict, list[str]]:
    """`Method.tensors` of a draft model: (required, optional) name -> (shape, "") its config.json implies."""
    req, opt = expected_draft_tensors(read_json(Path(path) / "config.json"))
    return {k: (s, "") for k, (s, _) in req.items()}, {k: (s, "") for k, (s, _) in opt.items()}, []


def _config_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name).removeprefix("torch."))


def _weight_headers(out: Path) -> dict:
    files = sorted(out.glob("*.safetensors"))
    if not files:
        raise VerificationError(f"{out}: no *.safetensors weights")
    found = {}
    for f in files:
        found.update(read_header(f))
    return found


@register_verifier(FORMAT)
def verify_draft(out: str | Path, target=None, prompt: str = "Write a short greeting.",
                 max_new_tokens: int = 24) -> list[str]:
    out = Path(out)
    guard = read_json(out / "draftsmith.json")
    config = read_json(out / "config.json")
    required, optional = expected_draft_tensors(config)
    problems = compare(_weight_headers(out), required, optional)
    fp = guard["target"]
    if config.get("vocab_size") != fp.get("vocab_size"):
        problems.append(f"config vocab_size {config.get('vocab_size')} != target vocab_size {fp.get('vocab_size')}")
    gen = read_json(out / "generation_config.json") if (out / "generation_config.json").is_file() else {}
    if "num_assistant_tokens" not in gen:
        problems.append("generation_config.json has no num_assistant_tokens")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    if tokenizer_hash(tok) != fp.get("tokenizer_hash"):
        problems.append("tokenizer files differ from the target's (tokenizer hash mismatch)")
    check(out, problems)
    checks = [f"{len(required)} tensors match the {config.get('architectures', ['?'])[0]} spec (names, shapes, dtype)",
              "vocab_size and tokenizer hash equal the target fingerprint's",
              f"generation_config.json num_assistant_tokens={gen['num_assistant_tokens']}"]
    if target is not None:
        checks.append(assisted_generation_check(out, target, prompt, max_new_tokens))
    return checks


@torch.no_grad()
def assisted_generation_check(out: Path, target, prompt: str, max_new_tokens: int) -> str:
    """The real consumer: transformers loads the draft and assisted greedy output equals target greedy."""
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(out, dtype=target.dtype).to(target.device).eval()
    tok = target.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].to(target.device)
    common = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id(target),
                  eos_token_id=target.eos_token_ids)
    plain = target.model.generate(ids, **common)
    assisted = target.model.generate(ids, assistant_model=draft, **common)
    if not torch.equal(plain, assisted):
        raise VerificationError(f"{out}: transformers assisted generation with this draft differs from the "
                                f"target's greedy output")
    n = plain.shape[1] - ids.shape[1]
    return f"transformers generate(assistant_model=draft) == target greedy ({n} tokens)"
