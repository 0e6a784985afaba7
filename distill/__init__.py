"""Distilled draft models: a small causal LM trained on the target's next-token distribution."""

from draftsmith.methods import Method

METHOD = Method(
    name="draft",
    summary="a small causal LM distilled from the target's logits",
    config="draftsmith.distill.job:DistillConfig",
    job="draftsmith.distill.job:DistillJob",
    load="draftsmith.distill.proposer:load_draft",
    proposer="draftsmith.distill.proposer:build_proposer",
    export="draftsmith.distill.export:export_draft",
    serving="draftsmith.distill.export:SERVING",
    memory="draftsmith.distill.memory:shape",
    tensors="draftsmith.distill.export:draft_artifact_tensors",
    train_memory="draftsmith.distill.memory:job_memory",
    default_config="smollm2-135m/distill",
    data_key="data.path",
    output_key=None,
    alias="distill",
)
