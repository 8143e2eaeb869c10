"""Out of traffic only for the swap: a pod that serves a probed version keeps serving while its
checkpoint stages, Rolling's next batch stages while the current one is out of traffic, and a
checkpoint that changes after staging is refused at the load with the pod put back to serving
the weights it had (real API server, real operator process, simulated workers)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.fleet import Fleet, make_checkpoints, start_fleet
from testbed.simworker import SIM_MODEL, SIM_WEIGHTS_FILE

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

END = {"Succeeded", "Failed", "Halted", "RolledBack"}


def _serving_v1(
    harness: tuple[Fleet, Any], sim_fleet: Any, tmp_path: Path, n: int
) -> tuple[Fleet, Any, list[Any], dict[str, Path]]:
    """n pods serving v1 (a first refit Succeeded), and checkpoints v1 and v2."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, n)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    fleet.apply_refit("wr-v1", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("wr-v1", END, 60, op)["status"]["phase"] == "Succeeded"
    return fleet, op, sims, ckpt


def _condition(fleet: Fleet, name: str) -> dict[str, Any]:
    pod = fleet.pod(name)
    return next(c for c in pod["status"]["conditions"] if c["type"].endswith("weights-ready"))


def _answered(sim: Any, step: str) -> int:
    return sum(c["step"] == step and c["status"] == 200 for c in sim.call_log())


def test_pods_serve_while_staging_and_the_next_batch_stages_ahead(harness, sim_fleet, tmp_path):
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 3)
    for sim in sims:
        sim.set_fault("refit_stage", "delay", 1.5, times=1)
        sim.set_fault("refit_load", "delay", 1.5)
    fleet.apply_refit(
        "wr-v2", "v2", ckpt["v2"], sims[0].port, strategy={"type": "Rolling", "maxUnavailable": 1}
    )
    # pod-0 stages (slowed) while it still serves v1.
    fleet.wait_serving(sims[0], "refit_stage")
    assert fleet.ready(fleet.pod("pod-0")) is True
    assert "pause" not in [c["step"] for c in sims[0].call_log()[-3:]]
    # pod-0 out of traffic for its load: pod-1, next in line, has staged meanwhile, in traffic.
    fleet.wait_serving(sims[0], "refit_load", after="refit_stage")
    assert fleet.ready(fleet.pod("pod-0")) is False
    fleet.wait_for(lambda: _answered(sims[1], "refit_stage") >= 1, 10, "pod-1 staged ahead")
    assert fleet.ready(fleet.pod("pod-1")) is True
    assert "pause" not in [c["step"] for c in sims[1].call_log()][-3:]
    st = fleet.wait_phase("wr-v2", END, 90, op)["status"]
    assert st["phase"] == "Succeeded", st
    for i, sim in enumerate(sims):
        record = fleet.progress(fleet.pod(f"pod-{i}"))
        assert record is not None and record["outcome"] == "Succeeded"
        assert sim.state()["weight_version"] == "v2"
        # The drained window holds the load (1.5 s) and the rest, not the 1.5 s of staging.
        out = record["finished"] - record["left_traffic"]
        assert record["left_traffic"] >= record["started"] + record["step_seconds"]["stage"]
        assert 1.5 <= out < record["finished"] - record["started"], record
    # pod-1 and pod-2 staged ahead of their turn (the slowed call: v1's pass, the stage ahead,
    # their own pass's stage), so their own pass's stage was quick.
    assert [_answered(s, "refit_stage") for s in sims] == [2, 3, 3]
    for i in (1, 2):
        record = fleet.progress(fleet.pod(f"pod-{i}"))
        assert record is not None and record["step_seconds"]["stage"] < 1.0, record


def test_the_drain_pauses_drain_delay_seconds_after_the_pod_left_traffic(
    harness, sim_fleet, tmp_path
):
    """spec.sequence.drainDelaySeconds: once the record took the pod out of traffic
    (readiness condition False) the pod is not paused until the delay has passed, so that
    what endpoints still send it meanwhile is served; the refit's admitted sequence
    (status.sequence) keeps the field, and the calls are the same as without it."""
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 1)
    (sim,) = sims
    sim.call_log(clear=True)
    fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sim.port, sequence={"drainDelaySeconds": 2})
    fleet.wait_for(lambda: fleet.ready(fleet.pod("pod-0")) is False, 10, "pod-0 out of traffic")
    assert "pause" not in sim.calls(), sim.calls()  # out of traffic, still serving
    st = fleet.wait_phase("wr-v2", END, 60, op)["status"]
    assert st["phase"] == "Succeeded", st
    assert st["sequence"]["drainDelaySeconds"] == 2
    record = fleet.progress(fleet.pod("pod-0"))
    assert record is not None and record["outcome"] == "Succeeded"
    # The drain began right after the record that took the pod out: it held the delay.
    assert record["step_seconds"]["drain"] >= 1.9, record
    assert record["drained_at"] - record["left_traffic"] >= 2.0, record
    probe = (
        "models",
        "completions",
        "health",
        "refit_probe_reference",
        "refit_info",
        "get_world_size",
    )
    calls = [c for c in sim.calls() if c not in probe]
    assert calls[:3] == ["refit_stage", "pause", "sleep"], calls


