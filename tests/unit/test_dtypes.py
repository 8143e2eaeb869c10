"""refit_worker.dtypes: the one table of safetensors dtype names."""

from __future__ import annotations

import pytest
import torch
from refit_worker import dtypes


def test_every_torch_name_has_its_size_and_maps_back() -> None:
    for name, dtype in dtypes.torch_dtypes().items():
        assert dtypes.DTYPE_BYTES[name] == dtype.itemsize
        assert dtypes.dtype_name(dtype) == name


def test_a_dtype_without_a_name() -> None:
    with pytest.raises(ValueError, match="no safetensors name"):
        dtypes.dtype_name(torch.complex64)
    assert dtypes.dtype_name_or_str(torch.complex64) == "torch.complex64"
    assert dtypes.dtype_name_or_str(torch.bfloat16) == "BF16"


def test_floating_dtypes_cast_and_the_rest_must_match() -> None:
    assert dtypes.dtype_compatible("BF16", "F32")
    assert not dtypes.dtype_compatible("F8_E4M3", "BF16")
    assert dtypes.dtype_compatible("I8", "I8")
