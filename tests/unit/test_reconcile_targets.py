"""Each pod has one target: the newest Succeeded refit that selects it now. decision.decide
driven with plain data through what changes a pod's target: its labels, a newer refit that
halts or is deleted, a container restart; and rollbacks that take each pod back to the
checkpoint that pod served (docs/concepts.md, "Convergence" and "Rollback")."""

from dataclasses import replace

from refit_operator.core import podflow
from refit_operator.core.api_spec import LabelSelector, WeightRefitSpec
from refit_operator.core.api_status import Condition, Phase, PodProbe, Previous, WeightRefitStatus
from refit_operator.core.claim import Claim
from refit_operator.core.decision import RETRY_FAILED_SECONDS, Observed, decide, rollback_targets
from refit_operator.core.plan import RefitRef
from refit_operator.core.pod_state import RefitView, foreign
from refit_operator.core.podview import PodView

NOW = 1_800_000_000.0
OLD, NEW, NEWEST = "2026-11-01T00:00:00Z", "2026-11-02T00:00:00Z", "2026-11-03T00:00:00Z"
STARTED = "2026-11-29T00:00:00Z"
REFERENCE = {"pool": "reference"}
ROLLOUT = {"pool": "rollout"}


def selector(labels: dict[str, str]) -> LabelSelector:
    return LabelSelector.model_validate({"matchLabels": labels})


def spec(labels: dict[str, str], version: str, **over: object) -> WeightRefitSpec:
    doc = {
        "fleet": {"selector": {"matchLabels": labels}},
        "checkpoint": {"path": f"/ckpt/{version}", "version": version},
        **over,
    }
    return WeightRefitSpec.model_validate(doc)


def refit(name: str, created: str, s: WeightRefitSpec, st: WeightRefitStatus) -> RefitView:
    return RefitView(name, f"uid-{name}", 1, created, s, st)


def ref(r: RefitView, phase: Phase | None = None) -> RefitRef:
    return RefitRef(r.name, r.created, phase or r.status.phase, selector=r.spec.fleet.selector)


def passed(r: RefitView, **over: object) -> podflow.Progress:
    """A pass of refit ``r`` that Succeeded (its probe passed)."""
    p = podflow.start(r.name, r.uid, r.spec.version, r.spec.path, NOW, created=r.created, **over)  # type: ignore[arg-type]
    return replace(p, step="", outcome="Succeeded", probe=PodProbe(verdict="Pass"), finished=NOW)


def pod(
    name: str, progress: podflow.Progress | None, labels: dict[str, str], **over: object
) -> PodView:
    base = dict(name=name, ip="127.0.0.2", has_gate=True, running=True, deleting=False,
                ready=True, restarts=0, progress=progress, labels=labels,
                uid=f"pod-{name}")  # fmt: skip
    base.update(over)
    return PodView(**base)  # type: ignore[arg-type]


def observe(
    r: RefitView, pods: list[PodView], fleet: list[RefitRef], refits: list[RefitView]
) -> Observed:
    return Observed(refit=r, fleet=fleet, pods=pods, in_flight=frozenset(), now=NOW,
                    refits={x.uid: x.name for x in refits})  # fmt: skip


SUCCEEDED = WeightRefitStatus(phase="Succeeded", start_time=STARTED)
BASE = refit("base", OLD, spec(REFERENCE, "base"), SUCCEEDED)  # the reference pool's refit
POLICY = refit("policy", NEW, spec(ROLLOUT, "policy"), SUCCEEDED)  # the rollout pool's, newer


# ---- 2. a pod moved into another fleet ------------------------------------------------------


