"""Hidden-state capture follows the documented layer convention."""

import pytest
import torch

from draftsmith.capture.forward import capture_forward
from draftsmith.capture.layers import default_eagle3_layers
from draftsmith.errors import ConfigError
from draftsmith.targets.families import decoder_layers


def test_layers_are_pre_norm_outputs(tiny_target):
    model = tiny_target.model
    ids = torch.randint(3, tiny_target.vocab_size, (2, 7))
    cap = capture_forward(model, ids, layers=[0, -1])
    ref = model(ids, output_hidden_states=True)
    assert torch.allclose(cap.layers[0], ref.hidden_states[1])
    # the last layer's pre-norm output, normed, is what the lm_head sees
    normed = model.model.norm(cap.layers[-1])
    assert torch.allclose(normed, ref.hidden_states[-1], atol=1e-5)
    assert torch.allclose(cap.last_hidden, ref.hidden_states[-1])
    assert torch.allclose(cap.logits, ref.logits)
    assert len(decoder_layers(model)) == 2


def test_default_eagle3_layers():
    """The ecosystem's defaults: vLLM / SGLang / speculators capture the inputs of layers (2, L/2, L-3), the
    outputs of draftsmith's (1, L/2-1, L-4); shallow targets spread over what the stacks capture (0..L-2)."""
    from draftsmith.capture.layers import uncapturable_layers

    assert default_eagle3_layers(30) == [1, 14, 26]  # vLLM: "auxiliary layers (2, 15, 27)"
    assert default_eagle3_layers(32) == [1, 15, 28]
    assert default_eagle3_layers(36) == [1, 17, 32]
    assert default_eagle3_layers(4) == [0, 1, 2]
    for n in range(4, 80):
        layers = default_eagle3_layers(n)
        assert layers == sorted(set(layers)) and len(layers) == 3 and all(0 <= i <= n - 2 for i in layers)
        assert uncapturable_layers(layers, n) == []
        if n >= 7:
            assert [i + 1 for i in layers] == [2, n // 2, n - 3]
    for n in (1, 2, 3):
        with pytest.raises(ConfigError, match=f"has {n} layer"):
            default_eagle3_layers(n)
    assert uncapturable_layers([0, 2, 3], 4) == [3]