def test_checkpoint_changed_after_staging_is_refused_and_the_pod_serves_v1_again(
    harness, sim_fleet, tmp_path
):
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 2)
    sims[1].set_fault("pause", "delay", 2.0)
    fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sims[0].port)
    fleet.wait_serving(sims[1], "pause")  # staged, draining: rewrite a shard in place
    shard = ckpt["v2"] / SIM_WEIGHTS_FILE
    shard.write_bytes(shard.read_bytes())  # same bytes, new identity (mtime, ctime)
    st = fleet.wait_phase("wr-v2", END, 60, op)["status"]
    assert st["phase"] == "Halted", st
    bad = next(p for p in st["pods"] if p["name"] == "pod-1")
    assert (bad["phase"], bad["reason"]) == ("Failed", "CheckpointChanged"), bad
    # Refused before the model was touched: the pod serves v1 again, and says why.
    assert sims[1].state()["weight_version"] == "v1"
    cond = _condition(fleet, "pod-1")
    assert cond["status"] == "True" and cond["reason"] == "PreviousWeights", cond
    assert "CheckpointChanged" in cond["message"]
    record = fleet.progress(fleet.pod("pod-1"))
    assert record is not None and record["restored"] and record["serving"] == "v1"
    calls = [c["step"] for c in sims[1].call_log()]
    after = calls[len(calls) - calls[::-1].index("refit_load") :]
    restore = ["wake_up", "reset_prefix_cache", "resume", "weight_info", "refit_ready"]
    assert [c for c in after if c in restore] == restore, calls


@pytest.mark.parametrize(
    ("kind", "code", "first"),
    [("error", "LoadFailed", "LoadFailed"), ("hang", None, "LoadTimeout")],
)
def test_a_refusal_after_a_load_that_may_have_touched_the_model_never_restores(
    harness, sim_fleet, tmp_path, kind, code, first
):
    """The first load fails after the worker may have begun (LoadFailed; or it hangs past the
    client's timeout, as a real vLLM load that keeps running); the retry is refused before
    the model is touched (a shard rewritten in place meanwhile). The pod must not go back to
    traffic on whatever the first try left in the model: it stays out, with the reason."""
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 2)
    sims[1].set_fault("pause", "delay", 2.0)
    sims[1].set_fault("refit_load", kind, 500 if kind == "error" else None, code=code, times=1)
    fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sims[0].port,
                      sequence={"loadTimeoutSeconds": 3, "retries": 1})  # fmt: skip
    fleet.wait_serving(sims[1], "pause")  # staged, draining: rewrite a shard in place
    shard = ckpt["v2"] / SIM_WEIGHTS_FILE
    shard.write_bytes(shard.read_bytes())
    st = fleet.wait_phase("wr-v2", END, 60, op)["status"]
    assert st["phase"] == "Halted", st
    bad = next(p for p in st["pods"] if p["name"] == "pod-1")
    assert (bad["phase"], bad["reason"]) == ("Failed", "CheckpointChanged"), bad
    assert "may have changed the model" in bad["message"], bad
    retried = [e["message"] for e in fleet.events("PodStepRetry")]
    assert any(f"load: {first}" in m for m in retried), retried  # the first try's failure
    assert sims[1].counts()["refit_load"] == 3  # v1's load, and two tries of v2
    cond = _condition(fleet, "pod-1")
    assert cond["status"] == "False" and cond["reason"] == "CheckpointChanged", cond
    record = fleet.progress(fleet.pod("pod-1"))
    assert record is not None and record["touched"] and not record["restored"], record
    assert "resume" not in [c["step"] for c in sims[1].call_log()][-4:]  # never unpaused
    assert fleet.ready(fleet.pod("pod-0")) is True


def test_sleep_level_2_cannot_restore_and_fails_closed(harness, sim_fleet, tmp_path):
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 2)
    sims[1].set_fault("pause", "delay", 2.0)
    fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sims[0].port, sequence={"sleepLevel": 2})
    fleet.wait_serving(sims[1], "pause")
    shard = ckpt["v2"] / SIM_WEIGHTS_FILE
    shard.write_bytes(shard.read_bytes())
    st = fleet.wait_phase("wr-v2", END, 60, op)["status"]
    bad = next(p for p in st["pods"] if p["name"] == "pod-1")
    assert bad["reason"] == "CheckpointChanged" and "sleep level 2" in bad["message"], bad
    cond = _condition(fleet, "pod-1")
    assert cond["status"] == "False" and cond["reason"] == "CheckpointChanged", cond


