"""Fencing tokens: one driver per pod.

Every call a refit pass makes to a pod carries a fencing token in the ``X-Refit-Fence``
header (``contract.FENCE_HEADER``): a non-negative integer that only grows across passes
and operator leaders (the operator derives it from the pod's resourceVersion its claim was
written against; to the pod it is an opaque number). The pod remembers the highest token it has
admitted and refuses a state-changing call that carries a lower one: that call comes from a
pass that has since been superseded, e.g. an operator leader frozen past its lease and
resumed, while a newer pass already drives the pod.

The rules (the admin guard applies them after the admin token is checked; the simulated
worker in testbed/simworker/ applies the same ones with this module):

- Only state-changing methods are fenced (anything but GET, HEAD and OPTIONS; in vLLM's
  admin API that is POST). Reads are never refused and never move the mark.
- No header: admitted, the mark does not move (a person with the admin token and curl).
- A token lower than the mark: refused (HTTP 409, code ``StaleFence``); the mark does not
  move. Equal: admitted. Higher: admitted, and it becomes the mark.
- A malformed header (not a plain decimal integer, negative, more than 20 digits or above
  2**64-1, or the header given twice): HTTP 400, nothing else happens.

The mark is process memory: a restarted pod starts with none, and has lost its weights too.

Pure and dependency-free (no vLLM import), so the operator's client and the tests use it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from refit_worker.contract import FENCE_HEADER, STALE_FENCE, bad_request_body

# The operator's tokens are 2**63 + a resourceVersion (etcd's int64 revision): 64 bits.
MAX_FENCE = 2**64 - 1
MAX_FENCE_DIGITS = len(str(MAX_FENCE))  # 20
# Methods that only read: never fenced.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
STALE_FENCE_STATUS = 409
MALFORMED_FENCE_STATUS = 400

_SHOWN = 40  # characters of a bad header value quoted back in the error message


class FenceError(ValueError):
    """A malformed fencing header or token; the message says what is wrong."""


def _show(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def parse_fence(value: str | bytes) -> int:
    """The token in one ``X-Refit-Fence`` header value: plain ASCII decimal digits (leading
    and trailing blanks ignored), at most 20 of them, at most 2**64-1. Raises FenceError."""
    if isinstance(value, bytes):
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            raise FenceError(
                f"{FENCE_HEADER} header {_show(value.decode('latin-1'))} is not a "
                "non-negative integer"
            ) from None
    else:
        text = value
    text = text.strip(" \t")
    if not text:
        raise FenceError(f"{FENCE_HEADER} header is empty; it must be a non-negative integer")
    if len(text) > MAX_FENCE_DIGITS:
        raise FenceError(
            f"{FENCE_HEADER} header {_show(text)} is {len(text)} characters long; a fencing "
            f"token has at most {MAX_FENCE_DIGITS} digits"
        )
    negative = text.startswith("-")
    digits = text[1:] if negative else text
    # str.isdigit() alone also accepts non-ASCII digits; int() also accepts '+', '_', blanks.
    if not (digits and digits.isascii() and digits.isdigit()):
        raise FenceError(f"{FENCE_HEADER} header {_show(text)} is not a non-negative integer")
    if negative:
        raise FenceError(f"{FENCE_HEADER} header {_show(text)} is negative")
    token = int(text)
    if token > MAX_FENCE:
        raise FenceError(
            f"{FENCE_HEADER} header {_show(text)} is above the largest fencing token {MAX_FENCE}"
        )
    return token


def read_fence(values: Iterable[str | bytes]) -> int | None:
    """A request's token from every value of its ``X-Refit-Fence`` header: None when the
    header is absent; FenceError when it is malformed or given more than once."""
    given = list(values)
    if not given:
        return None
    if len(given) > 1:
        raise FenceError(f"{FENCE_HEADER} header given {len(given)} times; send it once")
    return parse_fence(given[0])


def format_fence(token: int) -> str:
    """The header value for a token (the client side); FenceError for a token out of range."""
    if isinstance(token, bool) or not isinstance(token, int):
        raise FenceError(f"a fencing token is an integer, not {type(token).__name__}")
    if not 0 <= token <= MAX_FENCE:
        raise FenceError(f"fencing token {token} is outside 0..{MAX_FENCE}")
    return str(token)


def is_fenced(method: str) -> bool:
    """Whether a request of this HTTP method is fenced (it may change the pod's state)."""
    return method.upper() not in READ_METHODS


def stale_fence_message(token: int, highest: int) -> str:
    return (
        f"fencing token {token} is older than {highest}, the newest this pod has seen: "
        "another refit pass owns this pod"
    )


def stale_fence_body(token: int, highest: int) -> dict[str, Any]:
    """The JSON body of the 409 that refuses a stale token (the operator reads ``code``)."""
    return {"error": {"code": STALE_FENCE, "message": stale_fence_message(token, highest)}}


def malformed_fence_body(message: str) -> dict[str, Any]:
    """The JSON body of the 400 that refuses a malformed header."""
    return bad_request_body(message, FENCE_HEADER)


class FenceTracker:
    """The highest fencing token one pod has admitted, and the admit/refuse decision.

    Not thread-safe, and it need not be: :meth:`admit` compares and raises the mark without
    awaiting anything, so on ONE asyncio event loop (vLLM's API server, the simulator) no
    other request runs between the two. Do not share a tracker between threads or
    processes; each process has its own mark.
    """

    def __init__(self) -> None:
        self.highest: int | None = None  # None: no fenced call admitted yet

    def admit(self, token: int | None) -> bool:
        """Whether a fenced call carrying ``token`` may proceed; admitting a higher token
        raises the mark. None (no header) is admitted and leaves the mark alone."""
        if token is None:
            return True
        if self.highest is not None and token < self.highest:
            return False
        self.highest = token
        return True

    def reset(self) -> None:
        """Forget the mark (a restarted process starts without one)."""
        self.highest = None
