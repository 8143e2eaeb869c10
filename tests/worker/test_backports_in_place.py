"""The backports of vLLM PR #48251 ("Preserve post-load tensors across weight reloads")
against code that lacks the fix.

The installed vLLM refreshes sinks and W_UV/W_UK_T in place natively (test_backports.py
checks that on the real classes), so the backports there only report "native". To show
that the check catches the bug and that the backport repairs it, these tests subclass
the real classes and override only ``process_weights_after_loading`` with the pre-fix
code the PR describes; everything else is vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import vllm.utils.flashinfer as vllm_flashinfer
from refit_worker.backports import flashinfer_sinks, mla_weights
from refit_worker.backports._patch import State
from refit_worker.contract import CAP_FLASHINFER_SINKS_IN_PLACE, CAP_MLA_WEIGHTS_IN_PLACE


@pytest.fixture(scope="module")
def fi() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_flashinfer, "has_nvidia_artifactory", lambda: False)
        import vllm.v1.attention.backends.flashinfer as module

        yield module


def test_sinks_check_fails_then_backport_refreshes_in_place(fi: Any) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config

    class PreFixSinks(fi.FlashInferImpl):
        def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
            sinks: torch.Tensor | None = vars(self).get("sinks")
            if sinks is not None and sinks.dtype != torch.float32:
                self.sinks = sinks.to(torch.float32)  # detached from the parameter

    assert not flashinfer_sinks.refreshes_sinks_in_place(PreFixSinks)
    outcome = flashinfer_sinks.apply(PreFixSinks)[CAP_FLASHINFER_SINKS_IN_PLACE]
    assert outcome.state is State.BACKPORTED
    patched = PreFixSinks.process_weights_after_loading
    assert flashinfer_sinks.apply(PreFixSinks)[CAP_FLASHINFER_SINKS_IN_PLACE].state is (
        State.BACKPORTED
    )
    assert PreFixSinks.process_weights_after_loading is patched  # applied once

    source = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.float16), False)
    with set_current_vllm_config(VllmConfig()):
        impl = PreFixSinks(2, 64, 0.125, 1, None, None, "auto", sinks=source)
    impl.process_weights_after_loading(torch.float16)
    address = impl.sinks.data_ptr()
    for values in ([1.0, 2.0], [-3.0, 0.25]):  # two reloads
        source.data.copy_(torch.tensor(values, dtype=torch.float16))
        impl.process_weights_after_loading(torch.float16)
        assert impl.sinks.dtype == torch.float32
        assert torch.equal(impl.sinks, source.float())
        assert impl.sinks.data_ptr() == address
    # vLLM's own class was left alone.
    assert not hasattr(fi.FlashInferImpl.__dict__["__init__"], "__refit_backport__")


def test_mla_check_fails_then_backport_keeps_storage() -> None:
    from vllm.model_executor.layers.attention import mla_attention

    class PreFixMLA(mla_attention.MLAAttention):
        def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
            w_uk, w_uv = mla_attention.split_kv_b_proj(
                self.kv_b_proj,
                act_dtype,
                self.kv_lora_rank,
                self.num_heads,
                self.qk_nope_head_dim,
                self.v_head_dim,
            )
            self.W_UV = w_uv.transpose(0, 1)  # a new allocation on every load
            self.W_UK_T = w_uk.permute(1, 2, 0)

    assert not mla_weights.keeps_storage(PreFixMLA)
    outcome = mla_weights.apply(PreFixMLA)[CAP_MLA_WEIGHTS_IN_PLACE]
    assert outcome.state is State.BACKPORTED
    assert mla_weights.keeps_storage(PreFixMLA)
    assert mla_weights.apply(PreFixMLA)[CAP_MLA_WEIGHTS_IN_PLACE].state is State.BACKPORTED
    assert not hasattr(
        mla_attention.MLAAttention.__dict__["process_weights_after_loading"],
        "__refit_backport__",
    )