def test_a_pod_moved_into_another_fleet_is_refitted_by_that_fleets_target_out_of_traffic():
    """Relabelled from the rollout pool into the reference pool, the pod serves the policy:
    its record is the newer policy refit's, which no longer selects it. The reference refit
    is its target: it refits the pod, which leaves traffic at the pass's start."""
    ref0 = pod("ref-0", passed(BASE), REFERENCE)
    moved = pod("gen-3", passed(POLICY), REFERENCE)
    # The policy refit selects no pod of the reference pool now: it does not share its fleet.
    obs = observe(BASE, [ref0, moved], [ref(BASE)], [BASE, POLICY])
    d = decide(obs)
    assert [(x.pod, x.version, x.keep_serving) for x in d.start] == [("gen-3", "base", False)]
    assert d.status.phase == "Succeeded" and "moved on" not in d.status.message
    assert (d.status.target_pods, d.status.updated_pods) == (2, 1)
    assert not d.withdraw  # the pass's first write takes it out
    # Whatever refit of the reference pool ticks, a moved pod in traffic is taken out at once,
    # also when its target cannot start a pass now (its containers are not up).
    d = decide(replace(obs, pods=[ref0, replace(moved, containers_up=False)]))
    assert d.start == [] and d.watching
    assert d.withdraw["gen-3"].reason == "FleetChanged"
    assert "policy" in d.withdraw["gen-3"].message


def test_a_pod_still_in_the_newer_refits_fleet_has_moved_on():
    """Labels that both selectors match: the newer refit still answers for the pod."""
    both = {**REFERENCE, **ROLLOUT}
    p = pod("gen-3", passed(POLICY), both)
    ref0 = pod("ref-0", passed(BASE), REFERENCE)
    d = decide(observe(BASE, [ref0, p], [ref(BASE), ref(POLICY)], [BASE, POLICY]))
    assert d.start == [] and not d.withdraw
    assert "1 moved on to newer refits" in d.status.message


def test_a_pod_relabelled_mid_pass_is_left_to_the_pass_that_holds_it():
    """The newer refit's pass in flight when the labels changed: its claim holds the pod, and
    the pass decides the pod's readiness; the target waits for it."""
    running = replace(passed(POLICY), step="load", outcome="", finished=0.0)
    claim = Claim("policy", POLICY.uid, 7, "op")
    p = pod("gen-3", running, REFERENCE, claim=claim, ready=False)
    d = decide(observe(BASE, [p], [ref(BASE)], [BASE, POLICY]))
    assert d.start == [] and not d.withdraw
    assert "held by a pass of refit policy" not in d.status.message  # finished refits say less
    assert d.status.target_pods == 1 and d.status.updated_pods == 0


def test_a_record_of_a_recreated_refit_of_the_same_name_is_not_foreign():
    """The uid tells: a refit deleted and created again under the name is another refit."""
    again = replace(POLICY, uid="uid-policy-2")
    p = pod("gen-3", passed(POLICY), REFERENCE)
    assert foreign(p, [ref(BASE)], {POLICY.uid: "policy"})
    assert not foreign(p, [ref(BASE)], {again.uid: "policy"})
    both = pod("gen-3", passed(POLICY), {**REFERENCE, **ROLLOUT})
    assert not foreign(both, [ref(BASE), ref(POLICY)], {POLICY.uid: "policy"})


# ---- 4. restarted pods after a newer refit halted or was deleted -----------------------------

APP = {"app": "rollout"}
OLDER = refit("older", OLD, spec(APP, "v1"), SUCCEEDED)
HALTED = refit("halted", NEW, spec(APP, "v2"), WeightRefitStatus(phase="Halted"))


def test_a_halted_refits_pods_are_watched_by_the_target_and_a_restarted_one_converged():
    """The newer refit halted: pods it passed keep its version, failed ones stay out (Halt).
    The older Succeeded refit is their target: it watches them (not dormant), and a pod whose
    container restarts is withdrawn and refitted to the target's version at once."""
    ok = pod("p0", passed(HALTED), APP)
    bad = pod("p1", replace(passed(HALTED), outcome="Failed", reason="LogprobDrift"), APP,
              ready=False)  # fmt: skip
    fleet = [ref(OLDER), ref(HALTED)]
    d = decide(observe(OLDER, [ok, bad], fleet, [OLDER, HALTED]))
    assert d.start == [] and not d.withdraw
    assert d.watching and not d.dormant, "the target must watch the pods it answers for"
    assert d.status.phase == "Succeeded" and "2 moved on" in d.status.message
    restarted = replace(ok, restarts=1)
    d = decide(observe(OLDER, [restarted, bad], fleet, [OLDER, HALTED]))
    assert [(x.pod, x.version) for x in d.start] == [("p0", "v1")]
    assert d.withdraw["p0"].reason == "ContainerRestarted"
    assert (d.status.target_pods, d.status.updated_pods) == (1, 0)
    # The failed pod stays out of traffic (Halt) until it, too, restarts.
    d = decide(observe(OLDER, [ok, replace(bad, restarts=1)], fleet, [OLDER, HALTED]))
    assert [x.pod for x in d.start] == ["p1"]


