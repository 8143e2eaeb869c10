"""decision.decide driven with plain data: a fleet of pods through a whole refit."""

from dataclasses import replace
from typing import Any

from refit_operator.core import podflow
from refit_operator.core.admission import (
    PreflightResult,
    admitted_spec,
    fleet_problem,
    reference_scorers,
)
from refit_operator.core.api import LabelSelector, PodProbe, Previous, WeightRefitStatus
from refit_operator.core.decision import decide
from refit_operator.core.plan import RefitRef
from refit_operator.core.podview import PodView
from refit_operator.core.reasons import Problem

from tests.fixtures.refits import CREATED, NOW, STARTED, done, info, observe, pod, refit, spec


def test_new_refit_asks_for_preflight_then_starts_all_pods():
    s = spec()
    pods = [pod("p0"), pod("p1")]
    d = decide(observe(refit(s), pods))
    assert d.need_preflight and d.status.phase == "Preflight" and not d.start
    pre = PreflightResult(infos={"p0": info(), "p1": info()})
    d = decide(observe(refit(s, d.status), pods, preflight=pre))
    assert d.status.phase == "Progressing"
    assert [x.pod for x in d.start] == ["p0", "p1"] and not any(x.resume for x in d.start)
    assert {c.type: c.status for c in d.status.conditions} == {
        "Ready": "False", "Progressing": "True", "Degraded": "False",
    }  # fmt: skip


def test_bad_input_fails_preflight_and_touches_nothing():
    s = spec()
    cases = [
        ([], PreflightResult(), "NoPodsSelected"),
        (
            [pod("p0", has_gate=False)],
            PreflightResult(infos={"p0": info()}),
            "MissingReadinessGate",
        ),
        ([pod("p0")], PreflightResult(infos={"p0": "connect refused"}), "PodUnreachable"),
        ([pod("p0")], PreflightResult(infos={"p0": info(capabilities=())}), "UnsafeBackend"),
        (
            [pod("p0")],
            PreflightResult(infos={"p0": info(unsafe_reasons=("fp8 kv under full graphs",))}),
            "UnsafeConfiguration",
        ),
        (
            [pod("p0")],
            PreflightResult(problem=Problem("SecretMissing", "no secret")),
            "SecretMissing",
        ),
    ]
    for pods, pre, reason in cases:
        st = WeightRefitStatus(phase="Preflight")
        d = decide(observe(refit(s, st), pods, preflight=pre))
        assert d.status.phase == "Failed", reason
        assert d.start == []
        ready = next(c for c in d.status.conditions if c.type == "Ready")
        assert ready.status == "False" and ready.reason == reason
        assert d.events and d.events[0].type == "Warning"


def test_what_the_pod_objects_say_is_judged_before_any_pod_answered():
    """The engine calls no pod (and sends no admin token) unless fleet_problem is None; the
    decision then names the pod from the Pod objects alone, whichever pod sorts first and
    whatever else the preflight could not learn."""
    s = spec()
    st = WeightRefitStatus(phase="Preflight")
    fit = [pod("a0"), pod("a1")]
    for flawed, reason in ((pod("p9", has_gate=False), "MissingReadinessGate"),
                           (pod("p9", running=False), "PodNotRunning"),
                           (pod("p9", ip=""), "PodNotRunning")):  # fmt: skip
        assert not flawed.vetted and all(p.vetted for p in fit)
        pods = [*fit, flawed]
        assert (problem := fleet_problem(pods)) is not None and problem.reason == reason
        # Nothing asked (no infos, no secret read): still that reason, for that pod.
        d = decide(observe(refit(s, st), pods, preflight=PreflightResult()))
        assert d.status.phase == "Failed" and d.start == []
        assert d.status.message.startswith("pod p9"), d.status.message
        assert next(c for c in d.status.conditions if c.type == "Ready").reason == reason
    assert fleet_problem(fit) is None
    assert (empty := fleet_problem([])) is not None and empty.reason == "NoPodsSelected"


def test_staging_ahead_asks_only_vetted_pods():
    """Staging ahead sends the admin token: never to a next-in-line pod without the gate or
    not Running (a late pod that the fleet preflight never saw)."""
    rolling = {"type": "Rolling", "maxUnavailable": 1}
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    for nxt, ahead in ((pod("p1"), ["p1"]), (pod("p1", has_gate=False), []),
                       (pod("p1", running=False), [])):  # fmt: skip
        d = decide(observe(refit(spec(strategy=rolling), st), [pod("p0"), nxt, pod("p2")]))
        assert [x.pod for x in d.start] == ["p0"] and d.stage_ahead == ahead, nxt


