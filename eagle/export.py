"""EAGLE heads in the layouts the serving stacks read, and the reader back into a draftsmith artifact.

An EAGLE head (Li et al. 2024 "EAGLE"; 2025 "EAGLE-3") is one Llama decoder layer fed by the target's
features. EAGLE-1: fc([embed(x_t); f_t]) (2H -> H, with bias in the original) then the layer without
its input_layernorm; the target's lm_head gives the logits. EAGLE-3: g = fc([h_low; h_mid; h_high])
(3H -> H, no bias); the first layer normalises embed(x_t) (input_layernorm) and g (hidden_norm),
attends over [embeds; hidden] (q/k/v take 2H), then norm + its own lm_head over a reduced draft vocab
of N tokens with target_id = draft_id + d2t[draft_id].

Canonical names used inside this module (the stacks' names are derived from them):

    fc.weight [H, n·H]  fc.bias [H] (EAGLE-1)   layer.<HF LlamaDecoderLayer names>  layer.hidden_norm.weight
    norm.weight [H]     lm_head.weight [N, H]   d2t [N] int64   t2d [V] bool

Layouts:
    speculators-eagle3 (vLLM)   layers.0.*, fc, norm, lm_head, d2t, t2d; config.json `speculators_config`,
                                `transformer_layer_config`, explicit norm_before_residual and EAGLE-3.1 switches
    eagle3-midlayer (SGLang LlamaForCausalLMEagle3, TensorRT-LLM Eagle3)   midlayer.*, fc, norm, lm_head, d2t;
                                EAGLE-3.1: fc_norm.k (config `fc_norm`), `norm_output`, and for TensorRT-LLM
                                input_norm (`eagle_config.norm_before_fc`); docs/export.md says which loader
                                version reads which
    vllm-eagle1                 layers.0.* (no input_layernorm), fc.weight only: vLLM builds fc WITHOUT a
                                bias and drops an fc.bias silently, so a non-zero bias is refused
    eagle1                      layers.0.*, fc.weight + fc.bias (SGLang LlamaForCausalLMEagle, TensorRT-LLM):
                                nn.Linear with bias, a missing bias would stay at random init

Aux hidden-state layer ids (EAGLE-3). draftsmith (capture/layers.py): id i = OUTPUT of decoder layer i
(pre-final-norm). vLLM (models/llama.py: `if idx in aux_hidden_state_layers: append(hidden_states +
residual)` BEFORE running layer idx) and speculators capture the residual stream ENTERING layer id, so
vLLM id = draftsmith id + 1. SGLang (`layers_to_capture = [val + 1 for val in layer_ids]`, then the same
capture-before-layer) and TensorRT-LLM (capture after layer id) take output-of-layer ids: SGLang id =
TensorRT-LLM id = draftsmith id.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith import artifact, schema
from draftsmith.capture.layers import resolve_layers
from draftsmith.eagle import variants
from draftsmith.eagle.variants import variant
from draftsmith.errors import ArtifactError, ConfigError
from draftsmith.layouts.common import fenced, read_guard, state_dtype
from draftsmith.layouts.serving import (
    ENGINE_NAMES,
    Served,
    Serving,
    VllmServe,
    sglang_serve,
    trtllm_serve,
    vllm_serve,
)
from draftsmith.layouts.verify import (
    Spec,
    VerificationError,
    check,
    compare,
    guard_vocab_size,
    read_header,
    read_tensors,
    register_verifier,
    st_dtype,
    vocab_map_problems,
)
from draftsmith.outputs import atomic_write_json
from draftsmith.targets.device import dtype_name
from draftsmith.targets.families import attention_dims, full_attention_rope, rope_fields

SPECULATORS = "speculators-eagle3"
# EAGLE-3.1's options (eagle/model.py EagleConfig), written explicitly into the speculators layout
EAGLE31 = ("norm_before_fc", "fc_norm", "norm_output")
MIDLAYER = "eagle3-midlayer"
VLLM_EAGLE1 = "vllm-eagle1"
EAGLE1 = "eagle1"
# the layout each serving stack reads an EAGLE-3 / EAGLE-1 head in, and why a stack takes none
STACK_FORMATS = {
    "eagle3": {"vllm": SPECULATORS, "sglang": MIDLAYER, "trtllm": MIDLAYER, "hf": SPECULATORS},
    "eagle1": {"vllm": VLLM_EAGLE1, "sglang": EAGLE1, "trtllm": EAGLE1},
}
UNSUPPORTED = {"eagle1": {"hf": "Hugging Face has no EAGLE-1 loader; export EAGLE-1 heads for vllm, sglang or trtllm"}}
VLLM_METHOD = {SPECULATORS: "eagle3", VLLM_EAGLE1: "eagle"}  # vLLM's speculative method for each vLLM layout
# what the loaders of the midlayer layout read of EAGLE-3.1 (docs/export.md: which version, which file):
# SGLang's llama_eagle3.py builds fc_norm.k and feeds back the normalised output (`fc_norm`, `norm_output`), but
# has no input_norm; TensorRT-LLM's Eagle3DraftModel reads all three (`norm_before_fc` inside `eagle_config`)
MIDLAYER_READS = {"sglang": ("fc_norm", "norm_output"), "trtllm": ("norm_before_fc", "fc_norm", "norm_output")}

LAYER_PREFIXES = ("midlayer.", "layers.0.", "layer.", "decoder.", "decoder_layer.", "block.")
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings", "hidden_act", "rope_theta", "rope_parameters",
                "rope_scaling", "attention_bias", "mlp_bias")
AUX_KEYS = ("aux_layers", "layers", "target_layers", "layer_ids", "feature_layers", "eagle_aux_hidden_state_layer_ids")


# --- draftsmith artifact -> canonical --------------------------------------------------------------
def canonical_name(name: str) -> str | None:
    """Map an artifact tensor name to the canonical one (None: not exported, e.g. a frozen embedding copy)."""
    name = name.removeprefix("model.").removeprefix("eagle.")
    if "embed_tokens" in name:
        return None
    for p in LAYER_PREFIXES:
        if name.startswith(p):
            return "layer." + name[len(p):]
    if name.startswith(("fc.", "norm.", "lm_head.", "input_norm.", "fc_norm.")) or name in ("d2t", "t2d"):
        return name
    return "?" + name  # unknown: reported by the spec check rather than dropped


def read_eagle_artifact(path: str | Path, target=None) -> tuple[dict, dict, dict[str, torch.Tensor], dict[str, str]]:
    """(manifest, canonical config, canonical state, {canonical name: artifact name})."""
    path = Path(path)
    manifest, raw = artifact.load_artifact(path, kind="eagle", target=target)
    acfg = schema.read_doc(path / "config.json") if (path / "config.json").is_file() else {}
    state, names = {}, {}
    for k, v in raw.items():
        c = canonical_name(k)
        if c is not None:
            state[c], names[c] = v, k
    tcfg = target.text_config.to_dict() if target is not None else {}
    src = {**tcfg, **(acfg.get("layer_config") or {}), **{k: v for k, v in acfg.items() if v is not None}}
    cfg = {k: src[k] for k in LAYER_FIELDS if src.get(k) is not None}
    cfg.update(rope_fields(full_attention_rope(src)))  # every spelling, one base (families.rope_fields)
    cfg["layer_model_type"] = (acfg.get("layer_config") or {}).get("model_type") or acfg.get("model_type") or "llama"
    if "fc.weight" not in state:  # every EAGLE head has its feature projection
        raise ArtifactError(f"{path / artifact.WEIGHTS}: missing tensor 'fc.weight' (an EAGLE head's feature "
                            f"projection; it holds {', '.join(sorted(raw)[:3])}{' ...' if len(raw) > 3 else ''})")
    H = state["fc.weight"].shape[0]
    cfg["hidden_size"] = H
    cfg.setdefault("head_dim", H // cfg["num_attention_heads"])
    fin = state["fc.weight"].shape[1]
    v = variant(int(acfg.get("version") or acfg.get("eagle_version") or (1 if fin == 2 * H else 3)))
    cfg["version"] = v.number
    cfg["vocab_size"] = artifact.target_vocab(manifest)
    if cfg["vocab_size"] is None:
        raise ArtifactError(f"{path / artifact.MANIFEST}: field 'target.vocab_size' missing (the head's vocabulary)")
    if v.draft_vocab and "lm_head.weight" not in state:
        raise ArtifactError(f"{path}: an {v.name} artifact needs its own lm_head.weight")
    if v.draft_vocab:
        cfg["draft_vocab_size"] = int(state["lm_head.weight"].shape[0])
    if v.fuse_layers:
        n_layers = (manifest["target"].get("architecture") or {}).get("num_hidden_layers") or (
            target.num_layers if target is not None else None)
        aux = next((acfg[k] for k in AUX_KEYS if acfg.get(k)), None)
        if aux is None:
            if n_layers is None:
                raise ConfigError(f"{path}: config.json names no aux layers and the target depth is unknown")
            aux = v.default_layers(n_layers)
        cfg["aux_layers"] = resolve_layers(list(aux), n_layers) if n_layers else list(aux)
        if fin != len(cfg["aux_layers"]) * H:
            raise ArtifactError(f"{path}: fc takes {fin} features but {len(cfg['aux_layers'])} aux layers of {H}")
    if v.attention_input == "concat":
        cfg["norm_before_residual"] = bool(acfg.get("norm_before_residual", False))
        cfg.update({k: bool(acfg.get(k, False)) for k in EAGLE31})
    return manifest, cfg, state, names


# --- canonical -> layouts ----------------------------------------------------------------------------
def export(artifact_dir: str | Path, stack: str, out: str | Path, target=None,
           num_speculative_tokens: int | None = None, verify: bool = True, *, overwrite: bool = False,
           verifier: str | None = None):
    """`Method.export` of EAGLE heads (layouts/heads.py does the rest): EAGLE-1 and EAGLE-3 are two layout
    families, and every stack's drafter layer is a Llama layer."""
    from draftsmith.layouts.heads import HeadExport, export_heads
    from draftsmith.targets.families import FAMILIES

    artifact_dir = Path(artifact_dir)
    num_speculative_tokens = 4 if num_speculative_tokens is None else num_speculative_tokens
    manifest, cfg, state, names = read_eagle_artifact(artifact_dir, target)
    if not getattr(FAMILIES.get(cfg["layer_model_type"]), "llama_layer", False):
        raise ConfigError(f"{artifact_dir}: this EAGLE head's decoder layer is a {cfg['layer_model_type']} layer; "
                          "the EAGLE drafters of vLLM, SGLang, TensorRT-LLM and speculators are Llama layers: "
                          "retrain it with draft_layer: llama")

    def write(tmp: Path, fmt: str, target, target_ref: str, out: Path, k: int) -> str:
        target_arch = list(getattr(target.config, "architectures", None) or []) if target is not None else []
        write_layout(tmp, fmt, cfg, state, target_ref, target_arch, k)
        return target_ref

    guard = {"eagle": {"version": cfg["version"], "source_names": names, "aux_layers_draftsmith": cfg.get("aux_layers"),
                       "target_rope_theta": cfg["rope_theta"]}}
    layout = variant(cfg["version"]).layout
    unsupported = {**UNSUPPORTED.get(layout, {}), **{s: f"{artifact_dir}: {why}" for s, why in refusals(cfg).items()}}
    formats = {s: f for s, f in STACK_FORMATS[layout].items() if s not in unsupported}
    what = "an EAGLE-3 head" if layout == "eagle3" else "an EAGLE-1 head"

    def serve(stack: str, out: Path, target_ref: str, k: int) -> str:
        # the shape that engine serves (`evaluate --as-served` decodes it), stated under its launch command
        shape = served(stack, artifact_dir, k, {}) if stack in ENGINE_NAMES else None
        return serve_text(stack, layout, cfg, out, target_ref, k) + (f"\n{shape.text()}\n" if shape else "")

    plan = HeadExport(layout, what, formats, manifest, write, serve, guard=guard, unsupported=unsupported)
    return export_heads(plan, artifact_dir, stack, out, target, num_speculative_tokens, verify, overwrite=overwrite,
                        verifier=verifier)


