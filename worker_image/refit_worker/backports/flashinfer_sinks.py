"""vLLM PR #48251, FlashInfer attention sinks: refreshed in place by every post-load pass.

FlashInfer needs float32 sinks. Before the fix, ``process_weights_after_loading`` replaced
``self.sinks`` with a detached float32 copy, so a reload updated the BF16/FP16 source
parameter but not the tensor the kernels read. vLLM 0.32/0.33 keep the source
(``_sinks_source``) and copy into the float32 tensor; this module checks that by
behaviour and, where it is missing, records the source and refreshes in place itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from refit_worker.contract import CAP_FLASHINFER_SINKS_IN_PLACE

from ._patch import Outcome, State, import_backend, installed_by, patch_method

BACKPORT = "flashinfer-sinks-in-place"
MODULE = "vllm.v1.attention.backends.flashinfer"
SOURCE_ATTR = "_refit_sinks_source"  # where the backport keeps the sink parameter


def refreshes_sinks_in_place(cls: type) -> bool:
    """Two post-load passes over a BF16 sink parameter whose values change in between
    (as a reload does): the float32 runtime tensor must follow, at the same address."""
    impl: Any = object.__new__(cls)
    source = torch.nn.Parameter(
        torch.tensor([0.25, -0.5], dtype=torch.bfloat16), requires_grad=False
    )
    impl.sinks = source  # as __init__ stores it, in every version
    impl._sinks_source = source  # vLLM >= 0.32 also keeps the source here
    setattr(impl, SOURCE_ATTR, source)  # and the backport here
    cls.process_weights_after_loading(impl, torch.bfloat16)  # type: ignore[attr-defined]
    first = impl.sinks
    if not _matches(first, source):
        return False
    address = first.data_ptr()
    source.data.copy_(torch.tensor([1.5, 0.75], dtype=torch.bfloat16))
    cls.process_weights_after_loading(impl, torch.bfloat16)  # type: ignore[attr-defined]
    return _matches(impl.sinks, source) and impl.sinks.data_ptr() == address


def _matches(runtime: Any, source: torch.Tensor) -> bool:
    return (
        isinstance(runtime, torch.Tensor)
        and runtime.dtype == torch.float32
        and torch.equal(runtime, source.float())
    )


def _make_init(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        setattr(self, SOURCE_ATTR, bound.arguments.get("sinks"))

    return __init__


def _make_process(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(self: Any, act_dtype: torch.dtype) -> None:
        runtime = self.sinks
        original(self, act_dtype)
        source = getattr(self, SOURCE_ATTR, None)
        if source is None or source.dtype == torch.float32:
            return  # float32 sinks are used as they are: nothing is derived
        if (
            isinstance(runtime, torch.Tensor)
            and runtime is not source
            and runtime.dtype == torch.float32
            and runtime.shape == source.shape
            and runtime.device == source.device
        ):
            runtime.copy_(source)
            self.sinks = runtime
        else:
            self.sinks = source.to(torch.float32)

    return process_weights_after_loading


def apply(cls: type | None = None) -> dict[str, Outcome]:
    """``cls`` defaults to vLLM's FlashInferImpl (tests pass a stand-in for old code)."""
    if cls is None:
        mod = import_backend(MODULE)
        if mod is None:
            na = Outcome(State.NOT_APPLICABLE, "flashinfer is not installed")
            return {CAP_FLASHINFER_SINKS_IN_PLACE: na}
        cls = mod.FlashInferImpl
    if installed_by(cls.__dict__.get("process_weights_after_loading")) == BACKPORT:
        return {CAP_FLASHINFER_SINKS_IN_PLACE: Outcome(State.BACKPORTED, "sinks kept")}
    if refreshes_sinks_in_place(cls):
        return {CAP_FLASHINFER_SINKS_IN_PLACE: Outcome(State.NATIVE, "sinks refreshed")}
    patch_method(cls, "__init__", BACKPORT, _make_init)
    patch_method(cls, "process_weights_after_loading", BACKPORT, _make_process)
    if not refreshes_sinks_in_place(cls):
        return {CAP_FLASHINFER_SINKS_IN_PLACE: Outcome.missing("backport did not take")}
    return {CAP_FLASHINFER_SINKS_IN_PLACE: Outcome(State.BACKPORTED, "sinks kept")}
