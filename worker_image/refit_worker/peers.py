"""The workers of one engine agree before any of them touches the model.

With tensor or pipeline parallelism a pod runs several workers, and /collective_rpc (or a
broadcast round) runs the same refit step on each of them. Each worker checks on its own
(its staged identities, its view of the promise); without agreement a refusal on one
worker would leave the others loading the new weights beside it on the old ones: a model
that answers and is half new. So each worker says, before its reload, whether its own
checks passed, and every worker of the engine learns every other's answer: one refusal
refuses all of them, with the refusing worker's code, and nobody has loaded.

The exchange is two all-reduces on vLLM's own CPU groups (the tensor-parallel group, then
the pipeline-parallel one): summed over a grid of TP x PP entries they give every worker
the whole grid. Data-parallel engines each agree among their own workers (each engine
reloads on its own; a DP rank's refusal is its own engine's answer to its own request).
"""

from __future__ import annotations

from typing import Any

from refit_worker.contract import REJECTION_CODES, RefitRejected


def _groups() -> tuple[Any, Any] | None:
    """(TP group, PP group) of vLLM's distributed state; None outside an initialized engine
    (the unit tests' bare extension)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:  # pragma: no cover - vLLM is in every worker image
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tp_group(), parallel_state.get_pp_group()


def worker_index() -> tuple[int, int]:
    """(this worker's index among the engine's TP x PP workers, their number)."""
    groups = _groups()
    if groups is None:
        return 0, 1
    tp, pp = groups
    return pp.rank_in_group * tp.world_size + tp.rank_in_group, tp.world_size * pp.world_size


def agree(refusal: Exception | None) -> None:
    """Exchange this worker's refusal (None: its checks passed; an error that is no
    RefitRejected counts as LoadFailed for the others) with every worker of the engine;
    raise its own refusal, or, when only another worker refused, the first refusing
    worker's code with a detail naming every refusing worker. Returns only when every
    worker passed. Every worker of the engine calls it at the same point (each runs the
    same RPC): a worker that skipped it would leave the others waiting."""
    groups = _groups()
    if groups is None or groups[0].world_size * groups[1].world_size == 1:
        if refusal is not None:
            raise refusal
        return
    import torch
    import torch.distributed as dist

    tp, pp = groups
    index, count = worker_index()
    codes = torch.zeros(count, dtype=torch.int64)
    if refusal is not None:
        code = refusal.code if isinstance(refusal, RefitRejected) else "LoadFailed"
        codes[index] = REJECTION_CODES.index(code) + 1
    for group in (tp, pp):
        if group.world_size > 1:
            dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=group.cpu_group)
    if refusal is not None:
        raise refusal
    refused = [(i, REJECTION_CODES[c - 1]) for i, c in enumerate(codes.tolist()) if c]
    if refused:
        code = refused[0][1]
        named = ", ".join(f"worker {i} ({c})" for i, c in refused)
        raise RefitRejected(
            code,
            f"{named} of this pod's {count} refused; this worker ({index}) passed its own "
            "checks and loaded nothing, so every worker keeps the weights it served",
        )
