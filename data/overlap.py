"""Train/eval separation: find training prompts that repeat or nearly repeat a held-out eval prompt.

Texts are compared after `normalize_text` (lower case, punctuation dropped, whitespace collapsed).
A training prompt overlaps an eval prompt when
  - the normalised texts are equal (exact), or
  - one contains the other and the contained text has at least n words (substring: an eval question
    pasted inside a longer training prompt), or
  - the Jaccard similarity of their word n-gram sets |A ∩ B| / |A ∪ B| reaches the threshold
    (near-duplicate; the MinHash/shingling notion of Broder, 1997, computed exactly here).
Candidates come from an inverted index of eval n-grams, so only pairs sharing an n-gram are compared.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from draftsmith.data.config import EvalSetConfig
from draftsmith.data.sources import PromptRow, _FieldError, extract_turns, iter_jsonl, normalize_text
from draftsmith.errors import DataError
from draftsmith.paths import data_path

log = logging.getLogger(__name__)


def ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@dataclass
class EvalText:
    origin: str
    norm: str
    grams: set


@dataclass
class OverlapReport:
    hits: list[tuple[int, str, str, float]] = field(default_factory=list)  # (train index, eval origin, kind, score)
    eval_prompts: int = 0

    @property
    def rows(self) -> set[int]:
        return {h[0] for h in self.hits}

    def counts(self) -> dict[str, int]:
        return dict(Counter(h[2] for h in self.hits))


def load_eval_texts(eval_sets: list[EvalSetConfig], n: int) -> list[EvalText]:
    out = []
    for es in eval_sets:
        path = data_path(es.path)
        if not path.is_file():
            raise DataError(f"eval set {es.path}: no such file {path}")
        for lineno, obj, err in iter_jsonl(path):
            if err is not None:
                continue
            try:
                turns = extract_turns(obj, es.prompt, es.prompt_template, es.turns)
            except _FieldError:
                continue
            for turn in turns:  # every turn of a multi-turn eval prompt is held out
                norm = normalize_text(turn)
                out.append(EvalText(f"{path}:{lineno}", norm, ngrams(norm.split(), n)))
    return out


def find_overlap(rows: list[PromptRow], eval_texts: list[EvalText], n: int = 8,
                 jaccard: float = 0.5) -> OverlapReport:
    """Which training rows overlap which eval prompts (see module docstring)."""
    report = OverlapReport(eval_prompts=len(eval_texts))
    exact = {e.norm: e for e in eval_texts}
    index: dict[tuple, list[int]] = defaultdict(list)
    for j, e in enumerate(eval_texts):
        for g in e.grams:
            index[g].append(j)
    for i, row in enumerate(rows):
        for turn in row.turns:
            norm = normalize_text(turn)
            if norm in exact:
                report.hits.append((i, exact[norm].origin, "exact", 1.0))
                break
            grams = ngrams(norm.split(), n)
            shared = Counter(j for g in grams for j in index.get(g, ()))
            hit = None
            for j, common in shared.most_common():
                e = eval_texts[j]
                score = common / len(grams | e.grams)
                if score >= jaccard:
                    hit = (i, e.origin, "near-duplicate", score)
                    break
                small, big = (e.norm, norm) if len(e.norm) <= len(norm) else (norm, e.norm)
                if len(small.split()) >= n and small in big:
                    hit = (i, e.origin, "substring", score)
                    break
            if hit:
                report.hits.append(hit)
                break
    return report
