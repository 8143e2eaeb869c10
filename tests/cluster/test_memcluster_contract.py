"""The explorer's in-memory API server (testbed/explorer/memcluster.py) held to the real
kube-apiserver: the same operations on both, and what the engine's correctness rests on
compared. Conditional writes conflict on a stale resourceVersion; the status subresource and
the main resource ignore each other's part; every write moves resourceVersion; a finalizer
keeps a deleted object, with its deletionTimestamp, until it goes; creationTimestamp has
one-second resolution; the operator's own claims and withdrawals (cluster.Cluster over the
real server, MemoryCluster over the store) conflict the same way; and coordination.k8s.io
Leases (create, get, conditional replace, delete) answer leader.Lease alike."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from refit_operator.core import api, podflow
from refit_operator.core.claim import CLAIM_ANNOTATION, Claim
from refit_operator.edges import cluster
from refit_operator.edges.cluster import (
    FINALIZER,
    MERGE,
    SMP,
    Cluster,
    Kube,
    PodBusy,
    _done,
    read_json,
)
from refit_operator.edges.leader import Lease
from refit_worker.contract import API_GROUP, READINESS_GATE

from testbed.controlplane import ControlPlane
from testbed.explorer.memcluster import MemoryCluster, MemoryLeases, Store

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


LABELS = {"app": "rollout"}


def _pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai:test"}],
            "readinessGates": [{"conditionType": READINESS_GATE}],
        },
    }


def _refit(name: str, finalizers: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if finalizers:
        meta["finalizers"] = [FINALIZER]
    return {
        "apiVersion": f"{API_GROUP}/{api.VERSION}",
        "kind": "WeightRefit",
        "metadata": meta,
        "spec": {
            "fleet": {"selector": {"matchLabels": dict(LABELS)}, "port": 8000},
            "checkpoint": {"path": "/ckpt/v1", "version": "v1"},
        },
    }


class Real:
    name = "real"

    def __init__(self, api_client: client.ApiClient, ns: str) -> None:
        self.api, self.ns = api_client, ns
        self.core: Any = client.CoreV1Api(api_client)
        self.custom: Any = client.CustomObjectsApi(api_client)

    def _refit_args(self) -> tuple[str, str, str, str]:
        return API_GROUP, api.VERSION, self.ns, api.PLURAL

    async def create(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        if kind == "Pod":
            resp = await self.core.create_namespaced_pod(self.ns, body, _preload_content=False)
        else:
            resp = await self.custom.create_namespaced_custom_object(
                *self._refit_args(), body, _preload_content=False
            )
        doc: dict[str, Any] = await read_json(resp)
        return doc

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            if kind == "Pod":
                resp = await self.core.read_namespaced_pod(name, self.ns, _preload_content=False)
            else:
                resp = await self.custom.get_namespaced_custom_object(
                    *self._refit_args(), name, _preload_content=False
                )
            doc: dict[str, Any] = await read_json(resp)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return doc

    async def patch(self, kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if kind == "Pod":
            resp = await self.core.patch_namespaced_pod(
                name, self.ns, body, _content_type=MERGE, _preload_content=False
            )
        else:
            resp = await self.custom.patch_namespaced_custom_object(
                *self._refit_args(), name, body, _content_type=MERGE, _preload_content=False
            )
        doc: dict[str, Any] = await read_json(resp)
        return doc

    async def patch_status(self, kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if kind == "Pod":  # as cluster.Cluster writes it: a strategic merge of pods/status
            resp = await self.core.patch_namespaced_pod_status(
                name, self.ns, body, _content_type=SMP, _preload_content=False
            )
        else:  # as Cluster.patch_status writes it: a merge patch of the status subresource
            resp = await self.custom.patch_namespaced_custom_object_status(
                *self._refit_args(), name, body, _content_type=MERGE, _preload_content=False
            )
        doc: dict[str, Any] = await read_json(resp)
        return doc

    async def delete(self, kind: str, name: str) -> None:
        if kind == "Pod":
            await _done(
                await self.core.delete_namespaced_pod(name, self.ns, _preload_content=False)
            )
        else:
            await _done(await self.custom.delete_namespaced_custom_object(
                *self._refit_args(), name, _preload_content=False
            ))  # fmt: skip

    def kube(self, identity: str) -> Kube:
        return Cluster(api_client=self.api, identity=identity)

    def leases(self) -> Any:
        return client.CoordinationV1Api(self.api)

    def lease(self, name: str, identity: str, seconds: int) -> Lease:
        return Lease(self.api, self.ns, name, identity, seconds)  # its default API


class Memory:
    name = "memory"

    def __init__(self, ns: str) -> None:
        self.store, self.ns = Store(), ns

    async def create(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.store.get(kind, self.ns, self.store.create(kind, self.ns, body)["metadata"]
                              ["name"]) or {}  # fmt: skip

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.store.get(kind, self.ns, name)

    async def patch(self, kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.store.patch(kind, self.ns, name, body)
        return self.store.get(kind, self.ns, name) or {}

    async def patch_status(self, kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.store.patch_status(kind, self.ns, name, body)
        return self.store.get(kind, self.ns, name) or {}

    async def delete(self, kind: str, name: str) -> None:
        self.store.delete(kind, self.ns, name)

    def kube(self, identity: str) -> Kube:
        return MemoryCluster(self.store, identity)

    def leases(self) -> Any:
        return MemoryLeases(self.store)

    def lease(self, name: str, identity: str, seconds: int) -> Lease:
        return Lease(None, self.ns, name, identity, seconds, api=self.leases())


Backend = Real | Memory


async def _code(aw: Any) -> int:
    """200, or the status of the ApiException the call raised."""
    try:
        await aw
    except ApiException as e:
        return int(e.status)
    return 200


async def _both(control_plane: ControlPlane, namespace: str, scenario: Any) -> dict[str, Any]:
    """Run ``scenario(backend)`` on the real API server and on the in-memory one."""
    api_client = await cluster.connect(str(control_plane.kubeconfig))
    try:
        return {b.name: await scenario(b) for b in (Real(api_client, namespace), Memory(namespace))}
    finally:
        await api_client.close()


def _rv(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["resourceVersion"])


@pytest.mark.parametrize("kind", ["Pod", "WeightRefit"])
async def test_a_write_conditional_on_a_stale_resource_version_conflicts(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str, kind: str
) -> None:
    async def scenario(b: Backend) -> list[int]:
        doc = await b.create(kind, _pod("p") if kind == "Pod" else _refit("r"))
        name, stale = doc["metadata"]["name"], _rv(doc)
        fresh = _rv(await b.patch(kind, name, {"metadata": {"labels": {"moved": "yes"}}}))
        status = {"conditions": [{"type": "X", "status": "True"}]} if kind == "Pod" else {
            "phase": "Progressing"}  # fmt: skip
        return [
            await _code(
                b.patch_status(
                    kind, name, {"metadata": {"resourceVersion": stale}, "status": status}
                )
            ),
            await _code(
                b.patch(kind, name, {"metadata": {"resourceVersion": stale, "labels": {"a": "b"}}})
            ),
            await _code(
                b.patch_status(
                    kind, name, {"metadata": {"resourceVersion": fresh}, "status": status}
                )
            ),
        ]

    seen = await _both(control_plane, namespace, scenario)
    assert seen["real"] == seen["memory"] == [409, 409, 200], seen


async def test_the_status_subresource_and_the_main_resource_ignore_each_others_part(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str
) -> None:
    async def scenario(b: Backend) -> dict[str, Any]:
        await b.create("WeightRefit", _refit("r"))
        # spec.ttlSecondsAfterFinished: a spec field that stays mutable (CEL keeps the
        # sequence, fleet and checkpoint as created)
        both = {"spec": {"ttlSecondsAfterFinished": 100}, "status": {"phase": "Succeeded"}}
        main = await b.patch("WeightRefit", "r", both)
        both = {"spec": {"ttlSecondsAfterFinished": 200}, "status": {"phase": "Progressing"}}
        status = await b.patch_status("WeightRefit", "r", both)
        await b.create("Pod", _pod("p"))
        pod_main = await b.patch("Pod", "p", {"status": {"podIP": "10.0.0.9"}})
        pod_status = await b.patch_status("Pod", "p", {
            "metadata": {"annotations": {"k": "v"}},
            "spec": {"activeDeadlineSeconds": 5},
            "status": {"podIP": "10.0.0.7", "conditions": [
                {"type": READINESS_GATE, "status": "True", "reason": "A"}]},
        })  # fmt: skip
        pod_status = await b.patch_status("Pod", "p", {"status": {"conditions": [
            {"type": "Other", "status": "True"}]}})  # fmt: skip
        pod_status = await b.patch_status("Pod", "p", {"status": {"conditions": [
            {"type": READINESS_GATE, "status": "False", "reason": "B"}]}})  # fmt: skip
        conds = {c["type"]: (c["status"], c.get("reason")) for c in
                 pod_status["status"]["conditions"]}  # fmt: skip
        return {
            "main: spec ttl": main["spec"]["ttlSecondsAfterFinished"],
            "main: status phase": (main.get("status") or {}).get("phase"),
            "main: generation": main["metadata"]["generation"],
            "status: spec ttl": status["spec"]["ttlSecondsAfterFinished"],
            "status: phase": status["status"]["phase"],
            "status: generation": status["metadata"]["generation"],
            "pod main: podIP": (pod_main.get("status") or {}).get("podIP"),
            "pod status: annotation": pod_status["metadata"].get("annotations", {}).get("k"),
            "pod status: deadline": pod_status["spec"].get("activeDeadlineSeconds"),
            "pod status: podIP": pod_status["status"].get("podIP"),
            "pod status: conditions by type": {
                k: v for k, v in conds.items() if k in (READINESS_GATE, "Other")
            },
        }

    seen = await _both(control_plane, namespace, scenario)
    assert seen["real"] == seen["memory"], seen
    assert seen["memory"] == {
        "main: spec ttl": 100,
        "main: status phase": None,
        "main: generation": 2,
        "status: spec ttl": 100,
        "status: phase": "Progressing",
        "status: generation": 2,
        "pod main: podIP": None,
        "pod status: annotation": "v",
        "pod status: deadline": None,
        "pod status: podIP": "10.0.0.7",
        "pod status: conditions by type": {READINESS_GATE: ("False", "B"), "Other": ("True", None)},
    }


async def test_every_write_moves_the_resource_version_and_a_finalizer_keeps_a_deleted_object(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str
) -> None:
    async def scenario(b: Backend) -> dict[str, Any]:
        rvs = [_rv(await b.create("WeightRefit", _refit("r", finalizers=True)))]
        rvs.append(_rv(await b.patch("WeightRefit", "r", {"metadata": {"labels": {"a": "b"}}})))
        rvs.append(_rv(await b.patch_status("WeightRefit", "r", {"status": {"phase": "Pending"}})))
        await b.delete("WeightRefit", "r")
        deleting = await b.get("WeightRefit", "r")
        assert deleting is not None
        rvs.append(_rv(deleting))
        kept = await b.patch_status("WeightRefit", "r", {"status": {"phase": "Succeeded"}})
        rvs.append(_rv(kept))
        await b.patch("WeightRefit", "r", {"metadata": {"finalizers": None}})
        return {
            "distinct versions": len(set(rvs)) == len(rvs),
            "deletionTimestamp while the finalizer stays": bool(
                deleting["metadata"].get("deletionTimestamp")
            ),
            "finalizers kept": deleting["metadata"].get("finalizers"),
            "still written while deleting": kept["status"]["phase"],
            "gone once the finalizer goes": await b.get("WeightRefit", "r") is None,
        }

    seen = await _both(control_plane, namespace, scenario)
    assert seen["real"] == seen["memory"], seen
    assert seen["memory"] == {
        "distinct versions": True,
        "deletionTimestamp while the finalizer stays": True,
        "finalizers kept": [FINALIZER],
        "still written while deleting": "Succeeded",
        "gone once the finalizer goes": True,
    }


async def test_creation_timestamps_have_one_second_resolution(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str
) -> None:
    """Two refits created in one second show the same creationTimestamp: names, not
    timestamps, would then order them, which is why the engine never relies on either alone."""

    async def scenario(b: Backend) -> dict[str, Any]:
        for attempt in range(5):
            await asyncio.sleep(1.0 - time.time() % 1.0 + 0.02)  # just after a second begins
            began = int(time.time())
            a = await b.create("WeightRefit", _refit(f"a{attempt}"))
            z = await b.create("WeightRefit", _refit(f"z{attempt}"))
            if int(time.time()) == began:  # both inside one wall-clock second
                stamps = [d["metadata"]["creationTimestamp"] for d in (a, z)]
                return {
                    "whole seconds": all(
                        re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s) for s in stamps
                    ),
                    "tie": stamps[0] == stamps[1],
                }
        pytest.skip("the machine never created two objects within one second")

    seen = await _both(control_plane, namespace, scenario)
    assert seen["real"] == seen["memory"] == {"whole seconds": True, "tie": True}, seen


async def test_a_claim_taken_on_a_stale_list_conflicts_and_a_stale_withdrawal_does_nothing(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str
) -> None:
    """The operator's own code on both: Cluster.claim is a pods/status patch conditional on
    the resourceVersion of the list; the loser raises PodBusy. A withdrawal decided from the
    same stale list is dropped (the claimant decides the pod's readiness now)."""

    async def scenario(b: Backend) -> dict[str, Any]:
        await b.create("Pod", _pod("p"))
        kube_a, kube_b = b.kube("op-a"), b.kube("op-b")
        (view,) = await kube_a.list_pods(b.ns, "app=rollout")
        progress = podflow.start("wr", "uid-1", "v1", "/ckpt/v1", time.time())
        claim_a = Claim("wr", "uid-1", 1, "op-a")
        await kube_a.claim(b.ns, view, claim_a, progress, podflow.Readiness(False, "R", "m"))
        busy = False
        try:
            await kube_b.claim(b.ns, view, Claim("wr", "uid-1", 2, "op-b"), progress, None)
        except PodBusy:
            busy = True
        await kube_b.withdraw(view, b.ns, "ContainerRestarted", "stale")
        doc = await b.get("Pod", "p")
        assert doc is not None
        conds = {c["type"]: c for c in doc["status"].get("conditions") or []}
        (fresh,) = await kube_b.list_pods(b.ns, "app=rollout")
        await kube_b.claim(b.ns, fresh, Claim("wr", "uid-1", 3, "op-b"), progress, None)
        after = await b.get("Pod", "p")
        assert after is not None
        return {
            "second claim on the stale list": "PodBusy" if busy else "taken",
            "claim held": Claim.from_annotation(doc["metadata"]["annotations"][CLAIM_ANNOTATION]),
            "gate reason after the stale withdrawal": conds[READINESS_GATE]["reason"],
            "claim on a fresh list": Claim.from_annotation(
                after["metadata"]["annotations"][CLAIM_ANNOTATION]
            ),
            "listed as claimed": fresh.claim,
        }

    seen = await _both(control_plane, namespace, scenario)
    assert seen["real"] == seen["memory"], seen
    assert seen["memory"] == {
        "second claim on the stale list": "PodBusy",
        "claim held": Claim("wr", "uid-1", 1, "op-a"),
        "gate reason after the stale withdrawal": "R",
        "claim on a fresh list": Claim("wr", "uid-1", 3, "op-b"),
        "listed as claimed": Claim("wr", "uid-1", 1, "op-a"),
    }


def _lease(name: str, rv: str = "", holder: str = "a") -> dict[str, Any]:
    meta = {"name": name, **({"resourceVersion": rv} if rv else {})}
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 3},
    }


