"""Medusa heads in the two layouts the serving stacks read, and the reader back into a draftsmith artifact.

draftsmith (medusa/model.py):   heads.{h}.blocks.{l}.linear.weight [H, H], .bias [H]
                                heads.{h}.lm_head.weight [V, H]   (absent with share_lm_head)
vLLM (`model_type: medusa`, models/medusa.py + transformers_utils/configs/medusa.py):
                                blocks.{h}.layers.{l}.weight/.bias   (bias read only when medusa_fc_bias)
                                lm_heads.{h}.weight
                                config: num_heads, num_hidden_layers, hidden_size, vocab_size,
                                truncated_vocab_size, medusa_fc_bias
                                token_map [N] int64: the target ids of a draft vocabulary's rows (heads
                                with draft_vocab_size N; absent, and truncated_vocab_size = vocab_size,
                                without one). vLLM scatters each head's N logits into the full vocabulary.
FasterDecoding / TensorRT-LLM (`medusa_lm_head.safetensors`; head h is an nn.Sequential of L ResBlocks
then the Linear projection):    {h}.{l}.linear.weight/.bias, {h}.{L}.weight
                                config: medusa_num_heads, medusa_num_layers, hidden_size, vocab_size
                                (no token map: heads over a draft vocabulary cannot be written here)

Both compute the same function as draftsmith (Cai et al. 2024, eq. 1): head_h(x) = W_h · ResBlocks(x),
ResBlock(x) = x + SiLU(A x + b). With share_lm_head the target's lm_head is written once for vLLM
(`original_lm_head: true`, lm_heads.0 only: vLLM loads it into one lm_head all heads use) and into every head
for FasterDecoding / TensorRT-LLM, whose layout has no shared head. Neither can point at the target's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith import artifact, schema
from draftsmith.errors import ArtifactError, ConfigError
from draftsmith.layouts.common import fenced, read_guard, state_dtype
from draftsmith.layouts.serving import ENGINE_NAMES, Served, Serving, VllmServe, vllm_serve
from draftsmith.layouts.verify import (
    Spec,
    check,
    compare,
    guard_vocab_size,
    read_header,
    read_tensors,
    register_verifier,
    st_dtype,
)
from draftsmith.outputs import atomic_write_json
from draftsmith.targets.device import dtype_name
from draftsmith.targets.families import lm_head

VLLM_FORMAT = "vllm-medusa"
MEDUSA_FORMAT = "medusa-lm-head"  # FasterDecoding layout, read by TensorRT-LLM and Medusa's own HF model
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
# the layout each serving stack reads Medusa heads in, and why a stack takes none
STACK_FORMATS = {"vllm": VLLM_FORMAT, "trtllm": MEDUSA_FORMAT, "hf": MEDUSA_FORMAT}
UNSUPPORTED = {"sglang": "SGLang has no Medusa support; export Medusa heads for vllm, trtllm or hf"}


def read_medusa_artifact(path: str | Path, target=None) -> tuple[dict, dict, dict[str, torch.Tensor], list | None]:
    """(manifest, config, state with an lm_head in every head, tree rank paths or None), each file through
    its reader (medusa/model.py: config.json, tree.json)."""
    from dataclasses import asdict

    from draftsmith.medusa.model import read_heads_config, read_tree

    path = Path(path)
    manifest, state = artifact.load_artifact(path, kind="medusa", target=target)
    config = read_heads_config(path, artifact.target_vocab(manifest))
    cfg = asdict(config)
    if config.share_lm_head:
        if target is None:
            raise ConfigError(f"{path}: these Medusa heads share the target's lm_head; give --target to export them")
        w = lm_head(target.model).weight.detach().to("cpu", state_dtype(state))
        for h in range(config.num_heads):
            state[f"heads.{h}.lm_head.weight"] = w
    tree = read_tree(path, config.num_heads, config.out_size)
    return manifest, cfg, state, [list(p) for p in tree.paths] if tree is not None else None


def read_layout_config(out: str | Path, fmt: str | None = None) -> dict:
    """The one reader of a Medusa export's config.json, in the layout `fmt` names (None: the one the file
    itself says: vLLM's `model_type: medusa`, or FasterDecoding's `medusa_num_heads`): every field the
    verifier, serve-check and the reader back use, typed and in range, or a FieldError naming the file and
    field."""
    where = Path(out) / "config.json"
    config = schema.read_doc(where)
    if fmt is None:
        fmt = VLLM_FORMAT if config.get("model_type") == "medusa" else (
            MEDUSA_FORMAT if "medusa_num_heads" in config else None)
    if fmt is None:
        raise schema.FieldError(f"{where}: neither a vLLM Medusa config (model_type 'medusa') nor a FasterDecoding "
                                "one (medusa_num_heads)")
    V = schema.get(config, "vocab_size", where, "int", lo=1, hi=schema.MAX_VOCAB)
    schema.get(config, "hidden_size", where, "int", lo=1, hi=schema.MAX_HIDDEN)
    schema.get(config, "torch_dtype", where, "str", default="float32", choices=tuple(DTYPES))
    if fmt == VLLM_FORMAT:
        schema.get(config, "num_heads", where, "int", lo=1, hi=16)
        schema.get(config, "num_hidden_layers", where, "int", lo=0, hi=64)
        schema.get(config, "truncated_vocab_size", where, "int", lo=1, hi=V, null=True, default=None)
        for name in ("medusa_fc_bias", "original_lm_head"):
            schema.get(config, name, where, "bool", default=False)
    else:
        schema.get(config, "medusa_num_heads", where, "int", lo=1, hi=16)
        schema.get(config, "medusa_num_layers", where, "int", lo=0, hi=64)
    return config


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def export(artifact_dir: str | Path, stack: str, out: str | Path, target=None,
           num_speculative_tokens: int | None = None, verify: bool = True, *, overwrite: bool = False,
           verifier: str | None = None):
    """`Method.export` of Medusa heads (layouts/heads.py does the rest). A Medusa-2 artifact's heads belong to
    the adapted target, so its merged copy is exported beside them and serve.md names it.

    The draft length is the number of heads (None: taken from them). vLLM sizes its Medusa model by
    num_speculative_tokens (MedusaConfig.num_lookahead_tokens sets num_heads): more tokens than heads would
    build a head the checkpoint does not fill (random weights, drafting garbage), fewer would drop trained
    heads, so any other value is refused."""
    from draftsmith.layouts.heads import HeadExport, export_heads

    artifact_dir = Path(artifact_dir)
    manifest, cfg, state, tree = read_medusa_artifact(artifact_dir, target)
    heads = cfg["num_heads"]
    if num_speculative_tokens is None:
        num_speculative_tokens = heads
    elif num_speculative_tokens != heads:
        raise ConfigError(f"{artifact_dir / 'config.json'}: num_heads is {heads} but num_speculative_tokens "
                          f"{num_speculative_tokens} was asked: Medusa drafts one token per head (vLLM would build "
                          f"{num_speculative_tokens} heads from {heads} trained ones); omit it or pass {heads}")

    def write(tmp: Path, fmt: str, target, target_ref: str, out: Path, k: int) -> str:
        from draftsmith.medusa.medusa2 import adapted_target, has_adapter

        if has_adapter(artifact_dir):
            if target is None:
                raise ConfigError(f"{artifact_dir} is a Medusa-2 artifact: give the target, whose adapted "
                                  "(merged) copy is exported next to the heads")
            merged = adapted_target(target, artifact_dir)
            merged.model.save_pretrained(tmp / "adapted_target", safe_serialization=True)
            target.tokenizer.save_pretrained(tmp / "adapted_target")
            target_ref = str(out / "adapted_target")
        write_layout(tmp, fmt, cfg, state, target_ref)
        if tree is not None:  # the calibrated tree, for the stacks that take one (TensorRT-LLM's medusa_choices)
            atomic_write_json(tmp / "tree.json", {"paths": tree})
        return target_ref

    def serve(stack: str, out: Path, target_ref: str, k: int) -> str:
        # the shape that engine serves (`evaluate --as-served` decodes it), stated under its launch command
        shape = served(stack, artifact_dir, k, {}) if stack in ENGINE_NAMES else None
        return serve_text(stack, cfg, tree, out, target_ref, k) + (f"\n{shape.text()}\n" if shape else "")

    plan = HeadExport("medusa", "Medusa heads", STACK_FORMATS, manifest, write, serve,
                      guard={"medusa_choices": tree} if tree is not None else {},
                      unsupported={s: f"{artifact_dir}: {why}" for s, why in UNSUPPORTED.items()})
    return export_heads(plan, artifact_dir, stack, out, target,
                        num_speculative_tokens, verify, overwrite=overwrite, verifier=verifier)


def serve_text(stack: str, cfg: dict, tree: list | None, out: Path, target_ref: str, k: int) -> str:
    """serve.md's body: how `stack` launches these heads."""
    if stack == "vllm":
        return (f"{vllm_serve(target_ref, 'medusa', out, k)}\n\nvLLM's Medusa proposes a top-1 chain (one token per "
                "head); the calibrated tree is in draftsmith.json (`medusa_choices`) for stacks that take one "
                "(TensorRT-LLM).\n")
    if stack == "trtllm":
        return medusa_engine_flow(out, target_ref, cfg, tree)
    return (f"FasterDecoding Medusa layout (`{MEDUSA_WEIGHTS}`, the layout Medusa's own `MedusaModel` and "
            f"TensorRT-LLM's converter read), for base model `{target_ref}`.\n\n"
            f"Calibrated tree (`medusa_choices`): {json.dumps(tree)}\n")