def test_a_restarted_pod_of_a_newer_succeeded_refit_is_that_refits_to_converge():
    newer = replace(HALTED, status=SUCCEEDED)
    p = pod("p0", passed(newer), APP, restarts=1)
    d = decide(observe(OLDER, [p], [ref(OLDER), ref(newer)], [OLDER, newer]))
    assert d.start == [] and d.dormant
    assert d.status.target_pods == 0


def moved_on_status() -> WeightRefitStatus:
    ready = Condition(type="Ready", status="False", reason="PodsMovedOn", message="m",
                      last_transition_time=STARTED, observed_generation=1)  # fmt: skip
    return WeightRefitStatus(phase="Superseded", start_time=STARTED, conditions=[ready],
                             message="every pod of this refit moved on to newer")  # fmt: skip


def test_after_the_target_is_deleted_a_restarted_pod_is_converged_by_the_refit_before_it():
    """Every pod moved on to the newer refit, which Succeeded (the older one: Superseded),
    then the newer one was deleted. Pods that keep its version serve on; the older refit
    watches, and takes a pod that restarts back: Succeeded again, as its target."""
    newer = replace(HALTED, status=SUCCEEDED)
    superseded = replace(OLDER, status=moved_on_status())
    pods = [pod("p0", passed(newer), APP), pod("p1", passed(newer), APP)]
    gone = [superseded]  # the newer refit no longer exists
    d = decide(observe(superseded, pods, [ref(superseded)], gone))
    assert d.status.phase == "Superseded" and d.start == []
    assert d.watching and not d.dormant
    # While the newer refit exists and selects them, no watching: it is their target.
    d = decide(observe(superseded, pods, [ref(superseded), ref(newer)], [superseded, newer]))
    assert d.status.phase == "Superseded" and d.dormant
    restarted = [pods[0], replace(pods[1], restarts=1)]
    d = decide(observe(superseded, restarted, [ref(superseded)], gone))
    assert d.status.phase == "Succeeded", d.status.message
    assert [e.reason for e in d.events] == ["Succeeded"] and "p1" in d.events[0].message
    assert [(x.pod, x.version) for x in d.start] == [("p1", "v1")]
    assert d.withdraw["p1"].reason == "ContainerRestarted"
    assert {c.type: c.status for c in d.status.conditions}["Ready"] == "True"


def test_a_pod_a_deleted_refit_left_out_of_traffic_goes_back_to_the_target():
    """A deleted refit's record stands while the pod serves the version it left; a pod it
    left out of traffic (failed) is the target's to converge."""
    halted_gone = [OLDER]
    failed = replace(passed(HALTED), outcome="Failed", reason="LogprobDrift")
    pods = [pod("p0", passed(HALTED), APP), pod("p1", failed, APP, ready=False)]
    d = decide(observe(OLDER, pods, [ref(OLDER)], halted_gone))
    assert [x.pod for x in d.start] == ["p1"]


# ---- 3. a rollback takes each pod back to what it served -------------------------------------

TIERS = {"app": "rollout"}
GEN = {"app": "rollout", "tier": "gen"}
EVAL = {"app": "rollout", "tier": "eval"}


