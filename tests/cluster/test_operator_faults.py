"""Every fault of the simulated worker, and every kind of bad input, ends in its documented
outcome (docs/operator.md): the refit stops, the pod stays out of traffic with a reason."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from testbed.fleet import make_checkpoints, start_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

FAST = {"stepTimeoutSeconds": 2, "loadTimeoutSeconds": 3, "probeTimeoutSeconds": 2, "retries": 1}
END = {"Succeeded", "Failed", "Halted", "RolledBack"}

# (step, kind, value, code) -> (refit phase, pod phase, pod reason)
FAULTS: list[tuple[str, str, Any, str | None, str, str]] = [
    ("refit_load", "error", 500, "LoadFailed", "Failed", "LoadFailed"),
    ("refit_stage", "error", 500, "ManifestMismatch", "Failed", "ManifestMismatch"),
    ("sleep", "error", 500, None, "Failed", "WorkerHttpError"),
    ("wake_up", "hang", None, None, "Failed", "WakeWeightsTimeout"),
    ("pause", "crash", None, None, "Failed", "PodUnreachable"),
    ("weight_info", "wrong_version", "v0", None, "Failed", "VersionMismatch"),
    ("reset_prefix_cache", "refuse", None, None, "Failed", "WorkerRejected"),
    ("completions", "nan", "nan", None, "Inconclusive", "ProbeNaN"),
    ("completions", "garbage", None, None, "Failed", "ProbeGarbage"),
    ("completions", "drift", -0.5, None, "Failed", "LogprobDrift"),
    ("completions", "missing", None, None, "Inconclusive", "ProbeNoData"),
    ("completions", "hang", None, None, "Inconclusive", "ProbeTimeout"),
]


@pytest.mark.parametrize(("step", "kind", "value", "code", "pod_phase", "reason"), FAULTS)
def test_fault_fails_closed(
    harness, sim_fleet, tmp_path, step, kind, value, code, pod_phase, reason
):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    ckpt = make_checkpoints(tmp_path, "v1")
    # pod-1 gets the fault: the preflight scores the reference on pod-0 (before touching any).
    if kind == "crash":
        sims[1].set_fault(step, kind)
    else:
        sims[1].set_fault(step, kind, value, code=code)
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, sequence=FAST)
    st = fleet.wait_phase("wr", END, 120, op)["status"]
    assert st["phase"] == "Halted", st
    bad = next(p for p in st["pods"] if p["name"] == "pod-1")
    assert (bad["phase"], bad["reason"]) == (pod_phase, reason), bad
    pod = fleet.pod("pod-1")
    assert fleet.ready(pod) is False
    cond = next(c for c in pod["status"]["conditions"] if c["type"].endswith("weights-ready"))
    assert cond["reason"] == reason
    assert fleet.events("PodRefit" + pod_phase)
    # The healthy pod finished its own pass (AllAtOnce ran both) and alone is Ready.
    assert fleet.ready(fleet.pod("pod-0")) is True


def test_transient_fault_is_retried(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 1)
    sims[0].set_fault("refit_load", "error", 500, code="LoadFailed", times=1)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, sequence=FAST)
    st = fleet.wait_phase("wr", END, 60, op)["status"]
    assert st["phase"] == "Succeeded"
    record = fleet.progress(fleet.pod("pod-0"))  # succeeded: its record is on the pod only
    assert st["pods"] == [] and record is not None and record["outcome"] == "Succeeded"
    assert record["attempts"] == 0 and fleet.events("PodStepRetry")
    assert sims[0].counts()["refit_load"] == 2


def _untouched(sims: list[Any]) -> bool:
    return all(not ({"refit_stage", "pause", "sleep", "refit_load"} & set(s.calls())) for s in sims)


def _expect_refused(fleet: Any, op: Any, reason: str) -> dict[str, Any]:
    st = fleet.wait_phase("wr", END, 60, op)["status"]
    assert st["phase"] == "Failed", st
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == reason, ready

    # The operator writes the status, then posts the Event: the Event may trail the phase.
    def warned() -> bool:
        return any(e["type"] == "Warning" for e in fleet.events(reason))

    fleet.wait_for(warned, 15, f"a Warning Event {reason}")
    return dict(st)


def test_selector_matching_no_pods(harness, sim_fleet, tmp_path):
    fleet, op = harness
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], 8000)
    _expect_refused(fleet, op, "NoPodsSelected")


def test_missing_secret(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2, admin_token="s3cret")
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    ref = {"adminTokenSecretRef": {"name": "nope"}}
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, fleet=ref)
    _expect_refused(fleet, op, "SecretMissing")
    assert _untouched(sims)


def test_admin_token_and_api_key_from_secrets(harness, sim_fleet, tmp_path):
    """Pods guard their admin endpoints with a token and /v1 with vLLM's --api-key: the
    operator reads both from the Secrets the spec names (the probe fails without the key)."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2, admin_token="s3cret", api_key="k3y")
    for name, key, value in (("vllm-admin", "token", b"s3cret"), ("vllm-api", "key", b"k3y")):
        secret = {"metadata": {"name": name}, "data": {key: base64.b64encode(value).decode()}}
        fleet.core.create_namespaced_secret(fleet.ns, secret)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    admin = {"adminTokenSecretRef": {"name": "vllm-admin"}}
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, fleet=admin)
    st = _expect_refused(fleet, op, "ProbeUnauthorized")
    assert "apiKeySecretRef" in st["message"], st["message"]
    assert _untouched(sims)
    both = {**admin, "apiKeySecretRef": {"name": "vllm-api", "key": "key"}}
    fleet.apply_refit("wr2", "v2", ckpt["v2"], sims[0].port, fleet=both)
    assert fleet.wait_phase("wr2", END, 60, op)["status"]["phase"] == "Succeeded"