def medusa_engine_flow(out, target_ref: str, cfg: dict, tree: list | None) -> str:
    """TensorRT-LLM's PyTorch backend (`trtllm-serve`, the LLM API's default) refuses Medusa; its TensorRT
    engine flow serves it: convert the base model with the heads into a TensorRT-LLM checkpoint, build an
    engine with Medusa decoding, run it with the calibrated tree."""
    K = cfg["num_heads"]
    choices = json.dumps(tree or [[0] * d for d in range(1, K + 1)])
    convert = (f"python examples/medusa/convert_checkpoint.py --model_dir {target_ref} \\\n"
               f"  --medusa_model_dir {out} --num_medusa_heads {K} \\\n"
               f"  --output_dir ckpt-medusa --dtype bfloat16")
    build = ("trtllm-build --checkpoint_dir ckpt-medusa --output_dir engine-medusa \\\n"
             "  --gemm_plugin bfloat16 --speculative_decoding_mode medusa --max_batch_size 8")
    run = (f"python examples/run.py --engine_dir engine-medusa --tokenizer_dir {target_ref} \\\n"
           f"  --max_output_len 256 --medusa_choices='{choices}'")
    return ("TensorRT-LLM's PyTorch backend (`trtllm-serve`, the LLM API) does not serve Medusa heads. Its "
            "TensorRT engine flow does (the `examples/medusa` converter of the TensorRT-LLM releases that ship "
            "the TensorRT backend), from this folder (`medusa_lm_head.safetensors` + config.json), run from a "
            "TensorRT-LLM checkout:\n\n"
            f"{fenced(convert)}\n\n{fenced(build)}\n\n"
            "TensorRT-LLM verifies Medusa drafts greedily; `medusa_choices` is the tree draftsmith calibrated "
            "(tree.json):\n\n"
            f"{fenced(run)}\n")