def test_a_started_refit_keeps_the_sequence_its_preflight_admitted():
    """spec.sequence changed after the preflight (an API server with an older CRD accepts
    it): every decision and pass acts on the sequence the preflight admitted, recorded in
    the status (so it survives an operator restart)."""
    s = spec(sequence={"sleepLevel": 1})
    pods = [pod("p0"), pod("p1")]
    pre = PreflightResult(infos={"p0": info(), "p1": info(kv_cache_scales="compressed-tensors")})
    d = decide(observe(refit(s, WeightRefitStatus(phase="Preflight")), pods, preflight=pre))
    assert d.status.phase == "Progressing" and d.status.sequence == s.sequence
    st = WeightRefitStatus.model_validate(d.status.dump())  # as read back from the server
    assert st.sequence == s.sequence
    # Level 2 would have been refused at the preflight (p1's KV scales), and a 1 s total
    # timeout would trip the gate at once: neither reaches the refit.
    changed = spec(sequence={"sleepLevel": 2, "totalTimeoutSeconds": 1})
    kept = admitted_spec(changed, st)
    assert kept.sequence == s.sequence and kept.checkpoint == changed.checkpoint
    st.start_time = STARTED
    assert decide(observe(refit(kept, st), pods)).status.phase == "Progressing"
    assert decide(observe(refit(changed, st), pods)).status.phase == "Halted"  # had it acted
    # Unchanged, or not started yet (nothing recorded): the spec as it is.
    assert admitted_spec(s, st) is s
    assert admitted_spec(changed, WeightRefitStatus(phase="Queued")) is changed


def test_unsafe_allowed_explicitly():
    s = spec(allowUnsafeBackends=True)
    st = WeightRefitStatus(phase="Preflight")
    pre = PreflightResult(infos={"p0": info(capabilities=())})
    assert decide(observe(refit(s, st), [pod("p0")], preflight=pre)).status.phase == "Progressing"


def test_all_passed_succeeds_and_ready_is_true():
    s = spec()
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    r = refit(s, st)
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    d = decide(observe(r, [pod("p0", done(prog)), pod("p1", prog)]))
    assert d.status.phase == "Progressing" and d.status.updated_pods == 1
    assert [x.pod for x in d.start] == ["p1"] and d.start[0].resume
    d = decide(observe(r, [pod("p0", done(prog)), pod("p1", done(prog))]))
    assert d.status.phase == "Succeeded" and d.status.updated_pods == 2
    assert next(c for c in d.status.conditions if c.type == "Ready").status == "True"
    assert d.status.completion_time


def test_gate_halts_after_in_flight_pods_finish():
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    failed = done(prog, "Failed")
    d = decide(replace(observe(r, [pod("p0", failed), pod("p1")]), in_flight=frozenset({"p9"})))
    assert d.status.phase == "Progressing" and d.start == []
    d = decide(observe(r, [pod("p0", failed), pod("p1")]))
    assert d.status.phase == "Halted"
    assert next(c for c in d.status.conditions if c.type == "Degraded").status == "True"


def test_rollback_refits_touched_pods_to_previous():
    s = spec(onFailure="Rollback")
    prev = Previous(version="v1", path="/ckpt/v1", refit="wr-old")
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED, previous=prev)
    r = refit(s, st)
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW, serving="v1", serving_path="/ckpt/v1")
    d = decide(observe(r, [pod("p0", done(prog, "Failed")), pod("p1", done(prog)), pod("p2")]))
    assert d.status.phase == "RollingBack"
    assert sorted((x.pod, x.version, x.path, x.rollback) for x in d.start) == [
        ("p0", "v1", "/ckpt/v1", True), ("p1", "v1", "/ckpt/v1", True),
    ]  # fmt: skip
    back = podflow.start("wr", "uid", "v1", "/ckpt/v1", NOW, rollback=True)
    d = decide(
        observe(refit(s, d.status), [pod("p0", done(back)), pod("p1", done(back)), pod("p2")])
    )
    assert d.status.phase == "RolledBack"


def test_rollback_without_a_checkpoint_any_pod_served_fails_closed():
    """The first refit of a fleet (the pods served their boot weights, never probed): nothing
    to go back to. The pods it touched leave traffic: the fleet serves what it served."""
    s = spec(onFailure="Rollback")
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    d = decide(observe(r, [pod("p0", done(prog, "Failed"), ready=False), pod("p1", done(prog))]))
    assert d.status.phase == "RollingBack" and d.start == []
    assert list(d.withdraw) == ["p1"] and d.withdraw["p1"].reason == "NoRollbackTarget"
    r = refit(s, d.status)
    d = decide(observe(r, [pod("p0", done(prog, "Failed"), ready=False),
                           pod("p1", done(prog), ready=False)]))  # fmt: skip
    assert d.status.phase == "Failed" and d.status.conditions[0].reason == "NoRollbackTarget"
    assert "2 pods had no checkpoint to go back to" in d.status.message, d.status.message


