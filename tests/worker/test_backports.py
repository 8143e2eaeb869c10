"""The reload-safety backports, driven through the installed vLLM's real classes on CPU.

Only GPU kernel entry points (and the CUDA workspace they need) are replaced, by recorders
of the arguments they receive; vLLM's Attention, FlashInferImpl, Fp8KVCacheMethod and
MLAAttention run their own code. A "reload" loads new k/v scales through the real FP8
kv-cache method and post-load processing, as layerwise reload does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import vllm.utils.flashinfer as vllm_flashinfer
from refit_worker import backports
from refit_worker.backports import flashinfer_scales, mla_weights
from refit_worker.backports._patch import State, original_method
from refit_worker.contract import (
    CAP_ATTENTION_O_SCALE_RESET,
    CAP_FLASHINFER_BMM_SCALES,
    CAP_FLASHINFER_SINKS_IN_PLACE,
    CAP_MLA_DECODE_SCALES,
    CAP_MLA_WEIGHTS_IN_PLACE,
    CAP_MOE_RELAYOUT_ON_RELOAD,
    CAP_TRTLLM_DECODE_DEVICE_SCALES,
)

SCALE = 0.125
HEADS, KV_HEADS, HEAD_SIZE, BLOCK, BATCH = 4, 2, 64, 16, 2


@pytest.fixture(scope="module")
def fi() -> Iterator[Any]:
    """vLLM's FlashInfer backend module with the backports applied, offline."""
    with pytest.MonkeyPatch.context() as mp:
        # It sends an HTTP request to NVIDIA's artifactory; nothing may leave the machine.
        mp.setattr(vllm_flashinfer, "has_nvidia_artifactory", lambda: False)
        backports.apply_all()
        import vllm.v1.attention.backends.flashinfer as module

        assert backports.status()[CAP_FLASHINFER_BMM_SCALES].state.in_effect
        # The trtllm workspace is a CUDA allocation; a CPU buffer stands in for it.
        mp.setattr(module, "trtllm_workspace_buffer", torch.zeros(64, dtype=torch.uint8))
        yield module


class KernelRecorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)

    @property
    def last(self) -> dict[str, Any]:
        return self.calls[-1]


@pytest.fixture
def decode_kernel(fi: Any, monkeypatch: pytest.MonkeyPatch) -> KernelRecorder:
    recorder = KernelRecorder()
    monkeypatch.setattr(fi, "trtllm_batch_decode_with_kv_cache", recorder)
    return recorder


def make_layer(fi: Any, *, sinks: torch.Tensor | None = None) -> Any:
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    extra: dict[str, Any] = {} if sinks is None else {"sinks": sinks}
    with set_current_vllm_config(VllmConfig()):
        layer = Attention(
            num_heads=HEADS,
            head_size=HEAD_SIZE,
            scale=SCALE,
            num_kv_heads=KV_HEADS,
            cache_config=CacheConfig(cache_dtype="fp8_e4m3"),
            quant_config=Fp8Config(activation_scheme="static"),
            prefix="model.layers.0.self_attn.attn",
            attn_backend=fi.FlashInferBackend,
            **extra,
        )
    assert isinstance(layer.impl, fi.FlashInferImpl)
    return layer


def load_scales(layer: Any, q: float, k: float, v: float) -> None:
    """What a (re)load does to one attention layer: the checkpoint's scales go through the
    FP8 kv-cache method, then the layer's post-load processing."""
    if not hasattr(layer, "k_scale"):  # consumed by the previous load; reload restores it
        layer.quant_method.create_weights(layer)
    for name, value in (("q_scale", q), ("k_scale", k), ("v_scale", v)):
        param = getattr(layer, name)
        param.weight_loader(param, torch.tensor(value))
    layer.quant_method.process_weights_after_loading(layer)
    layer.process_weights_after_loading(torch.bfloat16)


def decode(
    fi: Any,
    layer: Any,
    *,
    forward: Any = None,
    output_scale: torch.Tensor | None = None,
    kernel: Any = None,
) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    md = fi.FlashInferMetadata(
        kv_cache_layout=KVCacheLayout.LBHNC,
        num_actual_tokens=BATCH,
        slot_mapping=torch.arange(BATCH),
        q_data_type_prefill=fi.FP8_DTYPE,
        q_data_type_decode=fi.FP8_DTYPE,
        num_decodes=BATCH,
        num_decode_tokens=BATCH,
        num_prefills=0,
        num_prefill_tokens=0,
        causal=True,
        prefill=None,
        decode=fi.FlashInferTrtllmAPIDecode(
            kernel=kernel or fi.FlashInferDecodeKernel.TRTLLM_GEN,
            block_tables=torch.zeros(BATCH, 1, dtype=torch.int32),
            seq_lens=torch.full((BATCH,), 5, dtype=torch.int32),
            max_seq_len=5,
        ),
    )
    query = torch.zeros(BATCH, HEADS, HEAD_SIZE, dtype=fi.FP8_DTYPE)
    kv_cache = torch.zeros(2, KV_HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.uint8)
    out_dtype = fi.FP8_DTYPE if output_scale is not None else torch.bfloat16
    output = torch.zeros(BATCH, HEADS, HEAD_SIZE, dtype=out_dtype)
    run = forward or layer.impl.forward
    if forward is not None:
        run = forward.__get__(layer.impl)
    run(layer, query, None, None, kv_cache, md, output, output_scale=output_scale)