def vllm_heads_problem(export_dir: Path, k: int) -> str | None:
    """vLLM's Medusa drafts one token per head: a chain longer than the heads cannot be served."""
    heads = read_layout_config(export_dir, VLLM_FORMAT)["num_heads"]
    if k > heads:
        return f"{export_dir / 'config.json'}: num_heads {heads} < k {k}: vLLM's Medusa drafts one token per head"
    return None


def served(engine: str, artifact_dir: Path, k: int | None, options: dict) -> Served:
    """`Serving.shape`: vLLM's Medusa drafts each head's argmax, a chain of k <= heads (one token per head);
    TensorRT-LLM verifies the calibrated tree export writes as `medusa_choices` (the heads' chain without one),
    every node every step, uncut; SGLang serves no Medusa heads."""
    from draftsmith.medusa.model import read_heads_config, read_tree

    if engine in UNSUPPORTED:
        raise ConfigError(f"--as-served {engine}: {artifact_dir}: {UNSUPPORTED[engine]}")
    manifest = artifact.load_manifest(artifact_dir, kind="medusa")
    config = read_heads_config(artifact_dir, artifact.target_vocab(manifest))
    heads = config.num_heads
    if engine == "vllm":
        k = heads if k is None else k
        if not 1 <= k <= heads:
            raise ConfigError(f"--as-served vllm: {artifact_dir}: {heads} Medusa heads draft at most {heads} tokens "
                              f"a step (one per head), got k {k}")
        return Served("vllm", "medusa", "chain", k, params={"num_speculative_tokens": k}, opts={"tree": False})
    tree = read_tree(artifact_dir, heads, config.out_size)
    chain = [(0,) * d for d in range(1, heads + 1)]  # export's medusa_choices without a calibrated tree
    paths = [tuple(p) for p in tree.paths] if tree is not None and tree.paths else chain
    depth = max(len(p) for p in paths)
    branching = tuple(1 + max(p[d] for p in paths if len(p) > d) for d in range(depth))
    params = {"medusa_choices": [list(p) for p in paths]}
    if all(b == 1 for b in branching):
        return Served("trtllm", "medusa", "chain", depth, params=params, opts={"tree": False})
    return Served("trtllm", "medusa", "tree", depth, branching=branching, max_nodes=len(paths), params=params,
                  opts={"tree": True})


