"""The deterministic fault explorer: the operator's real Engine (ticks, passes, claims,
fencing, the index, history collection) against an in-memory cluster and in-process
simulated workers, on virtual time, with every choice made by one seeded ``random.Random``.

A schedule is ``steps`` choices among: a replica ticks a refit (as kopf's daemon would), time
passes, a replica's watch delivers its events, and faults of the enabled classes (CLASSES).
After every choice the invariants are checked (invariants.py); then faults stop, and every
pod must reach its target within a bound (liveness); then nothing the engines keep may
outlive the refits that exist. Same seed and classes, same trace, byte for byte: a failing
schedule replays with ``python -m testbed.explorer --seed N --classes ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from refit_client.refit_document import build_refit
from refit_operator.controller.reconcile_loop import Engine
from refit_operator.core import history, times
from refit_operator.core.api_spec import LEADER_INDEX, LWS_GROUP_LABEL, LWS_INDEX_LABEL
from refit_operator.core.claim import CLAIM_ANNOTATION
from refit_operator.edges.leader import LeadershipLost, Lease
from refit_operator.edges.worker_client import WorkerClient
from refit_operator.handlers import ACTIVE_INTERVAL, DORMANT_INTERVAL, IDLE_INTERVAL
from refit_worker.checkpoint import manifest as checkpoint_manifest
from refit_worker.checkpoint import staging as checkpoint_staging
from refit_worker.contract import PROBE_FILE, RPC_INFO, RPC_LOAD, RPC_STAGE

from testbed.simworker.transfer import sim_transfer_manifest

from . import invariants
from .memcluster import Event, MemoryCluster, MemoryLeases, Store, clone, finalized, pod_body
from .trainer import FAULTS as TRAINER_FAULTS
from .trainer import SimTrainer
from .vtime import Stalled, VirtualClock, VirtualLoop
from .workers import (
    BAD_ADAPTER,
    ExplorerSimServer,
    InProcessSession,
    adapter_checkpoints,
    checkpoints,
)

NS = "fleet"
FLEET = {"app": "rollout"}
ELSEWHERE = {"app": "elsewhere"}
VERSIONS = [f"v{i}" for i in range(1, 9)]
ROOT = Path(tempfile.gettempdir()) / "refit-explorer-checkpoints"
LEASE_NS = "refit-system"  # each installation's Lease is named after it
# The operator's default (renewed every 2.5 s, its local deadline at 10 s), or a short one
# whose expiries and takeovers fall within a schedule's steps.
LEASE_SECONDS = (15, 5)
EXIT_SECONDS = 1.0  # a process that lost its lease stops its daemons, then exits
RESTART_SECONDS = 5.0  # the kubelet starts the exited container again

# Fault classes, each switchable. Sieve's three perturbations are here as the watch classes
# (unobserved: drop, coalesce; stale: delay) and operator restarts (intermediate states: a
# crash after any write, since a restart cancels the passes wherever they are).
CLASSES = (
    "worker_refusal",  # a load or preflight refused with a contract code, model untouched
    "load_touched",  # LoadFailed after the load touched the model
    "worker_timeout",  # an answer later than the client waits (the work goes on), or never
    "worker_crash",  # the process dies mid-call; the kubelet restarts the container later
    "pod_restart",  # the container restarts between calls
    "pod_relabel",  # a pod leaves the fleet's selector, or joins it
    "pod_replace",  # a pod is deleted and created again under the same name
    "pod_ip_change",  # the pod's sandbox is recreated: a new IP, a fresh process
    "refit_same_second",  # two refits created in one second, names against creation order
    "refit_delete",  # a refit deleted by hand (its finalizer runs)
    "refit_spec_update",  # spec.sequence changed mid-refit
    "history_gc",  # a small history limit: finished refits are collected
    "operator_restart",  # an operator process dies and a new one takes over
    "two_installations",  # a second operator installation (its own Lease) drives the fleet
    "lease_expiry",  # an operator process is frozen (SIGSTOP, a GC pause), maybe past its lease
    "lease_delete",  # an installation's Lease is deleted (the next replica that looks makes it)
    "watch_delay",  # watch events arrive late (stale index)
    "watch_drop",  # a watch event is lost (the next relist is all that recovers it)
    "watch_coalesce",  # only the newest event of an object arrives
    # Where features meet (issue 41). Any adapter class makes the pods take LoRA adapters at
    # runtime and some created refits adapter refits (spec.adapter, two adapter names);
    # any group class makes the fleet pod groups (LeaderWorkerSet labels, spec.fleet.groups).
    # Configs without them draw exactly as before.
    "adapter_refits",  # an adapter refit created beside the base refits
    "adapter_bad",  # an adapter refit of a directory without adapter_config.json
    "adapter_fail",  # a pod's next adapter load goes wrong: the staged name's, or the swap's
    "weights_skew",  # a pod's next read-back of its weights differs from its peers'
    "pod_groups",  # the fleet is pod groups of two (a leader and a follower)
    "group_member_restart",  # a follower's container restarts
    "group_member_delete",  # a follower is deleted; its replacement comes seconds later
    "group_member_replace",  # a follower is deleted and created again at once
    "group_member_pending",  # a follower is deleted and created again Pending, Running later
    "group_leader_replace",  # a leader is deleted and created again, mid-pass if one runs
    # The pods run a speculative drafter the worker refits from each checkpoint's drafter/
    # (refit_info.drafter). A base refit created now carries a stale drafter/ (trained with
    # another target: the target's probe passes, the drafter's acceptance does not) or none
    # (DrafterMissing, both models untouched); or a pod's next load leaves its drafter as it
    # was (a worker that reloads the target only).
    "drafter_stale",
    # A broadcast refit (spec.broadcast) created now, its weights sent by a simulated trainer
    # (trainer.py) that is on time, late (announces each round seconds after ReceiversReady),
    # dies mid-send, or sends bytes other than those it promised.
    "broadcast_rounds",
)
ADAPTER_CLASSES = frozenset({"adapter_refits", "adapter_bad", "adapter_fail", "weights_skew"})
GROUP_CLASSES = frozenset(c for c in CLASSES if c == "pod_groups" or c.startswith("group_"))
# Weight sources beyond checkpoints and adapters (drafters): out of every CI mix, so that
# existing seeds keep their schedules; the bench's long mode runs them (holes.SOURCES).
SOURCE_CLASSES = frozenset({"drafter_stale", "broadcast_rounds"})
ADAPTER_NAMES = ("policy", "critic")
ADAPTER_VERSIONS = [f"s{i}" for i in range(1, 9)]
MAX_LORA_RANK = 16
TRAINER_HOST = "10.9.0.1"  # where the pods reach a broadcast's simulated trainer
TRAINER_PORT = 29500  # each broadcast refit's rendezvous: this port + its number


@dataclass
class Config:
    seed: int
    classes: frozenset[str] = frozenset()
    steps: int = 40
    pods: int = 3
    max_refits: int = 4
    liveness_seconds: float = 900.0  # virtual seconds after faults stop
    # Invariants not held (their violations traced, not counted): to look past a known hole
    # that would end the schedule before the one it looks for.
    ignore: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.classes) - set(CLASSES)
        if unknown:
            raise ValueError(f"unknown fault classes {sorted(unknown)}; known: {CLASSES}")


@dataclass
class Result:
    config: Config
    trace: list[str]
    violations: list[invariants.Violation]
    steps: int = 0
    checks: int = 0
    virtual_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def digest(self) -> str:
        return hashlib.sha256("\n".join(self.trace).encode()).hexdigest()[:16]

    def replay(self) -> str:
        classes = ",".join(sorted(self.config.classes)) or "none"
        ignore = f" --ignore {','.join(sorted(self.config.ignore))}" if self.config.ignore else ""
        return (
            f"python -m testbed.explorer --seed {self.config.seed} --classes {classes} "
            f"--steps {self.config.steps} --pods {self.config.pods}{ignore}"
        )

    def report(self, tail: int = 60) -> str:
        lines = [f"seed {self.config.seed}: {len(self.violations)} violation(s)"]
        lines += [f"  {v}" for v in self.violations]
        lines.append(f"replay: {self.replay()}")
        lines.append(f"trace (last {tail} of {len(self.trace)}):")
        lines += ["  " + t for t in self.trace[-tail:]]
        return "\n".join(lines)


@dataclass
class Replica:
    """One operator process: its Lease, its engine, its view of the API server, kopf's
    daemons. It acts only while it leads (main.run: the Lease first, then the engine)."""

    name: str
    installation: str
    engine: Engine
    lease: Lease
    thawed: asyncio.Event  # clear while the process is frozen
    feed: list[Event] = field(default_factory=list)  # its watch, from when it leads
    leading: bool = False
    life: asyncio.Task[None] | None = None
    daemons: dict[str, str] = field(default_factory=dict)  # refit name -> uid (kopf's view)
    ticking: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    held: list[Event] = field(default_factory=list)  # delayed watch events
    due: dict[str, float] = field(default_factory=dict)  # refit name -> next daemon tick


class Explorer:
    def __init__(self, config: Config, clock: VirtualClock) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.on = config.classes
        self.trace: list[str] = []
        self.clock = clock
        self.store = Store(latency=self._api_latency)
        # The Leases' requests draw their latencies from a generator of their own: renewals
        # run on their own clock, and would otherwise reshuffle every other choice.
        self.lease_rng = random.Random(f"lease-{config.seed}")
        self.lease_seconds = self.lease_rng.choice(LEASE_SECONDS)
        self.drafters = "drafter_stale" in self.on
        self.ckpt = checkpoints(ROOT, VERSIONS, drafter=self.drafters)
        # A drafter fleet's refits with a stale drafter/, or with none (the plain checkpoints).
        self.drafter_ckpt = {
            "stale": checkpoints(ROOT, VERSIONS, drafter=self.drafters, stale=True),
            "missing": checkpoints(ROOT, VERSIONS),
        }
        self.ips = (f"10.0.{i // 250}.{i % 250 + 1}" for i in range(10_000))
        self.sim = ExplorerSimServer([], str(ROOT), None)
        self.sim.latency = self._worker_latency
        self.sim.drafter = "draft_model" if self.drafters else ""
        self.lora = bool(self.on & ADAPTER_CLASSES)
        self.grouped = bool(self.on & GROUP_CLASSES)
        self.adapter_ckpt: dict[tuple[str, str], str] = {}  # (name, version) -> directory
        if self.lora:
            self.sim.max_lora_rank = MAX_LORA_RANK
            self.adapter_ckpt = adapter_checkpoints(ROOT, list(ADAPTER_NAMES), ADAPTER_VERSIONS)
        self.adapter_refits: dict[str, int] = {}  # adapter name -> refits created
        self.trainers: set[asyncio.Task[None]] = set()  # broadcast_rounds' trainers running
        self.session = InProcessSession(self.sim)
        self.replicas: list[Replica] = []
        self.processes = 0
        self.refits = 0
        self.faulting = True
        self.checker = invariants.Checker(
            self.store, self.sim, self._note, self.grouped, config.ignore
        )
        self.store.on_write = self.checker.on_write
        self.sim.on_call = self.checker.on_call
        self.sim.on_restart = self._kubelet_restarted
        self.sim.on_crash = self._kubelet_crashed
        limit = self.rng.choice([0, 1, 2]) if "history_gc" in self.on else 10
        self.policy = history.Policy(limit)

    # ------------------------------------------------------------------ randomness
    def _api_latency(self) -> float:
        return self.rng.choice((0.0, 0.0, 0.001, 0.005, 0.02))

    def _lease_latency(self) -> float:
        return self.lease_rng.choice((0.0, 0.001, 0.005, 0.02))

    def _worker_latency(self, step: str) -> float:
        return self.rng.choice((0.001, 0.01, 0.05)) + (0.5 if step == RPC_LOAD else 0.0)

    def _note(self, line: str) -> None:
        self.trace.append(f"{self.clock.elapsed:9.3f} {line}")

    # ------------------------------------------------------------------- the world
    def _new_pod_process(self) -> str:
        ip = next(self.ips)
        self.sim.add_pod(ip)
        return ip

    def _create_pod(self, name: str, labels: dict[str, str]) -> None:
        ip = self._new_pod_process()
        self.store.create("Pod", NS, pod_body(name, ip, labels))
        self._note(f"pod {name} created at {ip}")

    def _group_labels(self, i: int) -> dict[str, str]:
        """With the group classes, pods form groups of two in order: pod-0 leads pod-1, ..."""
        if not self.grouped:
            return {}
        return {LWS_GROUP_LABEL: f"g{i // 2}", LWS_INDEX_LABEL: str(i % 2)}

    def _refit(
        self,
        name: str,
        version: str,
        adapter: str | None = None,
        path: str = "",
        broadcast: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        r = self.rng
        sleep_level = r.choice([0, 1])
        strategy, max_unavailable = r.choice([("AllAtOnce", None), ("Rolling", 1)])
        return build_refit(
            name, path or self.ckpt[version], version, fleet_selector=dict(FLEET), port=8000,
            adapter=adapter, broadcast=broadcast,
            probe_reference_config_map=f"{name}-weights" if broadcast else None,
            spec_fields={"fleet": {"groups": {}}} if self.grouped else None,
            strategy=strategy, max_unavailable=max_unavailable,
            on_failure=r.choice(["Halt", "Rollback"]),
            sequence={
                "sleepLevel": sleep_level,
                # Half the refits wait out a drain delay, so faults land inside it too. Derived
                # from a choice already drawn: a new draw would reshuffle every seed's schedule.
                "drainDelaySeconds": sleep_level,
                "drainMode": "abort",
                "stepTimeoutSeconds": 5,
                "drainTimeoutSeconds": 5,
                "loadTimeoutSeconds": 10,
                "probeTimeoutSeconds": 5,
                "totalTimeoutSeconds": 600,
                "retries": 2,
            },
        )  # fmt: skip

    def _create_refit(
        self, name: str | None = None, *, adapters: bool = True, drafter: str = ""
    ) -> None:
        """A base refit of the next version (``drafter`` "stale": its checkpoint's drafter/
        holds a drafter trained with another target; "missing": it has no drafter/)."""
        if adapters and self.lora and self.rng.random() < 0.5:
            self._create_adapter_refit(name)
            return
        version = VERSIONS[self.refits % len(VERSIONS)]
        self.refits += 1
        name = name or f"wr-{self.refits:03d}"
        path = self.drafter_ckpt[drafter][version] if drafter else ""
        doc = self.store.create("WeightRefit", NS, finalized(self._refit(name, version, path=path)))
        what = f"{version}, {drafter} drafter" if drafter else version
        self._note(f"refit {name} created ({what}, {doc['metadata']['uid']})")

    def _create_adapter_refit(self, name: str | None = None, bad: bool = False) -> None:
        """An adapter refit (spec.adapter) of one of two adapter names, the next version of
        that name's (or its directory without adapter_config.json)."""
        adapter = self.rng.choice(ADAPTER_NAMES[:1] * 2 + ADAPTER_NAMES[1:])  # mostly one name
        k = self.adapter_refits.get(adapter, 0)
        version = BAD_ADAPTER if bad else ADAPTER_VERSIONS[k % len(ADAPTER_VERSIONS)]
        self.adapter_refits[adapter] = k + (0 if bad else 1)
        self.refits += 1
        name = name or f"wr-{self.refits:03d}"
        path = self.adapter_ckpt[(adapter, version)]
        body = self._refit(name, version, adapter=adapter, path=path)
        doc = self.store.create("WeightRefit", NS, finalized(body))
        self._note(f"refit {name} created (adapter {adapter} {version}, {doc['metadata']['uid']})")

    def _create_broadcast_refit(self) -> None:
        """A broadcast refit of the next version, as RefitClient.broadcast creates one (its
        ConfigMap with the promise and the probe reference first), and its trainer."""
        r = self.rng
        fault = r.choice(TRAINER_FAULTS)
        version = VERSIONS[self.refits % len(VERSIONS)]
        self.refits += 1
        name = f"wr-{self.refits:03d}"
        trainer = SimTrainer(
            self.store, self.sim, self._note, NS, name, version, TRAINER_HOST,
            TRAINER_PORT + self.refits, fault, delay=r.choice((0.5, 5.0, 40.0)),
            die_round=r.choice((1, 2)), drafter=self.drafters,
        )  # fmt: skip
        promise = sim_transfer_manifest(trainer.promise())
        reference = json.loads((Path(self.ckpt[version]) / PROBE_FILE).read_text())
        self.store.create("ConfigMap", NS, {"metadata": {"name": f"{name}-weights"}, "data": {
            "transfer-manifest.json": json.dumps(promise.to_json_dict()),
            PROBE_FILE: json.dumps({**reference, "version": version}),
        }})  # fmt: skip
        source = {
            "rendezvous": {"host": trainer.host, "port": trainer.port},
            "manifest": {"configMapRef": {"name": f"{name}-weights"}, "digest": promise.digest},
            "timeoutSeconds": r.choice((10, 30)),
        }
        doc = self.store.create(
            "WeightRefit", NS, finalized(self._refit(name, version, broadcast=source))
        )
        what = {"late": f"late by {trainer.delay}s", "dies": f"dies in round {trainer.die_round}"}
        self._note(f"refit {name} created (broadcast {version}, trainer "
                   f"{what.get(fault, fault)}, {doc['metadata']['uid']})")  # fmt: skip
        task = asyncio.create_task(trainer.run())
        self.trainers.add(task)
        task.add_done_callback(self.trainers.discard)

    def _replica(self, installation: str) -> Replica:
        """A new operator process of ``installation``, wired as main.run wires it: its own
        identity, the installation's Lease (leader.Lease, the real one, over the in-memory
        API server), and the engine's writes and pod calls checked against it."""
        self.processes += 1
        name = f"{installation}-{self.processes}"
        thawed = asyncio.Event()
        thawed.set()
        cluster = MemoryCluster(self.store, name, thawed)
        leases = MemoryLeases(self.store, self._lease_latency, thawed)
        lease = Lease(None, LEASE_NS, installation, name, self.lease_seconds, api=leases)
        workers = _workers(_ProcessSession(self.session, lambda what: self._sending(r, what)),
                           thawed)  # fmt: skip
        engine = Engine(cluster, None, lease, self.policy, workers=workers)  # before_write
        r = Replica(name, installation, engine, lease, thawed)
        cluster.on_send = lambda: self._sending(r, "an API write")
        self._note(f"operator {name} starts")
        return r

    def _sending(self, replica: Replica, what: str) -> None:
        """A process sends a request: it must hold its lease, by its own deadline (a leader
        that may have lost its lease stops before acting)."""
        lease = replica.lease
        self.checker.checks += 1
        if lease.lost.is_set() or times.monotonic() >= lease.valid_until:
            self.checker.violate(
                "lease-stop",
                f"{replica.name} sent {what} past its lease deadline "
                f"({lease.valid_until:.3f}; lost={lease.lost.is_set()})",
            )

    async def _lead(self, replica: Replica) -> None:
        """main.run up to kopf: wait for the Lease, then fill the index (the watch starts)."""
        await replica.lease.acquire()
        self._note(f"{replica.name} leads on Lease {replica.lease.key}")
        replica.feed = self.store.subscribe()
        await replica.engine.sync([NS])
        replica.daemons = {d["metadata"]["name"]: d["metadata"]["uid"]
                           for d in self.store.scan("WeightRefit", NS)}  # fmt: skip
        replica.feed.clear()  # the list is newer than anything queued before it
        replica.leading = True

    async def _live(self, replica: Replica, leading: bool = False) -> None:
        """The rest of the process's life: lead, hold the Lease (leader.Lease.hold renews it
        on virtual time), and exit once it is lost; the kubelet then starts a new process."""
        try:
            if not leading:
                await self._lead(replica)
            await replica.lease.hold()
        except LeadershipLost:
            replica.lease.lost.set()
        replica.leading = False
        self._note(f"{replica.name} lost its lease: the process exits")
        await asyncio.sleep(EXIT_SECONDS)  # passes in flight stop at their next check
        await self._stop(replica)
        await asyncio.sleep(RESTART_SECONDS)
        if replica in self.replicas:
            self._spawn(replica, f"operator {replica.name} exited")

    def _spawn(self, old: Replica, why: str) -> None:
        new = self._replica(old.installation)
        self.replicas[self.replicas.index(old)] = new
        new.life = asyncio.create_task(self._live(new))
        self._note(f"{why}; {new.name} starts in its place")

    def _active(self, replica: Replica) -> bool:
        """Whether kopf runs in the process now: it leads and is not frozen."""
        return replica.leading and replica.thawed.is_set()

    # -------------------------------------------------------------------- running
    async def run(self) -> Result:
        result = Result(self.cfg, self.trace, self.checker.violations)
        for i in range(self.cfg.pods):
            self._create_pod(f"pod-{i}", {**FLEET, **self._group_labels(i)})
        self._create_refit(adapters=False)  # the fleet's base weights first
        installations = ["op-a", "op-b"] if "two_installations" in self.on else ["op-a"]
        for inst in installations:
            r = self._replica(inst)
            await self._lead(r)  # no Lease yet: it leads at once
            self.replicas.append(r)
            r.life = asyncio.create_task(self._live(r, leading=True))
        if self.on & {"lease_expiry", "lease_delete"}:  # a standby waits for op-a's Lease
            r = self._replica("op-a")
            self.replicas.append(r)
            r.life = asyncio.create_task(self._live(r))
        try:
            for step in range(self.cfg.steps):
                result.steps = step + 1
                await self._step()
                self.checker.check_state()
                if self.checker.violations:
                    break
            if not self.checker.violations:
                await self._quiesce()
            if not self.checker.violations:
                for replica in self.replicas:  # the deletions of the last round arrive
                    self._deliver(replica, faults=False)
                self.checker.check_memory([r.engine for r in self.replicas if r.leading])
        except Stalled as e:
            self.checker.violate("stalled", str(e))
        finally:
            await self._stop_all()
        result.checks = self.checker.checks
        result.virtual_seconds = self.clock.elapsed
        return result

    async def _step(self) -> None:
        r = self.rng
        actions = ["tick"] * 4 + ["advance"] * 4 + ["deliver"] * 2
        if self.refits < self.cfg.max_refits:
            actions.append("create")
        if self.on:
            actions += ["fault"] * 3
        action = r.choice(actions)
        if action == "tick":
            self._tick(r.choice(self.replicas))
            await asyncio.sleep(0)
        elif action == "advance":
            seconds = r.choice((0.01, 0.1, 0.5, 1.0, 3.0, 8.0))
            self._note(f"advance {seconds}")
            await asyncio.sleep(seconds)
        elif action == "deliver":
            self._deliver(r.choice(self.replicas))
        elif action == "create":
            self._create_refit()
        else:
            await self._fault(r.choice(sorted(self.on)))

    def _tick(self, replica: Replica, name: str | None = None) -> None:
        names = sorted(replica.daemons)
        if not names or not self._active(replica):
            return
        name = name or self.rng.choice(names)
        busy = replica.ticking.get(name)
        if busy is not None and not busy.done():
            return
        # handlers.refit_daemon: a turn the engine woke (a hand-off) decides from the refit as
        # the watch (late, coalesced, dropped) or its own last write showed it; a turn its
        # interval brings reads it.
        st = replica.engine.refits.get(replica.daemons.get(name, ""))
        fresh = st is None or not st.wake.is_set()
        if st is not None:
            st.wake.clear()
        self._note(f"{replica.name} ticks {name}" + ("" if fresh else " (woken)"))
        replica.ticking[name] = asyncio.create_task(self._daemon_tick(replica, name, fresh))

    async def _daemon_tick(self, replica: Replica, name: str, fresh: bool = True) -> None:
        """One turn of kopf's daemon of the refit, or of its deletion handler once the refit
        is being deleted (which removes kopf's finalizer when the engine releases it)."""
        eng = replica.engine
        seen = self.store.peek("WeightRefit", NS, name)
        deleting = bool(seen and seen["metadata"].get("deletionTimestamp"))
        began = self.store.revision
        try:
            d = await eng.tick(NS, name, deleting=deleting, fresh=fresh or deleting)
        except LeadershipLost:
            self._note(f"{replica.name} tick {name}: leadership lost")
            return  # handlers.refit_daemon: the process is stopping
        except asyncio.CancelledError:
            raise
        except ApiException as e:
            self._note(f"{replica.name} tick {name}: API error {e.status}")
            return
        except Exception as e:  # kopf logs it and ticks again
            self._note(f"{replica.name} tick {name}: {type(e).__name__}: {e}")
            self.checker.violate("tick-crash", f"{replica.name} tick {name}: {e!r}")
            return
        if d is None:
            replica.daemons.pop(name, None)  # the daemon ends: the object is gone
            return
        if not deleting:
            self.checker.after_tick(self.store.peek("WeightRefit", NS, name), began)
        # When kopf's daemon (handlers.refit_daemon) would tick again unless woken.
        interval = DORMANT_INTERVAL if d.dormant else IDLE_INTERVAL if d.idle else ACTIVE_INTERVAL
        replica.due[name] = self.clock.elapsed + interval
        self._note(f"{replica.name} {name}: {d.status.phase} {d.status.updated_pods}/"
                   f"{d.status.target_pods}")  # fmt: skip
        if deleting and d.release_finalizer:
            try:
                self.store.patch("WeightRefit", NS, name, {"metadata": {"finalizers": None}})
                self._note(f"{replica.name} released the finalizer of {name}")
            except ApiException:
                pass

    def _deliver(self, replica: Replica, faults: bool = True) -> None:
        # A watch is late, never out of order: what is held back is the newest part of the
        # stream (held earlier, then queued since), and it is delivered before anything newer.
        if not self._active(replica):
            return  # its watch waits (a frozen process reads nothing; a standby has none)
        events, replica.held, replica.feed[:] = replica.held + replica.feed, [], []
        if faults and "watch_delay" in self.on and events and self.rng.random() < 0.3:
            k = self.rng.randrange(len(events) + 1)
            replica.held, events = events[k:], events[:k]
            self._note(f"{replica.name} watch: {len(replica.held)} held back")
        if faults and "watch_coalesce" in self.on and self.rng.random() < 0.5:
            last: dict[str, Event] = {}
            for e in events:
                last[e.doc["metadata"]["uid"]] = e
            if len(last) < len(events):
                self._note(f"{replica.name} watch: {len(events)} coalesced to {len(last)}")
            events = [e for e in events if last[e.doc["metadata"]["uid"]] is e]
        for e in events:
            name = e.doc["metadata"]["name"]
            if faults and "watch_drop" in self.on and self.rng.random() < 0.2:
                self._note(f"{replica.name} watch: {e.type} {name} dropped")
                continue
            deleted = e.type == "DELETED"
            replica.engine.observe(clone(e.doc), deleted=deleted)
            if deleted:
                replica.daemons.pop(name, None)
            else:
                replica.daemons[name] = e.doc["metadata"]["uid"]

    # --------------------------------------------------------------------- faults
    def _pods(self) -> list[dict[str, Any]]:
        return self.store.scan("Pod", NS)

    async def _fault(self, kind: str) -> None:
        r = self.rng
        pods = self._pods()
        pod = r.choice(pods) if pods else None
        ip = pod["status"].get("podIP", "") if pod else ""
        if ip not in self.sim.pods:  # a Pending pod (group_member_pending): no process yet
            pod = None
        name = pod["metadata"]["name"] if pod else ""
        if kind == "worker_refusal" and pod:
            code = r.choice(["CheckpointMissing", "ManifestMismatch", "TensorMismatch",
                             "CheckpointChanged", "LoadFailed"])  # fmt: skip
            self.sim.set_fault(ip, RPC_LOAD, "error", code=code, times=1)
            self._note(f"fault: {name} refuses its next load ({code})")
        elif kind == "load_touched" and pod:
            self.sim.set_fault(ip, RPC_LOAD, "touch")
            self._note(f"fault: {name}'s next load fails after touching the model")
        elif kind == "worker_timeout" and pod:
            step = r.choice([RPC_LOAD, "sleep", "wake_up", "update_weight_version",
                             "completions", RPC_INFO, "pause"])  # fmt: skip
            late = r.choice(["delay", "delay", "hang"])
            self.sim.set_fault(ip, step, late, value=r.choice([6.0, 12.0, 30.0]), times=1)
            self._note(f"fault: {name} answers {step} late ({late})")
        elif kind == "worker_crash" and pod:
            step = r.choice([RPC_LOAD, "sleep", "wake_up", "completions", "update_weight_version",
                             "refit_ready", "resume", RPC_STAGE])  # fmt: skip
            after = r.choice([0.5, 2.0, 10.0])
            self.sim.set_fault(ip, step, "crash", value=after, times=1)
            self._note(f"fault: {name} crashes at its next {step}, back after {after}s")
        elif kind == "pod_restart" and pod:
            sim = self.sim.pods[ip]
            if sim.up:
                await self.sim.crash(sim)
                await self.sim.restart(sim)
                self._note(f"fault: {name}'s container restarted")
        elif kind == "pod_relabel" and pod:
            labels = ELSEWHERE if pod["metadata"]["labels"] == FLEET else FLEET
            self.store.patch("Pod", NS, name, {"metadata": {"labels": {"app": labels["app"]}}})
            self._note(f"fault: {name} relabelled app={labels['app']}")
        elif kind == "pod_replace" and pod:
            await self.sim.crash(self.sim.pods[ip])
            self.store.remove("Pod", NS, name)
            self._note(f"fault: {name} deleted")
            await asyncio.sleep(r.choice((0.0, 0.5, 2.0)))
            self._create_pod(name, pod["metadata"]["labels"])
        elif kind == "pod_ip_change" and pod:
            await self.sim.crash(self.sim.pods[ip])
            new_ip = self._new_pod_process()
            doc = self.store.objects[("Pod", NS, name)]
            statuses = doc["status"]["containerStatuses"]
            self.store.patch_pod_status(NS, name, {"status": {
                "podIP": new_ip,
                "containerStatuses": [{**statuses[0], "started": True, "restartCount":
                                       statuses[0]["restartCount"] + 1}],
            }})  # fmt: skip
            self._note(f"fault: {name} moved from {ip} to {new_ip}")
        elif kind == "refit_same_second":
            if self.refits + 2 <= self.cfg.max_refits + 2:
                k = self.refits
                self._create_refit(f"wr-{k + 2:03d}z")
                self._create_refit(f"wr-{k + 2:03d}a")  # newer, but first by name
        elif kind == "refit_delete":
            refits = self.store.scan("WeightRefit", NS)
            if refits:
                victim = r.choice(refits)["metadata"]["name"]
                self.store.delete("WeightRefit", NS, victim)
                self._note(f"fault: refit {victim} deleted")
        elif kind == "refit_spec_update":
            refits = self.store.scan("WeightRefit", NS)
            if refits:
                victim = r.choice(refits)["metadata"]["name"]
                seq = {"sleepLevel": r.choice([0, 1]), "retries": r.choice([0, 1, 3])}
                self.store.patch("WeightRefit", NS, victim, {"spec": {"sequence": seq}})
                self._note(f"fault: refit {victim} spec.sequence -> {seq}")
        elif kind == "history_gc":
            if self.refits < self.cfg.max_refits + 2:
                self._create_refit()
        elif kind == "operator_restart":
            old = r.choice(self.replicas)
            await self._stop(old)
            self._spawn(old, f"fault: operator {old.name} died")
        elif kind == "lease_expiry":
            victim = r.choice(self.replicas)
            if victim.thawed.is_set():
                seconds = r.choice((2.0, 6.0, 11.0, 20.0, 45.0))
                victim.thawed.clear()
                asyncio.get_running_loop().call_later(seconds, self._thaw, victim)
                self._note(f"fault: {victim.name} frozen for {seconds}s")
        elif kind == "lease_delete":
            inst = r.choice(sorted({x.installation for x in self.replicas}))
            if self.store.peek("Lease", LEASE_NS, inst) is not None:
                self.store.delete("Lease", LEASE_NS, inst)
                self._note(f"fault: Lease {LEASE_NS}/{inst} deleted")
        elif kind in ("watch_delay", "watch_drop", "watch_coalesce", "two_installations",
                      "pod_groups"):  # fmt: skip
            self._deliver(r.choice(self.replicas))
        elif kind == "adapter_refits":
            if self.refits < self.cfg.max_refits + 2:
                self._create_adapter_refit()
        elif kind == "adapter_bad":
            if self.refits < self.cfg.max_refits + 2:
                self._create_adapter_refit(bad=True)
        elif kind == "adapter_fail" and pod:
            how = r.choice(["staged", "swap"])
            self.sim.adapter_faults[ip] = how
            self._note(f"fault: {name}'s next {how} adapter load goes wrong")
        elif kind == "weights_skew" and pod:
            self.sim.set_fault(ip, "weight_checker", "skew", value=name, times=1)
            self._note(f"fault: {name}'s next weight read-back differs from its peers'")
        elif kind.startswith("group_"):
            await self._group_fault(kind)
        elif kind == "drafter_stale":
            how = r.choice(["stale", "stale", "missing", "load"])
            if how == "load" and pod:
                self.sim.drafter_faults.add(ip)
                self._note(f"fault: {name}'s next load leaves its drafter as it was")
            elif how != "load" and self.refits < self.cfg.max_refits + 2:
                self._create_refit(adapters=False, drafter=how)
        elif kind == "broadcast_rounds":
            if self.refits < self.cfg.max_refits + 2:
                self._create_broadcast_refit()

    def _members(self, leaders: bool) -> list[dict[str, Any]]:
        return [p for p in self._pods()
                if ((p["metadata"].get("labels") or {}).get(LWS_INDEX_LABEL) == LEADER_INDEX)
                == leaders]  # fmt: skip

    async def _group_fault(self, kind: str) -> None:
        """A pod group's member restarts, goes, comes back, or waits Pending (the
        LeaderWorkerSet controller recreates a deleted pod under its name)."""
        r = self.rng
        if kind == "group_leader_replace":
            pods = self._members(leaders=True)
            claimed = [p for p in pods if CLAIM_ANNOTATION in p["metadata"].get("annotations", {})]
            pods = claimed or pods  # mid-pass where a pass runs
        else:
            pods = self._members(leaders=False)
        if not pods:
            return
        pod = r.choice(pods)
        name, labels = pod["metadata"]["name"], pod["metadata"]["labels"]
        sim = self.sim.pods.get(pod["status"].get("podIP", ""))
        if kind == "group_member_restart":
            if sim is not None and sim.up:
                await self.sim.crash(sim)
                await self.sim.restart(sim)
                self._note(f"fault: member {name}'s container restarted")
            return
        if sim is not None:
            await self.sim.crash(sim)
        self.store.remove("Pod", NS, name)
        self._note(f"fault: {kind}: {name} deleted")
        loop = asyncio.get_running_loop()
        if kind in ("group_member_replace", "group_leader_replace"):
            await asyncio.sleep(r.choice((0.0, 0.5, 2.0)))
            self._create_pod(name, labels)
        elif kind == "group_member_delete":
            loop.call_later(r.choice((1.0, 5.0, 20.0)), self._recreate, name, labels)
        elif kind == "group_member_pending":
            body = pod_body(name, "", labels)
            body["status"] = {"phase": "Pending", "containerStatuses": [
                {"name": "vllm", "restartCount": 0, "started": False}]}  # fmt: skip
            self.store.create("Pod", NS, body)
            self._note(f"pod {name} created Pending")
            loop.call_later(r.choice((5.0, 20.0, 60.0)), self._scheduled, name)

    def _recreate(self, name: str, labels: dict[str, str]) -> None:
        if self.store.peek("Pod", NS, name) is None:
            self._create_pod(name, labels)

    def _scheduled(self, name: str) -> None:
        """A Pending pod is scheduled: it runs, with an address and a started container."""
        doc = self.store.peek("Pod", NS, name)
        if doc is None or doc["status"].get("phase") != "Pending":
            return
        ip = self._new_pod_process()
        self.store.patch_pod_status(NS, name, {"status": {
            "phase": "Running", "podIP": ip,
            "containerStatuses": [{"name": "vllm", "restartCount": 0, "started": True}],
        }})  # fmt: skip
        self._note(f"pod {name} scheduled: Running at {ip}")

    def _thaw(self, replica: Replica) -> None:
        if not replica.thawed.is_set():
            replica.thawed.set()
            self._note(f"{replica.name} thaws")

    def _kubelet_crashed(self, ip: str) -> None:
        self._container(ip, started=False)

    def _kubelet_restarted(self, ip: str) -> None:
        self._container(ip, started=True, restarted=True)

    def _container(self, ip: str, started: bool, restarted: bool = False) -> None:
        for (kind, _, _), doc in sorted(self.store.objects.items()):
            if kind == "Pod" and doc["status"].get("podIP") == ip:
                status = dict(doc["status"]["containerStatuses"][0])
                status["started"] = started
                status["restartCount"] += 1 if restarted else 0
                self.store.patch_pod_status(
                    NS, doc["metadata"]["name"], {"status": {"containerStatuses": [status]}}
                )
                self._note(f"kubelet: {doc['metadata']['name']} started={started}")
                return

    # ------------------------------------------------------------------- liveness
    async def _quiesce(self) -> None:
        """Faults stop: every pod process comes back, every watch delivers and relists,
        and kopf's daemons tick as they do (handlers.refit_daemon: after an active tick in a
        second, an idle one in 5, a dormant one in 60, or at once when the engine wakes the
        refit); every pod must then reach its target."""
        self.faulting = False
        self._note("faults stop")
        for _, pod in sorted(self.sim.pods.items()):
            pod.faults.clear()
        self.sim.adapter_faults.clear()
        self.sim.drafter_faults.clear()
        await asyncio.sleep(35.0)  # answers in flight arrive or time out; crashed pods restart
        for replica in self.replicas:  # frozen processes run again
            self._thaw(replica)
        for ip, pod in sorted(self.sim.pods.items()):
            if pod.up and self.sim.busy(ip):  # hung: the kubelet's liveness probe restarts it
                await self.sim.crash(pod)
                await self.sim.restart(pod)
                self._note(f"kubelet: restarted the hung container at {ip}")
        for replica in list(self.replicas):
            if not self._active(replica):
                continue  # a standby, or a process starting: it lists when it leads
            self._deliver(replica, faults=False)
            try:
                await replica.engine.sync([NS])  # a watch restarts with a list
            except LeadershipLost:
                continue
            for d in self.store.scan("WeightRefit", NS):
                replica.daemons[d["metadata"]["name"]] = d["metadata"]["uid"]
            replica.due.clear()  # every daemon ticks once now
        deadline = self.clock.elapsed + self.cfg.liveness_seconds
        while self.clock.elapsed < deadline:
            for replica in list(self.replicas):
                if not self._active(replica):
                    continue
                self._deliver(replica, faults=False)
                for name, uid in sorted(replica.daemons.items()):
                    st = replica.engine.refits.get(uid)
                    woken = st is not None and st.wake.is_set()
                    if woken or replica.due.get(name, 0.0) <= self.clock.elapsed:
                        self._tick(replica, name)  # clears the wake (a hand-off's turn)
            await asyncio.sleep(ACTIVE_INTERVAL)
            if self.checker.converged() is None:
                self._note("converged")
                return
            self.checker.check_state()
            if self.checker.violations:
                return
        known = {r.name: sorted(k.name for k in r.engine.index.known.values())
                 for r in self.replicas if r.leading}  # fmt: skip
        self.checker.violate("liveness", f"{self.checker.converged()}; indexes: {known}")

    async def _stop(self, replica: Replica) -> None:
        """The process is gone: everything it runs ends where it is."""
        replica.leading = False
        tasks = [t for st in replica.engine.refits.values()
                 for t in st.passes.running()]  # fmt: skip
        tasks += list(replica.ticking.values())
        if replica.life is not None and replica.life is not asyncio.current_task():
            tasks.append(replica.life)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        # By identity: another process's feed may equal this one (both empty).
        self.store.feeds[:] = [f for f in self.store.feeds if f is not replica.feed]

    async def _stop_all(self) -> None:
        for replica in self.replicas:
            await self._stop(replica)
        self.session.close()
        # Containers still due to come back, trainers still sending
        for task in [*self.sim.restart_tasks, *self.trainers]:
            task.cancel()
        await asyncio.sleep(0)