def host_scales(call: dict[str, Any]) -> tuple[float, float]:
    bmm1, bmm2 = call["bmm1_scale"], call["bmm2_scale"]
    assert isinstance(bmm1, float) and isinstance(bmm2, float), "eager decode takes floats"
    return bmm1, bmm2


# --- what the installed vLLM has, and idempotence --------------------------------------


def test_installed_vllm_capabilities(fi: Any) -> None:
    states = {name: outcome.state for name, outcome in backports.status().items()}
    assert states == {
        CAP_FLASHINFER_BMM_SCALES: State.BACKPORTED,
        CAP_ATTENTION_O_SCALE_RESET: State.BACKPORTED,
        CAP_TRTLLM_DECODE_DEVICE_SCALES: State.BACKPORTED,
        CAP_MLA_DECODE_SCALES: State.BACKPORTED,
        CAP_FLASHINFER_SINKS_IN_PLACE: State.NATIVE,
        CAP_MLA_WEIGHTS_IN_PLACE: State.NATIVE,
        CAP_MOE_RELAYOUT_ON_RELOAD: State.BACKPORTED,  # vLLM #42821 on CPU
    }
    assert backports.capabilities() == list(states)


def test_applying_twice_changes_nothing(fi: Any) -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    before = (fi.FlashInferImpl.forward, Attention.process_weights_after_loading)
    backports.apply_all()
    backports.status()
    backports.apply_all()
    assert (fi.FlashInferImpl.forward, Attention.process_weights_after_loading) == before
    # One wrapper each, directly around vLLM's own function.
    for cls, name in ((fi.FlashInferImpl, "forward"), (Attention, "process_weights_after_loading")):
        wrapper = cls.__dict__[name]
        assert wrapper.__refit_backport__ and wrapper.__wrapped__ is original_method(cls, name)
        assert not hasattr(wrapper.__wrapped__, "__refit_backport__")


def test_plugin_register_is_repeatable(fi: Any) -> None:
    from refit_worker.plugin import register

    forward = fi.FlashInferImpl.forward
    register()
    register()
    assert fi.FlashInferImpl.forward is forward


# --- the BMM scales fix: FlashInfer BMM scales follow a reload ------------------------------


def test_decode_scales_follow_reload(fi: Any, decode_kernel: KernelRecorder) -> None:
    layer = make_layer(fi)
    load_scales(layer, 1.0, 1.0, 1.0)  # e.g. a dummy-weights start
    decode(fi, layer)
    assert host_scales(decode_kernel.last) == (SCALE, 1.0)

    load_scales(layer, 0.75, 0.5, 0.25)
    decode(fi, layer)
    assert host_scales(decode_kernel.last) == pytest.approx((SCALE * 0.75 * 0.5, 0.25))


def test_unpatched_forward_keeps_start_up_scales(fi: Any, decode_kernel: KernelRecorder) -> None:
    """The same check against vLLM's own forward fails: the bug vLLM's BMM scales fix
    ("Recompute FlashInfer BMM scales when a weight reload changes the KV scales") removes, on
    this install."""
    layer = make_layer(fi)
    unpatched = original_method(fi.FlashInferImpl, "forward")
    load_scales(layer, 1.0, 1.0, 1.0)
    decode(fi, layer, forward=unpatched)
    load_scales(layer, 0.75, 0.5, 0.25)
    decode(fi, layer, forward=unpatched)
    assert host_scales(decode_kernel.last) == (SCALE, 1.0)  # stale


def test_fused_fp8_output_factor_follows_reload(fi: Any, decode_kernel: KernelRecorder) -> None:
    layer = make_layer(fi)
    o_scale = torch.tensor(2.0)  # the next quant op's input scale
    load_scales(layer, 1.0, 1.0, 1.0)
    decode(fi, layer, output_scale=o_scale)
    assert host_scales(decode_kernel.last) == (SCALE, 1.0 / 2.0)

    o_scale.copy_(torch.tensor(4.0))  # the reload rewrites the quant op's scale in place
    load_scales(layer, 1.0, 0.5, 0.25)
    assert layer._o_scale_float is None  # Attention.process_weights_after_loading reset it
    decode(fi, layer, output_scale=o_scale)
    assert host_scales(decode_kernel.last) == pytest.approx((SCALE * 0.5, 0.25 / 4.0))
    assert layer._o_scale_float == 4.0


def test_unpatched_attention_keeps_cached_o_scale(fi: Any) -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    layer = make_layer(fi)
    layer._o_scale_float = 2.0
    original_method(Attention, "process_weights_after_loading")(layer, torch.bfloat16)
    assert layer._o_scale_float == 2.0  # not reset: the fused factor would stay stale
    layer.process_weights_after_loading(torch.bfloat16)
    assert layer._o_scale_float is None