SERVING = Serving(vllm={VLLM_FORMAT: VllmServe("medusa", check=vllm_heads_problem)}, shape=served)  # `Method.serving`


def reimport(export_dir: Path, guard: dict):
    """`Method.reimport`: (config, state, writer of tree.json) of a vLLM or FasterDecoding Medusa export;
    None when `export_dir` is not one."""
    if guard.get("format") not in (VLLM_FORMAT, MEDUSA_FORMAT) and not (Path(export_dir) / MEDUSA_WEIGHTS).is_file():
        return None
    cfg, state = read_layout(export_dir)
    tree = guard.get("medusa_choices")

    def writer(tmp: Path) -> None:
        if tree is not None:
            atomic_write_json(tmp / "tree.json", {"paths": tree, "expected_length": 0.0})

    return cfg, state, writer


def to_vllm(cfg: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    K, L = cfg["num_heads"], cfg["num_layers"]
    shared = bool(cfg.get("share_lm_head"))
    out = {}
    for h in range(K):
        for ell in range(L):
            out[f"blocks.{h}.layers.{ell}.weight"] = state[f"heads.{h}.blocks.{ell}.linear.weight"]
            out[f"blocks.{h}.layers.{ell}.bias"] = state[f"heads.{h}.blocks.{ell}.linear.bias"]
        if not shared or h == 0:
            # shared heads: ONE copy of the target's lm_head, which vLLM (`original_lm_head`) loads from
            # lm_heads.0 into the single lm_head every head projects with (and slices by token_map itself)
            out[f"lm_heads.{h}.weight"] = state[f"heads.{h}.lm_head.weight"]
    n = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if cfg.get("draft_vocab_size"):
        out["token_map"] = torch.nonzero(state["t2d"]).flatten().to(torch.long)  # = arange(N) + d2t
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "truncated_vocab_size": n,
        "num_heads": K,
        "num_hidden_layers": L,
        "medusa_fc_bias": True,  # draftsmith's ResBlocks have a bias; without this vLLM builds bias-free layers
        "original_lm_head": shared,
        "torch_dtype": dtype_name(state_dtype(state)),
    }
    return config, out


