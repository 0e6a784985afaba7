"""DFlash: a few decoder layers that draft a whole block of tokens in one non-causal forward pass from the
target's fused hidden states (Chen, Liang, Liu 2026)."""

from draftsmith.methods import Method

METHOD = Method(
    name="dflash",
    summary="a DFlash block drafter (decoder layers predicting a block at once from the target's hidden states)",
    config="draftsmith.dflash.job:DFlashJobConfig",
    job="draftsmith.dflash.job:DFlashJob",
    load="draftsmith.dflash.model:load_dflash",
    proposer="draftsmith.dflash.proposer:build_proposer",
    export="draftsmith.dflash.export:export",
    serving="draftsmith.dflash.export:SERVING",
    reimport="draftsmith.dflash.export:reimport",
    memory="draftsmith.dflash.memory:shape",
    tensors="draftsmith.dflash.model:artifact_tensors",
    train_memory="draftsmith.dflash.memory:job_memory",
    features="draftsmith.dflash.job:features",
    default_config="smollm2-135m/dflash",
    own_tree=True,  # its block's chain (what vLLM and SGLang serve), and the GPU-sized tree beside it
)
