"""What the explorer still finds on the current code, and the batches CI and the bench run.

A known hole either switches its fault class off in CI (``excludes``: the class finds it too
often to run at all), or is tolerated by its ``signature`` (a regular expression over the
violation's text) so that every class still runs and anything else it finds fails. Each hole
keeps a seed that shows it; tests/explorer checks that the seed still does (when a fix
merges that test fails: drop the hole, so CI holds the fix).
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from .explore import (
    ADAPTER_CLASSES,
    CLASSES,
    GROUP_CLASSES,
    SOURCE_CLASSES,
    Config,
    Result,
    run_schedule,
)
from .invariants import Violation


@dataclass(frozen=True)
class Hole:
    seed: int
    classes: frozenset[str]
    what: str
    issue: str
    steps: int = 40
    pods: int = 3
    excludes: bool = True  # the class (the hole's name) stays off in CI
    # What the violation says (a regular expression): with ``excludes`` only the seed's
    # check reads it; otherwise CI tolerates a violation that matches it
    signature: str = ""
    # Invariants the seed's schedule does not hold (Config.ignore): a hole that another
    # known hole would otherwise hide
    ignore: frozenset[str] = frozenset()

    def config(self) -> Config:
        return Config(self.seed, self.classes, steps=self.steps, pods=self.pods, ignore=self.ignore)

    def matches(self, v: Violation) -> bool:
        return bool(self.signature) and re.search(self.signature, str(v)) is not None


KNOWN_HOLES: dict[str, Hole] = {
    "creation_order": Hole(
        19,
        frozenset({"watch_drop"}),
        "two refits created in one second without a client's creation stamp (kubectl) are "
        "stamped by the operator in the order it first sees them, and each stamp is persisted "
        "by a write of its own; that is the order the API server stored them in only while "
        "the watch shows every ADDED event and the stamps of one second land together. Seed "
        "19: wr-003's ADDED is lost (a watch that relists), wr-004 (created after it, in the "
        "same second) is stamped at once, wr-003 only when a list finds it. Also (mixed "
        "classes, operator_restart): a process persists the later refit's stamp, then dies "
        "or loses its Lease before the earlier one's (the explorer persists a stamp at the "
        "refit's first tick, production at its watch event: a narrower window); the next "
        "leader stamps the earlier refit anew, after the later one. Every replica then orders "
        "them against their creation for good (queue, targets, moved on; docs/concepts.md "
        "'Which refit is newer' says the stamps follow the storage order). After a write, "
        "nothing the API server answers recovers that order (resourceVersion moves, "
        "creationTimestamp has whole seconds): only a client's stamp (RefitClient) or the "
        "watch gives it",
        "refits created in one second are ordered by first sight, not creation, after a "
        "lost watch event",
        excludes=False,
        signature=r"^\[creation-order\]",
    ),
}
# The classes the schedules below were found with, as they were then (a class added later
# must not change them): the holding ones, and the adapters' among them.
_HOLDING_THEN = frozenset(
    "history_gc,lease_delete,lease_expiry,load_touched,operator_restart,pod_ip_change,"
    "pod_relabel,pod_replace,pod_restart,refit_delete,refit_same_second,refit_spec_update,"
    "two_installations,watch_coalesce,watch_delay,watch_drop,worker_crash,worker_refusal,"
    "worker_timeout".split(",")
)
_FEATURES_WITH_RESTARTS = frozenset(
    "adapter_bad,adapter_fail,adapter_refits,broadcast_rounds,group_member_restart,"
    "operator_restart,pod_groups,weights_skew,worker_crash".split(",")
)
_ADAPTERS_AMONG_HOLDING = _HOLDING_THEN | {"adapter_bad", "adapter_fail", "adapter_refits",
                                           "weights_skew"}  # fmt: skip
# Schedules that once found a hole since fixed: CI runs them (tests/explorer).
REGRESSIONS: dict[str, tuple[frozenset[str], tuple[int, ...]]] = {
    # Two installations, each leading on its own Lease: a pass took over the other's live
    # claim (the explorer's engines ran without Leases) and both drove the pod. With the
    # Leases modelled, a claim whose holder's Lease may still be valid is left to it
    # (engine._elsewhere, leader.holder_alive).
    "two_installations": (frozenset({"two_installations"}), (30,)),
    # The container restarted between the probe and the vouch, and the vouch made the new
    # process Ready on its boot weights; the vouch is now bound to the process probed.
    "worker_crash": (frozenset({"worker_crash"}), (3, 5, 8, 16, 30, 32, 35, 148)),
    # A DELETED event lost, then a relist: the index kept a ghost refit and queued the fleet
    # behind it; the index now converges to the refits that exist (RefitIndex.drop_missing).
    "watch_drop": (frozenset({"watch_drop", "refit_delete"}), (1, 90, 97)),
    # A restarted pod's convergence pass refused once was never tried again; every pod's
    # target now converges it (pod_state.moved_on, the watching Succeeded refit).
    "convergence_failed_once": (
        frozenset(
            "history_gc,load_touched,operator_restart,pod_ip_change,pod_relabel,pod_replace,"
            "pod_restart,refit_delete,refit_same_second,refit_spec_update,watch_coalesce,"
            "watch_delay,worker_crash,worker_refusal,worker_timeout".split(",")
        ),
        (200442, 200016),
    ),
    # A follower restarted after the group's probe, before the pass's last write, which put
    # the whole group back in traffic from the view the pass began with (the follower's
    # restart reaches no vouch of the leader's process); the last write now judges the group
    # by its members as the pod watch has them (pod_pass._run_now).
    "follower_restart_before_the_last_write": (
        _FEATURES_WITH_RESTARTS,
        (7565,),
    ),
    # The container of a group's leader restarted while an adapter pass ran on it; the pass
    # went on with the new process (boot weights), vouched for it, and its last write put the
    # pod back from the view the pass began with. That write now judges every unit, a pod
    # alone too, by its run as the pod watch shows it then (pod_pass._run_now).
    "restart_during_an_adapter_pass": (
        frozenset(
            "adapter_bad,adapter_fail,adapter_refits,broadcast_rounds,group_leader_replace,"
            "group_member_delete,group_member_pending,group_member_replace,"
            "group_member_restart,operator_restart,pod_groups,pod_restart,weights_skew,"
            "worker_crash".split(",")
        ),
        (30591,),
    ),
    # A refit's DELETED event lost after its finalizer was released: its passes, ending later,
    # woke it, and it decided on from the document last seen, a ghost in memory
    # (bounded-memory). The tick that releases the finalizer now drops that document, so the
    # next one reads the refit and forgets it.
    "ghost_after_its_finalizer": (
        _ADAPTERS_AMONG_HOLDING,
        (20303,),
    ),
    # An operator died in the middle of a Succeeded refit's convergence pass; newer refits of
    # the fleet waited for that pass's claim, and the Succeeded refit, which converges
    # nothing while another refit is at work, did not resume it: each waited for the other.
    # Its own passes cut short now resume (decision: Succeeded).
    "convergence_pass_cut_short": (
        _ADAPTERS_AMONG_HOLDING,
        (20581,),
    ),
    # The same for a refit that had halted: its pass cut short, and the refits queued behind
    # its claim. A finished refit's own passes cut short now resume.
    "halted_pass_cut_short": (_ADAPTERS_AMONG_HOLDING, (100615,)),
    # An adapter refit being deleted (history) had left the index, and the tick that
    # released its finalizer took the base weights' fleet for its own: another adapter
    # refit's pass on the pods looked foreign, and they were withdrawn FleetChanged for good.
    # The refit's own track is now the caller's (index.sharing).
    "deleted_adapter_refit_took_the_base_fleet": (
        _ADAPTERS_AMONG_HOLDING,
        (40722,),
    ),
    # A hand-off of a refit whose DELETED event was lost wrote its status: 404, and the
    # engine kept the ghost (bounded-memory). A 404 there now forgets it.
    "hand_off_of_a_deleted_refit": (
        _ADAPTERS_AMONG_HOLDING,
        (40659,),
    ),
    # The same, on a finished refit whose hand-off had nothing to write: the ghost stayed
    # until the next resync. A finished refit's hand-offs now read it (reconcile_loop._kept).
    "hand_off_of_a_finished_deleted_refit": (
        _HOLDING_THEN,
        (90015,),
    ),
    # A base pass reloaded the base and so unloaded an adapter; that adapter's refit came to
    # load it again, its probe failed, and its restore, taking the lost adapter for one the
    # pod served, failed for want of it: the pod stayed out for good. A pass now starts
    # serving nothing of an adapter its process lost (pod_pass, gate.adapter_missing).
    "lost_adapter_refused_again": (_FEATURES_WITH_RESTARTS, (77640,)),
    # Two installations: one's watch had not shown a refit the other had just created, so it
    # took that refit's live claim for a crashed pass's; its base pass drove the pod over the
    # adapter pass and left the staged adapter loaded. A claim of a refit not yet seen is now
    # read from the API server (reconcile_loop._unseen).
    "claim_of_a_refit_not_yet_seen": (
        _ADAPTERS_AMONG_HOLDING,
        (20236,),
    ),
}
# Issue 41's five breaks of one traffic gate per pod, fixed by the one gate (core/gate.py,
# b58e782): the schedules that found them on main before the fix (ef374ed), exactly as found
# (steps, pods, invariants ignored). (1) an adapter pass re-admitted a pod whose base weights
# failed (WeightChecksumMismatch); (2) the base weights' target, or another adapter's refit,
# re-admitted a pod whose adapter failed its probe after the swap; (3) a refused first
# adapter (no adapter_config.json) left a base-serving fleet out of traffic for good; (4) a
# failed adapter pass left its staged name (policy@s2) loaded; (5) a group whose follower
# was recreated Pending stayed half in traffic.
ISSUE_41: dict[str, tuple[Config, ...]] = {
    # Found on the first gate fix (b58e782): an adapter probed before any base pass named no
    # base, so the base pass that unloaded it left it counted and served; it now names none
    # (podflow.NO_BASE), and its refit loads it again (gate.adapter_missing).
    "adapter_on_unprobed_base": (Config(1, frozenset({"adapter_refits"}), steps=10, pods=2),),
    "adapter_readmits_failed_base": (Config(1, frozenset({"weights_skew"}), steps=10, pods=2),),
    "failed_adapter_readmitted_by_base": (
        Config(
            35,
            frozenset({"adapter_refits", "adapter_fail"}),
            steps=20,
            pods=2,
            ignore=frozenset({"adapter-held"}),
        ),
    ),
    "failed_adapter_readmitted_by_adapter": (
        Config(
            48,
            frozenset({"adapter_refits", "adapter_fail"}),
            steps=20,
            pods=2,
            ignore=frozenset({"adapter-held"}),
        ),
    ),
    "bad_first_adapter_strands_fleet": (Config(2, frozenset({"adapter_bad"}), steps=10, pods=2),),
    "adapter_staged_name_leaks": (
        Config(211, frozenset({"adapter_refits", "adapter_fail"}), steps=46, pods=2),
    ),
    "group_half_in_traffic": (Config(15, frozenset({"group_member_pending"}), steps=8, pods=2),),
}
EXCLUDED = frozenset(name for name, h in KNOWN_HOLES.items() if h.excludes)
# Issue 41's classes (adapters, pod groups): tests/explorer runs them on their own, with the
# known holes above tolerated by signature; out of HOLDING, so CI's mixes (holes.mixed, the
# 1,800 short schedules) keep the schedules they had. The bench's explorer suite mixes them in.
FEATURES = tuple(c for c in CLASSES if c in ADAPTER_CLASSES | GROUP_CLASSES)
# Weight sources the explorer models beyond checkpoints and adapters (a drafter refitted with
# its target, a trainer's broadcast): a few seeds in CI, the bench's long mode mixes them with
# the holding ones.
SOURCES = tuple(c for c in CLASSES if c in SOURCE_CLASSES)
HOLDING = tuple(c for c in CLASSES if c not in EXCLUDED and c not in FEATURES and c not in SOURCES)


def known(v: Violation) -> str | None:
    """The known hole, among those whose class runs in CI, that a violation shows (by its
    signature), if any."""
    return next((name for name, h in KNOWN_HOLES.items() if not h.excludes and h.matches(v)), None)


def mixed(seed: int, pool: tuple[str, ...] = HOLDING) -> frozenset[str]:
    """The classes of a batch's schedule: every class of the pool (the holding ones) on for
    one seed in three, else one to three of them (a fault among many is rarely the one that
    matters)."""
    if seed % 3 == 0:
        return frozenset(pool)
    r = random.Random(seed)
    return frozenset(r.sample(pool, r.randint(1, 3)))


@dataclass
class Batch:
    schedules: int = 0
    steps: int = 0
    checks: int = 0
    virtual_seconds: float = 0.0
    seconds: float = 0.0
    failures: list[Result] = field(default_factory=list)  # violations no known hole explains
    tolerated: Counter[str] = field(default_factory=Counter)  # known hole -> schedules

    @property
    def per_second(self) -> float:
        return self.schedules / self.seconds if self.seconds else 0.0

    def add(self, result: Result) -> None:
        self.schedules += 1
        self.steps += result.steps
        self.checks += result.checks
        self.virtual_seconds += result.virtual_seconds
        unknown = [v for v in result.violations if known(v) is None]
        if unknown:
            self.failures.append(result)
        elif result.violations:
            self.tolerated[str(known(result.violations[0]))] += 1

    def summary(self) -> str:
        tolerated = ", ".join(f"{k} {n}" for k, n in sorted(self.tolerated.items())) or "none"
        return (
            f"{self.schedules} schedules in {self.seconds:.1f}s ({self.per_second:.1f}/s), "
            f"{self.steps} steps, {self.checks} invariant checks, {len(self.failures)} failed; "
            f"known holes seen: {tolerated}"
        )


def run_batch(
    seeds: Iterable[int],
    *,
    steps: int = 20,
    pods: int = 2,
    pool: tuple[str, ...] = HOLDING,
    always: frozenset[str] = frozenset(),
) -> Batch:
    """Short schedules over small fleets, classes of ``pool`` mixed by seed (and ``always``
    in every one): CI's many schedules, the bench's long mode."""
    batch = Batch()
    began = time.perf_counter()
    for seed in seeds:
        classes = mixed(seed, pool) | always
        batch.add(run_schedule(Config(seed, classes, steps=steps, pods=pods)))
    batch.seconds = time.perf_counter() - began
    return batch