def to_medusa_lm_head(cfg: dict, state: dict[str, torch.Tensor], base: str) -> tuple[dict, dict[str, torch.Tensor]]:
    K, L = cfg["num_heads"], cfg["num_layers"]
    if cfg.get("draft_vocab_size"):
        raise ConfigError(f"the {MEDUSA_FORMAT} layout (TensorRT-LLM, FasterDecoding) has no token map: heads over a "
                          f"draft vocabulary of {cfg['draft_vocab_size']} tokens export to {VLLM_FORMAT} only; "
                          "train with draft_vocab_size: null for this layout")
    out = {}
    for h in range(K):
        for ell in range(L):
            out[f"{h}.{ell}.linear.weight"] = state[f"heads.{h}.blocks.{ell}.linear.weight"]
            out[f"{h}.{ell}.linear.bias"] = state[f"heads.{h}.blocks.{ell}.linear.bias"]
        out[f"{h}.{L}.weight"] = state[f"heads.{h}.lm_head.weight"]
    config = {
        "medusa_num_heads": K,
        "medusa_num_layers": L,
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "base_model_name_or_path": base,
        "torch_dtype": dtype_name(state_dtype(state)),
    }
    return config, out


def write_layout(tmp: Path, fmt: str, cfg: dict, state: dict[str, torch.Tensor], base: str) -> dict:
    if fmt == VLLM_FORMAT:
        config, tensors = to_vllm(cfg, state)
        weights = "model.safetensors"
    else:
        config, tensors = to_medusa_lm_head(cfg, state, base)
        weights = MEDUSA_WEIGHTS
    save_file(artifact.contiguous_state(tensors), str(tmp / weights), metadata={"format": "pt"})
    atomic_write_json(tmp / "config.json", config)
    return config


# --- specs ---------------------------------------------------------------------------------------------
def expected_tensors(fmt: str, config: dict) -> Spec:
    dt = st_dtype(DTYPES[config.get("torch_dtype", "float32")])
    H, V = config["hidden_size"], config["vocab_size"]
    spec: Spec = {}
    if fmt == VLLM_FORMAT:
        K, L = config["num_heads"], config["num_hidden_layers"]
        for h in range(K):
            for ell in range(L):
                spec[f"blocks.{h}.layers.{ell}.weight"] = ((H, H), dt)
                if config.get("medusa_fc_bias"):
                    spec[f"blocks.{h}.layers.{ell}.bias"] = ((H,), dt)
            if config.get("original_lm_head"):  # one full-vocabulary copy of the target's lm_head
                if h == 0:
                    spec["lm_heads.0.weight"] = ((V, H), dt)
            else:
                spec[f"lm_heads.{h}.weight"] = ((config.get("truncated_vocab_size") or V, H), dt)
        if (config.get("truncated_vocab_size") or V) < V:
            spec["token_map"] = ((config["truncated_vocab_size"],), "I64")
    else:
        K, L = config["medusa_num_heads"], config["medusa_num_layers"]
        for h in range(K):
            for ell in range(L):
                spec[f"{h}.{ell}.linear.weight"] = ((H, H), dt)
                spec[f"{h}.{ell}.linear.bias"] = ((H,), dt)
            spec[f"{h}.{L}.weight"] = ((V, H), dt)
    return spec


def verify_layout(out: Path, fmt: str, expect_vocab: int | None = None) -> list[str]:
    config = read_layout_config(out, fmt)
    weights = out / ("model.safetensors" if fmt == VLLM_FORMAT else MEDUSA_WEIGHTS)
    problems = []
    if fmt == VLLM_FORMAT:
        if config.get("model_type") != "medusa":
            problems.append(f"config model_type is {config.get('model_type')!r}, vLLM needs 'medusa'")
        if not config.get("medusa_fc_bias"):
            problems.append("config lacks medusa_fc_bias: true (vLLM would build bias-free ResBlocks)")
    else:
        for key in ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"):
            if key not in config:
                problems.append(f"config lacks {key}")
        check(out, problems)
    if expect_vocab is not None and config.get("vocab_size") != expect_vocab:
        problems.append(f"config vocab_size {config.get('vocab_size')} != target vocab_size {expect_vocab}")
    spec = expected_tensors(fmt, config)
    problems += compare(read_header(weights), spec)
    check(out, problems)
    return [f"{len(spec)} tensors match the {fmt} spec (names, shapes, dtype); no unexpected names"]


