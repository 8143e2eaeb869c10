"""unsafe_reasons: the configurations vLLM's BMM scales fix ("Recompute FlashInfer BMM scales
when a weight reload changes the KV scales") leaves uncovered under full CUDA graphs."""

from __future__ import annotations

import dataclasses

import pytest
from refit_worker import backports
from refit_worker.backports.unsafe import GraphConfig, reasons_for

FULL = "FULL_AND_PIECEWISE"
SAFE_TRTLLM = GraphConfig(
    attention_backends=("FLASHINFER",),
    kv_cache_dtype="fp8_e4m3",
    cudagraph_mode=FULL,
    device_capability=100,
    trtllm_decode=True,
)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, []),  # trtllm-gen decode on SM100: device scales under capture
        ({"attention_backends": ("CPU_ATTN",)}, []),
        ({"cudagraph_mode": "PIECEWISE"}, []),
        ({"cudagraph_mode": "NONE"}, []),
        ({"enforce_eager": True}, []),
        ({"kv_cache_dtype": "auto"}, []),  # no reloadable KV scales
        ({"attention_backends": ("FLASH_ATTN",)}, []),  # reads device scales itself
        ({"cudagraph_mode": "FULL_DECODE_ONLY", "dcp_size": 2}, ["DCP decode"]),
        ({"device_capability": 90}, ["XQA decode (SM90)"]),
        ({"device_capability": 120}, ["XQA decode (SM120)"]),
        ({"device_capability": 89}, ["non-trtllm decode"]),
        ({"trtllm_decode": False}, ["non-trtllm decode"]),
        ({"trtllm_decode": None}, ["eligibility unknown"]),
        ({"device_capability": None}, ["GPU architecture unknown"]),
        ({"fuse_attn_quant": True, "quantization": "modelopt_fp4"}, ["fused NVFP4 output"]),
        ({"fuse_attn_quant": True, "quantization": "fp8"}, []),
        ({"attention_backends": ("FLASHINFER_MLA",)}, ["FLASHINFER_MLA: MLA trtllm decode"]),
        ({"attention_backends": ("FLASHINFER_MLA_SPARSE",)}, ["FLASHINFER_MLA_SPARSE: MLA"]),
        ({"attention_backends": ("TOKENSPEED_MLA",)}, ["TOKENSPEED_MLA: MLA"]),
        ({"attention_backends": ()}, ["attention backend unknown"]),
        (
            {"dcp_size": 4, "device_capability": 90, "attention_backends": ("FLASHINFER",)},
            ["DCP decode", "XQA decode"],
        ),
    ],
)
def test_reasons_table(changes: dict[str, object], expected: list[str]) -> None:
    cfg = dataclasses.replace(SAFE_TRTLLM, **changes)  # type: ignore[arg-type]
    reasons = reasons_for(cfg)
    assert len(reasons) == len(expected), reasons
    for reason, fragment in zip(reasons, expected, strict=True):
        assert fragment in reason
        assert "PIECEWISE" in reason  # each names the workaround


def test_adapter_reads_a_vllm_config() -> None:
    from vllm.config import CacheConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    full = VllmConfig(cache_config=CacheConfig(cache_dtype="fp8_e4m3"))
    # The CPU platform turns CUDA graphs off while building the config; a GPU pod's keeps it.
    full.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    reasons = backports.unsafe_reasons(
        full, attention_backends=("FLASHINFER",), device_capability=90
    )
    assert len(reasons) == 1 and "XQA decode (SM90)" in reasons[0]
    assert backports.unsafe_reasons(full, attention_backends=("CPU_ATTN",)) == []
    piecewise = VllmConfig(cache_config=CacheConfig(cache_dtype="fp8_e4m3"))
    piecewise.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert backports.unsafe_reasons(piecewise, attention_backends=("FLASHINFER",)) == []
