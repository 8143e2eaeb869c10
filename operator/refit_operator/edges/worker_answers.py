"""What one vLLM pod's answers mean: the checks and reads of its JSON and /metrics answers,
and the refusals in its error bodies, apart from how the requests travel (worker_client.py).

Pure: each function takes an answer already read in full and returns what it says, or raises
:class:`WorkerError` of kind ``protocol`` when the answer does not have the shape the client
and the contract expect; ``refusal`` reads an error body as the pod's refusal (``rejected``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families
from refit_worker import contract

ErrorKind = Literal["http", "timeout", "connect", "protocol", "rejected"]


class WorkerError(Exception):
    """One failed call to a pod; ``kind`` says what the caller may assume (worker_client's
    docstring lists the kinds), ``status`` the HTTP status and ``code`` a refusal's contract
    code where there is one."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: ErrorKind = kind
        self.status = status
        self.code = code
        self.message = message


# --- fields of a JSON answer ------------------------------------------------------------
def field(doc: Any, key: str, kind: type, where: str) -> Any:
    """``doc[key]``, which must be of type ``kind`` (a bool is no int)."""
    if not isinstance(doc, dict) or key not in doc:
        raise WorkerError("protocol", f"{where}: answer lacks {key!r}: {str(doc)[:200]}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise WorkerError("protocol", f"{where}: {key!r} is {type(value).__name__}, not {kind}")
    return value


def expect(doc: Any, key: str, want: Any, where: str) -> None:
    """The answer confirms the call: ``doc[key]`` is ``want``."""
    got = field(doc, key, type(want), where)
    if got != want:
        raise WorkerError("protocol", f"{where}: {key}={got!r}, expected {want!r}")


def digests(doc: dict[Any, Any]) -> dict[str, str]:
    """A {tensor key: hex digest} answer, checked: anything else is a protocol error."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise WorkerError("protocol", "checksums: keys and digests must be strings")
    return dict(doc)


def rpc_result(doc: Any, method: str) -> Any:
    """The first worker's result from a /collective_rpc answer."""
    results = field(doc, "results", list, method)
    if not results:
        raise WorkerError("protocol", f"{method}: no worker answered")
    return results[0]


def rpc_dict(result: Any, method: str) -> dict[str, Any]:
    """An extension method's result that must be a JSON object."""
    if not isinstance(result, dict):
        raise WorkerError("protocol", f"{method}: result is {type(result).__name__}, not dict")
    return result


def world_size(doc: Any) -> int:
    """The worker count of a get_world_size answer (at least 1)."""
    size = field(doc, "world_size", int, "get_world_size")
    if isinstance(size, bool) or size < 1:
        raise WorkerError("protocol", f"get_world_size: {size!r} is not a worker count")
    return int(size)


def awake(doc: Any) -> bool:
    """A wake_up answer: True when the engine is fully awake, False while a tag still sleeps."""
    status = field(doc, "status", str, "wake_up")
    if status not in ("awake", "sleeping"):
        raise WorkerError("protocol", f"wake_up: unknown status {status!r}")
    return bool(status == "awake")


def served_models(doc: Any) -> list[tuple[str, str | None]]:
    """A /v1/models answer as (id, parent) per card: vLLM gives an adapter's card the base
    model's name as parent, a base model name none."""
    out: list[tuple[str, str | None]] = []
    for card in field(doc, "data", list, "models"):
        model = field(card, "id", str, "models")
        parent = card.get("parent")
        out.append((model, parent if isinstance(parent, str) and parent else None))
    return out


# --- prompt logprobs ----------------------------------------------------------------------
def _logprob(entry: Any, token_id: int, where: str) -> float | None:
    """The logprob of token_id in one prompt_logprobs entry; None when it is absent."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise WorkerError("protocol", f"{where}: entry is {type(entry).__name__}, not an object")
    scored = entry.get(str(token_id))
    if scored is None:
        return None
    value = scored.get("logprob") if isinstance(scored, dict) else None
    # NaN and infinities are data for the probe (garbage), not a protocol error.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise WorkerError("protocol", f"{where}: logprob of token {token_id} is {value!r}")


def _prompt_scores(choice: Any, token_ids: list[int], index: int) -> list[float | None]:
    """One completion choice's prompt_logprobs as the logprob of each of token_ids."""
    where = f"completions: prompt {index}"
    echoed = field(choice, "prompt_token_ids", list, where)
    if echoed != token_ids:
        raise WorkerError(
            "protocol", f"{where}: the choice scored other tokens than the prompt holds"
        )
    entries = field(choice, "prompt_logprobs", list, where)
    if len(entries) != len(token_ids):
        raise WorkerError(
            "protocol", f"{where}: {len(entries)} prompt_logprobs for {len(token_ids)} tokens"
        )
    scores = [
        _logprob(entry, tok, f"{where}: prompt_logprobs[{i}]")
        for i, (entry, tok) in enumerate(zip(entries, token_ids, strict=True))
    ]
    scores[0] = None
    return scores


def prompt_scores(doc: Any, prompts: list[list[int]]) -> list[list[float | None]]:
    """A /v1/completions answer to ``prompts`` (with prompt_logprobs and return_token_ids) as
    each prompt token's logprob, ``result[i]`` for ``prompts[i]``, its entry 0 None. vLLM
    answers one choice per prompt, numbered by ``index``: the choices are matched by that
    index, not by their order, and each must echo the tokens it scored."""
    by_index: dict[int, Any] = {}
    for choice in field(doc, "choices", list, "completions"):
        index = field(choice, "index", int, "completions: choice")
        if not 0 <= index < len(prompts):
            raise WorkerError(
                "protocol",
                f"completions: a choice has index {index}, the request had {len(prompts)} prompts",
            )
        if index in by_index:
            raise WorkerError("protocol", f"completions: two choices for prompt {index}")
        by_index[index] = choice
    missing = [i for i in range(len(prompts)) if i not in by_index]
    if missing:
        raise WorkerError(
            "protocol",
            f"completions: no choice for prompt(s) {missing} of {len(prompts)}",
        )
    return [_prompt_scores(by_index[i], tokens, i) for i, tokens in enumerate(prompts)]


# --- /metrics -----------------------------------------------------------------------------
def metric_sums(text: str, names: tuple[str, ...]) -> list[float]:
    """Each sample name's sum over its labels (every engine) in a /metrics answer, in
    ``names``' order; a name the pod does not export is a protocol error."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise WorkerError("protocol", f"metrics: cannot parse: {exc}") from exc
    sums: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name in names:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    missing = [n for n in names if n not in sums]
    if missing:
        raise WorkerError("protocol", f"metrics: missing {', '.join(missing)}")
    return [sums[n] for n in names]


def in_flight(sums: list[float]) -> int:
    """The requests a drain still waits for: the running and waiting gauges' sum."""
    total = sum(sums)
    if not math.isfinite(total) or total < 0:
        raise WorkerError("protocol", f"metrics: in-flight count is {total}")
    return int(total)


# --- refusals in error bodies -----------------------------------------------------------
# vLLM wraps a worker exception raised under /collective_rpc as
# {"error": {"message": "Call to collective_rpc method failed: Worker failed with error
# '<str(exc)>', please check the stack trace above for the root cause", ...}}.
_VLLM_RPC_ERROR_SUFFIX = "', please check the stack trace above for the root cause"


def _rpc_error_text(body: str) -> str:
    """The worker exception's own text from a /collective_rpc error body (else the body)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(message, str):
        return body
    return message.split(_VLLM_RPC_ERROR_SUFFIX, 1)[0]


def _stale_fence(body: str) -> str | None:
    """The message of a pod's StaleFence refusal body; None when the body is not one."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(error, dict) or error.get("code") != contract.STALE_FENCE:
        return None
    message = error.get("message")
    return message if isinstance(message, str) else contract.STALE_FENCE


def refusal(status: int, body: str, *, rpc: bool) -> WorkerError | None:
    """A non-2xx answer read as the pod's refusal on purpose, a ``rejected`` error: from any
    path a StaleFence (HTTP 409), and from a route that raises the worker's exceptions through
    vLLM's app (``rpc``: /collective_rpc, the broadcast's routes) its RefitRejected with the
    contract code. None when the answer is neither (an ``http`` error for the caller)."""
    if status == 409:
        stale = _stale_fence(body)
        if stale is not None:
            return WorkerError("rejected", stale, status=status, code=contract.STALE_FENCE)
    if rpc:
        rejection = contract.parse_rejection(_rpc_error_text(body))
        if rejection is not None:
            code, detail = rejection
            return WorkerError("rejected", detail, status=status, code=code)
    return None
