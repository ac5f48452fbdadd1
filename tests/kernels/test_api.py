"""chunk_attention input validation: clear ValueError/TypeError for bad input."""

from __future__ import annotations

import pytest
import torch

from chunkserve.kernels import chunk_attention


@pytest.fixture()
def small(cache_tree):
    tree = cache_tree(0, 2, 64, 16, torch.float32, device="cpu")
    return tree, [tree.add([1, 2, 3] * 6), tree.add([1, 2, 3] * 6 + [4])]


def test_unknown_backend_raises_value_error(small):
    tree, ids = small
    with pytest.raises(ValueError, match="backend"):
        chunk_attention(torch.randn(2, 4, 64), tree.cache, ids, backend="flashinfer")


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((2, 4), torch.float32, r"\[batch, Hq, D\]"),
        ((3, 4, 64), torch.float32, "3 rows but 2 sequences"),
        ((2, 4, 32), torch.float32, "head dim"),
        ((2, 3, 64), torch.float32, "multiple of Hkv"),
        ((2, 4, 64), torch.float16, "dtype"),
        ((2, 4, 64), torch.float64, "dtype"),
    ],
)
def test_bad_query_shapes_and_dtypes_raise_value_error(small, shape, dtype, match):
    tree, ids = small
    with pytest.raises(ValueError, match=match):
        chunk_attention(torch.randn(*shape).to(dtype), tree.cache, ids, backend="torch")


def test_bad_layer_and_non_tensor_query(small):
    tree, ids = small
    with pytest.raises(ValueError, match="layer"):
        chunk_attention(torch.randn(2, 4, 64), tree.cache, ids, layer=1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        chunk_attention([[0.0]], tree.cache, ids)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.125, True])
def test_a_scale_that_is_not_a_finite_positive_number_is_refused(small, scale):
    """The torch backends returned zeros for a NaN scale where the reference returned NaN."""
    tree, ids = small
    with pytest.raises(ValueError, match="scale"):
        chunk_attention(torch.randn(2, 4, 64), tree.cache, ids, scale=scale)


@pytest.mark.parametrize("bad", [[0.9, 1], [True, 0]])
def test_sequence_ids_that_are_not_integers_are_refused(small, bad):
    """A float id was truncated (0.9 read as sequence 0) and a bool read as 0 or 1."""
    tree, _ = small
    with pytest.raises(TypeError, match="seq_ids"):
        chunk_attention(torch.randn(2, 4, 64), tree.cache, bad)