def test_pod_without_readiness_gate(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)
    fleet.add_pod("pod-0", sims[0])
    fleet.add_pod("pod-1", sims[1], gate=False)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    st = _expect_refused(fleet, op, "MissingReadinessGate")
    assert "pod-1" in st["message"]
    assert _untouched(sims)


@pytest.mark.parametrize("flaw", ["no-gate", "finished"])
def test_the_admin_token_reaches_only_vetted_pods(harness, sim_fleet, tmp_path, flaw):
    """The admin token travels in clear to a pod's IP. A selected pod without the readiness
    gate, or one no longer Running whose IP may now be another pod's, makes the preflight
    refuse the fleet before ANY pod is called; once the fleet is fit, the token goes only on
    the calls the guard requires it for (not on a drain's /metrics)."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path, admin_token="s3cret")
    secret = {"metadata": {"name": "vllm-admin"},
              "data": {"token": base64.b64encode(b"s3cret").decode()}}  # fmt: skip
    fleet.core.create_namespaced_secret(fleet.ns, secret)
    fleet.add_pod("pod-0", sims[0])
    fleet.add_pod("pod-1", sims[1], gate=flaw != "no-gate")
    if flaw == "finished":  # its IP stays in status.podIP; the address may be reused
        fleet.core.patch_namespaced_pod_status("pod-1", fleet.ns, {"status": {"phase": "Failed"}})
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    admin = {"adminTokenSecretRef": {"name": "vllm-admin"}}
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, fleet=admin)
    reason = "MissingReadinessGate" if flaw == "no-gate" else "PodNotRunning"
    st = _expect_refused(fleet, op, reason)
    assert "pod-1" in st["message"], st["message"]
    assert [s.call_log() for s in sims] == [[], []]  # not even a token-free call
    # The same fleet, fit: every admin call carries the token, no open read does.
    fleet.core.delete_namespaced_pod("pod-1", fleet.ns, grace_period_seconds=0)
    fleet.wait_for(lambda: len(fleet.pods()) == 1, 30, "pod-1 gone")
    fleet.apply_refit("wr-2", "v2", ckpt["v2"], sims[0].port, fleet=admin)
    assert fleet.wait_phase("wr-2", END, 60, op)["status"]["phase"] == "Succeeded"
    calls = [c for c in sims[0].call_log() if c["step"] not in ("models", "completions")]  # /v1
    # The one open read: GET /refit/ready (which process the probe scores); the vouch (POST
    # /refit/ready) is an admin call. (A wait drain ends with its pause, never on /metrics.)
    assert {c["step"] for c in calls if not c["auth"]} == {"refit_ready"}, calls
    assert any(c["step"] == "refit_ready" and c["auth"] for c in calls), calls
    assert all(c["status"] != 401 for c in calls), calls
    assert sims[1].call_log() == []


def test_unreachable_pod(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[1].crash()
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    _expect_refused(fleet, op, "PodUnreachable")
    assert _untouched(sims)


def test_unsafe_backend_refused_unless_allowed(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[1].set_state(capabilities=["verified-reload"])
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    st = _expect_refused(fleet, op, "UnsafeBackend")
    assert "flashinfer-bmm-scales-per-forward" in st["message"]
    assert _untouched(sims)
    fleet.apply_refit("wr-unsafe", "v1", ckpt["v1"], sims[0].port, allowUnsafeBackends=True)
    assert fleet.wait_phase("wr-unsafe", END, 60, op)["status"]["phase"] == "Succeeded"


def test_pod_with_workers_the_refit_cannot_hear_is_refused(harness, sim_fleet, tmp_path):
    """A pod whose API server counts two workers while refit_info answers for one (vLLM with
    --data-parallel-size 2, tests/worker/test_data_parallel.py): refused before any call."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[1].set_state(world_size=2)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    st = _expect_refused(fleet, op, "WorkersOutOfReach")
    assert st["message"].startswith("pod pod-1: /get_world_size counts 2 workers"), st
    assert _untouched(sims)


