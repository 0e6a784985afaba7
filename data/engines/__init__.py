"""Everything that produces text, behind one interface (base.py: `TextEngine.run(requests, on_done, on_tokens)`).

    continuous.py  the batched decode loop on the local target, capture included (generation.engine: continuous)
    hf.py          transformers' own generate on static batches, for comparison (engine: hf)
    remote.py      OpenAI-compatible completion servers: vLLM, SGLang, `transformers serve` (backend: openai)
    rollout.py     our speculative decoder with a head; rows plus where its drafts were rejected (engine: speculative)

`engine_for(generation, target)` builds the one a data config names; `generate_dataset` asks nothing else of
it. The speculative decoder itself stays in decoding/ (evaluation runs it); rollout.py drives it row by row.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from draftsmith.data.engines.base import Completion, Request, TextEngine
from draftsmith.data.engines.continuous import CaptureSpec, ContinuousBatcher
from draftsmith.data.engines.hf import HFEngine
from draftsmith.data.engines.remote import RemoteEngine
from draftsmith.data.engines.rollout import speculative_engine
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.errors import DataError
from draftsmith.targets.device import dtype_name
from draftsmith.targets.families import pad_token_id
from draftsmith.targets.precision import Float32Logits, inference_copy, inference_dtype

__all__ = ["CaptureSpec", "Completion", "Request", "TextEngine", "engine_for", "writing_target"]

log = logging.getLogger(__name__)


def engine_for(gen, target, *, chat_mode: str = "chat", capture: CaptureSpec | None = None) -> TextEngine:
    """The engine `gen` (a data config's `generation`) names, ready to run, with its `target` and `precision` set.

    `backend: openai`: the servers write (checked to serve one model first); the local target, as it was
    loaded, formats, masks and captures. Otherwise `engine` writes on the target as it writes
    (`writing_target`). `capture`: the states the batched loop keeps while it writes; the servers' and the
    rollouts' rows are read by the target once afterwards, and engine hf refuses it. `chat_mode` (chat or
    plain) names the end-of-turn token a server's text answer is given back."""
    if gen.backend == "openai":
        engine: TextEngine = RemoteEngine(target.tokenizer, target.eos_token_ids, gen, chat_mode,
                                          vocab_size=target.vocab_size)
        engine.check_servers()
        engine.target, engine.precision = target, {"backend": "openai", "served_model": engine.model}
        return engine
    target, precision = writing_target(target, gen)
    engine = _local_engine(gen, target, capture)
    engine.target, engine.precision = target, precision
    return engine


def _local_engine(gen, target, capture: CaptureSpec | None) -> TextEngine:
    if gen.engine == "speculative":  # on-policy rollouts by our decoder with the head (rollout.py)
        return speculative_engine(target, gen)
    sampling = SamplingConfig.from_flags(gen.do_sample, gen.temperature, gen.top_p)
    if gen.engine == "hf":
        if capture is not None:
            raise DataError("capture during generation needs generation.engine: continuous")
        return HFEngine(target.model, target.eos_token_ids, pad_token_id(target), gen.batch_size, sampling)
    return ContinuousBatcher(target.model, target.eos_token_ids, pad_token_id(target), gen.batch_size, sampling,
                             capture)


def writing_target(target, gen) -> tuple[Any, dict[str, str]]:
    """The target as it writes the data (dtype per `generation.dtype`, targets/precision.py; a copy where that
    differs, so the caller's model is left as it is) and a record of that precision for run.json /
    provenance.json."""
    dtype = inference_dtype(target.device, gen.dtype)
    model = inference_copy(target.model, dtype, gen.fp32_logits)
    if model is not target.model:
        target.fingerprint()  # of the weights as loaded (the copy's fp32 head would hash as one more tensor)
        log.info("the target writes in %s (generation.dtype: %s)", dtype_name(dtype), gen.dtype)
        target = dataclasses.replace(target, model=model)
    head = model.get_output_embeddings()
    logits = torch.float32 if isinstance(head, Float32Logits) else next(model.parameters()).dtype
    return target, {"dtype": dtype_name(dtype), "logits": dtype_name(logits)}
