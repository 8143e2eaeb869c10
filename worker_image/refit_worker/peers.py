"""The workers of one engine answer a refit call as one.

With tensor or pipeline parallelism a pod runs several workers, and /collective_rpc (or a
broadcast round) runs the same refit step on each of them. Two things go wrong without
agreement, both reproduced on vLLM 0.32 CPU with --tensor-parallel-size 2:

- A refusal on one worker leaves the others loading the new weights beside it on the old
  ones: a model that answers and is half new. So before a reload every worker says whether
  its own checks passed, and one refusal refuses all of them before anybody loads.
- vLLM's MultiprocExecutor.collective_rpc reads the workers' replies in rank order and
  raises at the first failed one, leaving the later workers' replies in their queues: the
  next call of any kind (/wake_up, /collective_rpc) reads those stale replies, and the pod
  answers every later call one reply late. So a refusal is raised by the last worker only
  (``answering``); the others return normally, and every reply is read.

The exchange is two all-reduces on vLLM's own CPU groups (the tensor-parallel group, then the
pipeline-parallel one): summed over a grid of TP x PP entries they give every worker the
whole grid. Data-parallel engines each agree among their own workers: each DP engine loads
on its own (docs/concepts.md, "Parallel layouts and multi-pod replicas").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from refit_worker.contract import REJECTION_CODES, RefitRejected

F = TypeVar("F", bound=Callable[..., Any])


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


def answering() -> bool:
    """Whether this worker raises the engine's refusal: the last one, whose reply vLLM's
    collective_rpc reads last (module docstring)."""
    index, count = worker_index()
    return index == count - 1


def exchange(error: Exception | None) -> Exception | None:
    """Tell every worker of the engine whether this one failed (None: its step passed) and
    return the engine's refusal: this worker's own error, else the first refusing peer's
    code as a RefitRejected naming every refusing worker; None when every worker passed.
    An error that is no RefitRejected counts as LoadFailed for the peers. Every worker of the
    engine calls it at the same point (each runs the same step): a worker that skipped it
    would leave the others waiting."""
    groups = _groups()
    if groups is None or groups[0].world_size * groups[1].world_size == 1:
        return error
    import torch
    import torch.distributed as dist

    tp, pp = groups
    index, count = worker_index()
    codes = torch.zeros(count, dtype=torch.int64)
    if error is not None:
        code = error.code if isinstance(error, RefitRejected) else "LoadFailed"
        codes[index] = REJECTION_CODES.index(code) + 1
    for group in (tp, pp):
        if group.world_size > 1:
            dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=group.cpu_group)
    if error is not None:
        return error
    refused = [(i, REJECTION_CODES[c - 1]) for i, c in enumerate(codes.tolist()) if c]
    if not refused:
        return None
    named = ", ".join(f"worker {i} ({c})" for i, c in refused)
    return RefitRejected(
        refused[0][1],
        f"{named} of this pod's {count} refused; worker {index} passed its own checks",
    )


def collective(method: F) -> F:
    """An extension RPC that answers as one: run on every worker, a failure on any is the
    engine's refusal, raised by the answering worker only (the others return a note that
    nobody reads)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        result: Any = None
        error: Exception | None = None
        try:
            result = method(self, *args, **kwargs)
        except Exception as exc:
            error = exc
        refusal = exchange(error)
        if refusal is None:
            return result
        if answering():
            raise refusal
        return {"refusedByPod": str(refusal)}

    return run  # type: ignore[return-value]