def refusals(cfg: dict) -> dict[str, str]:
    """stack -> why it would load this head but compute something else than was trained (none: every stack of
    the head's layout family computes it as trained)."""
    out = {}
    if cfg.get("norm_before_residual"):  # both layers keep the un-normalised feature as the residual
        for stack, name in (("sglang", "SGLang"), ("trtllm", "TensorRT-LLM")):
            out[stack] = (f"this EAGLE-3 head was trained with norm_before_residual: true, which {name}'s EAGLE-3 "
                          "layer does not honour (it adds the un-normalised feature): export it for vllm or hf, or "
                          "retrain with norm_before_residual: false")
    for stack, reads in MIDLAYER_READS.items():
        unread = [k for k in EAGLE31 if cfg.get(k) and k not in reads]
        if unread and stack not in out:
            out[stack] = (f"this EAGLE-3.1 head ({', '.join(unread)}) needs a norm {stack}'s EAGLE-3 loader does not "
                          "build (docs/export.md): export it for vllm or hf (speculators layout)")
    return out


def serve_text(stack: str, layout: str, cfg: dict, out: Path, target_ref: str, k: int) -> str:
    """serve.md's body: how `stack` launches an EAGLE head of `layout` (eagle3 / eagle1)."""
    eagle3 = layout == "eagle3"
    on = [key for key in EAGLE31 if cfg.get(key)]
    if stack == "vllm":
        text = f"{vllm_serve(target_ref, VLLM_METHOD[STACK_FORMATS[layout]['vllm']], out, k)}\n"
        if eagle3:
            text += (f"\nThe target's aux hidden states are taken at vLLM layer ids {aux_ids(cfg, 'vllm')} "
                     "(config.json "
                     f"`eagle_aux_hidden_state_layer_ids`; vLLM id = draftsmith id + 1: vLLM captures the residual "
                     f"stream entering a layer; draftsmith ids {cfg['aux_layers']} name layer outputs).\n")
        return text
    if stack == "sglang":
        steps, topk, tokens = sglang_tree(k, {})
        flags = (f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} "
                 f"--speculative-num-draft-tokens {tokens}")
        text = f"{sglang_serve(target_ref, 'EAGLE3' if eagle3 else 'EAGLE', out, flags)}\n"
        if eagle3:
            text += (f"\nAux hidden states at SGLang layer ids {aux_ids(cfg, 'sglang')} (config.json "
                     f"`eagle_config.eagle_aux_hidden_state_layer_ids`; SGLang takes output-of-layer ids and adds "
                     f"1 internally, so they equal draftsmith's; vLLM's ids are one higher).\n")
        if on:
            text += (f"\nEAGLE-3.1 ({', '.join(on)}): SGLang's `llama_eagle3.py` reads these since its PR #24663 "
                     "(merged 2026-05); an older SGLang loads the head without them and drafts a different function.\n")
        return text
    if stack == "trtllm":
        options = ([f"decoding_type: {'Eagle3' if eagle3 else 'Eagle'}", f"max_draft_len: {k}"]
                   + ([f"eagle3_layers_to_capture: {json.dumps(aux_ids(cfg, 'trtllm'))}"] if eagle3 else []))
        text = trtllm_serve(target_ref, out, options)
        if on:
            text += (f"\nEAGLE-3.1 ({', '.join(on)}): TensorRT-LLM's `Eagle3DraftModel` reads `fc_norm` and "
                     "`norm_output` since its PR #14988 (merged 2026-06) and `eagle_config.norm_before_fc` since its "
                     "PR #12561; an older TensorRT-LLM loads the head without them.\n")
        return text
    code = (f"from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig\n"
            f"config = Eagle3SpeculatorConfig.from_pretrained('{out}')\n"
            f"config.transformer_layer_config._attn_implementation = 'sdpa'  # flex attention needs a GPU\n"
            f"model = Eagle3DraftModel.from_pretrained('{out}', config=config)\n"
            f"model.load_verifier_weights()  # embeddings from the verifier: {target_ref}")
    return f"The speculators (transformers-based) EAGLE-3 format:\n\n{fenced(code, 'python')}\n"