def test_queued_and_superseded():
    s = spec()
    active = RefitRef("a", "2026-11-28T00:00:00Z", "Progressing")
    r = refit(s)
    d = decide(observe(r, [pod("p0")], fleet=[active, RefitRef("wr", CREATED, "Pending")]))
    assert d.status.phase == "Queued" and d.status.queue_position == 1 and d.start == []
    newer = RefitRef("z", "2026-11-30T00:00:00Z", "Pending", "LatestWins")
    d = decide(observe(r, [pod("p0")], fleet=[active, RefitRef("wr", CREATED, "Queued"), newer]))
    assert d.status.phase == "Superseded" and "z" in d.status.message


def test_convergence_of_late_or_restarted_pod():
    s = spec()
    st = WeightRefitStatus(phase="Succeeded", start_time=STARTED)
    r = refit(s, st)
    prog = done(podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW))
    fleet = [RefitRef("wr", CREATED, "Succeeded")]
    d = decide(observe(r, [pod("p0", prog), pod("late"), pod("p1", prog, restarts=1)], fleet=fleet))
    assert sorted(x.pod for x in d.start) == ["late", "p1"]
    assert d.status.phase == "Succeeded"
    assert d.watching and not d.dormant
    d = decide(observe(r, [pod("p0", prog)], fleet=fleet))
    assert d.idle and d.start == [] and d.watching
    newer = RefitRef("wr-2", "2026-11-30T00:00:00Z", "Succeeded", selector=LabelSelector())
    d = decide(observe(r, [pod("p0", prog)], fleet=[*fleet, newer]))
    assert d.dormant and d.start == []


def test_a_pass_waits_for_the_kubelet_to_report_the_containers_up():
    """A restarted container (vLLM loading again) or a replacement pod gets its pass only once
    ContainersReady is True: begun earlier, the pass spent its retries on refused connections
    and failed for good (found on the real node, tests/node)."""
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Succeeded", start_time=STARTED))
    prog = done(podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW))
    fleet = [RefitRef("wr", CREATED, "Succeeded")]
    starting = [pod("p1", prog, restarts=1, containers_up=False),
                pod("new", containers_up=False)]  # fmt: skip
    d = decide(observe(r, [pod("p0", prog), *starting], fleet=fleet))
    assert d.start == [] and d.status.phase == "Succeeded" and d.watching
    ready = [replace(p, containers_up=True) for p in starting]
    d = decide(observe(r, [pod("p0", prog), *ready], fleet=fleet))
    assert sorted(x.pod for x in d.start) == ["new", "p1"]
    # The same while the refit progresses: the pod is not started, and the refit waits.
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    d = decide(observe(r, [pod("p0", prog), pod("new", containers_up=False)]))
    assert d.start == [] and d.status.phase == "Progressing"


def test_a_restarted_pod_in_traffic_is_withdrawn_at_once():
    """Its gate is still True from its pass: without this the kubelet marks it Ready on fresh
    (unprobed) weights as soon as vLLM is up (seen on the real node, tests/node)."""
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Succeeded", start_time=STARTED))
    prog = done(podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW))
    fleet = [RefitRef("wr", CREATED, "Succeeded")]
    restarted = pod("p1", prog, restarts=1, containers_up=False)
    d = decide(observe(r, [pod("p0", prog), restarted], fleet=fleet))
    assert list(d.withdraw) == ["p1"] and d.start == []
    assert d.withdraw["p1"].reason == "ContainerRestarted"
    # A pod another pass holds is that pass's to take out (its claim write does).
    held = replace(restarted, claim=podflow.Claim("other", "u2", 7, "op"))
    d = decide(observe(r, [pod("p0", prog), held], fleet=fleet))
    assert not d.withdraw
    # Withdrawn (gate False): not again; it waits for its containers, then gets a pass.
    d = decide(observe(r, [pod("p0", prog), replace(restarted, ready=False)], fleet=fleet))
    assert not d.withdraw and d.start == []
    back = replace(restarted, ready=False, containers_up=True)
    d = decide(observe(r, [pod("p0", prog), back], fleet=fleet))
    assert [x.pod for x in d.start] == ["p1"] and not d.withdraw


def test_containers_up_is_read_from_the_pod_status():
    doc: dict[str, Any] = {
        "metadata": {"name": "p", "uid": "u"},
        "spec": {},
        "status": {"phase": "Running", "podIP": "10.0.0.2",
                   "conditions": [{"type": "ContainersReady", "status": "False"}]},
    }  # fmt: skip
    assert PodView.from_pod(doc).startable is False
    doc["status"]["conditions"][0]["status"] = "True"
    assert PodView.from_pod(doc).startable is True
    doc["status"]["conditions"] = []  # no kubelet (the API-only test bed): counts as ready
    assert PodView.from_pod(doc).startable is True