async def test_leases_answer_leader_lease_alike(
    control_plane: ControlPlane, namespace: str
) -> None:
    """What leader.Lease rests on (the explorer runs the real one over the store): a Lease is
    created once (409 after), read (404 when absent, as a ``_preload_content=False`` answer),
    replaced only conditional on its current resourceVersion (409 stale, 422 without one; an
    absent one is created), and deleted; and leader.Lease itself acquires, renews, keeps a
    live holder's Lease from another identity, and makes a deleted Lease again, alike."""

    async def scenario(b: Backend) -> dict[str, Any]:
        api = b.leases()

        async def read(name: str) -> dict[str, Any]:
            doc: dict[str, Any] = await read_json(
                await api.read_namespaced_lease(name, b.ns, _preload_content=False)
            )
            return doc

        codes = {"get absent": await _code(read("l"))}
        codes["create"] = await _code(api.create_namespaced_lease(b.ns, _lease("l")))
        codes["create again"] = await _code(api.create_namespaced_lease(b.ns, _lease("l")))
        first = _rv(await read("l"))
        codes["replace"] = await _code(
            api.replace_namespaced_lease("l", b.ns, _lease("l", first, holder="b"))
        )
        after = await read("l")
        codes["replace stale"] = await _code(
            api.replace_namespaced_lease("l", b.ns, _lease("l", first, holder="c"))
        )
        codes["replace without resourceVersion"] = await _code(
            api.replace_namespaced_lease("l", b.ns, _lease("l", holder="c"))
        )
        codes["replace absent"] = await _code(  # Leases allow create on update
            api.replace_namespaced_lease("m", b.ns, _lease("m", first))
        )
        made = (await read("m"))["spec"]["holderIdentity"]
        codes["delete"] = await _code(api.delete_namespaced_lease("l", b.ns))
        codes["get deleted"] = await _code(read("l"))

        a, other = b.lease("op", "op-a", 3), b.lease("op", "op-b", 3)
        acquired = [await a.try_acquire(), await other.try_acquire(), await a.try_acquire()]
        alive = await other.holders_alive({(a.key, "op-a", 3), (a.key, "op-x", 3)})
        epoch = a.epoch
        await api.delete_namespaced_lease("op", b.ns)
        again = await a.try_acquire()  # its renewal makes the deleted Lease again
        doc = await read("op")
        return {
            **codes,
            "holder after the replace": after["spec"]["holderIdentity"],
            "made by the replace": made,
            "a, b, a renewing": acquired,
            "alive": sorted(h[1] for h in alive),
            "epoch after a renewal": epoch,
            "renewal of a deleted Lease": again,
            "made again": (doc["spec"]["holderIdentity"], doc["spec"].get("leaseTransitions", 0)),
        }

    seen = await _both(control_plane, namespace, scenario)
    assert seen["real"] == seen["memory"], seen
    assert seen["memory"] == {
        "get absent": 404,
        "create": 200,
        "create again": 409,
        "replace": 200,
        "replace stale": 409,
        "replace without resourceVersion": 422,
        "replace absent": 200,
        "delete": 200,
        "get deleted": 404,
        "holder after the replace": "b",
        "made by the replace": "a",
        "a, b, a renewing": [True, False, True],
        "alive": ["op-a"],
        "epoch after a renewal": 0,
        "renewal of a deleted Lease": True,
        "made again": ("op-a", 0),
    }
