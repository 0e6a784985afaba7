"""Distilled draft models: a small causal LM trained on the target's next-token distribution."""

from draftsmith.methods import Method

METHOD = Method(
    name="draft",
    summary="a small causal LM distilled from the target's logits",
    config="draftsmith.distill.config:DistillConfig",
    train="draftsmith.distill.commands:train",
    load="draftsmith.decoding.draft:load_draft",
    proposer="draftsmith.decoding.draft:build_proposer",
    export="draftsmith.export.hf:export_draft",
    memory="draftsmith.planning.memory:draft_shape",
    tensors="draftsmith.export.hf:draft_artifact_tensors",
    train_memory="draftsmith.planning.train_memory:distill_memory",
    default_config="configs/smollm2-135m/distill.yaml",
    data_key="data.path",
    output_key=None,
    command=("distill",),
    aliases=("distill",),
)