def test_with_the_refit_readiness_probe_a_pod_is_up_once_its_containers_started():
    """/refit/ready keeps ContainersReady False until a pass stamps the weights: waiting for it
    would wait forever (the pass is what stamps). Started (the startupProbe passed) it is."""
    doc: dict[str, Any] = {
        "metadata": {"name": "p", "uid": "u"},
        "spec": {"containers": [
            {"name": "vllm", "readinessProbe": {"httpGet": {"path": "/refit/ready/"}}},
            {"name": "sidecar"},
        ]},
        "status": {"phase": "Running", "podIP": "10.0.0.2",
                   "conditions": [{"type": "ContainersReady", "status": "False"}],
                   "containerStatuses": [{"name": "vllm", "started": False},
                                         {"name": "sidecar", "started": True}]},
    }  # fmt: skip
    assert PodView.from_pod(doc).startable is False  # vLLM has not answered its startupProbe
    doc["status"]["containerStatuses"][0]["started"] = True
    assert PodView.from_pod(doc).startable is True  # though ContainersReady is still False
    doc["status"]["containerStatuses"][1]["started"] = False  # any container restarting
    assert PodView.from_pod(doc).startable is False
    doc["status"]["containerStatuses"] = []  # not yet created
    assert PodView.from_pod(doc).startable is False
    # Another readiness probe: ContainersReady decides, whatever started says.
    doc["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] = "/health"
    doc["status"]["containerStatuses"] = [{"name": "vllm", "started": True}]
    assert PodView.from_pod(doc).startable is False


def test_deleted_pod_is_dropped_with_reason():
    s = spec()
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    d = decide(observe(refit(s, st), [pod("p0", prog), pod("p1", done(prog))]))
    d = decide(observe(refit(s, d.status), [pod("p1", done(prog))]))
    gone = next(p for p in d.status.pods if p.name == "p0")
    assert gone.phase == "Dropped" and gone.reason == "PodDeleted"
    assert d.status.phase == "Succeeded" and d.status.target_pods == 1


def test_total_timeout_trips_the_gate():
    s = spec(sequence={"totalTimeoutSeconds": 10})
    st = WeightRefitStatus(phase="Progressing", start_time="2020-01-01T00:00:00Z")
    d = decide(observe(refit(s, st), [pod("p0")]))
    assert d.status.phase == "Halted" and d.status.conditions[0].reason == "TotalTimeoutExceeded"


def test_deletion_waits_for_active_pods():
    s = spec()
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    r = replace(refit(s, WeightRefitStatus(phase="Progressing")), deleting=True)
    d = decide(observe(r, [pod("p0", prog)]))
    assert not d.release_finalizer and d.start[0].resume
    d = decide(observe(r, [pod("p0", done(prog))]))
    assert d.release_finalizer


def test_pod_deleted_before_its_first_status_write_is_still_recorded():
    s = spec()
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    obs = replace(observe(refit(s, st), [pod("p1", done(prog))]), vanished=frozenset({"p0"}))
    d = decide(obs)
    gone = next(p for p in d.status.pods if p.name == "p0")
    assert (gone.phase, gone.reason) == ("Dropped", "PodDeleted")
    d = decide(observe(refit(s, d.status), [pod("p1", done(prog))]))
    assert any(p.name == "p0" and p.phase == "Dropped" for p in d.status.pods)


def test_success_with_tolerated_failures_is_ready_and_degraded():
    s = spec(probe={"failureLimit": 1})
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    d = decide(observe(r, [pod("p0", done(prog, "Failed")), pod("p1", done(prog))]))
    assert d.status.phase == "Succeeded" and d.status.failed_pods == 1
    conds = {c.type: (c.status, c.reason) for c in d.status.conditions}
    assert conds["Ready"] == ("True", "Succeeded")
    assert conds["Degraded"] == ("True", "PodsFailedWithinLimits")
    clean = decide(observe(r, [pod("p0", done(prog)), pod("p1", done(prog))]))
    assert {c.type: c.status for c in clean.status.conditions}["Degraded"] == "False"


# ---- one driver per pod: claims, overlapping refits, pods that moved on
def _claimed(by: str, uid: str) -> podflow.Claim:
    return podflow.Claim(refit=by, uid=uid, fence=7, holder="op-1")


def test_pod_held_by_another_live_refit_is_blocked_not_started():
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    held = pod("p1", claim=_claimed("other", "uid-other"))
    obs = observe(r, [pod("p0"), held], refits={"uid": "wr", "uid-other": "other"})
    d = decide(obs)
    assert [x.pod for x in d.start] == ["p0"]
    assert "p1 held by a pass of refit other" in d.status.message
    assert d.status.phase == "Progressing"  # it waits; it does not finish without p1


def test_claim_of_a_refit_that_no_longer_exists_is_stale():
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    stale = pod("p1", claim=_claimed("deleted", "uid-gone"))
    d = decide(observe(r, [stale], refits={"uid": "wr"}))
    assert [x.pod for x in d.start] == ["p1"]


def test_own_claim_from_a_previous_leader_is_taken_over():
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW, created=CREATED)
    mine = pod("p0", prog, claim=_claimed("wr", "uid"), ready=False)
    d = decide(observe(r, [mine], refits={"uid": "wr"}))
    assert [(x.pod, x.resume) for x in d.start] == [("p0", True)]


