"""EAGLE variants, declared once: what one EAGLE drafter does differently from another.

The head (`eagle/model.py`), its job (`eagle/job.py`), its export layouts (`eagle/export.py`) and its memory
estimate (`eagle/memory.py`) read these declared options rather than asking "is this EAGLE-3?", so a further
variant is one more entry in `VARIANTS` plus the code of whatever option it adds, not a new branch at every
place the head is built, trained, exported or costed.

  option            EAGLE-1                                    EAGLE-3
  feature_layers    1 (the last layer's output)                3 (low, mid, high: `default_eagle3_layers`)
  fuse_layers       no: fc joins [embedding; feature], 2H -> H  yes: fc fuses the layers, 3H -> H, before the layer
  attention_input   "fc": the layer reads fc's output           "concat": q/k/v read [norm(embedding); norm(feature)]
  vocabulary        "target": the target's final norm + lm_head "draft": an own norm + lm_head over N frequent tokens
  teacher           "features": regress the next feature, plus  "logits": the target's next-token distribution on the
                    a weighted token cross-entropy              draft vocabulary, per test-time step
  replay            no                                         on-policy replay of rejected drafts
                                                               (data/engines/rollout.py)
  default_ttt_steps 1                                          7
  layout            "eagle1" (vLLM EAGLE-1, SGLang/TRT EAGLE)   "eagle3" (speculators, midlayer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from draftsmith.errors import ConfigError


@dataclass(frozen=True)
class Variant:
    name: str  # the job config's `version`
    number: int  # the int config.json stores as `version` and the export layouts read
    feature_layers: int  # target layers the head reads
    fuse_layers: bool  # fc fuses the target layers (feature_layers·H -> H) before the draft layer
    attention_input: Literal["fc", "concat"]  # fc([e; f]) through the layer, or q/k/v over [norm(e); norm(g)]
    vocabulary: Literal["target", "draft"]  # logits through the target's frozen head, or the head's own
    teacher: Literal["features", "logits"]  # what the loss compares the draft with
    replay: bool  # the loss can weigh on-policy rejections (eagle/job.py replay_weight)
    default_ttt_steps: int
    layout: str  # export layout family (eagle/export.py STACK_FORMATS)

    @property
    def draft_vocab(self) -> bool:
        return self.vocabulary == "draft"

    def default_layers(self, num_layers: int) -> list[int]:
        """The target layers read when the config names none (draftsmith's output-of-layer ids)."""
        from draftsmith.capture.layers import default_eagle3_layers

        if self.feature_layers == 1:
            return [num_layers - 1]
        if self.feature_layers == 3:
            return default_eagle3_layers(num_layers)
        raise ConfigError(f"EAGLE variant {self.name}: no default for {self.feature_layers} feature layers")

    def fc_shape(self, hidden: int) -> tuple[int, int, bool]:
        """(in, out, bias) of the feature projection."""
        if self.fuse_layers:
            return self.feature_layers * hidden, hidden, False
        return 2 * hidden, hidden, True

    def attention_width(self, hidden: int) -> int:
        """What the draft layer's q/k/v read per token."""
        return 2 * hidden if self.attention_input == "concat" else hidden

    def capture(self) -> dict:
        """What the target must give besides the feature layers: the logits teacher needs the post-norm last
        hidden state (the target's logits on the draft vocabulary come from it) and the argmax (accuracy)."""
        logits = self.teacher == "logits"
        return {"topk": 1 if logits else 0, "last_hidden": logits}


EAGLE1 = Variant("eagle1", 1, feature_layers=1, fuse_layers=False, attention_input="fc", vocabulary="target",
                 teacher="features", replay=False, default_ttt_steps=1, layout="eagle1")
EAGLE3 = Variant("eagle3", 3, feature_layers=3, fuse_layers=True, attention_input="concat", vocabulary="draft",
                 teacher="logits", replay=True, default_ttt_steps=7, layout="eagle3")
VARIANTS = {v.name: v for v in (EAGLE1, EAGLE3)}


def variant(version: str | int) -> Variant:
    """The variant a job's `version` ("eagle3") or a config.json's (3) names."""
    for v in VARIANTS.values():
        if version in (v.name, v.number):
            return v
    raise ConfigError(f"EAGLE version must be one of {', '.join(VARIANTS)}, got {version!r}")
