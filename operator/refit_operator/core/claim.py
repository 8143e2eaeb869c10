"""Who drives a pod now: the claim a refit pass takes on it (``Claim``, stored on the pod) and
the fencing token every write and worker call of the pass carries (``claim_fence``). Pure.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from refit_worker.contract import API_GROUP

# Where a pod's claim lives on the pod (docs/operator.md).
CLAIM_ANNOTATION = f"{API_GROUP}/claim"


@dataclass(frozen=True)
class Claim:
    """Who drives a pod now: one refit pass of one operator replica, with its fencing token.

    Stored on the pod (annotation ``refit.rollout.dev/claim``, JSON) from the pass's first
    write, which takes it with optimistic concurrency (the pod's resourceVersion), to its last
    write, which removes it. Every write of the pass in between is conditional on the claim
    still being this one; every worker call carries ``fence`` (:func:`claim_fence`).

    ``lease`` and ``lease_seconds`` name the Lease the holder leads on (``namespace/name``):
    another operator process, of this installation or another, judges from that Lease
    whether the holder may still act, and takes the pod over only once it cannot. A claim
    written before these fields existed has them empty: judged by the reader's own Lease."""

    refit: str
    uid: str
    fence: int
    holder: str  # the operator replica's identity
    lease: str = ""
    lease_seconds: int = 0

    def to_annotation(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_annotation(cls, text: str | None) -> Claim | None:
        if not text:
            return None
        try:
            doc = json.loads(text)
            return cls(
                str(doc["refit"]), str(doc["uid"]), int(doc["fence"]), str(doc["holder"]),
                str(doc.get("lease", "")), int(doc.get("lease_seconds", 0)),
            )  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


# A pass's fencing token is FENCE_BASE + the resourceVersion of the pod its claim's write was
# conditional on. The API server takes one claim per resourceVersion of a pod, and every later
# claim is conditional on a version written after it (the earlier claim's own write at least),
# so each claim of a pod carries a higher token than every earlier one, whichever operator
# process, Lease or installation took it: no two drivers ever hold equal tokens, and no Lease
# (re-created or not) restarts them. It relies on resourceVersion being etcd's revision, an
# integer that grows across the cluster, which the API calls opaque (docs/operator.md, "Fencing
# tokens"). FENCE_BASE puts these tokens above every token of the Lease-epoch scheme
# (leaseTransitions << 32 | pass; Lease.next_fence), which a pod may remember from an older
# operator, and an int64 revision below 2**63 keeps them within the pods' 64 bits.
FENCE_BASE = 1 << 63


def claim_fence(resource_version: str) -> int | None:
    """The fencing token of a claim written conditional on the pod's ``resource_version``;
    None when that is not a decimal integer below 2**63 (then the pass takes the Lease-epoch
    token instead)."""
    rv = resource_version
    if not (rv.isascii() and rv.isdigit()) or int(rv) >= FENCE_BASE:
        return None
    return FENCE_BASE + int(rv)
