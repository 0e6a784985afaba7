"""Which layers a capture reads: the layer convention every draftsmith module and artifact uses, and the
EAGLE-3 layer choices the serving stacks agree on.

Layer i, 0-based, is the OUTPUT of decoder layer i, before the final norm. Layer -1 means the last decoder
layer's output (pre-norm). `final` (the post-norm state the lm_head sees) is not a layer: a capture returns
it separately as `last_hidden` (forward.py) — that is Medusa's input.
"""

from __future__ import annotations

from draftsmith.errors import ConfigError


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    out = []
    for i in layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ConfigError(f"layer {i} is out of range for a target with {num_layers} layers")
        out.append(j)
    return out


def default_eagle3_layers(num_layers: int) -> list[int]:
    """The EAGLE-3 fusion layers the serving ecosystem defaults to, as draftsmith ids (decoder-layer outputs).

    vLLM, SGLang and speculators take the residual stream entering layers (2, L/2, L-3); entering layer i is
    the output of layer i-1, so draftsmith's ids are (1, L/2-1, L-4), and a head trained on them fuses the same
    features as the published speculators heads users start from. Targets too shallow for those three to be
    distinct (under 7 layers) get first / middle / last of the layers the stacks capture (outputs of 0..L-2:
    the last layer's output never enters a layer, so no stack captures it); under 4 layers there are not
    three of them.
    """
    L = num_layers
    picked = [1, L // 2 - 1, L - 4]
    if not 0 <= picked[0] < picked[1] < picked[2]:
        picked = sorted({0, (L - 1) // 2, L - 2})
    if len(picked) < 3 or picked[0] < 0:
        raise ConfigError(f"EAGLE-3 fuses 3 distinct layers a serving stack captures (outputs of layers 0..L-2), "
                          f"and this target has {L} layer(s): use EAGLE-1 or a deeper target")
    return picked


def bench_layers(num_layers: int) -> list[int]:
    """The layers a benchmark captures to cost what an EAGLE-3 job would: its default layers, or every layer of
    a target too shallow to have three a serving stack captures."""
    try:
        return default_eagle3_layers(num_layers)
    except ConfigError:
        return list(range(num_layers))


def uncapturable_layers(layers: list[int], num_layers: int) -> list[int]:
    """The EAGLE-3 feature layers (draftsmith ids, resolved) no serving stack captures.

    vLLM and SGLang record the residual stream entering decoder layers 0..L-1, i.e. the outputs of layers
    -1 (the embeddings) .. L-2: the output of the last layer (id L-1) is never captured, and a head fed it would
    get 2 features for its 3 x H fc once served.
    """
    return [i for i in layers if i >= num_layers - 1]
