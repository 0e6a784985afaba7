"""Medusa heads: K extra next-next-token heads on a frozen target's last hidden state.

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads".
With h_t the target's post-norm last hidden state after reading token x_t, the target's own head
predicts x_{t+1}; Medusa head i (0-based) predicts x_{t+2+i}:

    head_i(h) = W_i · ResBlock_i,L( ... ResBlock_i,1(h) )      ResBlock(x) = x + SiLU(A x + b)

Every ResBlock starts at the identity (A = 0, b = 0, SiLU(0) = 0) and W_i starts as a copy of the
target's lm_head, so a fresh head predicts exactly what the target's own head predicts (STYLE: heads
start harmless). With `share_lm_head`, W_i IS the target's frozen lm_head (no vocab-sized parameters per
head: the choice for large vocabularies such as Gemma 3's 262k).

With `draft_vocab_size: N` every W_i has N rows, those of the N tokens the target writes most often
(`heads/vocab.py`; vLLM's Medusa calls the list `token_map`). On a CPU the K vocab projections are most of a
Medusa step: on SmolLM2, 4 x 49,152 rows cost ~0.85 of a target step, 4 x 8,192 rows ~0.15. A head
then predicts nothing outside its vocabulary: the labels it cannot predict are left out of its loss and
count as misses in its accuracy. Logits are over draft ids; `to_target` maps ids back.

This file holds the module, its config, the loss and the sparse candidate tree; no I/O in `__init__`.
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import artifact, schema
from draftsmith.errors import ConfigError, DraftsmithError, show
from draftsmith.heads.vocab import check_draft_vocab
from draftsmith.targets.families import text_config
from draftsmith.targets.gemm import rows_linear


@dataclass
class MedusaHeadsConfig:
    """Shape of a set of Medusa heads (stored as the artifact's config.json)."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = False
    draft_vocab_size: int | None = None  # None: the target's whole vocabulary

    def __post_init__(self):
        if self.num_heads < 1 or self.num_heads > 16:
            raise ValueError(f"num_heads must be in 1..16, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError("hidden_size and vocab_size must be positive")
        if self.draft_vocab_size is not None:
            if not 1 <= self.draft_vocab_size <= self.vocab_size:
                raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
            if self.share_lm_head:
                raise ValueError("share_lm_head reads the target's whole lm_head; a draft vocabulary gives each "
                                 "head its own N-row projection: set one of them")

    @property
    def out_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised so that it starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, own_lm_head: bool):
        super().__init__()
        # Each block is its own module (Medusa's `[module] * n` shared one block n times).
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False) if own_lm_head else None

    def features(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


class MedusaHeads(nn.Module):
    """K Medusa heads. forward(h [.., H]) -> logits [K, .., V] (V = draft_vocab_size when set)."""

    def __init__(self, config: MedusaHeadsConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.out_size, config.num_layers, not config.share_lm_head)
            for _ in range(config.num_heads)
        )
        self._shared_lm_head: nn.Module | None = None  # set by attach_lm_head when share_lm_head
        if config.draft_vocab_size is not None:  # buffers: saved with the weights, moved with the module
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    @classmethod
    def from_target(cls, target_config, num_heads: int = 4, num_layers: int = 1, share_lm_head: bool = False,
                    lm_head: nn.Module | None = None,
                    draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> MedusaHeads:
        """Heads shaped for a target. Pass the target's `lm_head` to initialise (or share) the projections,
        and `draft_vocab = (d2t, t2d)` (heads/vocab.py) for projections over a reduced vocabulary."""
        tc = text_config(target_config)
        n = int(draft_vocab[0].numel()) if draft_vocab is not None else None
        heads = cls(MedusaHeadsConfig(tc.hidden_size, tc.vocab_size, num_heads, num_layers, share_lm_head, n))
        if draft_vocab is not None:
            heads.set_draft_vocab(*draft_vocab)
        if lm_head is not None:
            heads.attach_lm_head(lm_head, copy=not share_lm_head)
        return heads

    def attach_lm_head(self, lm_head: nn.Module, copy: bool) -> None:
        """Copy the target's lm_head into every head (copy=True) or keep a reference to it (shared, frozen)."""
        if copy:
            w = lm_head.weight if self.t2d is None else lm_head.weight[self.t2d.to(lm_head.weight.device)]
            with torch.no_grad():
                for head in self.heads:
                    head.lm_head.weight.copy_(w.to(head.lm_head.weight))
        else:
            # stored outside the module tree so it is neither trained, saved nor DDP-synchronised
            object.__setattr__(self, "_shared_lm_head", lm_head)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if self.d2t is None or d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ConfigError(f"draft vocabulary of {d2t.numel()} / {t2d.numel()} tokens does not fit heads built "
                              f"for {self.config.draft_vocab_size} / {self.config.vocab_size}")
        check_draft_vocab(d2t, t2d)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of the heads' output ids (the identity without a draft vocabulary)."""
        return ids if self.d2t is None else ids + self.d2t[ids]

    def _lm_head_weight(self) -> torch.Tensor:
        if self._shared_lm_head is None:
            raise ConfigError("these Medusa heads share the target's lm_head: call attach_lm_head first")
        return self._shared_lm_head.weight

    def project(self, i: int, feats: torch.Tensor) -> torch.Tensor:
        head = self.heads[i]
        if head.lm_head is not None:
            return head.lm_head(feats)
        w = self._lm_head_weight()
        return rows_linear(feats.to(w.dtype), w)

    def forward(self, hidden: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        """hidden [.., H] -> logits [K, .., V]; or a list of per-head inputs [N_i, H] -> a list of [N_i, V]
        (training feeds each head only the positions its loss uses; the vocab projection dominates)."""
        if isinstance(hidden, list | tuple):
            return [self.project(i, self.heads[i].features(h)) for i, h in enumerate(hidden)]
        return self.first_logits(len(self.heads), hidden)

    def first_logits(self, n: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of heads 0..n-1, [n, .., V]."""
        feats = torch.stack([self.heads[i].features(hidden) for i in range(n)])  # [n, .., H]
        if self.config.share_lm_head:  # one product over every head's rows: at decode time n rows instead
            w = self._lm_head_weight()  # of n one-row products, each of which streams the whole lm_head
            return rows_linear(feats.to(w.dtype), w)
        return torch.stack([self.heads[i].lm_head(f) for i, f in enumerate(feats)])

    def head_logits(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.project(i, self.heads[i].features(hidden))


def head_weights(num_heads: int, decay: float) -> list[float]:
    """Medusa weighs head i by decay**i: later heads are less accurate and matter less."""
    return [decay**i for i in range(num_heads)]


def head_positions(loss_mask: torch.Tensor, i: int) -> torch.Tensor:
    """Bool [B, T] of the positions t whose head-i label x_{t+2+i} is an assistant token (and exists)."""
    shift = i + 2
    sel = torch.zeros_like(loss_mask, dtype=torch.bool)
    if loss_mask.shape[1] > shift:
        sel[:, : -shift] = loss_mask[:, shift:].bool()
    return sel


def head_labels(input_ids: torch.Tensor, sel: torch.Tensor, i: int) -> torch.Tensor:
    """The labels x_{t+2+i} at the selected positions, flattened [N]."""
    shifted = torch.roll(input_ids, shifts=-(i + 2), dims=1)  # shifted[t] = x_{t+2+i}; wrapped tail unselected
    return shifted[sel]


def medusa_loss(logits: list[torch.Tensor], labels: list[torch.Tensor], weights: list[float],
                teacher: list[tuple[torch.Tensor, torch.Tensor]] | None = None, kd_weight: float = 0.0,
                topk: tuple[int, ...] = (1, 5)) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ_i w_i · CE(head_i(h_t), x_{t+2+i}) over the selected positions (see `head_positions`).

    logits[i] [N_i, V] and labels[i] [N_i] for head i. With `teacher[i]` = the target's top-k logits at
    position t+1+i (values [N_i, k], indices [N_i, k]; k = V for the full distribution) and kd_weight > 0,
    the hard CE is mixed with KL(p_target ‖ head_i) — the target's own distribution for the same token
    (Medusa-1's self-distillation variant), the teacher renormalised over its top-k support.
    With a draft vocabulary, ids are draft ids and -1 marks a label (teacher token) outside it.
    Returns the loss and `head{i}/loss`, `head{i}/top1`, `head{i}/top5`.
    """
    total = logits[0].new_zeros(()).float()
    metrics: dict[str, float] = {}
    for i, (pred, y) in enumerate(zip(logits, labels)):
        pred = pred.float()
        n = y.numel()
        if n == 0:
            metrics[f"head{i}/loss"] = 0.0
            for k in topk:
                metrics[f"head{i}/top{k}"] = 0.0
            continue
        known = y >= 0  # a label outside the heads' draft vocabulary is -1: no loss, a miss
        head_loss = F.cross_entropy(pred, y, ignore_index=-1) if bool(known.any()) else pred.sum() * 0.0
        if teacher is not None and kd_weight > 0:
            t_val, t_idx = teacher[i]
            inside = t_idx >= 0  # teacher tokens outside the draft vocabulary leave its support
            rows = inside.any(-1)
            if bool(rows.any()):
                log_p = F.log_softmax(t_val[rows].float().masked_fill(~inside[rows], float("-inf")), -1)
                log_q = F.log_softmax(pred[rows], -1).gather(-1, t_idx[rows].long().clamp(min=0))
                kl = (log_p.exp() * (log_p - log_q)).masked_fill(~inside[rows], 0.0).sum(-1).mean()
            else:
                kl = pred.sum() * 0.0
            head_loss = (1 - kd_weight) * head_loss + kd_weight * kl
        total = total + weights[i] * head_loss
        metrics[f"head{i}/loss"] = float(head_loss.detach())
        with torch.no_grad():
            ranked = pred.topk(min(max(topk), pred.shape[-1]), dim=-1).indices
            hit = ranked == y.unsqueeze(-1)
            for k in topk:
                metrics[f"head{i}/top{k}"] = float(hit[:, :k].any(-1).float().mean())
    return total, metrics


# ---------------------------------------------------------------------------------------------------
# Sparse candidate tree (Medusa §3.1.2): a node is a path (r_0, r_1, ..., r_d) of ranks, r_i being the
# rank of the candidate taken from head i. Assuming heads are independent, the node is accepted with
# probability Π_i acc[i][r_i], where acc[i][r] is head i's measured top-(r+1)-but-not-top-r accuracy
# on calibration data. The expected accepted length of a tree is the sum of its nodes' probabilities,
# so the best tree under a node budget takes the most probable nodes. A child is never more probable
# than its parent, so greedy expansion from the frontier (a max-heap) is optimal and keeps the tree
# closed under prefixes.
# ---------------------------------------------------------------------------------------------------


@dataclass
class MedusaTree:
    paths: list[tuple[int, ...]] = field(default_factory=list)  # rank paths, parents before children
    expected_length: float = 0.0  # Σ node probabilities (+1 for the bonus token gives τ)
    probs: list[float] | None = None  # [i] = calibrated P(path i is accepted), the verifier's pruning scores

    def to_json(self) -> dict:
        out = {"paths": [list(p) for p in self.paths], "expected_length": self.expected_length}
        if self.probs is not None:
            out["probs"] = list(self.probs)
        return out

    @classmethod
    def from_json(cls, data: dict) -> MedusaTree:
        probs = data.get("probs")
        return cls([tuple(p) for p in data["paths"]], float(data.get("expected_length", 0.0)),
                   [float(x) for x in probs] if probs is not None else None)

    def with_probs(self, acc: list[list[float]]) -> MedusaTree:
        """The same tree with node probabilities from calibration rank accuracies (older artifacts kept
        only the accuracies, in their manifest's metrics)."""
        return MedusaTree(list(self.paths), self.expected_length, [path_probability(acc, p) for p in self.paths])

    @classmethod
    def chain(cls, depth: int) -> MedusaTree:
        return cls([tuple([0] * d) for d in range(1, depth + 1)])

    def parents(self) -> list[int]:
        """Index of each node's parent in `paths` (-1 for children of the root)."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]


MAX_TREE_NODES = 1024  # far above any tree that pays (GPU-sized trees hold ~64-256 nodes); bounds the mask
MAX_TREE_RANK = 256  # candidates per head a tree may use (calibration considers `tree_max_rank`, default 8)
MAX_TREE_BYTES = 4 << 20


def read_tree(folder: str | Path, num_heads: int, vocab: int, noun: str = "artifact") -> MedusaTree | None:
    """The one reader of tree.json (an artifact's or an export's): None where there is none, else a tree whose
    every field is checked — `paths` a tree the heads can draft (`tree_problem`), `probs` one probability in
    [0, 1] per path, `expected_length` a finite number in [0, number of paths] — or a FieldError naming the file
    and the field. A tree.json that cannot be read (a dangling link, a folder, a file of many MB) is an error,
    never "no tree"."""
    f = Path(folder) / "tree.json"
    if not os.path.lexists(f):
        return None
    data = schema.read_doc(f, max_bytes=MAX_TREE_BYTES)
    paths = schema.get(data, "paths", f, "list")
    problem = tree_problem(paths, num_heads, vocab, str(f), noun)
    if problem:
        raise schema.FieldError(problem)
    probs = schema.get(data, "probs", f, "numbers", lo=0, hi=1, null=True, default=None)
    if probs is not None and len(probs) != len(paths):
        raise schema.FieldError(f"{f}: field 'probs' holds {len(probs)} values for {len(paths)} paths, expected one "
                                "probability per path")
    expected = schema.get(data, "expected_length", f, "number", lo=0, hi=len(paths), default=0.0)
    return MedusaTree([tuple(p) for p in paths], float(expected), [float(x) for x in probs] if probs else None)


def read_tree_or_problem(folder: str | Path, num_heads: int, vocab: int,
                         noun: str = "artifact") -> tuple[MedusaTree | None, str | None]:
    """`read_tree`, with a tree.json it refuses given back as its one-line problem."""
    try:
        return read_tree(folder, num_heads, vocab, noun), None
    except DraftsmithError as e:
        return None, str(e)


def tree_problem(paths, num_heads: int, vocab: int, where: str, noun: str = "artifact") -> str | None:
    """The first reason `paths` is not a tree the heads can draft, one line, or None: a list of at most
    MAX_TREE_NODES distinct non-empty rank paths, each rank an int in [0, min(vocab, MAX_TREE_RANK)), each
    no deeper than the heads, each parent listed before its children (the decoder cuts the tree to a
    prefix, medusa/proposer.py)."""
    if not isinstance(paths, list):
        return f"{where}: the tree is not a list of rank paths"
    if len(paths) > MAX_TREE_NODES:
        return f"{where}: {len(paths)} tree nodes, more than {MAX_TREE_NODES}"
    top = min(vocab, MAX_TREE_RANK)
    seen: set[tuple[int, ...]] = set()
    for i, p in enumerate(paths):
        if (not isinstance(p, list | tuple) or not p
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in p)):
            return f"{where}: path {i} ({show(p)}) is not a non-empty list of int ranks"
        t = tuple(p)
        bad = next((r for r in t if not 0 <= r < top), None)
        if bad is not None:
            return f"{where}: path {i} {list(t)[:8]} has rank {bad}, outside the heads' top-{top}"
        if len(t) > num_heads:
            return f"{where}: a path of depth {len(t)}, but the {noun} has {num_heads} heads"
        if t in seen:
            return f"{where}: path {i} {list(t)[:8]} is listed twice"
        if len(t) > 1 and t[:-1] not in seen:
            return f"{where}: path {i} {list(t)[:8]} comes before its parent {list(t[:-1])[:8]} (or without it)"
        seen.add(t)
    return None


def rank_accuracies(hits: torch.Tensor) -> list[list[float]]:
    """hits [K, N, R] booleans (head i's rank-r candidate was right at calibration position n)
    -> acc[i][r] = P(rank r is the right one)."""
    return hits.float().mean(1).tolist()


def build_tree(acc: list[list[float]], budget: int) -> MedusaTree:
    """Greedy tree maximising expected accepted length with at most `budget` nodes."""
    if budget < 1:
        raise ConfigError(f"tree node budget must be >= 1, got {budget}")
    K = len(acc)
    heap: list[tuple[float, tuple[int, ...]]] = []
    for r, a in enumerate(acc[0]):
        if a > 0:
            heapq.heappush(heap, (-a, (r,)))
    paths: list[tuple[int, ...]] = []
    probs: list[float] = []
    expected = 0.0
    while heap and len(paths) < budget:
        neg_p, path = heapq.heappop(heap)
        paths.append(path)
        probs.append(-neg_p)
        expected += -neg_p
        depth = len(path)
        if depth < K:
            for r, a in enumerate(acc[depth]):
                p = -neg_p * a
                if p > 0:
                    heapq.heappush(heap, (-p, path + (r,)))
    if not paths:
        paths, probs = [(0,)], [0.0]
    return MedusaTree(paths, expected, probs)


def path_probability(acc: list[list[float]], path: tuple[int, ...]) -> float:
    """Π_d acc[d][r_d]: the path's acceptance probability under independent heads (0 for a rank or head
    the accuracies do not cover)."""
    return math.prod(acc[d][r] if d < len(acc) and r < len(acc[d]) else 0.0 for d, r in enumerate(path))


def tree_expected_length(acc: list[list[float]], tree: MedusaTree) -> float:
    return sum(path_probability(acc, p) for p in tree.paths)


def read_heads_config(path: str | Path, vocab: int | None = None) -> MedusaHeadsConfig:
    """The one reader of a Medusa artifact's config.json: every field typed and in range, `vocab_size` the
    target's (`vocab`, from the manifest's fingerprint, where known), or a FieldError naming the file and field."""
    where = Path(path) / "config.json"
    cfg = schema.read_doc(where)
    V = schema.get(cfg, "vocab_size", where, "int", lo=1, hi=schema.MAX_VOCAB)
    if vocab is not None and V != vocab:
        raise schema.FieldError(f"{where}: field 'vocab_size' is {V}, but the target's vocabulary has {vocab} tokens")
    fields = {"hidden_size": schema.get(cfg, "hidden_size", where, "int", lo=1, hi=schema.MAX_HIDDEN),
              "vocab_size": V, "num_heads": schema.get(cfg, "num_heads", where, "int", lo=1, hi=16),
              "num_layers": schema.get(cfg, "num_layers", where, "int", lo=0, hi=64),
              "share_lm_head": schema.get(cfg, "share_lm_head", where, "bool"),
              # absent from artifacts older than the option
              "draft_vocab_size": schema.get(cfg, "draft_vocab_size", where, "int", lo=1, hi=V, null=True,
                                             default=None)}
    try:
        return MedusaHeadsConfig(**fields)
    except ValueError as e:
        raise schema.FieldError(f"{where}: {e}") from None


def load_medusa(path: str | Path, target=None) -> tuple[MedusaHeads, MedusaTree | None, dict]:
    """Heads, calibrated tree and manifest of a Medusa artifact (fingerprint checked against `target`)."""
    path = Path(path)
    manifest, state = artifact.load_artifact(path, kind="medusa", target=target)
    config = read_heads_config(path, artifact.target_vocab(manifest))
    heads = MedusaHeads(config)
    artifact.load_strict(heads, state, path)
    if heads.config.share_lm_head:
        if target is None:
            raise ConfigError(f"{path}: these heads share the target's lm_head; give the target to load them")
        heads.attach_lm_head(target.model.lm_head, copy=False)
    if target is not None:
        heads.to(device=target.device, dtype=target.dtype)
    tree = read_tree(path, config.num_heads, config.out_size)
    acc = (manifest.get("metrics") or {}).get("calibration_rank_accuracy")
    if tree is not None and tree.probs is None and acc:
        tree = tree.with_probs(acc)
    return heads.eval(), tree, manifest


def artifact_tensors(path: str | Path) -> tuple[dict, dict, list[str]]:
    """`Method.tensors`: (required, optional) name -> (shape, dtype or "") of the heads `config.json` describes,
    built on the meta device (the vocabulary maps keep their own dtypes), and a tree.json it refuses."""
    path = Path(path)
    config = read_heads_config(path, artifact.target_vocab(artifact.load_manifest(path)))
    with torch.device("meta"):
        module = MedusaHeads(config)
    _, unreadable = read_tree_or_problem(path, config.num_heads, config.out_size)
    return schema.module_spec(module), {}, [unreadable] if unreadable else []