SGLANG_TOPK = 4  # the EAGLE tree serve.md gives SGLang: topk 4, num_steps k, num_draft_tokens 2k + 2


def sglang_tree(k: int, options: dict) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) of SGLang's EAGLE tree: serve.md's, or the `options` given."""
    steps = int(options.get("num_steps", k))
    topk = int(options.get("topk", SGLANG_TOPK))
    return steps, topk, int(options.get("num_draft_tokens", steps + 1 if topk == 1 else 2 * steps + 2))


def served(engine: str, artifact_dir: Path, k: int | None, options: dict) -> Served:
    """`Serving.shape`: vLLM and TensorRT-LLM (what export writes for it: `max_draft_len`, no tree) draft an EAGLE
    head's argmax chain of k; SGLang its tree (eagle_worker: the root's top `topk`, then each step the `topk` best
    of their topk x topk children, for `num_steps` steps; the best num_draft_tokens - 1 nodes are verified), which
    is draftsmith's EAGLE-2 tree of depth num_steps, topk, max_nodes num_draft_tokens - 1, uncut."""
    manifest = artifact.load_manifest(artifact_dir, kind="eagle")
    layout = artifact_layout(manifest)
    acfg = schema.read_doc(artifact_dir / "config.json") if (artifact_dir / "config.json").is_file() else {}
    why = {**UNSUPPORTED.get(layout, {}), **refusals({k2: acfg.get(k2) for k2 in ("norm_before_residual", *EAGLE31)})}
    if engine in why:
        raise ConfigError(f"--as-served {engine}: {artifact_dir}: {why[engine]}")
    k = 4 if k is None else k
    eagle3 = layout == "eagle3"
    if engine == "sglang":
        steps, topk, tokens = sglang_tree(k, options)
        most = 1 + topk + (steps - 1) * topk * topk  # the root and every node the steps create
        if topk < 1 or steps < 1 or (topk == 1 and tokens != steps + 1) or not 2 <= tokens <= most:
            raise ConfigError(f"--as-served sglang: num_steps {steps}, topk {topk}, num_draft_tokens {tokens} is no "
                              "tree SGLang builds (topk 1 needs num_draft_tokens = num_steps + 1)")
        params = {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens}
        method = "EAGLE3" if eagle3 else "EAGLE"
        if topk == 1:
            return Served("sglang", method, "chain", steps, params=params, opts={"tree": False, "depth": steps})
        return Served("sglang", method, "tree", steps, branching=(topk,) * steps, max_nodes=tokens - 1, params=params,
                      opts={"tree": True, "depth": steps, "topk": topk, "max_nodes": tokens - 1, "calibrate": False})
    if engine == "trtllm":
        return Served("trtllm", "Eagle3" if eagle3 else "Eagle", "chain", k, params={"max_draft_len": k},
                      opts={"tree": False, "depth": k})
    method = VLLM_METHOD[STACK_FORMATS[layout]["vllm"]]
    return Served("vllm", method, "chain", k, params={"num_speculative_tokens": k}, opts={"tree": False, "depth": k})


