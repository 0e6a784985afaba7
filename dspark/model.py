"""DSpark: the DFlash block drafter, plus a sequential Markov head that restores the dependency between the
block's slots, plus a confidence head that estimates each drafted token's acceptance.

The backbone is DFlash's (dflash/model.py, shared, not copied): one non-causal forward over the block
[x_a, M, ..., M] gives outputs z_1..z_{B-1}, and slot j's base logits b_j = lm_head(norm(z_j)) predict x_{a+j}
without knowing the tokens drafted before it. DSpark adds, left to right (the layout vLLM's
`Qwen3DSparkForCausalLM` serves, vllm/model_executor/models/qwen3_dspark.py):

  Markov head     e_j = W1[y_{j-1}]                 W1: [V, r], y_0 = x_a (the anchor), y_{j-1} the token
                                                    drafted at slot j-1 (a target id)
                  l_j = b_j + W2 e_j                W2: [N, r], N the draft vocabulary (V without a reduced one)
                  y_j = argmax l_j (or a top-k of it, for a tree)
  confidence      c_j = σ(w · [norm(z_j); e_j] + β)  the probability that y_j is accepted given y_1..y_{j-1} were

W2 starts at zero, so a fresh DSpark drafts what its backbone drafts (a head starts harmless); the rank r is
small (the bias is a low-rank bigram table, V·r + N·r parameters). The confidence's running product
Π_{i<=j} c_i estimates that the whole chain up to slot j is accepted, which is what vLLM's adaptive
verification ranks slots by and what draftsmith's verifier cuts a proposal by (decoding/budget.py).

Training (dspark/job.py) teacher-forces the Markov head with the target's own tokens: y_{j-1} = x_{a+j-1}.
Under verification a slot's token matters only when every slot before it was accepted, i.e. when the tokens
before it ARE the target's, so teacher forcing trains exactly the case that counts for a chain; the confidence
head learns whether l_j's argmax equals x_{a+j} in that same case.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import schema
from draftsmith.dflash.model import DFlashConfig, DFlashDraft, load_dflash, read_config
from draftsmith.targets.gemm import rows_linear


@dataclass
class DSparkConfig(DFlashConfig):
    """A DFlash config plus the two heads (stored as the artifact's config.json)."""

    markov_rank: int = 64
    confidence_head: bool = True
    confidence_with_markov: bool = True  # the confidence reads [norm(z_j); e_j] (vLLM: confidence_head_with_markov)

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.markov_rank <= 4096:
            raise ValueError(f"markov_rank must be in 1..4096, got {self.markov_rank}")

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class MarkovHead(nn.Module):
    """The transition bias W2 W1[prev]: vLLM's `DSparkMarkovHead` names (markov_w1, markov_w2)."""

    def __init__(self, vocab_size: int, out_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab, bias=False)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, e: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(e)


class ConfidenceHead(nn.Module):
    """σ(proj([h; e])): vLLM's `DSparkConfidenceHead` (`proj`, with a bias); returns the logit, not σ."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h, e.to(h.dtype)], dim=-1) if self.with_markov else h
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """The DSpark drafter (see the module docstring)."""

    config_class = DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        c = config
        self.markov_head = MarkovHead(c.vocab_size, c.out_vocab, c.markov_rank)
        self.confidence_head = (ConfidenceHead(c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0),
                                               c.confidence_with_markov) if c.confidence_head else None)

    def init_own(self) -> None:
        """W1 ~ N(0, 1) (an embedding's default), W2 = 0: the bias starts at zero and the draft drafts what its
        backbone does; the confidence starts at σ(0) = 1/2."""
        self.markov_head.markov_w1.weight.normal_(0.0, 1.0)
        self.markov_head.markov_w2.weight.zero_()
        if self.confidence_head is not None:
            self.confidence_head.proj.weight.zero_()
            self.confidence_head.proj.bias.zero_()

    def head_states(self, z: torch.Tensor) -> torch.Tensor:
        """Block outputs z -> norm(z), what the lm_head and the confidence head read (vLLM's head hidden)."""
        return self.norm(z)

    def corrected(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(base logits, Markov-corrected logits, confidence logits or None) of slots whose head states are h
        [.., H] and whose previous tokens (target ids) are prev [..]."""
        base = self.head_logits(h)
        e = self.markov_head.embed(prev)
        logits = base + self.markov_head.bias(e).to(base.dtype)
        # the confidence reads the states without moving them: its loss trains the estimate, not what it estimates
        conf = self.confidence_head(h.detach(), e.detach()) if self.confidence_head is not None else None
        return base, logits, conf

    def target_logprobs(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's log-probabilities [n, N] from its post-norm last hidden states [n, H], normalised over its
        whole vocabulary and taken at the N tokens `logits` predicts (`sampling_overlap`'s p)."""
        w = self._head.weight
        logp = F.log_softmax(rows_linear(last_hidden.to(w.dtype), w).float(), -1)
        return logp[:, self.t2d.to(logp.device)] if self.config.reduced_vocab else logp

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                select: torch.Tensor | None = None):
        """Training forward (DFlashDraft.forward's blocks). With `select` (bool [B, n, bs]): (base, corrected,
        confidence) of the selected slots, [n_sel, N] / [n_sel, N] / [n_sel] or None, the Markov head
        teacher-forced with the row's own tokens (slot j of block a reads x_{a+j-1})."""
        z = super().forward(input_ids, features, anchors)
        if select is None:
            return z
        B, T = input_ids.shape
        bs = self.config.block_size
        prev_pos = (anchors.clamp(min=0)[..., None] + torch.arange(bs, device=anchors.device) - 1).clamp(0, T - 1)
        prev = input_ids.gather(1, prev_pos.view(B, -1)).view(prev_pos.shape)
        return self.corrected(self.head_states(z[select]), prev[select])


def dspark_extra(cfg: dict, where: Path, fields: dict) -> None:
    """DSpark's own config.json fields, typed and in range (read_config's `extra`)."""
    fields["markov_rank"] = schema.get(cfg, "markov_rank", where, "int", lo=1, hi=4096)
    fields["confidence_head"] = schema.get(cfg, "confidence_head", where, "bool")
    fields["confidence_with_markov"] = schema.get(cfg, "confidence_with_markov", where, "bool")


def read_dspark_config(path: str | Path, manifest: dict | None = None) -> DSparkConfig:
    """The one reader of a DSpark artifact's config.json (DFlash's fields and the heads')."""
    return read_config(path, manifest, make=DSparkConfig, extra=dspark_extra)


def load_dspark(path: str | Path, target=None) -> tuple[DSparkDraft, dict]:
    """Draft and manifest of a DSpark artifact, as `load_dflash` loads a DFlash one."""
    return load_dflash(path, target, kind="dspark", reader=read_dspark_config)


def artifact_tensors(path: str | Path):
    from draftsmith.dflash.model import artifact_tensors as backbone_tensors

    return backbone_tensors(path, reader=read_dspark_config)


def confidence_loss(conf: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the confidence logits [n] against whether each slot's token is accepted [n]: a
    bool, or the probability that it is (`sampling_overlap`), whose BCE is least where σ(conf) equals it."""
    return F.binary_cross_entropy_with_logits(conf.float(), accepted.float())


def sampling_overlap(draft_logits: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    """[n] Σ_v min(q_v, p_v) = 1 − TV(q, p): the probability that a token drafted from q = softmax(draft_logits)
    [n, N] is accepted by speculative sampling against the target's p (log-probabilities [n, N]; over a reduced
    draft vocabulary, the target's full-vocabulary probabilities of those tokens, which sum to less than 1: the
    mass outside the vocabulary is never drafted). The confidence target of speculators' DSpark trainer
    (vllm-project/speculators, src/speculators/models/dspark/metrics.py) and the acceptance LK losses raise
    (arXiv 2602.23881)."""
    q = F.softmax(draft_logits.float(), -1)
    return torch.minimum(q, target_logprobs.float().exp()).sum(-1)
