"""refit_client.client against the real API server: what submit creates, how wait reads
the operator's verdicts (simulated here through the status subresource, as the operator
writes it), the timeout, the manifest/reference writers, and one run against the real
operator with simulated workers."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from refit_client.client import RefitClient, RefitFailed, RefitTimeout
from refit_client.refit_error import RefitError
from refit_worker import contract

from testbed.controlplane import ControlPlane
from testbed.fleet import make_checkpoints

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture
def refits(control_plane: ControlPlane, weightrefit_crd: str, namespace: str) -> Any:
    with RefitClient(namespace=namespace, kubeconfig=control_plane.kubeconfig) as c:
        yield c


def set_status(c: RefitClient, name: str, status: dict[str, Any]) -> None:
    c.custom.patch_namespaced_custom_object_status(
        "refit.rollout.dev", "v1alpha1", c.namespace, "weightrefits", name, {"status": status}
    )


def test_submit_creates_the_refit_with_server_defaults(refits):
    name = refits.submit(
        "/ckpt/step-7", "step-7", fleet_selector="app=rollout", strategy="Rolling", canary=1
    )
    assert name == "refit-step-7"
    doc = refits.get(name)
    spec = doc["spec"]
    assert spec["checkpoint"] == {"path": "/ckpt/step-7", "version": "step-7",
                                  "format": "safetensors"}  # fmt: skip
    assert spec["fleet"]["selector"]["matchLabels"] == {"app": "rollout"}
    assert spec["fleet"]["port"] == 8000  # the API server's default
    assert spec["strategy"] == {"type": "Rolling", "canary": 1, "maxUnavailable": "25%"}
    assert spec["onFailure"] == "Halt"
    # A retry with the same checkpoint is the same refit; another checkpoint is refused.
    assert refits.submit("/ckpt/step-7", "step-7", fleet_selector="app=rollout") == name
    with pytest.raises(RefitError, match="already exists for step-7"):
        refits.submit("/ckpt/other", "step-7", fleet_selector="app=rollout")
    assert len(refits.list_refits()) == 1


def test_submit_reports_the_api_servers_validation_and_creates_nothing(refits):
    with pytest.raises(RefitError, match=r"checkpoint\.path"):
        refits.submit("relative/path", "v1", fleet_selector="app=rollout")
    assert refits.list_refits() == []


def test_wait_raises_with_the_operators_reason(refits):
    name = refits.submit("/ckpt/v3", "v3", fleet_selector={"app": "rollout"})
    status = {
        "phase": "Halted",
        "message": "halted: 1 pods failed (failureLimit 0)",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "FailureLimitExceeded",
             "message": "halted: 1 pods failed (failureLimit 0)",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Degraded", "status": "True", "reason": "FailureLimitExceeded",
             "message": "halted: 1 pods failed (failureLimit 0)",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ],
        "pods": [{"name": "pod-1", "phase": "Failed", "reason": "NllDrift",
                  "message": "|NLL - reference NLL| over threshold"}],
    }  # fmt: skip
    # The verdict arrives while wait is already watching.
    timer = threading.Timer(1.0, set_status, (refits, name, status))
    timer.start()
    seen: list[str] = []
    began = time.monotonic()
    with pytest.raises(RefitFailed) as err:
        refits.wait(name, timeout=30, on_update=lambda st: seen.append(st.get("phase", "")))
    timer.join()
    assert time.monotonic() - began < 10
    e = err.value
    assert (e.phase, e.reason) == ("Halted", "FailureLimitExceeded")
    assert [(f.pod, f.reason) for f in e.pod_failures] == [("pod-1", "NllDrift")]
    assert seen[-1] == "Halted"


def test_wait_after_a_rollback_finds_the_cause_in_the_events(refits, control_plane):
    name = refits.submit("/ckpt/v3", "v3", fleet_selector={"app": "rollout"})
    uid = refits.get(name)["metadata"]["uid"]
    ns = refits.namespace

    def event(reason: str, message: str, seq: int) -> None:
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{name}.{seq}", "namespace": ns},
                "involvedObject": {"apiVersion": "refit.rollout.dev/v1alpha1",
                                   "kind": "WeightRefit", "name": name, "namespace": ns,
                                   "uid": uid},
                "reason": reason, "message": message, "type": "Warning",
                "firstTimestamp": f"2026-01-01T00:00:0{seq}Z",
                "lastTimestamp": f"2026-01-01T00:00:0{seq}Z", "count": 1}  # fmt: skip
        control_plane.kubectl("create", "-f", "-", input=json.dumps(body))

    # What the operator records when the canary's probe fails and the fleet rolls back.
    event("PodRefitFailed", "pod pod-0: LogprobDrift: max |Δlogprob| over threshold", 1)
    event("FailureLimitExceeded", "1 pods failed (failureLimit 0); rolling back to v2", 2)
    set_status(refits, name, {
        "phase": "RolledBack", "message": "1 pods rolled back to v2",
        "conditions": [{"type": "Degraded", "status": "True", "reason": "RolledBack",
                        "message": "1 pods rolled back to v2",
                        "lastTransitionTime": "2026-01-01T00:00:03Z"}],
        "pods": [{"name": "pod-0", "phase": "RolledBack", "version": "v2"}],
    })  # fmt: skip
    with pytest.raises(RefitFailed) as err:
        refits.wait(name, timeout=10)
    e = err.value
    assert (e.phase, e.reason, e.cause) == ("RolledBack", "RolledBack", "FailureLimitExceeded")
    assert [(f.pod, f.phase, f.reason) for f in e.pod_failures] == [
        ("pod-0", "Failed", "LogprobDrift")]  # fmt: skip


def test_wait_returns_the_status_on_success_and_times_out_cleanly(refits):
    name = refits.submit("/ckpt/v1", "v1", fleet_selector={"app": "rollout"})
    began = time.monotonic()
    with pytest.raises(RefitTimeout, match="not finished after 2s: phase Pending"):
        refits.wait(name, timeout=2)
    assert 2 <= time.monotonic() - began < 8
    set_status(refits, name, {"phase": "Succeeded", "updatedPods": 3, "targetPods": 3})
    assert refits.wait(name, timeout=5)["updatedPods"] == 3
    with pytest.raises(RefitError, match="not found"):
        refits.wait("no-such-refit", timeout=2)


def test_submit_writes_manifest_and_reference(refits, tiny_model, tmp_path):
    ckpt = tmp_path / "A"
    shutil.copytree(tiny_model.checkpoints["A"], ckpt)
    (ckpt / contract.MANIFEST_FILE).unlink()
    (ckpt / contract.PROBE_FILE).unlink()
    texts = tiny_model.probe_texts_file.read_text().splitlines()
    refits.submit(ckpt, "A", fleet_selector="app=x", write_manifest=True,
                  write_reference_texts=texts, reference_max_tokens=48)  # fmt: skip
    original = tiny_model.checkpoints["A"]
    assert json.loads((ckpt / contract.MANIFEST_FILE).read_text()) == json.loads(
        (original / contract.MANIFEST_FILE).read_text()
    )
    mine = contract.ProbeReference.from_json_dict(
        json.loads((ckpt / contract.PROBE_FILE).read_text())
    )
    ref = tiny_model.reference("A")
    assert [p.token_ids for p in mine.prompts] == [p.token_ids for p in ref.prompts]
    assert mine.prompts[0].nll == pytest.approx(ref.prompts[0].nll, abs=1e-5)
    assert refits.get("refit-a")["spec"]["checkpoint"]["path"] == str(ckpt)


def test_submit_and_wait_against_the_real_operator(harness, sim_fleet, tmp_path: Path,
                                                   control_plane):  # fmt: skip
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)
    ckpt = make_checkpoints(tmp_path, "v1", "v2", drift={"v2": -0.5})
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
    op.start()
    with RefitClient(namespace=fleet.ns, kubeconfig=control_plane.kubeconfig) as refits:
        name = refits.submit(ckpt["v1"], "v1", fleet_selector="app=rollout", port=sims[0].port)
        status = refits.wait(name, timeout=60)
        assert (status["phase"], status["updatedPods"]) == ("Succeeded", 2)
        bad = refits.submit(ckpt["v2"], "v2", fleet_selector="app=rollout", port=sims[0].port)
        with pytest.raises(RefitFailed) as err:
            refits.wait(bad, timeout=60)
    e = err.value
    assert e.phase == "Halted" and e.reason == "FailureLimitExceeded", (e, op.logs())
    assert {f.reason for f in e.pod_failures} <= {"LogprobDrift", "NllDrift"}
    assert e.pod_failures