def test_own_refits_pod_held_by_another_live_operator_is_not_taken_over():
    """Issue 24 #7: a second installation (or replica) saw the pass of another operator
    process on a pod of the same refit and resumed it: two reloads at once. While that
    process may still act, the pod is blocked, named with the process, and counts as in
    flight: no resume, no fresh pass, no finish, no deletion under that pass."""
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW, created=CREATED)
    theirs = pod("p0", prog, claim=_claimed("wr", "uid"), ready=False)
    live = frozenset({"p0"})
    d = decide(observe(r, [theirs], refits={"uid": "wr"}, elsewhere=live))
    assert d.start == []
    assert "p0 held by a pass of refit wr (operator op-1)" in d.status.message
    assert d.status.phase == "Progressing"
    # Its own refit's other pods wait under Rolling: that pod is out of traffic.
    rolling = spec(strategy={"type": "Rolling", "maxUnavailable": 1})
    rr = refit(rolling, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    d = decide(observe(rr, [theirs, pod("p1")], refits={"uid": "wr"}, elsewhere=live))
    assert d.start == []
    deleting = replace(r, deleting=True)
    d = decide(observe(deleting, [theirs], refits={"uid": "wr"}, elsewhere=live))
    assert not d.release_finalizer and d.start == []
    # Once that process provably cannot act any more, this one resumes the pass.
    d = decide(observe(r, [theirs], refits={"uid": "wr"}))
    assert [(x.pod, x.resume) for x in d.start] == [("p0", True)]


def test_a_live_operators_claim_of_a_deleted_refit_is_still_stale():
    """A refit deleted: its passes are cancelled by every operator that watches it, so its
    claims block nobody, whoever holds them."""
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    stale = pod("p1", claim=_claimed("deleted", "uid-gone"))
    d = decide(observe(r, [stale], refits={"uid": "wr"}, elsewhere=frozenset({"p1"})))
    assert [x.pod for x in d.start] == ["p1"]


def _by_newer(version: str = "v3") -> podflow.Progress:
    return done(
        podflow.start("newer", "uid-n", version, "/ckpt/v3", NOW, created="2026-11-30T00:00:00Z")
    )


def test_pods_a_newer_refit_drove_are_superseded_not_reclaimed():
    s = spec()
    mine = done(podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW, created=CREATED))
    r = refit(s, WeightRefitStatus(phase="Succeeded", start_time=STARTED))
    fleet = [
        RefitRef("wr", CREATED, "Succeeded"),
        RefitRef("newer", "2026-11-30T00:00:00Z", "Succeeded", selector=LabelSelector()),
    ]
    d = decide(observe(r, [pod("p0", mine), pod("p1", _by_newer())], fleet=fleet))
    assert d.start == [] and d.status.phase == "Succeeded"
    assert (d.status.target_pods, d.status.updated_pods) == (1, 1)
    assert "1 moved on to newer refits" in d.status.message
    both = [pod("p0", _by_newer()), pod("p1", _by_newer())]
    # Moved on to a refit still at work, or one that failed: not superseded (yet).
    for phase in ("Progressing", "Halted"):
        other = [fleet[0], replace(fleet[1], phase=phase)]
        d = decide(observe(r, both, fleet=other))
        assert d.status.phase == "Succeeded" and d.start == []
    d = decide(observe(r, both, fleet=fleet))
    assert d.status.phase == "Superseded" and d.dormant
    assert "moved on to newer" in d.status.message
    assert {c.type: c.status for c in d.status.conditions}["Ready"] == "False"


def test_older_pass_on_a_pod_does_not_supersede_a_newer_refit():
    """The other order of arrival: the pod's last pass belongs to an OLDER refit, so this
    (newer) refit still owes the pod its version."""
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    older = done(
        podflow.start("old", "uid-o", "v1", "/ckpt/v1", NOW, created="2026-11-01T00:00:00Z")
    )
    d = decide(observe(r, [pod("p0", older)], refits={"uid": "wr", "uid-o": "old"}))
    assert [x.pod for x in d.start] == ["p0"]