# --- back into draftsmith -------------------------------------------------------------------------------
def read_layout(out: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A vLLM or FasterDecoding Medusa folder -> (draftsmith MedusaHeadsConfig dict, draftsmith state)."""
    out = Path(out)
    config = read_layout_config(out)
    state: dict[str, torch.Tensor] = {}
    if config.get("model_type") == "medusa":
        K, L = config["num_heads"], config["num_hidden_layers"]
        t = read_tensors(out / "model.safetensors")
        for h in range(K):
            for ell in range(L):
                state[f"heads.{h}.blocks.{ell}.linear.weight"] = t[f"blocks.{h}.layers.{ell}.weight"]
                bias = t.get(f"blocks.{h}.layers.{ell}.bias")
                state[f"heads.{h}.blocks.{ell}.linear.bias"] = (
                    bias if bias is not None
                    else torch.zeros(config["hidden_size"], dtype=t[f"blocks.{h}.layers.{ell}.weight"].dtype))
            # original_lm_head: every head projects with the one copy in lm_heads.0
            state[f"heads.{h}.lm_head.weight"] = t["lm_heads.0.weight" if config.get("original_lm_head") else
                                                   f"lm_heads.{h}.weight"]
        n = config.get("truncated_vocab_size") or config["vocab_size"]
        if n < config["vocab_size"]:
            token_map = t["token_map"].long()
            state["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool)
            state["t2d"][token_map] = True
            state["d2t"] = token_map - torch.arange(n)
    elif "medusa_num_heads" in config:
        K, L = config["medusa_num_heads"], config["medusa_num_layers"]
        t = read_tensors(out / MEDUSA_WEIGHTS)
        for h in range(K):
            for ell in range(L):
                state[f"heads.{h}.blocks.{ell}.linear.weight"] = t[f"{h}.{ell}.linear.weight"]
                state[f"heads.{h}.blocks.{ell}.linear.bias"] = t[f"{h}.{ell}.linear.bias"]
            state[f"heads.{h}.lm_head.weight"] = t[f"{h}.{L}.weight"]
    else:
        raise ArtifactError(f"{out}: not a vLLM or FasterDecoding Medusa folder")
    cfg = {"hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"], "num_heads": K,
           "num_layers": L, "share_lm_head": False, "draft_vocab_size": None}
    if "d2t" in state:
        cfg["draft_vocab_size"] = int(state["d2t"].numel())
    return cfg, state


# --- verifiers (re-read from disk; the format is named in draftsmith.json) ------------------------------


def tree_problems(out: Path) -> list[str]:
    """The tree written beside the heads (draftsmith.json `medusa_choices`, tree.json) may only use heads
    that exist: a path of depth d reads head d-1, and a stack given a deeper tree indexes past its heads."""
    from draftsmith.medusa.model import read_tree_or_problem, tree_problem

    config = read_layout_config(out)
    heads = config.get("num_heads", config.get("medusa_num_heads"))
    vocab = config.get("truncated_vocab_size") or config["vocab_size"]
    _, unreadable = read_tree_or_problem(out, heads, vocab, noun="export")
    problems = [unreadable] if unreadable else []
    choices = read_guard(out).get("medusa_choices")
    if choices:
        problem = tree_problem(choices, heads, vocab, f"{out / 'draftsmith.json'} medusa_choices", noun="export")
        problems += [problem] if problem else []
    return problems


def _verify(out, fmt: str) -> list[str]:
    out = Path(out)
    checks = verify_layout(out, fmt, guard_vocab_size(out))
    check(out, tree_problems(out))
    return checks + ["the Medusa tree uses only the exported heads"]


@register_verifier(VLLM_FORMAT)
def _verify_vllm(out, target=None) -> list[str]:
    return _verify(out, VLLM_FORMAT)


@register_verifier(MEDUSA_FORMAT)
def _verify_medusa(out, target=None) -> list[str]:
    return _verify(out, MEDUSA_FORMAT)
