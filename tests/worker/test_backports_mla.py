"""vLLM's BMM scales fix, MLA decode: the FlashInfer MLA, sparse MLA and Tokenspeed MLA impls
read the layer's current scales on every call after the backport (and keep the start-up ones
without it).

These impls need a GPU to construct, so each is built as upstream's tests build such
classes on CPU: ``object.__new__`` plus the attributes the decode path reads. The kernel
entry points (and their CUDA workspaces) are recorders; the impl methods are vLLM's.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.utils.flashinfer as vllm_flashinfer
from refit_worker import backports
from refit_worker.backports._patch import State, original_method
from refit_worker.contract import CAP_MLA_DECODE_SCALES

SCALE = 0.1
HEADS, LORA, ROPE, NOPE = 16, 64, 16, 32


@pytest.fixture(scope="module", autouse=True)
def applied() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_flashinfer, "has_nvidia_artifactory", lambda: False)
        backports.apply_all()
        assert backports.status()[CAP_MLA_DECODE_SCALES].state is State.BACKPORTED
        yield


def scale_layer(q: float, k: float) -> SimpleNamespace:
    """The host floats a layer carries after (re)load, as the FP8 kv-cache method sets."""
    return SimpleNamespace(_q_scale_float=q, _k_scale_float=k, _v_scale_float=k)


def reload(layer: SimpleNamespace, q: float, k: float) -> None:
    layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = q, k, k


def decode_metadata() -> SimpleNamespace:
    decode = SimpleNamespace(
        block_table=torch.zeros(2, 1, dtype=torch.int32),
        seq_lens=torch.full((2,), 5, dtype=torch.int32),
        max_query_len=1,
        query_start_loc=None,
        dcp_tot_seq_lens=None,
    )
    return SimpleNamespace(
        decode=decode, causal=True, num_decodes=2, num_decode_tokens=2, max_seq_len=5
    )


class Recorder:
    def __init__(self, result: Callable[..., Any]) -> None:
        self.calls: list[dict[str, Any]] = []
        self._result = result

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self._result(**kwargs)


def _query_shaped(**kwargs: Any) -> torch.Tensor:
    q = kwargs["query"]
    return torch.zeros(*q.shape[:-1], LORA)


def _common(impl: Any) -> None:
    impl.scale = SCALE
    impl.kv_cache_dtype = "fp8"
    impl.dcp_world_size = 1
    impl.dcp_rank = 0
    impl.need_to_return_lse_for_decode = False
    impl.kv_lora_rank = LORA
    impl.qk_rope_head_dim = ROPE
    impl.qk_nope_head_dim = NOPE


def run_flashinfer_mla(monkeypatch: pytest.MonkeyPatch, forward: Any = None) -> list[Any]:
    from vllm.v1.attention.backends.mla import flashinfer_mla

    kernel = Recorder(_query_shaped)
    monkeypatch.setattr(flashinfer_mla, "trtllm_batch_decode_with_kv_cache_mla", kernel)
    monkeypatch.setattr(flashinfer_mla, "_get_workspace_buffer", lambda lse: torch.zeros(8))
    impl: Any = object.__new__(flashinfer_mla.FlashInferMLAImpl)
    _common(impl)
    impl.bmm1_scale = impl.bmm2_scale = None
    impl._mla_counter_bytes, impl._mla_counter_max_batch = None, 8
    run = (forward or flashinfer_mla.FlashInferMLAImpl.forward_mqa).__get__(impl)
    layer = scale_layer(1.0, 1.0)
    q = torch.zeros(2, HEADS, LORA + ROPE)
    cache = torch.zeros(4, 16, LORA + ROPE)
    run(q, cache, decode_metadata(), layer)
    reload(layer, 0.5, 0.25)
    run(q, cache, decode_metadata(), layer)
    return [(c["bmm1_scale"], c["bmm2_scale"]) for c in kernel.calls]


def test_flashinfer_mla_decode_scales_follow_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    scales = run_flashinfer_mla(monkeypatch)
    assert scales == [(SCALE, 1.0), pytest.approx((SCALE * 0.5 * 0.25, 0.25))]


def test_unpatched_flashinfer_mla_keeps_start_up_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLAImpl

    unpatched = original_method(FlashInferMLAImpl, "forward_mqa")
    assert run_flashinfer_mla(monkeypatch, unpatched) == [(SCALE, 1.0), (SCALE, 1.0)]


def prepare_sparse(prepare: Any) -> list[tuple[float, float]]:
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

    impl: Any = object.__new__(FlashInferMLASparseImpl)
    _common(impl)
    impl.bmm1_scale = impl.bmm2_scale = None
    impl._workspace_buffer = torch.zeros(8)  # allocated on CUDA by the first call
    layer = scale_layer(1.0, 1.0)
    seen = []
    for q, k in ((1.0, 1.0), (0.5, 0.25)):
        reload(layer, q, k)
        # The scales _run_mqa_kernel hands the sparse decode kernel on this call.
        prepare(impl, layer, torch.device("cpu"))
        seen.append((impl.bmm1_scale, impl.bmm2_scale))
    return seen


def test_flashinfer_mla_sparse_scales_follow_reload() -> None:
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

    patched = prepare_sparse(FlashInferMLASparseImpl._prepare_mqa_kernel)
    assert patched == [(SCALE, 1.0), pytest.approx((SCALE * 0.5 * 0.25, 0.25))]
    unpatched = prepare_sparse(original_method(FlashInferMLASparseImpl, "_prepare_mqa_kernel"))
    assert unpatched == [(SCALE, 1.0), (SCALE, 1.0)]


def run_tokenspeed(monkeypatch: pytest.MonkeyPatch, forward: Any = None) -> list[Any]:
    from vllm.v1.attention.backends.mla import tokenspeed_mla

    kernel = Recorder(_query_shaped)
    # The tokenspeed_mla kernel package is GPU-only; its entry point is the recorder.
    stub = types.ModuleType("tokenspeed_mla")
    stub.tokenspeed_mla_decode = kernel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tokenspeed_mla", stub)
    monkeypatch.setattr(tokenspeed_mla, "_get_workspace", lambda *args: torch.zeros(8))
    impl: Any = object.__new__(tokenspeed_mla.TokenspeedMLAImpl)
    _common(impl)
    impl.softmax_scale = impl.output_scale = None
    impl._min_split_kv, impl._max_decode_tokens = 1, 0
    impl._parallel_config = SimpleNamespace(cp_kv_cache_interleave_size=1)
    run = (forward or tokenspeed_mla.TokenspeedMLAImpl.forward_mqa).__get__(impl)
    layer = scale_layer(1.0, 1.0)
    q = torch.zeros(2, HEADS, LORA + ROPE, dtype=torch.float8_e4m3fn)
    cache = torch.zeros(4, 16, LORA + ROPE)
    run(q, cache, decode_metadata(), layer)
    reload(layer, 0.5, 0.25)
    run(q, cache, decode_metadata(), layer)
    return [(c["softmax_scale"], c["output_scale"]) for c in kernel.calls]


def test_tokenspeed_mla_scales_follow_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends.mla.tokenspeed_mla import TokenspeedMLAImpl

    assert run_tokenspeed(monkeypatch) == [
        (SCALE, 1.0),
        pytest.approx((SCALE * 0.5 * 0.25, 0.25)),
    ]
    unpatched = original_method(TokenspeedMLAImpl, "forward_mqa")
    assert run_tokenspeed(monkeypatch, unpatched) == [(SCALE, 1.0), (SCALE, 1.0)]