def test_finished_refit_does_not_converge_pods_a_newer_succeeded_refit_selects():
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Succeeded", start_time=STARTED))
    only_gen = LabelSelector.model_validate({"matchLabels": {"tier": "gen"}})
    fleet = [
        RefitRef("wr", CREATED, "Succeeded"),
        RefitRef("newer", "2026-11-30T00:00:00Z", "Succeeded", selector=only_gen),
    ]
    pods = [
        pod("gen", labels={"app": "rollout", "tier": "gen"}),
        pod("plain", labels={"app": "rollout"}),
    ]
    d = decide(observe(r, pods, fleet=fleet))
    assert [x.pod for x in d.start] == ["plain"] and d.watching


def test_queued_refit_names_the_refit_it_waits_for():
    s = spec()
    r = refit(s)
    fleet = [
        RefitRef("wr", CREATED, "Pending"),
        RefitRef("first", "2026-11-28T00:00:00Z", "Progressing"),
    ]
    d = decide(observe(r, [pod("p0")], fleet=fleet))
    assert d.status.phase == "Queued" and "waiting for first" in d.status.message


# ---- status that scales: status.pods lists only pods that need attention, capped
def _record(i: int, outcome: str = "Succeeded", **over: object) -> podflow.Progress:
    """A realistic finished (or running) pass of pod i: every step timed, a probe."""
    steps = {s: 0.5 + 0.01 * (i % 7) for s in podflow.STEPS}
    verdict = {"Succeeded": "Pass", "Failed": "Fail", "Inconclusive": "Inconclusive"}
    base = dict(
        refit="wr", uid="uid", version="v2", path="/ckpt/v2", created=CREATED, step="",
        outcome=outcome, started=NOW - 60, finished=NOW - 1, step_seconds=steps,
        probe={"verdict": verdict.get(outcome, "Pass"), "nll": 2.31 + 1e-5 * (i % 100),
               "referenceNll": 2.31, "meanAbsLogprobDiff": 0.004, "maxAbsLogprobDiff": 0.03,
               "tokens": 512},
    )  # fmt: skip
    if outcome in ("Failed", "Inconclusive"):
        base.update(reason="LogprobDrift" if outcome == "Failed" else "ProbeTimeout",
                    message="max |Δlogprob| 1.84 > 0.5 on prompt 3 of 8 (token 17)",
                    step="probe", attempts=2)  # fmt: skip
    if outcome == "":
        base.update(step="load", finished=0.0, probe=None)
    base.update(over)
    if isinstance(base["probe"], dict):  # written as the record on the pod holds it
        base["probe"] = PodProbe.model_validate(base["probe"])
    return podflow.Progress(**base)  # type: ignore[arg-type]


def test_status_of_a_10000_pod_fleet_is_small_and_lists_the_worst_first():
    import json

    from refit_operator.core.api import STATUS_PODS_LIMIT

    n = 10_000
    failed = {f"vllm-{i:05d}" for i in range(7, n, 500)}  # 20
    inconclusive = {f"vllm-{i:05d}" for i in range(11, n, 1000)}  # 10
    deleting = {f"vllm-{i:05d}" for i in range(13, n, 2000)}  # 5
    running = {f"vllm-{i:05d}" for i in range(17, n, 333)} - deleting - failed - inconclusive
    assert not (failed & inconclusive) and not ((failed | inconclusive) & (deleting | running))
    pods = []
    for i in range(n):
        name = f"vllm-{i:05d}"
        if name in failed:
            rec = _record(i, "Failed", probe={"verdict": "Fail", "nll": 3.1, "referenceNll": 2.31,
                                             "meanAbsLogprobDiff": 0.2, "maxAbsLogprobDiff": 1.84,
                                             "tokens": 512})  # fmt: skip
        elif name in inconclusive:
            rec = _record(i, "Inconclusive", probe={"verdict": "Inconclusive", "tokens": 0})
        elif name in running:
            rec = _record(i, "")
        elif i == 4242:  # the worst passing pod, far from the listed ones
            rec = _record(i, probe={"verdict": "Pass", "nll": 2.35, "referenceNll": 2.31,
                                    "meanAbsLogprobDiff": 0.049, "maxAbsLogprobDiff": 0.45,
                                    "tokens": 512})  # fmt: skip
        else:
            rec = _record(i)
        pods.append(pod(name, rec, deleting=name in deleting, ready=rec.outcome == "Succeeded"))
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    s = spec(probe={"failureLimit": 100, "inconclusiveLimit": 100})
    d = decide(observe(refit(s, st), pods))
    doc = d.status.dump()
    size = len(json.dumps(doc, separators=(",", ":")))
    print(f"\n{n} pods: status {size} bytes, {len(d.status.pods)} entries")
    assert size < 256 * 1024

    # Exactly the pods that need attention, worst first (Failed, Inconclusive, Dropped, then
    # InProgress), each group by name, cut at the limit; the rest counted.
    want = (
        [(p, "Failed") for p in sorted(failed)]
        + [(p, "Inconclusive") for p in sorted(inconclusive)]
        + [(p, "Dropped") for p in sorted(deleting)]
        + [(p, "InProgress") for p in sorted(running)]
    )
    assert len(want) > STATUS_PODS_LIMIT == 50
    assert [(r.name, r.phase) for r in d.status.pods] == want[:STATUS_PODS_LIMIT]
    assert d.status.pods_omitted == len(want) - STATUS_PODS_LIMIT == doc["podsOmitted"]
    assert {r.reason for r in d.status.pods if r.phase == "Dropped"} == {"PodDeleted"}
    bad = d.status.pods[0]
    assert bad.probe is not None and bad.probe.verdict == "Fail" and bad.step == "probe"
    assert bad.reason == "LogprobDrift" and bad.attempts == 2 and set(bad.step_seconds)

    # The probe summary is over every pod's record, not over the listed few.
    summary = d.status.probe_summary
    passes = n - len(failed) - len(inconclusive) - len(running)  # deleting pods were probed too
    assert (summary.passed, summary.failed, summary.inconclusive) == (
        passes, len(failed), len(inconclusive),
    )  # fmt: skip
    assert summary.worst_mean_abs_logprob_diff == 0.2
    assert summary.worst_max_abs_logprob_diff == 1.84
    assert round(summary.nll_spread, 6) == round(2.35 - 2.31, 6)
    # Counts are over the fleet too (Dropped pods leave it).
    assert d.status.failed_pods == len(failed) and d.status.inconclusive_pods == len(inconclusive)
    assert d.status.target_pods == n - len(deleting)