class _ProcessClient(WorkerClient):
    """WorkerClient in one operator process: a frozen process sends nothing; thawed, its
    next request runs the lease check (``before_call``) before it is sent."""

    thawed: asyncio.Event

    async def _request(self, *args: Any, **kw: Any) -> Any:
        if not self.thawed.is_set():
            await self.thawed.wait()
        return await super()._request(*args, **kw)


class _ProcessSession:
    """One operator process's connections to the pods: each request is seen as it leaves."""

    def __init__(self, session: InProcessSession, on_send: Callable[[str], None]) -> None:
        self.session, self.on_send = session, on_send

    def request(self, method: str, url: str, **kw: Any) -> Any:
        self.on_send(f"{method} {url}")
        return self.session.request(method, url, **kw)


def _workers(session: _ProcessSession, thawed: asyncio.Event) -> Any:
    def make(url: str, **kw: Any) -> WorkerClient:
        client = _ProcessClient(url, http=session, **kw)  # type: ignore[arg-type]
        client.thawed = thawed
        return client

    return make


class _InlinePool:
    """refit_worker.checkpoint's digest pool without threads: each of the explorer's
    checkpoints is one small shard, and a pool per staging (threads started and joined in
    real time) cost more than the rest of a load."""

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        return (fn(x) for x in items)


@contextlib.contextmanager
def _inline_digests() -> Iterator[None]:
    @contextlib.contextmanager
    def pool(n_files: int) -> Iterator[_InlinePool]:
        yield _InlinePool()

    # Both users of the pool bound it by name (from ... import digest_pool).
    saved = checkpoint_manifest.digest_pool, checkpoint_staging.digest_pool
    checkpoint_manifest.digest_pool = pool  # type: ignore[assignment]
    checkpoint_staging.digest_pool = pool  # type: ignore[assignment]
    try:
        yield
    finally:
        checkpoint_manifest.digest_pool, checkpoint_staging.digest_pool = saved


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The operator logs every refused step; thousands of schedules need none of it."""
    log = logging.getLogger("refit_operator")
    level, log.level = log.level, logging.CRITICAL + 1
    try:
        yield
    finally:
        log.level = level


def run_schedule(config: Config) -> Result:
    """Run one schedule on a virtual-time loop of its own; deterministic in ``config``."""
    random.seed(config.seed)  # the simulator scores garbage with the module's generator
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    try:
        with times.using(clock), _quiet(), _inline_digests():

            async def main() -> Result:
                return await Explorer(config, clock).run()

            return loop.run_until_complete(main())
    finally:
        loop.close()