def artifact_layout(manifest: dict) -> str:
    """`Serving.layout`: eagle3 / eagle1, the artifact's version (the name vLLM's measured table uses)."""
    version = (manifest.get("config") or {}).get("version")
    return "eagle1" if version in (1, "eagle1") else "eagle3"


def reimport(export_dir: Path, guard: dict):
    """`Method.reimport`: (config, state under the artifact's own names, None) of a speculators, midlayer or
    EAGLE-1 export (draftsmith's, by its draftsmith.json, or another's: every EAGLE layout has the fc that
    joins the features); None when `export_dir` is not one."""
    export_dir = Path(export_dir)
    fmt = guard.get("format")
    if fmt is not None and fmt not in (SPECULATORS, MIDLAYER, VLLM_EAGLE1, EAGLE1):
        return None
    if fmt is None:
        if not (export_dir / "model.safetensors").is_file():
            return None
        if "fc.weight" not in {canonical_name(k) for k in read_header(export_dir / "model.safetensors")}:
            return None
        if "dflash_config" in schema.read_doc(export_dir / "config.json"):  # a block drafter's fc, not a head's
            return None
    names = (guard.get("eagle") or {}).get("source_names")
    cfg, state = read_layout(export_dir, names)
    bias = (names or {}).get("fc.bias", "fc.bias")
    if variant(cfg["version"]).fc_shape(1)[2] and bias not in state:  # vLLM's EAGLE-1 layout: no fc bias (a zero one)
        fc = state[(names or {}).get("fc.weight", "fc.weight")]
        state[bias] = torch.zeros(fc.shape[0], dtype=fc.dtype)
    return head_config(cfg, guard, export_dir), state, None