def test_succeeded_and_rolled_back_pods_are_not_listed_but_counted():
    s = spec(onFailure="Rollback")
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    d = decide(observe(r, [pod("p0", done(prog)), pod("p1", done(prog))]))
    assert d.status.phase == "Succeeded"
    assert d.status.pods == [] and d.status.pods_omitted == 0
    assert d.status.probe_summary.passed == 2 and d.status.updated_pods == 2
    prev = Previous(version="v1", path="/ckpt/v1", refit="wr-old")
    back = done(podflow.start("wr", "uid", "v1", "/ckpt/v1", NOW, rollback=True))
    r = refit(s, WeightRefitStatus(phase="RollingBack", start_time=STARTED, previous=prev))
    d = decide(observe(r, [pod("p0", back), pod("p1", back)]))
    assert d.status.phase == "RolledBack" and d.status.pods == []
    assert d.status.probe_summary.passed == 2


def test_dropped_pods_are_remembered_within_the_limit_worst_first():
    from refit_operator.core.api import STATUS_PODS_LIMIT, PodResult

    s = spec()
    st = WeightRefitStatus(
        phase="Progressing",
        start_time=STARTED,
        pods=[PodResult(name="gone", phase="InProgress", step="load")],
    )
    running = [pod(f"r{i:02d}", _record(i, "")) for i in range(STATUS_PODS_LIMIT)]
    failed = pod("zz-failed", _record(99, "Failed"))
    d = decide(observe(refit(s, st), [*running, failed]))
    names = [r.name for r in d.status.pods]
    # Failed first, then the pod that vanished (now Dropped, with why), then the rest.
    assert names[:2] == ["zz-failed", "gone"] and len(names) == STATUS_PODS_LIMIT
    gone = d.status.pods[1]
    assert (gone.phase, gone.reason) == ("Dropped", "PodDeleted")
    assert d.status.pods_omitted == 2  # two of the pods in progress
    # Still remembered on the next tick (the status is its only record).
    d = decide(observe(refit(s, d.status), [*running, failed]))
    assert [r.name for r in d.status.pods][:2] == ["zz-failed", "gone"]


def test_result_for_a_pod_now_in_another_refits_hands_is_kept_only_if_it_needs_attention():
    from refit_operator.core.api import PodResult

    s = spec(probe={"failureLimit": 1})
    old = [
        PodResult(name="p0", phase="Failed", reason="LogprobDrift"),
        PodResult(name="p1", phase="Succeeded", version="v2"),
    ]
    st = WeightRefitStatus(phase="Succeeded", start_time=STARTED, pods=old)
    other = done(podflow.start("other", "uid-o", "v2", "/ckpt/v2", NOW))
    d = decide(observe(refit(s, st), [pod("p0", other), pod("p1", other)]))
    assert [(r.name, r.phase) for r in d.status.pods] == [("p0", "Failed")]