def test_capture_uses_device_scales_read_from_buffers(
    fi: Any, decode_kernel: KernelRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = make_layer(fi)
    load_scales(layer, 1.0, 1.0, 1.0)
    monkeypatch.setattr(flashinfer_scales, "is_capturing", lambda: True)
    decode(fi, layer)
    bmm1, bmm2 = decode_kernel.last["bmm1_scale"], decode_kernel.last["bmm2_scale"]
    assert isinstance(bmm1, torch.Tensor) and bmm1.dtype == torch.float32
    assert isinstance(bmm2, torch.Tensor) and bmm2.dtype == torch.float32
    assert bmm1.item() == SCALE
    # bmm2 is the layer's own v-scale buffer: a replayed graph reads its current value.
    assert bmm2.data_ptr() == layer._v_scale.data_ptr()

    # An in-place buffer update (what a reload does to these buffers) without touching
    # the host floats: the capture path follows the buffers, eager follows the floats.
    layer._q_scale.copy_(torch.tensor(0.75))
    layer._k_scale.copy_(torch.tensor(0.5))
    layer._v_scale.copy_(torch.tensor(0.25))
    decode(fi, layer)
    assert decode_kernel.last["bmm1_scale"].item() == pytest.approx(SCALE * 0.75 * 0.5)
    assert bmm2.item() == 0.25
    monkeypatch.setattr(flashinfer_scales, "is_capturing", lambda: False)
    decode(fi, layer)
    assert host_scales(decode_kernel.last) == (SCALE, 1.0)


def test_capture_with_fused_fp8_output_divides_by_output_scale_buffer(
    fi: Any, decode_kernel: KernelRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = make_layer(fi)
    load_scales(layer, 1.0, 0.5, 0.25)
    o_scale = torch.tensor(2.0)
    decode(fi, layer, output_scale=o_scale)  # warm-up run fills the host o scale
    monkeypatch.setattr(flashinfer_scales, "is_capturing", lambda: True)
    decode(fi, layer, output_scale=o_scale)
    assert decode_kernel.last["bmm2_scale"].item() == pytest.approx(0.25 / 2.0)


# --- vLLM PR #48251: sinks and MLA weights refreshed in place ----------------------------


def test_flashinfer_sinks_refreshed_in_place(fi: Any) -> None:
    source = torch.nn.Parameter(
        torch.tensor([0.5, -1.0, 0.25, 2.0], dtype=torch.bfloat16), requires_grad=False
    )
    layer = make_layer(fi, sinks=source)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    runtime = layer.impl.sinks
    assert runtime.dtype == torch.float32 and torch.equal(runtime, source.float())
    address = runtime.data_ptr()
    source.data.copy_(torch.tensor([1.0, 1.5, -0.5, 0.0], dtype=torch.bfloat16))  # reload
    layer.impl.process_weights_after_loading(torch.bfloat16)
    assert torch.equal(layer.impl.sinks, source.float())
    assert layer.impl.sinks.data_ptr() == address


def test_mla_w_uv_w_uk_t_keep_storage(fi: Any) -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = mla_weights.probe_layer(MLAAttention)
    layer.process_weights_after_loading(torch.float32)
    addresses = (layer.W_UV.data_ptr(), layer.W_UK_T.data_ptr())
    for step in range(2):  # two reloads, each followed by post-load processing
        with torch.no_grad():
            layer.kv_b_proj.weight.copy_(torch.randn_like(layer.kv_b_proj.weight) + step)
        layer.process_weights_after_loading(torch.float32)
        w_uv, w_uk_t = mla_weights.expected_weights(layer.kv_b_proj.weight)
        assert torch.equal(layer.W_UV, w_uv) and torch.equal(layer.W_UK_T, w_uk_t)
        assert (layer.W_UV.data_ptr(), layer.W_UK_T.data_ptr()) == addresses


PLUGIN_SCRIPT = """
import sys
import vllm.utils.flashinfer as vllm_flashinfer
vllm_flashinfer.has_nvidia_artifactory = lambda: False  # no network
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
backend = "vllm.v1.attention.backends.flashinfer"
assert backend not in sys.modules, "the plugin must not import the backend itself"
import vllm.v1.attention.backends.flashinfer as fi
from vllm.model_executor.layers.attention.attention import Attention
from refit_worker import backports
print(fi.FlashInferImpl.forward.__refit_backport__)
print(Attention.process_weights_after_loading.__refit_backport__)
print(",".join(backports.capabilities()))
"""


@pytest.mark.slow
def test_vllm_loads_the_plugin_and_backports_apply_on_import() -> None:
    """Through vLLM's own plugin loader (the entry point in pyproject.toml), in a fresh
    interpreter: the backports wait for their modules and patch them on import."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": "refit"}
    done = subprocess.run(
        [sys.executable, "-c", PLUGIN_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    forward, o_reset, caps = done.stdout.strip().splitlines()[-3:]
    assert forward == flashinfer_scales.BACKPORT
    assert o_reset == "attention-o-scale-reset"
    assert caps.split(",") == list(backports.status())
