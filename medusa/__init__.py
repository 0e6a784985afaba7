"""Medusa heads (and Medusa-2: heads with a LoRA adapter on the target): extra decoding heads on the
target's last hidden state, one per draft position, verified as a calibrated tree."""

from draftsmith.methods import Method

METHOD = Method(
    name="medusa",
    summary="Medusa heads on the target's last hidden state (Medusa-2 with medusa2.enabled)",
    config="draftsmith.medusa.job:MedusaJobConfig",
    job="draftsmith.medusa.job:MedusaJob",
    load="draftsmith.medusa.model:load_medusa",
    proposer="draftsmith.medusa.proposer:build_proposer",
    export="draftsmith.medusa.export:export",
    serving="draftsmith.medusa.export:SERVING",
    reimport="draftsmith.medusa.export:reimport",
    tensors="draftsmith.medusa.model:artifact_tensors",
    train_memory="draftsmith.medusa.memory:job_memory",
    features="draftsmith.medusa.job:features",
    default_config="smollm2-135m/medusa",
    own_tree=True,
    commands="draftsmith.medusa.commands:register",
)