def head_config(cfg: dict, guard: dict, where: Path) -> dict:
    """A layout's config as the artifact's config.json (eagle/model.py EagleConfig: target_layers, layer_config),
    so that an imported head loads, decodes and trains like one draftsmith wrote. The layout's own fields stay
    beside them (aux_layers)."""
    arch = (guard.get("target") or {}).get("architecture") or {}
    if variant(cfg["version"]).fuse_layers:
        layers = list(cfg["aux_layers"])
    else:  # EAGLE-1 reads the last layer's output
        n = arch.get("num_hidden_layers")
        if n is None:
            raise ConfigError(f"{where}: an EAGLE-1 layout names no feature layer and draftsmith.json no target depth")
        layers = [n - 1]
    layer = {k: cfg[k] for k in LAYER_FIELDS if k in cfg}
    layer.update(model_type="llama", num_hidden_layers=1, vocab_size=cfg["vocab_size"], tie_word_embeddings=False)
    return {**cfg, "target_layers": layers, "layer_config": layer,
            "hidden_size": cfg.get("hidden_size"), "draft_vocab_size": cfg.get("draft_vocab_size")}


def aux_ids(cfg: dict, stack: str) -> list[int]:
    """The aux layer ids in `stack`'s convention (see module docstring)."""
    return [i + 1 for i in cfg["aux_layers"]] if stack == "vllm" else list(cfg["aux_layers"])


def _llama_fields(cfg: dict, dtype: torch.dtype) -> dict:
    out = {k: cfg[k] for k in LAYER_FIELDS if k in cfg}
    out.update(rope_fields(full_attention_rope(cfg)))
    out.update(model_type="llama", num_hidden_layers=1, vocab_size=cfg["vocab_size"], tie_word_embeddings=False,
               torch_dtype=dtype_name(dtype))
    return out


def layout_state(fmt: str, cfg: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "midlayer." if fmt == MIDLAYER else "layers.0."
    out = {}
    for k, v in state.items():
        if k.startswith("layer."):
            out[prefix + k[len("layer."):]] = v
        elif k in ("d2t", "t2d") and cfg.get("draft_vocab_size") == cfg["vocab_size"]:
            continue  # full vocabulary: no maps (speculators registers none, the stacks skip them)
        else:
            out[k] = v
    if fmt == VLLM_EAGLE1:
        bias = out.pop("fc.bias", None)
        if bias is not None and bool(bias.abs().max() > 0):
            raise ConfigError("vLLM's EAGLE-1 builds fc without a bias and would silently drop this head's "
                              "non-zero fc.bias: export for sglang/trtllm, or train with a bias-free fc")
    if fmt == EAGLE1 and "fc.bias" not in out:
        out["fc.bias"] = torch.zeros(cfg["hidden_size"], dtype=state["fc.weight"].dtype)
    if fmt in (VLLM_EAGLE1, EAGLE1):
        out.pop("layers.0.input_layernorm.weight", None)  # EAGLE-1 skips the first layer's input norm
    return out


def layout_config(fmt: str, cfg: dict, dtype: torch.dtype, target_folder: str, target_arch: list[str],
                  k: int) -> dict:
    base = _llama_fields(cfg, dtype)
    if fmt == SPECULATORS:
        from draftsmith import __version__

        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_folder, "architectures": target_arch},
            },
            "transformer_layer_config": {k2: v for k2, v in base.items() if k2 != "torch_dtype"},
            "draft_vocab_size": cfg["draft_vocab_size"],
            "norm_before_residual": bool(cfg["norm_before_residual"]),  # explicit: vLLM defaults it differently
            **{k: bool(cfg.get(k, False)) for k in EAGLE31},  # explicit: speculators' trainer defaults some on
            "target_hidden_size": cfg["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": aux_ids(cfg, "vllm"),
            "torch_dtype": dtype_name(dtype),
            "draftsmith_version": __version__,
        }
    if fmt == MIDLAYER:
        # the EAGLE-3.1 switches explicit (both loaders default them off): `fc_norm` and `norm_output` at the top,
        # where SGLang and TensorRT-LLM read them; `norm_before_fc` also inside eagle_config, where TensorRT-LLM
        # reads it
        return {**base, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg["draft_vocab_size"],
                "target_hidden_size": cfg["hidden_size"], "norm_before_residual": bool(cfg["norm_before_residual"]),
                **{k: bool(cfg.get(k, False)) for k in EAGLE31},
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids(cfg, "sglang"),
                                 "use_aux_hidden_state": True,
                                 "norm_before_fc": bool(cfg.get("norm_before_fc", False))}}
    arch = "EagleLlamaForCausalLM" if fmt == VLLM_EAGLE1 else "LlamaForCausalLMEagle"
    return {**base, "architectures": [arch]}


