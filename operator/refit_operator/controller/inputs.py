"""What the controller reads from the cluster besides refits and pods: a Secret's or ConfigMap's
value, or the problem that says why not (RBAC, absent), as the preflight and the weight sources
report it."""

from __future__ import annotations

from ..core.reasons import Problem, Reason
from ..edges.cluster import AccessDenied, Kube


async def read_key(
    cluster: Kube,
    kind: str,
    namespace: str,
    name: str,
    key: str,
    *,
    missing: Reason,
    forbidden: Reason,
) -> str | Problem:
    """A Secret's or ConfigMap's value, or the problem: ``forbidden`` when RBAC forbids the
    read, ``missing`` when the object or key is absent."""
    try:
        value = await cluster.read_key(kind, namespace, name, key)
    except AccessDenied as e:
        return Problem(forbidden, str(e))
    if value is None:
        return Problem(missing, f"{kind} {name} has no key {key!r}")
    return value
