"""Draft-model proposer: any HF causal LM that shares the target's tokenizer (vanilla two-model
speculative decoding, Leviathan et al. 2023). The draft keeps its own KV cache, synced to the committed
context before every proposal: the longest common prefix of what it has cached and the context is kept,
the rest cropped, the missing tokens fed — so a rejection rolls the draft back automatically.

Greedy: the draft proposes its argmax chain (deterministic candidates, q = None). Sampling: it draws each
token from q = probs_from_logits(draft logits) with the SAME temperature/top-k/top-p as the target, and
returns q so the verifier applies Leviathan/Chen speculative sampling. A tree budget is answered with a
chain of the tree's depth (a chain is a tree).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.decoding.proposer import Proposal, Proposer, TreeSpec, as_model
from draftsmith.decoding.sampling import SamplingConfig, probs_from_logits, sample
from draftsmith.errors import ArtifactError, FingerprintMismatch
from draftsmith.targets import kvcache
from draftsmith.targets.gemm import use_rows_linear


class DraftProposer(Proposer):
    name = "draft"

    def __init__(self, model, name: str = "draft", greedy: bool = False):
        self.model = as_model(model)  # a Target or a bare HF model
        self.name = name
        # draft the argmax even when the target samples: the serving engines' greedy draft sampling (vLLM's
        # `draft_sample_method: greedy`), whose one-hot proposal the verifier's rule for fixed candidates verifies
        self.greedy = greedy
        self.device = next(self.model.parameters()).device
        self.cache = None
        self.cached: torch.Tensor = torch.zeros(0, dtype=torch.long)

    @property
    def assistant_model(self):
        return self.model

    @classmethod
    def from_path(cls, path: str | Path, target, greedy: bool = False, **_opts) -> DraftProposer:
        """Load an HF folder or a draftsmith draft artifact; refuse one made for another target."""
        return cls(load_draft(path, target), name=f"draft:{Path(path).expanduser().name}", greedy=greedy)

    def use_dtype(self, dtype: torch.dtype) -> bool:
        """A copy of the draft in `dtype` (the model may be shared, e.g. the target drafting for itself);
        its logits come out in `dtype` and sampling computes q from them in float32."""
        import copy

        from draftsmith.targets.precision import cast_parameters

        if next(self.model.parameters()).dtype != dtype:
            self.model = cast_parameters(copy.deepcopy(self.model), dtype)
            self.cache = None
        return True

    def begin(self, prompt_ids, features) -> None:
        self.cache = kvcache.new_cache(self.model)
        self.cached = torch.zeros(0, dtype=torch.long, device=self.device)

    def _feed(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.cached.numel()
        pos = torch.arange(start, start + ids.numel(), device=self.device)[None]
        out = self.model(input_ids=ids[None], past_key_values=self.cache, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        self.cached = torch.cat([self.cached, ids])
        return out.logits[0, -1]

    @torch.no_grad()
    def propose(self, context: torch.Tensor, spec: TreeSpec, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        if self.cache is None:
            self.begin(context, None)
        context = context.to(self.device)
        n = min(self.cached.numel(), context.numel())
        same = (self.cached[:n] == context[:n]).long()
        common = int(same.cumprod(0).sum()) if n else 0
        common = min(common, context.numel() - 1)  # always feed at least the last token
        kvcache.crop(self.cache, common)
        self.cached = self.cached[:common]
        logits = self._feed(context[common:])
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for d in range(spec.depth):
            if sampling.greedy or self.greedy:
                tok = int(logits.argmax())
            else:
                q = probs_from_logits(logits, sampling)
                tok = sample(q, generator)
                qs.append(q)
            tokens.append(tok)
            if d + 1 < spec.depth:
                logits = self._feed(torch.tensor([tok], dtype=torch.long, device=self.device))
        q = torch.stack(qs) if qs else None
        return Proposal.chain(tokens, q, device=self.device)


def load_draft(path: str | Path, target):
    """The draft model of an HF folder or a draftsmith draft artifact, on the target's device and dtype;
    refuses one made for another target (fingerprint, vocabulary size, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.artifact import MANIFEST, load_manifest, verify_weights
    from draftsmith.targets.fingerprint import check_compatible, tokenizer_hash

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ArtifactError(f"draft {path}: not an HF model folder or draft artifact (no config.json)")
    if (path / MANIFEST).is_file():
        manifest = load_manifest(path, kind="draft")
        check_compatible(manifest["target"], target.fingerprint(), what=f"draft {path}")
        verify_weights(path, manifest)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device)
    except Exception as e:  # transformers raises assorted errors for unreadable folders
        raise ArtifactError(f"draft {path}: cannot load the model ({type(e).__name__}: {e})") from None
    model.eval().requires_grad_(False)
    use_rows_linear(model)  # a draft re-reads accepted tokens a few rows at a time
    rows = model.get_input_embeddings().weight.shape[0]
    if rows != target.vocab_size:
        raise FingerprintMismatch(f"draft {path}: vocab size {rows} differs from the target's {target.vocab_size}")
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        tok = AutoTokenizer.from_pretrained(path)
        if tokenizer_hash(tok) != tokenizer_hash(target.tokenizer):
            raise FingerprintMismatch(f"draft {path}: its tokenizer vocabulary differs from the target's")
    return model


def build_proposer(target, path: str, **opts) -> DraftProposer:
    """`Method.proposer` of draft models: `draft:PATH` (a draft artifact or any HF folder)."""
    return DraftProposer.from_path(path, target, **opts)
