"""What the controller reads from the cluster besides refits and pods: a Secret's or ConfigMap's
value, or the problem that says why not (RBAC, absent), as the preflight and the weight sources
report it. Each object is read once per tick (``Tick.reads``): a broadcast's transfer manifest and
its probe reference are two keys of one ConfigMap (RefitClient.broadcast writes both into
``<refit>-weights``), which the preflight read twice."""

from __future__ import annotations

from ..core.reasons import Problem, Reason
from ..edges.cluster import AccessDenied, Kube
from .refit_state import Tick


async def value(cluster: Kube, t: Tick, kind: str, name: str, key: str) -> str | None:
    """The value under ``key`` of the refit namespace's Secret or ConfigMap ``name`` (None when
    the object or key is absent), read once per tick; AccessDenied as the cluster raises it."""
    where = (kind, t.namespace, name)
    if where not in t.reads:
        t.reads[where] = await cluster.read_data(kind, t.namespace, name)
    data = t.reads[where]
    return None if data is None else data.get(key)


async def read_key(
    cluster: Kube,
    t: Tick,
    kind: str,
    name: str,
    key: str,
    *,
    missing: Reason,
    forbidden: Reason,
) -> str | Problem:
    """A Secret's or ConfigMap's value, or the problem: ``forbidden`` when RBAC forbids the
    read, ``missing`` when the object or key is absent."""
    try:
        found = await value(cluster, t, kind, name, key)
    except AccessDenied as e:
        return Problem(forbidden, str(e))
    if found is None:
        return Problem(missing, f"{kind} {name} has no key {key!r}")
    return found
