"""EAGLE-1 / EAGLE-3 heads: one decoder layer that drafts from the target's hidden states, as a tree."""

from draftsmith.methods import Method

METHOD = Method(
    name="eagle",
    summary="an EAGLE-1 or EAGLE-3 head (one decoder layer on the target's hidden states)",
    config="draftsmith.eagle.job:EagleJobConfig",
    job="draftsmith.eagle.job:EagleJob",
    load="draftsmith.eagle.model:load_eagle",
    proposer="draftsmith.eagle.proposer:build_proposer",
    export="draftsmith.eagle.export:export",
    serving="draftsmith.eagle.export:SERVING",
    reimport="draftsmith.eagle.export:reimport",
    memory="draftsmith.eagle.memory:shape",
    tensors="draftsmith.eagle.model:artifact_tensors",
    train_memory="draftsmith.eagle.memory:job_memory",
    features="draftsmith.eagle.job:features",
    default_config="smollm2-135m/eagle3",
    own_tree=True,
)