def write_layout(tmp: Path, fmt: str, cfg: dict, state: dict[str, torch.Tensor], target_folder: str,
                 target_arch: list[str], k: int) -> dict:
    tensors = layout_state(fmt, cfg, state)
    config = layout_config(fmt, cfg, state_dtype(state), target_folder, target_arch, k)
    save_file(artifact.contiguous_state(tensors), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    atomic_write_json(tmp / "config.json", config)
    return config


# --- specs -------------------------------------------------------------------------------------------
def _layer_spec(prefix: str, c: dict, dt: str, first_in: int, concat: bool) -> Spec:
    """The draft layer's tensors; `concat`: the attention reads [norm(embedding); norm(feature)] (the
    variant's attention_input), so the layer holds both norms."""
    H, inter = c["hidden_size"], c["intermediate_size"]
    nh, nkv, hd = attention_dims(c)
    spec = {
        f"{prefix}self_attn.q_proj.weight": ((nh * hd, first_in), dt),
        f"{prefix}self_attn.k_proj.weight": ((nkv * hd, first_in), dt),
        f"{prefix}self_attn.v_proj.weight": ((nkv * hd, first_in), dt),
        f"{prefix}self_attn.o_proj.weight": ((H, nh * hd), dt),
        f"{prefix}mlp.gate_proj.weight": ((inter, H), dt),
        f"{prefix}mlp.up_proj.weight": ((inter, H), dt),
        f"{prefix}mlp.down_proj.weight": ((H, inter), dt),
        f"{prefix}post_attention_layernorm.weight": ((H,), dt),
    }
    if concat:
        spec[f"{prefix}input_layernorm.weight"] = ((H,), dt)
        spec[f"{prefix}hidden_norm.weight"] = ((H,), dt)
    return spec


def expected_tensors(fmt: str, config: dict) -> Spec:
    """The tensors each stack's loader asks for, derived from the config.json written."""
    c = config["transformer_layer_config"] if fmt == SPECULATORS else config
    dt = st_dtype(getattr(torch, config.get("torch_dtype", "float32")))
    H, V = c["hidden_size"], c["vocab_size"]  # typed by read_layout_config
    if fmt in (SPECULATORS, MIDLAYER):
        n_aux = len(config["eagle_aux_hidden_state_layer_ids"] if fmt == SPECULATORS
                    else config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        N = config["draft_vocab_size"]
        th = config.get("target_hidden_size") or H
        prefix = "layers.0." if fmt == SPECULATORS else "midlayer."
        spec = _layer_spec(prefix, c, dt, variants.EAGLE3.attention_width(H), concat=True)
        spec.update({"fc.weight": ((H, n_aux * th), dt), "norm.weight": ((H,), dt), "lm_head.weight": ((N, H), dt)})
        if config.get("norm_before_fc"):
            spec["input_norm.weight"] = ((n_aux * th,), dt)
        if config.get("fc_norm"):
            spec.update({f"fc_norm.{i}.weight": ((th,), dt) for i in range(n_aux)})
        if N != V:
            spec.update({"d2t": ((N,), "I64"), "t2d": ((V,), "BOOL")})
        return spec
    spec = _layer_spec("layers.0.", c, dt, variants.EAGLE1.attention_width(H), concat=False)
    spec["fc.weight"] = ((H, 2 * H), dt)
    if fmt == EAGLE1:
        spec["fc.bias"] = ((H,), dt)
    return spec


def rope_problems(c: dict, expect_theta: float | None) -> list[str]:
    """The draft layer's RoPE base, as every reader sees it: `rope_theta` (SGLang's Llama layer falls back
    to 10000 without it), `rope_parameters` (transformers 5) and `rope_scaling` (vLLM) must agree, and with
    the target's full-attention base."""
    theta = c.get("rope_theta")
    params = c.get("rope_parameters") or {}
    if theta is None:
        return ["config lacks rope_theta (SGLang's Llama layer would use 10000)"]
    problems = []
    if params.get("rope_theta") is not None and float(params["rope_theta"]) != float(theta):
        problems.append(f"rope_theta {theta} != rope_parameters.rope_theta {params['rope_theta']}")
    scaled = params.get("rope_type", "default") != "default"
    if scaled and (c.get("rope_scaling") or {}).get("rope_type") != params.get("rope_type"):
        problems.append(f"rope_scaling does not carry rope_parameters' {params.get('rope_type')} scaling")
    if expect_theta is not None and float(theta) != float(expect_theta):
        problems.append(f"rope_theta {theta} != the target's full-attention RoPE base {expect_theta}")
    return problems


def verify_layout(out: Path, fmt: str, expect_vocab: int | None = None, expect_theta: float | None = None
                  ) -> list[str]:
    config = read_layout_config(out, fmt)
    problems = []
    c = config.get("transformer_layer_config", config)
    if expect_vocab is not None and c.get("vocab_size") != expect_vocab:
        problems.append(f"config vocab_size {c.get('vocab_size')} != target vocab_size {expect_vocab}")
    problems += rope_problems(c, expect_theta)
    if fmt == SPECULATORS:
        for key in ("speculators_config", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
                    "draft_vocab_size", *EAGLE31):
            if key not in config:
                problems.append(f"config lacks {key}")
        ids = config.get("eagle_aux_hidden_state_layer_ids") or []
        if len(set(ids)) != len(ids):
            problems.append(f"aux layer ids {ids} repeat a layer (vLLM/speculators need distinct ids)")
    if fmt == MIDLAYER:
        for key in ("draft_vocab_size", "torch_dtype", "eagle_config", *EAGLE31):
            if key not in config:
                problems.append(f"config lacks {key}")
        if config.get("tie_word_embeddings") is not False:
            problems.append("config must set tie_word_embeddings: false (the head has its own lm_head)")
        inner = (config.get("eagle_config") or {}).get("norm_before_fc", False)
        if bool(inner) != bool(config.get("norm_before_fc")):
            problems.append(f"eagle_config.norm_before_fc {inner} != norm_before_fc {config.get('norm_before_fc')} "
                            "(TensorRT-LLM reads the first, SGLang's refusal the second)")
    check(out, problems)
    spec = expected_tensors(fmt, config)
    problems += compare(read_header(out / "model.safetensors"), spec)
    checks = [f"{len(spec)} tensors match the {fmt} spec (names, shapes, dtype); no unexpected names",
              f"RoPE base {c['rope_theta']} in rope_theta, rope_parameters and rope_scaling"
              + (" (the target's full-attention base)" if expect_theta is not None else "")]
    if "d2t" in spec:
        t = read_tensors(out / "model.safetensors", ["d2t", "t2d"]) if not problems else {}
        if t:
            problems += vocab_map_problems(t["d2t"], t["t2d"], spec["t2d"][0][0], spec["d2t"][0][0])
            checks.append(f"d2t/t2d consistent: nonzero(t2d) == arange({spec['d2t'][0][0]}) + d2t")
    check(out, problems)
    return checks


def read_layout_config(out: str | Path, fmt: str | None = None) -> dict:
    """The one reader of an EAGLE export's config.json, in the layout `fmt` names (None: the one the file says:
    speculators' `speculators_model_type: eagle3`, the midlayer's `eagle_config`, else EAGLE-1): every field
    the verifier and the reader back use, typed and in range, or a FieldError naming the file and field."""
    f = Path(out) / "config.json"
    config = schema.read_doc(f)
    if fmt is None:
        fmt = (SPECULATORS if config.get("speculators_model_type") == "eagle3" else
               MIDLAYER if "eagle_config" in config else EAGLE1)
    layer = "transformer_layer_config." if fmt == SPECULATORS else ""
    V = schema.get(config, f"{layer}vocab_size", f, "int", lo=1, hi=schema.MAX_VOCAB)
    for name in ("hidden_size", "intermediate_size", "num_attention_heads"):
        schema.get(config, layer + name, f, "int", lo=1, hi=schema.MAX_VOCAB)
    for name in ("num_key_value_heads", "head_dim"):
        schema.get(config, layer + name, f, "int", lo=1, hi=schema.MAX_VOCAB, null=True, default=None)
    schema.get(config, layer + "rope_theta", f, "number", lo=0, null=True, default=None)
    for name in ("rope_parameters", "rope_scaling"):
        schema.get(config, layer + name, f, "dict", null=True, default=None)
        schema.get(config, f"{layer}{name}.rope_theta", f, "number", lo=0, null=True, default=None)
        schema.get(config, f"{layer}{name}.rope_type", f, "str", null=True, default=None)
    schema.get(config, "torch_dtype", f, "str", default="float32", choices=("float32", "float16", "bfloat16",
                                                                             "float64"))
    schema.get(config, "target_hidden_size", f, "int", lo=1, hi=schema.MAX_HIDDEN, null=True, default=None)
    if fmt in (SPECULATORS, MIDLAYER):
        aux = ("eagle_aux_hidden_state_layer_ids" if fmt == SPECULATORS
               else "eagle_config.eagle_aux_hidden_state_layer_ids")
        ids = schema.get(config, aux, f, "ints", lo=1 if fmt == SPECULATORS else 0, hi=1024)
        if not ids:
            raise schema.FieldError(f"{f}: field '{aux}' is empty, expected the target layers the head reads")
        schema.get(config, "draft_vocab_size", f, "int", lo=1, hi=V)
        schema.get(config, "norm_before_residual", f, "bool", default=False)
        for name in EAGLE31:
            schema.get(config, name, f, "bool", default=False)
    return config


# --- back into draftsmith -----------------------------------------------------------------------------
def read_layout(out: str | Path, names: dict[str, str] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A speculators / midlayer / EAGLE-1 folder -> (config, state under the artifact's own names when
    `names` (canonical -> artifact, recorded in draftsmith.json) is given, else canonical names)."""
    out = Path(out)
    config = read_layout_config(out)
    tensors = read_tensors(out / "model.safetensors")
    state = {}
    for k, v in tensors.items():
        c = canonical_name(k)
        if c is None:
            continue
        state[(names or {}).get(c, c)] = v
    if config.get("speculators_model_type") == "eagle3":
        tl = config["transformer_layer_config"]
        cfg = {k: tl[k] for k in LAYER_FIELDS if k in tl}
        cfg.update(version=3, draft_vocab_size=config["draft_vocab_size"], vocab_size=tl["vocab_size"],
                   aux_layers=[i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]],
                   norm_before_residual=config["norm_before_residual"],
                   **{k: bool(config.get(k, False)) for k in EAGLE31})
    elif "eagle_config" in config:
        cfg = {k: config[k] for k in LAYER_FIELDS if k in config}
        cfg.update(version=3, draft_vocab_size=config["draft_vocab_size"], vocab_size=config["vocab_size"],
                   aux_layers=list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
                   norm_before_residual=bool(config.get("norm_before_residual", False)),
                   **{k: bool(config.get(k, config["eagle_config"].get(k, False))) for k in EAGLE31})
    else:
        cfg = {k: config[k] for k in LAYER_FIELDS if k in config}
        cfg.update(version=1, vocab_size=config["vocab_size"])
    return cfg, state


# --- verifiers ---------------------------------------------------------------------------------------
def _expected_theta(out: Path, target) -> float | None:
    """The target's full-attention RoPE base: from the target when given, else as recorded at export."""
    if target is not None:
        return full_attention_rope(target.config)["rope_theta"]
    return (read_guard(out).get("eagle") or {}).get("target_rope_theta")


def _make_verifier(fmt: str):
    def verify(out, target=None) -> list[str]:
        out = Path(out)
        checks = verify_layout(out, fmt, guard_vocab_size(out), _expected_theta(out, target))
        if fmt == SPECULATORS and target is not None:
            msg = speculators_check(out, target)
            if msg:
                checks.append(msg)
        return checks
    return register_verifier(fmt)(verify)


for _fmt in (SPECULATORS, MIDLAYER, VLLM_EAGLE1, EAGLE1):
    _make_verifier(_fmt)

# `Method.serving`: what export/'s drivers ask of EAGLE heads. The refusal was measured in vLLM 0.32.0 by
# scripts/vllm_families.py (results/vllm-families/report.json): Gemma3ForCausalLM does not implement vLLM's
# SupportsEagle3, so it cannot hand its aux hidden states out
SERVING = Serving(
    vllm={fmt: VllmServe(method) for fmt, method in VLLM_METHOD.items()},
    layout=artifact_layout,
    shape=served,
    vllm_refuses={("gemma3_text", "eagle3"): "RuntimeError: Model does not support EAGLE3 interface but "
                                             "aux_hidden_state_outputs was requested"},
)


def load_speculators(out: Path, config):
    """speculators' Eagle3DraftModel on an export, with the verifier's embedding (not stored in the export).

    speculators loads a verifier-owned weight only where the parameter is still NaN, its mark for "never
    loaded"; under transformers 5 `from_pretrained` leaves such a parameter as uninitialised memory rather
    than NaN, so the embedding would keep whatever the memory held. Marking it NaN first restores the rule."""
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(str(out), config=config).eval()
    with torch.no_grad():
        model.embed_tokens.weight.fill_(float("nan"))
    model.load_verifier_weights()
    if bool(model.embed_tokens.weight.isnan().any()):
        raise VerificationError(f"{out}: speculators found no embedding in the verifier "
                                f"{config.speculators_config.verifier.name_or_path}")
    return model


def speculators_check(out: Path, target) -> str | None:
    """The real consumer of the vLLM EAGLE-3 format: speculators loads the folder and runs a forward pass.

    Returns None when speculators is not installed (an optional dependency)."""
    try:
        from speculators import SpeculatorModel  # noqa: F401
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
    except ImportError:
        return None
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention does not run on CPU
    if getattr(target, "folder", None) is not None:  # the verifier may be named by a hub id (--verifier)
        config.speculators_config.verifier.name_or_path = str(target.folder)
    model = load_speculators(out, config)
    written = read_tensors(out / "model.safetensors")
    sd = model.state_dict()
    for name, t in written.items():
        if name not in sd:
            raise VerificationError(f"{out}: speculators has no parameter for '{name}'")
        if not torch.equal(sd[name].to(t.dtype).cpu(), t):
            raise VerificationError(f"{out}: speculators loaded '{name}' with different values")
    H = config.transformer_layer_config.hidden_size
    n_aux = len(config.eagle_aux_hidden_state_layer_ids)
    T = 6
    ids = torch.randint(0, config.transformer_layer_config.vocab_size, (1, T))
    # the features come in the head's own dtype, as a serving stack feeds a bf16 / fp16 head: a float32
    # input would fail in the head's first matmul ("expected m1 and m2 to have the same dtype")
    dtype = model.fc.weight.dtype
    with torch.no_grad():
        drafts = model(hidden_states=torch.randn(1, T, n_aux * H, dtype=dtype), input_ids=ids,
                       document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=2)
    if len(drafts) != 2 or drafts[0].shape != (1, T):
        raise VerificationError(f"{out}: speculators forward returned unexpected draft shapes")
    return f"speculators Eagle3DraftModel.from_pretrained loaded all {len(written)} tensors bit-exact; forward ran"
