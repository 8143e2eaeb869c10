"""reconcile.decide driven with plain data: a fleet of pods through a whole refit."""

from dataclasses import replace

from refit_operator import podflow
from refit_operator.api import Previous, WeightRefitSpec, WeightRefitStatus
from refit_operator.plan import RefitRef
from refit_operator.reconcile import (
    Observed,
    PodView,
    PreflightResult,
    RefitView,
    decide,
    rfc3339,
)
from refit_worker.contract import REQUIRED_CAPABILITIES, RefitInfo

NOW = 1_800_000_000.0
CREATED = "2026-11-29T00:00:00Z"
STARTED = rfc3339(NOW - 5)


def spec(**over: object) -> WeightRefitSpec:
    doc = {
        "fleet": {"selector": {"matchLabels": {"app": "rollout"}}},
        "checkpoint": {"path": "/ckpt/v2", "version": "v2"},
        **over,
    }
    return WeightRefitSpec.model_validate(doc)


def info(**over: object) -> RefitInfo:
    base = dict(
        vllm_version="0.32.0", attention_backend="CPU_ATTN", kv_cache_dtype="auto",
        cudagraph_mode="NONE", capabilities=REQUIRED_CAPABILITIES, unsafe_reasons=(),
        weight_version="v1", model="m", allowed_root="/ckpt",
    )  # fmt: skip
    base.update(over)
    return RefitInfo(**base)  # type: ignore[arg-type]


def pod(name: str, progress: podflow.Progress | None = None, **over: object) -> PodView:
    base = dict(
        name=name, ip="127.0.0.2", has_gate=True, running=True, deleting=False, ready=True,
        restarts=0, progress=progress,
    )  # fmt: skip
    base.update(over)
    return PodView(**base)  # type: ignore[arg-type]


def refit(s: WeightRefitSpec, status: WeightRefitStatus | None = None) -> RefitView:
    return RefitView("wr", "uid", 1, CREATED, s, status or WeightRefitStatus())


def observe(r: RefitView, pods: list[PodView], **kw: object) -> Observed:
    fleet = kw.pop("fleet", [RefitRef(r.name, r.created, r.status.phase)])
    return Observed(refit=r, fleet=fleet, pods=pods, in_flight=frozenset(), now=NOW, **kw)  # type: ignore[arg-type]


def done(p: podflow.Progress, outcome: str = "Succeeded") -> podflow.Progress:
    return replace(p, outcome=outcome, step="", probe={"verdict": "Pass", "nll": 1.0})  # type: ignore[arg-type]


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
        ([pod("p0")], PreflightResult(problem=("SecretMissing", "no secret")), "SecretMissing"),
    ]
    for pods, pre, reason in cases:
        st = WeightRefitStatus(phase="Preflight")
        d = decide(observe(refit(s, st), pods, preflight=pre))
        assert d.status.phase == "Failed", reason
        assert d.start == []
        ready = next(c for c in d.status.conditions if c.type == "Ready")
        assert ready.status == "False" and ready.reason == reason
        assert d.events and d.events[0].type == "Warning"


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
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    d = decide(observe(r, [pod("p0", done(prog, "Failed")), pod("p1", done(prog)), pod("p2")]))
    assert d.status.phase == "RollingBack"
    assert sorted((x.pod, x.version, x.rollback) for x in d.start) == [
        ("p0", "v1", True), ("p1", "v1", True),
    ]  # fmt: skip
    back = podflow.start("wr", "uid", "v1", "/ckpt/v1", NOW, rollback=True)
    d = decide(
        observe(refit(s, d.status), [pod("p0", done(back)), pod("p1", done(back)), pod("p2")])
    )
    assert d.status.phase == "RolledBack"


def test_rollback_without_previous_halts():
    s = spec(onFailure="Rollback")
    r = refit(s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    d = decide(observe(r, [pod("p0", done(prog, "Failed"))]))
    assert d.status.phase == "Halted" and d.status.conditions[0].reason == "NoRollbackTarget"


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
    newer = RefitRef("wr-2", "2026-11-30T00:00:00Z", "Succeeded")
    d = decide(observe(r, [pod("p0", prog)], fleet=[*fleet, newer]))
    assert d.dormant and d.start == []


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
