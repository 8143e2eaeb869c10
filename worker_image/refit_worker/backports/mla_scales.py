"""vLLM's BMM scales fix, MLA decode: scale caches of the FlashInfer MLA, sparse MLA and
Tokenspeed MLA impls.

Each caches its BMM scales the first time it runs (``if self.bmm1_scale is None``) from
the layer's host floats. The backport clears the cache before every call, so the
original code recomputes it from the current floats: eager and piecewise execution
follow a reload. Full-graph replay of these kernels keeps capture-time host scalars
(``unsafe_reasons`` reports that configuration).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refit_worker.contract import CAP_MLA_DECODE_SCALES

from ._patch import Outcome, State, import_backend, installed_by, patch_method, source_of

BACKPORT = "mla-decode-scales"


@dataclass(frozen=True)
class Target:
    module: str
    cls: str
    method: str  # the method whose lazy branch fills the cache
    cached: tuple[str, ...]  # the cache attributes, cleared before each call


TARGETS = (
    Target(
        "vllm.v1.attention.backends.mla.flashinfer_mla",
        "FlashInferMLAImpl",
        "forward_mqa",
        ("bmm1_scale", "bmm2_scale"),
    ),
    Target(
        "vllm.v1.attention.backends.mla.flashinfer_mla_sparse",
        "FlashInferMLASparseImpl",
        "_prepare_mqa_kernel",
        ("bmm1_scale", "bmm2_scale"),
    ),
    Target(
        "vllm.v1.attention.backends.mla.tokenspeed_mla",
        "TokenspeedMLAImpl",
        "forward_mqa",
        ("softmax_scale", "output_scale"),
    ),
)


def has_lazy_cache(method: Any, cached: tuple[str, ...]) -> bool:
    source = source_of(method)
    return source is None or any(f"self.{name} is None" in source for name in cached)


def _make(cached: tuple[str, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            for name in cached:
                setattr(self, name, None)
            return original(self, *args, **kwargs)

        return method

    return make


def apply_one(target: Target) -> Outcome:
    mod = import_backend(target.module)
    if mod is None:
        return Outcome(State.NOT_APPLICABLE, f"{target.module} cannot be imported here")
    cls = getattr(mod, target.cls)
    current = cls.__dict__.get(target.method)
    where = f"{target.cls}.{target.method}"
    if current is None:
        return Outcome.missing(f"{where} not found")
    if installed_by(current) == BACKPORT:
        return Outcome(State.BACKPORTED, where)
    if not has_lazy_cache(current, target.cached):
        return Outcome(State.NATIVE, where)
    patch_method(cls, target.method, BACKPORT, _make(target.cached))
    return Outcome(State.BACKPORTED, where)


def apply() -> dict[str, Outcome]:
    outcomes: list[Outcome] = []
    for target in TARGETS:
        try:
            outcomes.append(apply_one(target))
        except Exception as exc:
            outcomes.append(Outcome.missing(f"{target.cls}: {exc!r}"))
    missing = [o.detail for o in outcomes if not o.state.in_effect]
    if missing:
        return {CAP_MLA_DECODE_SCALES: Outcome.missing("; ".join(missing))}
    states = {o.state for o in outcomes}
    state = (
        State.BACKPORTED
        if State.BACKPORTED in states
        else State.NATIVE
        if State.NATIVE in states
        else State.NOT_APPLICABLE
    )
    detail = "; ".join(f"{o.detail}: {o.state.value}" for o in outcomes)
    return {CAP_MLA_DECODE_SCALES: Outcome(state, detail)}
