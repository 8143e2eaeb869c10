"""How many API requests one pass makes on its pod, per weight source: the real pass runner
(controller/pod_pass.py, podflow, cluster.ClaimedPod) against the explorer's in-memory cluster,
every step's worker calls left out (each step succeeds at once). Counts, not timings: two pod
writes per pass (the claim, which takes the pod out of traffic, and the last write) for a
checkpoint or a broadcast; three for an adapter, whose staged load and probe run under the
claim while the pod serves (claim, the record that takes it out before the drain, the last
write); and no read of the pod unless its kubelet has yet to apply the condition the pass set
False (docs/operator.md, "API writes per pod")."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from refit_operator.controller import pod_pass
from refit_operator.controller.pass_context import PassContext, StepRun
from refit_operator.core.api_spec import WeightRefitSpec
from refit_operator.core.decision import PodStart
from refit_operator.core.podflow import Progress
from refit_operator.core.podview import PodView
from refit_operator.core.preflight_cache import Identity
from refit_operator.core.sequences import Step

from testbed.explorer.memcluster import MemoryCluster, Store, pod_body

NS = "fleet"
SELECTOR = {"fleet": {"selector": {"matchLabels": {"app": "rollout"}}}}
SOURCES = ("adapter", "broadcast", "checkpoint")


def _spec(source: str, version: str) -> WeightRefitSpec:
    by_source: dict[str, dict[str, Any]] = {
        "checkpoint": {"checkpoint": {"path": f"/ckpt/{version}", "version": version}},
        "broadcast": {
            "broadcast": {
                "version": version,
                "rendezvous": {"host": "10.0.0.5", "port": 29500},
                "manifest": {"configMapRef": {"name": "manifest"}, "digest": "a" * 64},
            },
            "probe": {"reference": {"source": "ConfigMap", "configMapRef": {"name": "ref"}}},
        },
        "adapter": {
            "adapter": {"name": "policy", "path": f"/lora/policy/{version}", "version": version}
        },
    }
    return WeightRefitSpec.model_validate({**SELECTOR, **by_source[source]})


class CountingCluster(MemoryCluster):
    """The in-memory API server, counting each pod's writes and reads."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, "op")
        self.writes: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()

    async def _patch_pod_status(
        self, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes[name] += 1
        return await super()._patch_pod_status(namespace, name, body)

    async def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads[name] += 1
        doc = await super().read_pod(namespace, name)
        if any(c.get("type") == "Ready" for c in doc["status"].get("conditions") or []):
            _set_ready(doc, "False")  # by now the kubelet applied the gate's False
        return doc

    async def event(self, *args: Any) -> None:
        self.writes["events"] += 1


def _set_ready(doc: dict[str, Any], status: str) -> None:
    conds = [c for c in doc["status"].get("conditions") or [] if c.get("type") != "Ready"]
    doc["status"]["conditions"] = [*conds, {"type": "Ready", "status": status}]


async def _stepped(run: StepRun, step: Step) -> str:
    """Every step succeeds at once; the drain still waits out the endpoints as it does."""
    if step == Step.drain:
        from refit_operator.controller.steps import _wait_out_of_endpoints

        assert run.ctx is not None and run.pod is not None
        await _wait_out_of_endpoints(run.ctx, run.pod, run.claimed)
    return ""


def _ctx(cluster: CountingCluster, spec: WeightRefitSpec, name: str, pod: PodView) -> PassContext:
    return PassContext(
        cluster=cluster, namespace=NS, refit_doc={"metadata": {"name": name}}, refit_name=name,
        refit_uid=f"uid-{name}", refit_created="", fleet="rollout", spec=spec,
        client=lambda p, fence: None,  # type: ignore[arg-type,return-value]  # no step calls
        next_fence=lambda: 1, reference=None,  # type: ignore[arg-type]
        peer_nlls=lambda v: [], admitted={pod.name: Identity.of(pod)},
    )  # fmt: skip


async def _two_passes(source: str, kubelet: bool) -> list[tuple[int, int, Progress]]:
    """(pod writes, pod reads, record) of a first pass (the pod serves nothing probed) and of
    the next refit's pass (the pod serves the first one's version)."""
    store = Store()
    store.create("Pod", NS, pod_body("pod-0", "10.0.0.1", {"app": "rollout"}))
    cluster = CountingCluster(store)
    out = []
    for i, version in enumerate(("v1", "v2")):
        if kubelet:  # Ready as the kubelet shows a pod in traffic (or about to be)
            doc = store.get("Pod", NS, "pod-0")
            assert doc is not None
            _set_ready(doc, "True")
            store.replace("Pod", NS, "pod-0", doc)
        listed = store.get("Pod", NS, "pod-0")
        assert listed is not None
        pod = PodView.from_pod(listed)
        cluster.writes.clear()
        cluster.reads.clear()
        spec = _spec(source, version)
        path = spec.checkpoint.path if spec.checkpoint else ""
        if spec.adapter:
            path = spec.adapter.path
        start = PodStart("pod-0", version, path, rollback=False, resume=False)
        record = await pod_pass.run_pass(_ctx(cluster, spec, f"r{i}", pod), pod, start)
        assert record.outcome == "Succeeded", record
        out.append((cluster.writes["pod-0"], cluster.reads["pod-0"], record))
        assert cluster.writes["events"] == 0  # a pod that succeeded gets no Event
    return out


# (writes, reads) of the first pass and of the next, without a kubelet (the simulated fleet)
# and with one that lags the gate (each drain reads the pod until it is no longer Ready).
BUDGET = {
    # Out of traffic in the claim: claim + last write. Serving: staged before the claim
    # (unfenced, as a stage ahead of its turn), so the claim takes it out; then the last.
    "checkpoint": ((2, 0), (2, 0)),
    # Nothing to stage: the claim takes any pod out, serving or not.
    "broadcast": ((2, 0), (2, 0)),
    # The base weights serve beside the adapter while it is staged and probed, every pass.
    "adapter": ((3, 0), (3, 0)),
}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("kubelet", [False, True], ids=["no-kubelet", "kubelet"])
def test_a_pass_writes_its_pod_two_or_three_times_and_reads_it_only_for_the_kubelet(
    source: str, kubelet: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pod_pass, "run_step_code", _stepped)
    passes = asyncio.run(_two_passes(source, kubelet))
    got = [(w, r) for w, r, _ in passes]
    # With a kubelet, the answer to the write that took the pod out still shows it Ready
    # (the kubelet has yet to see the gate): one read shows it caught up.
    want = [(w, 1 if kubelet else 0) for w, _ in BUDGET[source]]
    assert got == want, f"{source}: (writes, reads) per pass {got}, budget {want}"
    # The second pass found the pod serving the first one's version (a weights pass: it
    # recorded that, to go back to it on a refusal before the model was touched).
    second = passes[1][2]
    assert second.left_traffic > 0
    assert second.serving == ("v1" if source != "adapter" else second.serving)
