"""targets/gemm.py: the few-row linear path equals F.linear, and only inference on CPU fp32 takes it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.targets import gemm
from draftsmith.targets.gemm import RowsLinear, rows_linear, use_rows_linear


@pytest.mark.parametrize("out_features", [48, gemm.VOCAB_OUT])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 33, 64, 65])
def test_rows_linear_equals_linear(out_features, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(out_features, 24, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(1, rows, 24, generator=g)
    with torch.no_grad():
        for bias in (None, b):
            y = rows_linear(x, w, bias)
            assert y.shape == (1, rows, out_features) and y.is_contiguous()
            torch.testing.assert_close(y, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)


def test_rows_linear_takes_the_transposed_product_only_where_measured():
    w = torch.randn(16, 8)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert gemm._transposed(x, w)
        assert not gemm._transposed(x[:1], w)  # one row: the matrix-vector product is already fast
        assert not gemm._transposed(torch.randn(gemm.SMALL_ROWS + 1, 8), w)
        assert gemm._transposed(torch.randn(gemm.VOCAB_ROWS, 8), torch.randn(gemm.VOCAB_OUT, 8))
        assert not gemm._transposed(x.bfloat16(), w.bfloat16())  # measured in float32 only
    xg = x.clone().requires_grad_(True)
    assert not gemm._transposed(xg, w)  # training keeps F.linear (and its backward)
    y = rows_linear(xg, w)
    y.sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(4, 8))


def test_use_rows_linear_swaps_plain_linears_only():
    class Sub(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Sub(8, 4), nn.Linear(4, 3, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 8)
    with torch.no_grad():
        ref = model(x)
        assert use_rows_linear(model) == 2
        assert type(model[0]) is RowsLinear and type(model[2]) is Sub and type(model[3]) is RowsLinear
        torch.testing.assert_close(model(x), ref, atol=1e-6, rtol=1e-6)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert type(copy.deepcopy(model)[0]) is RowsLinear
    assert use_rows_linear(model) == 0  # idempotent


def test_targets_are_loaded_with_rows_linear(tiny_target):
    kinds = {type(m) for m in tiny_target.model.modules() if isinstance(m, nn.Linear)}
    assert kinds == {RowsLinear}


def test_compare_times_both_paths_and_restores_the_switch(tiny_target):
    saved = gemm.ENABLED
    res = gemm.compare(tiny_target, [1, 3], context=8, repeats=1)
    assert set(res) == {1, 3} and all(t["linear"] > 0 and t["rows"] > 0 for t in res.values())
    assert gemm.ENABLED == saved
