"""The comm hook's NaN/Inf test (one sum per bucket) sees every non-finite value isfinite sees."""

from __future__ import annotations

import pytest
import torch

from gpumon.guard.core import nonfinite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_one_nan_or_inf_anywhere_in_a_bucket_is_seen(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    buf = (torch.randn(4097, generator=g) * 100).to(dtype)
    assert not bool(nonfinite(buf))
    for where in (0, 2048, 4096):
        for bad in (float("nan"), float("inf"), float("-inf")):
            c = buf.clone()
            c[where] = bad
            assert bool(nonfinite(c)), (dtype, where, bad)
    both = buf.clone()
    both[1], both[2] = float("inf"), float("-inf")  # Inf - Inf: NaN, still seen
    assert bool(nonfinite(both))


def test_a_large_finite_fp16_bucket_is_not_called_non_finite() -> None:
    """fp16's largest values summed over a big bucket would overflow fp16 itself: summed in fp32."""
    assert not bool(nonfinite(torch.full((1 << 20,), 65504.0, dtype=torch.float16)))