def test_a_rollback_takes_each_pod_back_to_the_checkpoint_that_pod_served():
    """App-wide a1, then the gen tier to gen-1, then an app-wide refit that fails on an eval
    pod: the gen pods go back to gen-1, the eval pods to a1 (never gen-1, the fleet-wide
    newest that status.previous names)."""
    s = spec(TIERS, "a2", onFailure="Rollback")
    prev = Previous(version="gen-1", path="/ckpt/gen-1", refit="gen")
    r = refit("app-2", NEWEST, s, WeightRefitStatus(phase="Progressing", start_time=STARTED,
                                                    previous=prev))  # fmt: skip

    def fwd(served: str, outcome: str = "Succeeded") -> podflow.Progress:
        p = passed(r, serving=served, serving_path=f"/ckpt/{served}")
        return replace(p, outcome=outcome)  # type: ignore[arg-type]

    pods = [pod("gen-0", fwd("gen-1"), GEN), pod("gen-1", fwd("gen-1"), GEN),
            pod("eval-0", fwd("a1", "Failed"), EVAL, ready=False),
            pod("eval-1", fwd("a1"), EVAL)]  # fmt: skip
    d = decide(observe(r, pods, [ref(r)], [r]))
    assert d.status.phase == "RollingBack"
    assert sorted((x.pod, x.version, x.path, x.rollback) for x in d.start) == [
        ("eval-0", "a1", "/ckpt/a1", True), ("eval-1", "a1", "/ckpt/a1", True),
        ("gen-0", "gen-1", "/ckpt/gen-1", True), ("gen-1", "gen-1", "/ckpt/gen-1", True),
    ]  # fmt: skip
    # The rollback passes are the pods' records now: each goes on to its own target.
    back = {x.pod: passed(r, rollback=True) for x in d.start}
    back = {n: replace(back[n], version=x.version, path=x.path) for x in d.start for n in [x.pod]}
    after = [replace(p, progress=back[p.name]) for p in pods]
    r2 = replace(r, status=d.status)
    # A pod that restarts while the others roll back goes back to its own target again.
    d = decide(observe(r2, [*after[:3], replace(after[3], restarts=1)], [ref(r2)], [r2]))
    assert [(x.pod, x.version, x.path) for x in d.start] == [("eval-1", "a1", "/ckpt/a1")]
    d = decide(observe(r2, after, [ref(r2)], [r2]))
    assert d.status.phase == "RolledBack", d.status.message
    assert "2 pods rolled back to a1 (eval-0, eval-1)" in d.status.message
    assert "2 pods rolled back to gen-1 (gen-0, gen-1)" in d.status.message


def test_a_pod_with_no_checkpoint_to_go_back_to_fails_closed_and_one_left_untouched_stays():
    """A pod that served a broadcast, or nothing probed (it joined mid-refit), has no
    checkpoint to go back to: it leaves traffic with NoRollbackTarget, and the refit ends
    Failed saying so. A pod whose load was refused before its weights were touched serves
    what it served: nothing to undo."""
    s = spec(TIERS, "a2", onFailure="Rollback")
    r = refit("app-2", NEWEST, s, WeightRefitStatus(phase="Progressing", start_time=STARTED))
    ok = replace(passed(r, serving="a1", serving_path="/ckpt/a1"))
    bcast = passed(r, serving="b1")  # a broadcast: no path
    joined = passed(r)  # served nothing probed
    restored = replace(passed(r, serving="a1", serving_path="/ckpt/a1"), outcome="Failed",
                       restored=True, reason="CheckpointChanged")  # fmt: skip
    failed = replace(ok, outcome="Failed", reason="LogprobDrift")
    pods = [pod("a", ok, TIERS), pod("b", bcast, TIERS), pod("c", joined, TIERS),
            pod("d", restored, TIERS), pod("e", failed, TIERS, ready=False)]  # fmt: skip
    to, kept, nothing = rollback_targets(pods, r)
    assert to == {"a": ("a1", "/ckpt/a1"), "e": ("a1", "/ckpt/a1")}
    assert (kept, nothing) == (["d"], ["b", "c"])
    d = decide(observe(r, pods, [ref(r)], [r]))
    assert d.status.phase == "RollingBack"
    assert sorted(x.pod for x in d.start) == ["a", "e"]
    assert {n: w.reason for n, w in d.withdraw.items()} == {"b": "NoRollbackTarget",
                                                         "c": "NoRollbackTarget"}  # fmt: skip
    back = replace(passed(r, rollback=True), version="a1", path="/ckpt/a1")
    done = [pod("a", back, TIERS), replace(pods[1], ready=False), replace(pods[2], ready=False),
            pods[3], pod("e", back, TIERS)]  # fmt: skip
    d = decide(observe(replace(r, status=d.status), done, [ref(r)], [r]))
    assert d.status.phase == "Failed" and d.status.conditions[0].reason == "NoRollbackTarget"
    msg = d.status.message
    assert "2 pods had no checkpoint to go back to, out of traffic (b, c)" in msg, msg
    assert "2 pods rolled back to a1 (a, e)" in msg and "1 pods kept what they served (d)" in msg


