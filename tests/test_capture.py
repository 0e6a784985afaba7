"""Hidden-state capture follows the documented layer convention."""

import torch

from draftsmith.targets.capture import capture_forward, decoder_layers, default_eagle3_layers


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
    assert default_eagle3_layers(30) == [2, 15, 27]
    assert default_eagle3_layers(18) == [2, 9, 15]
    assert default_eagle3_layers(4) == [0, 2, 3]
    assert default_eagle3_layers(2) == [0, 1]
    for n in range(1, 40):
        layers = default_eagle3_layers(n)
        assert layers == sorted(set(layers)) and all(0 <= i < n for i in layers)
