"""Safetensors dtype names: their sizes, which of them a load may cast, and the torch dtypes
they mean. The one table of dtype names in refit_worker: checkpoint headers, manifests, the
broadcast wire and the model's expectations all say dtypes this way.

Importing this module imports no torch (the checkpoint side runs without it); torch_dtypes and
dtype_name import it when first called.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Bytes per element for each safetensors dtype (used to check a header's byte ranges).
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 0.5,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

# The names that stand for a torch dtype here (torch's attribute names): what the broadcast
# wire carries and what a model parameter's dtype is reported as.
_TORCH_ATTRS: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}

# The dtypes a probe reference may be scored in (torch's names; reference.score, the CLI).
SCORING_DTYPES: tuple[str, ...] = tuple(_TORCH_ATTRS[n] for n in ("F32", "BF16", "F16"))


def dtype_compatible(checkpoint: str, param: str) -> bool:
    """vLLM casts floating checkpoints to the parameter dtype on load; anything else (FP8,
    integer-packed quantized weights) must match exactly."""
    if checkpoint in FLOAT_DTYPES and param in FLOAT_DTYPES:
        return True
    return checkpoint == param


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Safetensors name -> torch dtype, for the names that have one here."""
    import torch

    return {name: getattr(torch, attr) for name, attr in _TORCH_ATTRS.items()}


@functools.cache
def _names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in torch_dtypes().items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; ValueError for one without a name here."""
    try:
        return _names()[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name this wire knows") from None


def dtype_name_or_str(dtype: torch.dtype) -> str:
    """dtype_name, or torch's own spelling for a dtype without one (it then matches no
    safetensors name, and a check against it names both)."""
    return _names().get(dtype, str(dtype))
