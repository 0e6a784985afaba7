"""DSpark: DFlash's block drafter with a sequential Markov head over the block's slots and a confidence head that
estimates each drafted token's acceptance (the method vLLM serves as `dspark`)."""

from draftsmith.methods import Method

METHOD = Method(
    name="dspark",
    summary="a DSpark block drafter (DFlash's parallel block, corrected left to right by a Markov head, with a "
            "confidence head)",
    config="draftsmith.dspark.job:DSparkJobConfig",
    job="draftsmith.dspark.job:DSparkJob",
    load="draftsmith.dspark.model:load_dspark",
    proposer="draftsmith.dspark.proposer:build_proposer",
    export="draftsmith.dspark.export:export",
    serving="draftsmith.dspark.export:SERVING",
    reimport="draftsmith.dspark.export:reimport",
    memory="draftsmith.dspark.memory:shape",
    tensors="draftsmith.dspark.model:artifact_tensors",
    train_memory="draftsmith.dspark.memory:job_memory",
    features="draftsmith.dspark.job:features",
    default_config="smollm2-135m/dspark",
    own_tree=True,  # its block's chain (what vLLM serves), and the GPU-sized tree beside it
)
