"""The pod's readiness probe: ``/refit/ready`` (contract.READY_PATH).

A fleet pod is in traffic only while both hold: the operator's readiness-gate condition is
True (a pass loaded, stamped and probed a version) and its containers are ready. The condition
lives on the Pod object, so it outlives the process: when vLLM dies and the kubelet restarts
the container, the new process serves the boot checkpoint while the condition still says True,
and with ``/health`` as its readiness probe the pod is back in endpoints until the operator
notices the restart. This probe closes that window from the process's side:

- ``GET /refit/ready`` (open, for the kubelet): 503 until a refit pass vouched for the
  weights of *this* process, then 200 with the version it vouched for. Both answers name the
  process (``process``: a random identity drawn when the process starts).
- ``POST /refit/ready`` ``{"version": "<v>", "process": "<id>"}`` (admin token, fenced like
  every admin POST): the pass vouches, once its probe passed and right before it sets the
  condition True. ``process`` is the identity the pass read before it probed: a process that
  is not that one (the container restarted between the probe and the vouch, and the new
  process serves its boot weights) refuses the vouch, 409 ``ProcessChanged``, and stays
  unready; the pass fails closed, and the restart is the next pass's to handle.

Why after the probe and not at the stamp: the kubelet computes a pod's Ready from the gate
condition it last saw, and while a container is unready it does not refresh that view when
the condition changes (a restarted pod's True → False). A process that became ready before
its probe could therefore be Ready for a moment on the stale True; vouched after the probe,
the worst such moment serves probed weights.

The mark is process memory, like the fencing mark: a restarted container starts without one.
It is never withdrawn within a process: there the operator moves the condition itself (False
before it touches the weights, True after the probe).

Because the container is not ready until the operator's pass, the operator cannot wait for
ContainersReady to begin that pass; with this probe it waits for the container to have
*started* instead, which a ``startupProbe`` on ``/health`` makes mean "vLLM answers"
(docs/operator.md, "Pod requirements").

Pure and dependency-free: the admin guard (refit_worker.guard) serves it in vLLM's API server,
the simulated worker (testbed/simworker/) with the same class.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from refit_worker.contract import PROCESS_CHANGED, bad_request_body

NOT_READY_STATUS = 503
BAD_REQUEST_STATUS = 400
PROCESS_CHANGED_STATUS = 409
MAX_VERSION_CHARS = 256


class VouchError(ValueError):
    """A malformed ``POST /refit/ready`` body; the message says what is wrong."""


class VouchRefused(Exception):
    """A vouch for another process than this one (ProcessChanged)."""


def parse_vouch(body: bytes) -> str:
    """The version in a ``POST /refit/ready`` body, or VouchError."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise VouchError('the body must be JSON: {"version": "<weight version>"}') from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(version, str) or not version:
        raise VouchError('the body must name the probed weights: {"version": "<weight version>"}')
    if len(version) > MAX_VERSION_CHARS:
        raise VouchError(f"version is {len(version)} characters; at most {MAX_VERSION_CHARS}")
    return version


def vouched_process(body: bytes) -> str | None:
    """The process a (well-formed) vouch is bound to; None when it names none (an operator
    from before the binding)."""
    doc = json.loads(body)
    process = doc.get("process") if isinstance(doc, dict) else None
    return process if isinstance(process, str) and process else None


class ReadyMark:
    """Whether, and for which version, a refit pass vouched for this process's weights."""

    def __init__(self) -> None:
        self.version: str | None = None  # None: no pass vouched in this process
        self.at: float | None = None  # epoch seconds of the last vouch
        self.process = secrets.token_hex(8)  # this process, as GET /refit/ready names it

    @property
    def ready(self) -> bool:
        return self.version is not None

    def vouch(self, version: str, process: str | None = None) -> dict[str, Any]:
        """Record a pass's vouch; the JSON answer to its POST. VouchRefused when the pass
        probed another process than this one."""
        if process is not None and process != self.process:
            raise VouchRefused(
                f"the pass probed process {process}, this is process {self.process} (the "
                "container restarted since): its weights were never probed"
            )
        self.version, self.at = version, time.time()
        return self.answer()[1]

    def answer(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) of ``GET /refit/ready``."""
        if self.version is None:
            return NOT_READY_STATUS, {
                "ready": False,
                "reason": "NotVouched",
                "message": "no refit pass has probed the weights of this process yet",
                "process": self.process,
            }
        return 200, {
            "ready": True,
            "version": self.version,
            "vouchedAt": self.at,
            "process": self.process,
        }

    def reset(self) -> None:
        """Forget the mark: a restarted process starts without one, as another process."""
        self.version = self.at = None
        self.process = secrets.token_hex(8)


def vouch_refused_body(message: str) -> dict[str, Any]:
    """The 409 that refuses a vouch for another process."""
    return {"error": {"code": PROCESS_CHANGED, "message": message}}


def vouch_error_body(message: str) -> dict[str, Any]:
    """The 400 that refuses a malformed vouch."""
    return bad_request_body(message, "version")