def test_a_partial_checkpoint_is_refused_while_the_pod_still_serves(harness, sim_fleet, tmp_path):
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 2)
    (ckpt["v2"] / "model-00002-of-00002.safetensors").write_bytes(b"partial")  # still copying
    before = [len(sim.call_log()) for sim in sims]
    fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sims[0].port)
    st = fleet.wait_phase("wr-v2", END, 60, op)["status"]
    assert st["phase"] in ("Failed", "Halted"), st
    for i, sim in enumerate(sims):
        # Refused by the fleet preflight or by the stage: either way never out of traffic.
        assert fleet.ready(fleet.pod(f"pod-{i}")) is True
        assert sim.state()["weight_version"] == "v1"
        v2_calls = [c["step"] for c in sim.call_log()[before[i] :]]
        assert "pause" not in v2_calls and "refit_load" not in v2_calls, v2_calls
    st_pods = {p["name"]: p for p in st["pods"]}
    assert st_pods and all(p["reason"] == "ManifestMismatch" for p in st_pods.values()), st


def test_the_drain_waits_for_the_kubelet_to_take_the_pod_out_of_endpoints(
    harness, sim_fleet, tmp_path
):
    """The pass sets the readiness condition False, but the pod stays Ready (endpoints keep
    sending to it) until its kubelet applies that. Requests that reach a paused vLLM run
    after the resume, before the probe: so no /pause until the pod's Ready is no longer
    True. Here the test is the kubelet, and a slow one."""
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 1)

    def kubelet_says(ready: str) -> float:
        fleet.core.patch_namespaced_pod_status(
            "pod-0", fleet.ns, {"status": {"conditions": [{"type": "Ready", "status": ready}]}}
        )
        return time.time()

    kubelet_says("True")
    paused = [c["step"] for c in sims[0].call_log()].count("pause")  # v1's pass
    fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sims[0].port)
    fleet.wait_for(lambda: fleet.ready(fleet.pod("pod-0")) is False, 30, "the condition False")
    time.sleep(2.0)  # the kubelet lags
    assert [c["step"] for c in sims[0].call_log()].count("pause") == paused
    caught_up = kubelet_says("False")
    st = fleet.wait_phase("wr-v2", END, 60, op)["status"]
    assert st["phase"] == "Succeeded", st
    # The drain's pause, and wakeKV's abort of what queued since (steps._abort_late_arrivals).
    assert [c["step"] for c in sims[0].call_log()].count("pause") == paused + 2
    record = fleet.progress(fleet.pod("pod-0"))
    assert record is not None and record["finished"] - record["left_traffic"] >= 2.0, record
    assert record["finished"] > caught_up


def test_a_pod_a_drain_timeout_left_paused_does_not_fail_the_next_refit(
    harness, sim_fleet, tmp_path
):
    """Regression (found on real vLLM under load): a DrainTimeout fails closed with the pod
    paused, and the next refit's preflight scored its probe reference on that pod (the first
    by name): the score queued until probeTimeoutSeconds, and that refit and every later one
    failed PodUnreachable before touching any pod. The preflight scores on a pod in traffic;
    the next refit then takes the paused pod through its pass and back into traffic."""
    fleet, op, sims, ckpt = _serving_v1(harness, sim_fleet, tmp_path, 2)
    answers: list[httpx.Response] = []

    def long_request() -> None:  # 4,000 tokens: 10 s on the simulator
        body = {"model": SIM_MODEL, "prompt": [1, 2, 3], "max_tokens": 4000}
        answers.append(httpx.post(f"{sims[0].base_url}/v1/completions", json=body, timeout=60))

    request = threading.Thread(target=long_request)
    request.start()
    fleet.wait_for(lambda: sims[0].state()["generating"] > 0, 10, "the request in flight")
    rolling = {"type": "Rolling", "maxUnavailable": 1}
    fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sims[0].port, strategy=rolling,
                      sequence={"drainMode": "wait", "drainTimeoutSeconds": 1})  # fmt: skip
    st = fleet.wait_phase("wr-v2", END, 60, op)["status"]
    assert st["phase"] == "Halted", st
    record = fleet.progress(fleet.pod("pod-0"))
    assert record is not None and record["reason"] == "DrainTimeout", record
    assert sims[0].state()["paused"] is True  # failed closed: paused, out of traffic
    assert fleet.ready(fleet.pod("pod-0")) is False and fleet.ready(fleet.pod("pod-1")) is True
    request.join(30)
    assert answers and answers[0].status_code == 200  # it finished on v1, as wait promises
    # The next refit: a probe timeout short enough that a score queued on pod-0 would fail it.
    fleet.apply_refit("wr-v2b", "v2", ckpt["v2"], sims[0].port, strategy=rolling,
                      sequence={"probeTimeoutSeconds": 5})  # fmt: skip
    st = fleet.wait_phase("wr-v2b", END, 60, op)["status"]
    assert st["phase"] == "Succeeded", st
    for i, sim in enumerate(sims):
        assert fleet.ready(fleet.pod(f"pod-{i}")) is True
        assert sim.state()["weight_version"] == "v2" and sim.state()["paused"] is False