def test_serving_path_is_the_checkpoint_of_the_version_the_pod_serves():
    r = OLDER
    assert pod("p", passed(r), APP).serving_path == "/ckpt/v1"
    assert pod("p", passed(r), APP, restarts=1).serving_path == ""  # lost with the restart
    assert pod("p", passed(r), APP, ready=False).serving_path == ""
    bcast = replace(passed(r), path="", source="broadcast")
    assert pod("p", bcast, APP).serving_path == ""
    refused = replace(passed(r, serving="v0", serving_path="/ckpt/v0"), outcome="Failed",
                      restored=True)  # fmt: skip
    assert pod("p", refused, APP).serving == "v0"
    assert pod("p", refused, APP).serving_path == "/ckpt/v0"
    # Recorded when a pass begins on a pod that serves: what its rollback loads.
    p = pod("p", passed(r), APP)
    nxt = podflow.start("x", "u", "v2", "/ckpt/v2", NOW, serving=p.serving,
                        serving_path=p.serving_path)  # fmt: skip
    assert (nxt.serving, nxt.serving_path) == ("v1", "/ckpt/v1")
    assert podflow.start("x", "u", "v2", "/ckpt/v2", NOW, serving_path="/x").serving_path == ""


def test_a_succeeded_refit_resumes_its_own_pass_cut_short_while_another_refit_waits_for_it():
    """An operator died mid-way through the target's convergence pass on p0: its claim stays
    on the pod. A newer refit of the fleet is at work and waits for that claim; the target,
    which starts no convergence while another refit is at work, still resumes its own pass
    (found by the explorer: both waited for each other for good)."""
    running = replace(passed(OLDER), step="stampVersion", outcome="", finished=0.0)
    claim = Claim("older", OLDER.uid, 7, "op-dead")
    p0 = pod("p0", running, APP, claim=claim, ready=False)
    newer = refit("newer", NEW, spec(APP, "v2"), WeightRefitStatus(phase="Progressing"))
    fleet = [ref(OLDER), ref(newer)]
    d = decide(observe(OLDER, [p0], fleet, [OLDER, newer]))
    assert [(x.pod, x.version, x.resume) for x in d.start] == [("p0", "v1", True)]
    assert not d.idle
    waiting = decide(observe(newer, [p0], fleet, [OLDER, newer]))
    assert waiting.start == [] and "held by a pass of refit older" in waiting.status.message


def test_the_target_tries_a_pod_its_own_pass_failed_on_again_a_minute_later():
    """The target's own pass failed on p0 (a read-back that differed once): the pod stays out
    with the reason, and the target tries it again once RETRY_FAILED_SECONDS have passed
    since that pass ended (found by the explorer: such a pod stayed out for good)."""
    bad = replace(passed(OLDER), outcome="Failed", reason="WeightChecksumMismatch",
                  finished=NOW - RETRY_FAILED_SECONDS + 1)  # fmt: skip
    p0 = pod("p0", bad, APP, ready=False)
    d = decide(observe(OLDER, [p0], [ref(OLDER)], [OLDER]))
    assert d.start == [] and d.watching
    later = replace(p0, progress=replace(bad, finished=NOW - RETRY_FAILED_SECONDS))
    d = decide(observe(OLDER, [later], [ref(OLDER)], [OLDER]))
    assert [(x.pod, x.version, x.resume) for x in d.start] == [("p0", "v1", False)]


def test_a_halted_refit_finishes_its_own_pass_cut_short_that_another_refit_waits_for():
    """As a Succeeded refit does: the operator died mid-pass after the refit halted; the
    pass resumes (it would have finished had the operator lived), and its claim is let go."""
    running = replace(passed(HALTED), step="probe", outcome="", finished=0.0)
    p1 = pod("p1", running, APP, claim=Claim("halted", HALTED.uid, 7, "op-dead"), ready=False)
    newer = refit("newer", NEWEST, spec(APP, "v3"), WeightRefitStatus(phase="Progressing"))
    d = decide(observe(HALTED, [p1], [ref(HALTED), ref(newer)], [HALTED, newer]))
    assert [(x.pod, x.version, x.resume) for x in d.start] == [("p1", "v2", True)]
    assert not d.idle