def test_reference_the_model_cannot_score(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    ckpt = make_checkpoints(tmp_path, "v1")
    reference = {
        "formatVersion": 1, "version": "v1", "dtype": "float32",
        "prompts": [{"tokenIds": [1, 99999, 3], "logprobs": [None, -1.0, -1.0]}],
    }  # fmt: skip
    cm = {"metadata": {"name": "ref"}, "data": {"refit-probe.json": json.dumps(reference)}}
    fleet.core.create_namespaced_config_map(fleet.ns, cm)
    op.start()
    probe = {"reference": {"source": "ConfigMap", "configMapRef": {"name": "ref"}}}
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, probe=probe)
    _expect_refused(fleet, op, "ReferenceUnscorable")
    assert _untouched(sims)


def test_reference_of_another_version_is_refused_before_any_pod_is_touched(
    harness, sim_fleet, tmp_path
):
    """A ConfigMap reference still holding step v1's reference (a scorable one: it passed
    every check but its version) for a refit to v2: without the check every pod would be
    drained, reloaded and fail its probe, and the fleet be left out of traffic."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    stale = (ckpt["v1"] / "refit-probe.json").read_text()
    cm = {"metadata": {"name": "ref"}, "data": {"refit-probe.json": stale}}
    fleet.core.create_namespaced_config_map(fleet.ns, cm)
    op.start()
    probe = {"reference": {"source": "ConfigMap", "configMapRef": {"name": "ref"}}}
    fleet.apply_refit("wr", "v2", ckpt["v2"], sims[0].port, probe=probe)
    st = _expect_refused(fleet, op, "ReferenceVersionMismatch")
    assert "'v1'" in st["message"] and "'v2'" in st["message"], st["message"]
    assert _untouched(sims)
    assert all(fleet.ready(fleet.pod(f"pod-{i}")) is not False for i in range(2))
    # The reference of v2 in the same ConfigMap: the refit goes through.
    cm["data"]["refit-probe.json"] = (ckpt["v2"] / "refit-probe.json").read_text()
    fleet.core.replace_namespaced_config_map("ref", fleet.ns, cm)
    fleet.apply_refit("wr-2", "v2", ckpt["v2"], sims[0].port, probe=probe)
    assert fleet.wait_phase("wr-2", END, 60, op)["status"]["phase"] == "Succeeded"


def test_late_pods_are_refused_as_the_preflight_would_refuse_them(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = sim_fleet(5, allowed_root=tmp_path)
    fleet.add_pod("pod-0", sims[0])
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("wr", "Succeeded", 60, op)["status"]["layout"] == "TP1 PP1 DP1"
    sims[2].set_state(capabilities=[])
    sims[3].set_state(world_size=2)
    sims[4].set_state(tensor_parallel_size=2, world_size=2)  # reachable, another layout
    fleet.add_pod("no-gate", sims[1], gate=False)
    fleet.add_pod("unsafe", sims[2])
    fleet.add_pod("out-of-reach", sims[3])
    fleet.add_pod("tp2", sims[4])

    def refused() -> dict[str, str]:
        pods = fleet.refit("wr")["status"]["pods"]
        return {p["name"]: p["reason"] for p in pods if p["phase"] == "Failed"}

    fleet.wait_for(lambda: len(refused()) == 4, 60, "the late pods refused")
    assert refused() == {
        "no-gate": "MissingReadinessGate",
        "unsafe": "UnsafeBackend",
        "out-of-reach": "WorkersOutOfReach",
        "tp2": "ParallelLayoutMismatch",
    }
    assert _untouched(sims[1:])
    assert fleet.ready(fleet.pod("pod-0")) is True