def test_summary_of_a_finished_refit_keeps_probes_of_pods_that_moved_on():
    s = spec()
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    pods = [pod(f"p{i}", _record(i)) for i in range(3)]
    d = decide(observe(r, pods))
    assert d.status.phase == "Succeeded" and d.status.probe_summary.passed == 3
    written = d.status.probe_summary
    # A newer refit takes two of the pods: their annotations now hold its passes.
    newer = _record(0, refit="newer", uid="uid-n", version="v3", created="2026-11-30T00:00:00Z")
    moved = [pods[0], pod("p1", newer), pod("p2", newer)]
    fleet = [
        RefitRef("wr", CREATED, "Succeeded"),
        RefitRef("newer", "2026-11-30T00:00:00Z", "Progressing"),
    ]
    d = decide(observe(refit(s, d.status), moved, fleet=fleet))
    assert d.status.probe_summary == written
    # A pod re-probed by a convergence pass counts again once its probe is back.
    again = [pod("p0", _record(0, "")), pods[1], pods[2]]
    d = decide(observe(refit(s, d.status), again))
    assert d.status.probe_summary == written
    worse = _record(0, probe={"verdict": "Pass", "nll": 2.33, "referenceNll": 2.31,
                              "meanAbsLogprobDiff": 0.01, "maxAbsLogprobDiff": 0.2})  # fmt: skip
    d = decide(observe(refit(s, d.status), [pod("p0", worse), pods[1], pods[2]]))
    assert d.status.probe_summary.passed == 3
    assert d.status.probe_summary.worst_max_abs_logprob_diff == 0.2


def test_fleet_results_show_every_pod_from_its_record():
    from refit_operator.core.api import PodResult
    from refit_operator.core.status import fleet_results, pod_phases

    listed = [
        PodResult(name="b", phase="Failed", reason="LogprobDrift"),
        PodResult(name="c", phase="InProgress", step="probe"),  # live: newer than the record
        PodResult(name="gone", phase="Dropped", reason="PodDeleted"),
    ]
    pods = [
        pod("a", _record(0)),  # Succeeded: only its annotation has it
        pod("b", _record(1, "Failed")),
        pod("c", _record(2, "", step="load")),
        pod("d"),  # not reached
        pod("e", _record(4, refit="other", uid="uid-o")),  # another refit's record
    ]
    rows = {r.name: r for r in fleet_results(listed, pods, "uid")}
    assert list(rows) == ["a", "b", "c", "d", "e", "gone"]
    a = rows["a"]
    assert (a.phase, a.version, a.step) == ("Succeeded", "v2", "ready")
    assert a.probe is not None and a.probe.verdict == "Pass" and a.step_seconds
    assert (rows["b"].phase, rows["b"].reason) == ("Failed", "LogprobDrift")
    assert (rows["c"].phase, rows["c"].step) == ("InProgress", "probe")
    assert rows["d"].phase == rows["e"].phase == "Pending"
    assert rows["gone"].phase == "Dropped"
    assert pod_phases(listed, pods, "uid") == {
        "Succeeded": 1, "Failed": 1, "InProgress": 1, "Dropped": 1,
    }  # fmt: skip


def test_status_pods_limit_is_the_crds_max_items():
    from pathlib import Path

    import yaml
    from refit_operator.core.api import STATUS_PODS_LIMIT

    crd = yaml.safe_load((Path(__file__).parents[2] / "crds" / "weightrefit.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["pods"]["maxItems"] == STATUS_PODS_LIMIT
    assert f"at most {STATUS_PODS_LIMIT} entries" in status["properties"]["pods"]["description"]
    assert status["properties"]["podsOmitted"]["type"] == "integer"


def test_the_reference_is_scored_on_a_pod_that_serves_never_on_one_left_paused():
    """Regression (found on real vLLM under load): the preflight scored the reference on the
    first pod by name. A DrainTimeout fails closed with that pod paused, so the score queued
    until probeTimeoutSeconds and every later refit failed PodUnreachable."""
    left = podflow.start("wr-1", "u", "v2", "/c/v2", NOW, serving="v1")
    drained = replace(left, left_traffic=NOW + 1, outcome="Failed", reason="DrainTimeout")
    paused = pod("a0", drained, ready=False)
    assert paused.may_be_paused
    fresh = pod("a2", ready=False)  # no pass yet: out of traffic, not paused
    serving = pod("a1", done(left))
    assert not fresh.may_be_paused and not serving.may_be_paused
    assert [p.name for p in reference_scorers([paused, fresh, serving])] == ["a1", "a2"]
    # Restored, or a restarted container (a new process): it answers again.
    restored = pod("a0", replace(drained, restored=True), ready=False)
    restarted = pod("a0", drained, ready=False, restarts=1)
    assert not restored.may_be_paused and not restarted.may_be_paused
    # A pass still in flight took it out of traffic: it may be paused too.
    assert pod("a0", replace(left, left_traffic=NOW + 1), ready=False).may_be_paused
    # Only paused pods: none scores it (each pod's probe does, after its resume).
    assert reference_scorers([paused]) == []
