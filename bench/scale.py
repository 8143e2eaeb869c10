"""Suite `scale`: the real `refit-operator` process against a real kube-apiserver + etcd, with
simulated workers (one loopback address per pod, no added latency; one simulator subprocess
for up to ~9,500 pods, more above that: ShardedSimFleet, sized by the open-file limit).

Per fleet size and strategy: wall time from `create WeightRefit` to phase Succeeded (every
pod probed and passed, checked in the status and in each simulated pod's version), operator
CPU seconds and peak RSS (/proc VmHWM of a fresh operator process per run), and API-server
requests per pod by verb, from the server's own apiserver_request_total before/after, minus
the requests this harness itself made in that window (one create, its status polls), and the
size of the WeightRefit as the API server returns it (its JSON), largest seen while polling,
and the leader's longest gap between two renewals of its Lease while the refit ran (watched on
the API server: each stored ``spec.renewTime``, which the operator stamps as it sends the
renewal), as a fraction of the lease duration: the leader stops acting once a gap reaches two
thirds of it (leader.Lease.check), so under that bound no refit is lost to its own work.
Beside each run, its bare write floor: the same number of pod status patches made right after
it by a plain client (``write_floor``), so a wall time reads against what the API server and
etcd alone take for those writes on this machine.

The pieces other suites reuse (bench/soak.py): `control_plane` (a temporary control plane
with the CRD and a `Bench` on it), `Bench.start_operator`, `refit_body`, `sim_fleet`,
`operator_process`, `stop`, `raise_fd_limit`.

10,000 pods (`--scale-sizes 10000`) are not among the default sizes: creating the pods,
starting the simulators and the refit take several minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_asyncio.client
import psutil
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from refit_client.refit_document import build_refit
from refit_operator.core import api
from refit_operator.core.api_spec import LWS_GROUP_LABEL, LWS_INDEX_LABEL
from refit_operator.edges import cluster
from refit_operator.edges.leader import DEFAULT_LEASE_SECONDS
from refit_worker.contract import API_GROUP, READINESS_GATE

from bench import apiserver
from bench.results import Metric, summarize
from testbed.controlplane import ControlPlane
from testbed.lease_watch import LeaseRenewals, max_renewal_gap
from testbed.operator_process import OperatorError, OperatorProcess
from testbed.pods import register_pod
from testbed.simworker import make_sim_checkpoint
from testbed.simworker.fleet import SimFleet

PY_SPY = Path(sys.executable).with_name("py-spy")
LABELS = {"app": "bench"}
# The pods run the admin guard, as a fleet's pods do (its token in a Secret the refit names):
# the operator then sends the token and fence, and pools RPCs on each pod's connection
# (CAP_ERRORS_KEEP_CONNECTION), as it does in production.
ADMIN_TOKEN = "bench-admin-token"
ADMIN_SECRET = "bench-admin-token"
GROUP, VERSION, PLURAL = API_GROUP, api.VERSION, api.PLURAL
STRATEGIES = {
    "AllAtOnce": {"type": "AllAtOnce"},
    "Rolling25": {"type": "Rolling", "maxUnavailable": "25%"},
}
POLL_SECONDS = 0.25
LEASE_SECONDS = DEFAULT_LEASE_SECONDS  # the operator's default --lease-seconds
TERMINAL = ("Succeeded", "Failed", "Halted", "RolledBack")
# Open files per simulated pod in a simulator process: its listening socket and the
# connection it accepted (the operator keeps one per pod alive; its own end is one file).
SIM_FDS_PER_POD = 2
# Targets of the issues: a 1000-pod AllAtOnce refit under 30 s; a 10,000-pod one within 60 s,
# at most 2.5 API writes per pod and no renewal gap over half the lease (issue 43; 2-core
# machine); the WeightRefit under 256 KiB at any fleet size.
WALL_TARGETS = {("AllAtOnce", 1000): "< 30", ("AllAtOnce", 10000): "<= 60"}
WRITES_TARGETS = {10000: "<= 2.5"}
WRITES_TARGET = "<= 10"
OBJECT_TARGET_KIB = "< 256"
# The leader's local deadline (leader.Lease.check): two thirds of a lease after a renewal.
RENEWAL_GAP_TARGET = "< 0.667"
RENEWAL_GAP_TARGETS = {10000: "<= 0.5"}


def pod_name(i: int) -> str:
    return f"pod-{i}"


@dataclass
class RunResult:
    pods: int
    strategy: str
    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    requests: dict[str, int]  # "VERB resource" -> count, harness requests removed
    verbs: dict[str, int]
    writes: int
    probed: int
    completed: bool = True  # False: the timeout ended the run (wall_s is then the timeout)
    updated: int = 0
    timeout: float = 0.0
    object_bytes: int = 0  # the WeightRefit's JSON as the API server returned it at the end
    object_bytes_max: int = 0  # the largest of the polls (0: not measured, older runs)
    lease_seconds: int = 0  # the operator's --lease-seconds (0: older runs)
    write_floor_s: float = 0.0  # the run's pod writes by a plain client (0: not measured)
    renewal_gap_max_s: float = 0.0  # longest gap between Lease renewals while the refit ran
    renewals: int = 0  # renewals seen in that window
    group_size: int = 1  # pods per refit unit (spec.fleet.groups; 1: every pod alone)

    def per_pod(self, value: float) -> float:
        return value / self.pods


class Bench:
    def __init__(
        self,
        cp: ControlPlane,
        work: Path,
        profile: Path | None = None,
        lease_seconds: int = LEASE_SECONDS,
    ) -> None:
        self.cp, self.work = cp, work
        self.profile = profile  # py-spy flame data of each operator run goes here
        self.lease_seconds = lease_seconds  # the operator's --lease-seconds
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(str(cp.kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = 16
        self.api = k8s.ApiClient(cfg)
        # Typed as Any: plain dict bodies and _preload_content=False answers.
        self.core: Any = k8s.CoreV1Api(self.api)
        self.custom: Any = k8s.CustomObjectsApi(self.api)
        self.runs = 0

    def close(self) -> None:
        self.api.close()

    def make_pods(self, ns: str, ips: list[str], group_size: int = 1) -> None:
        """The fleet's Pod objects; with ``group_size`` > 1, in groups of that many labelled as
        LeaderWorkerSet labels them (the first of each its leader)."""

        def one(i_ip: tuple[int, str]) -> None:
            i, ip = i_ip
            labels = dict(LABELS)
            if group_size > 1:
                labels[LWS_GROUP_LABEL] = f"g{i // group_size}"
                labels[LWS_INDEX_LABEL] = str(i % group_size)
            register_pod(self.core, ns, pod_name(i), ip, labels=labels,
                         image="vllm/vllm-openai:bench")  # fmt: skip

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, enumerate(ips)))

    def start_operator(
        self, ns: str, lease: str, extra_args: Sequence[str] = ()
    ) -> OperatorProcess:
        """The operator for namespace ns, holding Lease `lease` (log: work/<lease>.log);
        returns once it holds the lease and its watches have had time to start."""
        wrap: list[str] = []
        if self.profile is not None:
            self.profile.mkdir(parents=True, exist_ok=True)
            out = self.profile / f"{lease}.txt"
            # Collapsed stacks (one line per stack, sample count last): grep-able, and
            # flamegraph tools read them. --idle off: only time the operator spends on CPU.
            wrap = [str(PY_SPY), "record", "--format", "raw", "--rate", "200", "-o", str(out), "--"]
        op = OperatorProcess.start(
            self.cp.kubeconfig, ns, self.work / f"{lease}.log", identity=lease,
            lease_name=lease, lease_seconds=self.lease_seconds, extra_args=extra_args, wrap=wrap,
        )  # fmt: skip
        coord: Any = k8s.CoordinationV1Api(self.api)

        def leads() -> bool:
            try:
                return bool(coord.read_namespaced_lease(lease, ns).spec.holder_identity)
            except k8s.ApiException:
                return False

        try:
            op.wait_until(leads, timeout=60, what="holding its lease")
        except OperatorError:
            stop(op)
            raise
        time.sleep(2.0)  # kopf's watches start after leadership
        return op

    def log_tail(self, lease: str) -> str:
        return (self.work / f"{lease}.log").read_text(errors="replace")[-3000:]

    def lease_log(self, lease: str) -> list[str]:
        """What the operator logged about its Lease (why it stopped leading)."""
        text = (self.work / f"{lease}.log").read_text(errors="replace")
        return [line for line in text.splitlines() if "refit_operator.edges.leader" in line][-5:]

    def get_refit(self, ns: str, name: str) -> tuple[dict[str, Any], int]:
        """The WeightRefit and the size in bytes of its JSON as the API server sent it."""
        resp = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name, _preload_content=False
        )
        data = resp.data
        doc: dict[str, Any] = json.loads(data)
        return doc, len(data)

    def wait_refits_served(self, timeout: float = 30.0) -> None:
        """Until WeightRefits can be listed. Established is not enough: right after it the
        API server may answer 429 "storage is (re)initializing" for a moment, and an operator
        started then exits (its first list at start-up is not retried)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1)
                return
            except k8s.ApiException as e:
                if e.status != 429 or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def make_admin_secret(self, ns: str) -> None:
        """The Secret with the pods' admin token that the bench's refits name."""
        token = base64.b64encode(ADMIN_TOKEN.encode()).decode()
        body = {"metadata": {"name": ADMIN_SECRET}, "data": {"token": token}}
        self.core.create_namespaced_secret(ns, body)

    def create_refit(self, ns: str, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)

    def run(
        self,
        ns: str,
        fleet: ShardedSimFleet,
        strategy: str,
        ckpt_root: Path,
        timeout: float,
        group_size: int = 1,
    ) -> RunResult:
        self.runs += 1
        n = len(fleet.pods)
        units = n // group_size  # refit units: the groups' leaders (or every pod)
        version = f"v{self.runs}"
        ckpt = make_sim_checkpoint(ckpt_root / version, version)
        lease = f"bench-{n}-{self.runs}"
        proc = self.start_operator(ns, lease)
        renewals = LeaseRenewals(self.api, ns, lease)
        try:
            me = operator_process(proc)
            before = apiserver.request_totals(self.cp)
            cpu0 = sum(me.cpu_times()[:2])
            groups: dict[str, Any] = {"fleet": {"groups": {}}} if group_size > 1 else {}
            body = refit_body(version, fleet.port, ckpt, version, STRATEGIES[strategy], **groups)
            t0, started = time.monotonic(), time.time()
            self.create_refit(ns, body)
            polls = size = size_max = 0
            doc: dict[str, Any] = {}
            poll = POLL_SECONDS if n <= 100 else 1.0
            completed = True
            while True:
                doc, size = self.get_refit(ns, version)
                size_max = max(size_max, size)
                polls += 1
                phase = (doc.get("status") or {}).get("phase")
                if phase in TERMINAL:
                    break
                if proc.poll() is not None:
                    gap, seen = max_renewal_gap(renewals.times, started, time.time())
                    raise RuntimeError(
                        f"the operator exited with {proc.returncode} after "
                        f"{time.monotonic() - t0:.1f} s ({status_line(doc)}; longest gap "
                        f"between Lease renewals {gap:.2f} s of --lease-seconds "
                        f"{self.lease_seconds}, {seen} renewals); its Lease: "
                        + " | ".join(self.lease_log(lease))
                        + "; its log ends: "
                        + " | ".join(self.log_tail(lease).splitlines()[-3:])
                    )
                if time.monotonic() - t0 > timeout:
                    completed = False
                    break
                time.sleep(poll)
            wall, ended = time.monotonic() - t0, time.time()
            cpu = sum(me.cpu_times()[:2]) - cpu0
            after = apiserver.request_totals(self.cp)
            peak_kib = _vm_hwm_kib(me.pid)
        except BaseException:
            renewals.stop()
            stop(proc)
            raise
        renew_times = renewals.stop()
        gap, seen = max_renewal_gap(renew_times, started, ended)
        status = doc.get("status") or {}
        stop(proc)
        probed = int(status.get("probeSummary", {}).get("passed", 0))
        if completed:
            if status["phase"] != "Succeeded":
                raise RuntimeError(
                    f"{n} pods {strategy}: {status['phase']}: {status.get('message')}"
                )
            # Only the leaders are called: the followers' simulators keep their boot version.
            versions = Counter(s["weight_version"] for s in fleet.states().values())
            want = Counter(
                {version: units, "default": n - units} if group_size > 1 else {version: n}
            )
            if probed != units or versions != +want:
                raise RuntimeError(f"{n} pods: {probed} probes passed, versions {dict(versions)}")
        counts = apiserver.diff(after, before)
        # This harness's own requests in the window.
        counts[("POST", PLURAL)] -= 1
        counts[("GET", PLURAL)] -= polls
        # and its Lease watch (the operator only reads, creates and replaces its Lease)
        counts[("LIST", "leases")] = counts[("WATCH", "leases")] = 0
        counts = +counts
        pod_writes = counts[("PATCH", "pods/status")]
        floor = write_floor(self.cp.kubeconfig, ns, [pod_name(i) for i in range(n)], pod_writes)
        return RunResult(
            pods=n,
            group_size=group_size,
            strategy=strategy,
            wall_s=wall,
            cpu_s=cpu,
            peak_rss_mib=peak_kib / 1024,
            requests={f"{v} {r}": c for (v, r), c in sorted(counts.items())},
            verbs=apiserver.by_verb(counts),
            writes=apiserver.writes(counts),
            probed=probed,
            completed=completed,
            updated=int(status.get("updatedPods", 0)),
            timeout=timeout,
            object_bytes=size,
            object_bytes_max=size_max,
            lease_seconds=self.lease_seconds,
            renewal_gap_max_s=gap,
            renewals=seen,
            write_floor_s=floor,
        )


WRITE_FLOOR_CONCURRENCY = 100  # the operator's API client pools as many connections


def write_floor(kubeconfig: Path, ns: str, pods: list[str], writes: int) -> float:
    """Seconds a plain client takes to make ``writes`` pod status patches on ``pods`` (round
    robin), shaped like a pass's record (a progress annotation and the readiness condition),
    through the operator's own API client set-up, at most WRITE_FLOOR_CONCURRENCY at once:
    the API server's and etcd's share of a run's pod writes on this machine, with no operator
    work around them. 0.0 when the run wrote no pod."""
    if not writes or not pods:
        return 0.0

    async def patch_all() -> float:
        api_client = await cluster.connect(str(kubeconfig))
        # Typed as Any: with _preload_content=False the generated signatures no longer hold.
        core: Any = kubernetes_asyncio.client.CoreV1Api(api_client)
        gate = asyncio.Semaphore(WRITE_FLOOR_CONCURRENCY)

        async def one(i: int) -> None:
            body = {
                "metadata": {"annotations": {f"{GROUP}/bench-floor": json.dumps({"write": i})}},
                "status": {"conditions": [{
                    "type": READINESS_GATE, "status": "True" if i % 2 else "False",
                    "reason": "BenchFloor", "message": f"write {i}",
                }]},
            }  # fmt: skip
            async with gate:
                resp = await core.patch_namespaced_pod_status(
                    pods[i % len(pods)], ns, body, _preload_content=False,
                    _content_type=cluster.SMP,
                )  # fmt: skip
                await cluster.read_json(resp)

        try:
            t0 = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(writes)))
            return time.monotonic() - t0
        finally:
            await api_client.close()

    return asyncio.run(patch_all())


def status_line(doc: dict[str, Any]) -> str:
    status = doc.get("status") or {}
    return (
        f"phase {status.get('phase')}, {status.get('updatedPods', 0)} pods updated, "
        f"reason {status.get('reason')}"
    )


def refit_body(
    name: str, port: int, checkpoint: Path, version: str, strategy: dict[str, Any], **spec: Any
) -> dict[str, Any]:
    """A WeightRefit for the bench fleet (pods labelled LABELS); spec: further spec fields."""
    return build_refit(name, str(checkpoint), version, fleet_selector=LABELS, port=port,
                       admin_token_secret=ADMIN_SECRET,
                       spec_fields={"strategy": strategy, **spec})  # fmt: skip


def raise_fd_limit(want: int) -> int:
    """Raise this process's RLIMIT_NOFILE (inherited by the simulator, the operator and the
    control plane it starts) to at least `want` if it can; returns the soft limit now.

    A simulator holds SIM_FDS_PER_POD files per pod, the operator one (its connection)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return soft
    if hard == resource.RLIM_INFINITY or hard >= want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    try:  # raising the hard limit needs root (CAP_SYS_RESOURCE), and at most fs.nr_open
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        return want
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard


def operator_process(proc: OperatorProcess) -> psutil.Process:
    """The operator itself: the process started, or py-spy's child when profiling."""
    me = psutil.Process(proc.pid)
    deadline = time.monotonic() + 10
    while me.name() == "py-spy" and time.monotonic() < deadline:
        kids = me.children()
        if kids:
            return kids[0]
        time.sleep(0.05)
    return me


def _vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for {pid}")


def stop(proc: OperatorProcess) -> None:
    if proc.poll() is None:
        me = operator_process(proc)
        if me.pid != proc.pid:  # py-spy writes its profile once the operator has exited
            me.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
    proc.stop(grace=15.0)


@contextlib.contextmanager
def fresh_control_plane(prefix: str) -> Iterator[tuple[ControlPlane, Path]]:
    """A fresh control plane (etcd + kube-apiserver, the WeightRefit CRD installed) and a
    temporary folder it lives in; both are stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        cp = ControlPlane(work / "cp")
        cp.start()
        try:
            cp.install_crds()
            yield cp, work
        finally:
            cp.stop()


@contextlib.contextmanager
def control_plane(
    prefix: str, profile: Path | None = None, lease_seconds: int = LEASE_SECONDS
) -> Iterator[Bench]:
    """A fresh control plane and a Bench on it; everything is stopped and removed on exit."""
    with fresh_control_plane(prefix) as (cp, work):
        bench = Bench(cp, work, profile, lease_seconds)
        try:
            bench.wait_refits_served()
            yield bench
        finally:
            bench.close()


def run_suite(
    sizes: list[int],
    repeats: dict[int, int],
    log: Any,
    large_timeout: float = 360.0,
    strategies: list[str] | None = None,
    profile: Path | None = None,
    lease_seconds: int = LEASE_SECONDS,
    group_size: int = 1,
) -> tuple[list[Metric], dict]:
    """Measure every (size, strategy) `repeats[size]` times; returns metrics and raw runs.
    With ``group_size`` > 1 each size counts pods in groups of that many (spec.fleet.groups),
    so the operator refits size / group_size units."""
    runs: list[RunResult] = []
    failures: list[str] = []
    # One simulator for the whole fleet if the limit can be raised so far; if not,
    # ShardedSimFleet splits it. The operator needs one file per pod.
    fds = raise_fd_limit(SIM_FDS_PER_POD * max(sizes) + 1024)
    if fds < max(sizes) + 1024:
        log(f"scale: the open-file limit {fds} is too low for {max(sizes)} pods' connections")
    with control_plane("refit-bench-scale-", profile, lease_seconds) as bench:
        for n in sizes:
            ckpt_root = bench.work / f"ckpt-{n}"
            ckpt_root.mkdir()
            timeout = 120.0 if n <= 100 else large_timeout
            fleet = sim_fleet(n, ckpt_root)
            try:
                for rep in range(repeats[n]):
                    for strategy in strategies or list(STRATEGIES):
                        # A fresh namespace per run: no earlier refit or pass in the way.
                        ns = bench.cp.create_namespace(f"bench-{n}")
                        bench.make_admin_secret(ns)
                        bench.make_pods(ns, [p.ip for p in fleet.pods], group_size)
                        try:
                            r = bench.run(ns, fleet, strategy, ckpt_root, timeout=timeout,
                                          group_size=group_size)  # fmt: skip
                        except Exception as e:  # recorded; the other runs still count
                            failures.append(f"{n} pods {strategy} #{rep + 1}: {e}"[:400])
                            log(f"scale: FAILED RUN {failures[-1]}")
                            r = None
                        if r is not None:
                            runs.append(r)
                            done = "" if r.completed else f" TIMEOUT ({r.updated}/{n})"
                            log(
                                f"scale: {n} pods {strategy} #{rep + 1}: {r.wall_s:.2f}s "
                                f"wall{done}, {r.cpu_s:.1f}s cpu, {r.peak_rss_mib:.0f} MiB, "
                                f"{r.writes / n:.1f} writes/pod {r.verbs}, object "
                                f"{r.object_bytes_max / 1024:.1f} KiB at most; bare write "
                                f"floor {r.write_floor_s:.2f}s"
                            )
                        if r is None or not r.completed:
                            # Pods left mid-pass: the next run gets a fresh simulator.
                            fleet.close()
                            fleet = sim_fleet(n, ckpt_root)
            finally:
                fleet.close()
    raw = {"runs": [r.__dict__ for r in runs], "failures": failures, "lease_seconds": lease_seconds}
    return metrics_of(runs, sizes), raw


class ShardedSimFleet:
    """n simulated pods in as many simulator subprocesses as the open-file limit needs, all on
    one port (each pod has its own loopback address), so one WeightRefit selects them all.

    One simulator holds two files per pod (its listening socket and the connection the
    operator keeps alive); a process without CAP_SYS_RESOURCE cannot raise its hard limit
    (20,000 here), so 10,000 pods take two simulators."""

    def __init__(self, n: int, ckpt_root: Path, per_shard: int | None = None) -> None:
        if per_shard is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            per_shard = max(1, (soft - 1024) // SIM_FDS_PER_POD)
        sizes = shard_sizes(n, per_shard)
        self.shards: list[SimFleet] = []
        try:
            for size in sizes:
                port = self.shards[0].port if self.shards else 0
                self.shards.append(
                    SimFleet(
                        size,
                        admin_token=ADMIN_TOKEN,
                        allowed_root=ckpt_root,
                        port=port,
                        start_timeout=max(180, size / 20),
                    )
                )
        except BaseException:
            self.close()
            raise
        self.port = self.shards[0].port
        self.pods = [p for shard in self.shards for p in shard.pods]

    def states(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for shard in self.shards:
            out.update(shard.states())
        return out

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def shard_sizes(n: int, per_shard: int) -> list[int]:
    """n pods split evenly over the fewest shards of at most per_shard pods each."""
    shards = -(-n // per_shard)
    return [n // shards + (1 if i < n % shards else 0) for i in range(shards)]


def sim_fleet(n: int, ckpt_root: Path) -> ShardedSimFleet:
    """n simulated pods that load checkpoints under ckpt_root."""
    return ShardedSimFleet(n, ckpt_root)


def metrics_of(runs: list[RunResult], sizes: list[int]) -> list[Metric]:
    out: list[Metric] = []
    if not runs or not sizes:
        return out  # every run failed: the result's notes say why
    biggest = max(sizes)
    for strategy in STRATEGIES:
        for n in sizes:
            rs = [r for r in runs if r.pods == n and r.strategy == strategy]
            if not rs:
                continue
            g = rs[0].group_size
            tag = f"{strategy} {n} pods" + (f" in {n // g} groups of {g}" if g > 1 else "")
            wall_target = WALL_TARGETS.get((strategy, n)) if g == 1 else None
            unfinished = [r for r in rs if not r.completed]
            note = "every pod probed (status + simulated pod version)"
            if unfinished:
                note = (
                    f"{len(unfinished)} of {len(rs)} runs NOT finished at the "
                    f"{unfinished[0].timeout:.0f} s limit (pods updated by then: "
                    f"{[r.updated for r in unfinished]}); such a sample is the limit, a lower bound"
                )
            out.append(
                Metric(
                    f"{tag}: wall apply->Succeeded", [r.wall_s for r in rs], "s", wall_target, note
                )
            )
            # Per-pod costs from finished runs only: an unfinished run did part of the work.
            rs = [r for r in rs if r.completed] or rs
            partial = "" if rs[0].completed else "PARTIAL, the run did not finish: "
            out.append(Metric(f"{tag}: wall per pod", [1000 * r.wall_s / n for r in rs], "ms"))
            out.append(
                Metric(f"{tag}: operator CPU per pod", [1000 * r.cpu_s / n for r in rs], "ms")
            )
            out.append(
                Metric(
                    f"{tag}: API writes per pod",
                    [r.writes / n for r in rs],
                    "req",
                    None if partial else WRITES_TARGETS.get(n, WRITES_TARGET),
                    partial + _verb_note(rs[0]),
                )
            )
            out.append(
                Metric(
                    f"{tag}: API requests per pod", [sum(r.verbs.values()) / n for r in rs], "req"
                )
            )
            out.append(Metric(f"{tag}: operator peak RSS", [r.peak_rss_mib for r in rs], "MiB"))
            floored = [r for r in rs if r.write_floor_s]  # runs before 2026-12-07 lack it
            if floored:
                out.append(
                    Metric(
                        f"{tag}: bare write floor",
                        [r.write_floor_s for r in floored],
                        "s",
                        note="the run's pod status patches made by a plain client "
                        f"({WRITE_FLOOR_CONCURRENCY} at once, the operator's API client set-up) "
                        "right after the run, on the same API server",
                    )
                )
                out.append(
                    Metric(
                        f"{tag}: wall / bare write floor",
                        [r.wall_s / r.write_floor_s for r in floored],
                        "x",
                        note="apply->Succeeded over the floor, each run with its own floor",
                    )
                )
            leased = [r for r in runs if r.pods == n and r.strategy == strategy and r.lease_seconds]
            if leased:
                # Every run, finished or not: a starved renewal is what ends a run early.
                out.append(
                    Metric(
                        f"{tag}: longest gap between Lease renewals / lease duration",
                        [r.renewal_gap_max_s / r.lease_seconds for r in leased],
                        "",
                        RENEWAL_GAP_TARGETS.get(n, RENEWAL_GAP_TARGET),
                        f"--lease-seconds {leased[0].lease_seconds}; longest gaps "
                        f"{[round(r.renewal_gap_max_s, 2) for r in leased]} s over "
                        f"{[r.renewals for r in leased]} renewals; the leader renews every "
                        "sixth of the duration and stops acting at two thirds without one",
                    )
                )
            sized = [r for r in rs if r.object_bytes_max]  # runs before 2026-12-01 lack it
            if sized:
                out.append(
                    Metric(
                        f"{tag}: WeightRefit object size",
                        [r.object_bytes_max / 1024 for r in sized],
                        "KiB",
                        OBJECT_TARGET_KIB,
                        "the largest JSON the API server returned for it while the harness "
                        f"polled; at the end: {[round(r.object_bytes / 1024, 1) for r in sized]} "
                        "KiB",
                    )
                )
        small = [r for r in runs if r.strategy == strategy and r.pods == min(sizes)]
        large = [r for r in runs if r.strategy == strategy and r.pods == biggest]
        if small and large and biggest > min(sizes):
            # Scaling exponent of wall time: 1.0 is linear; below 1 is better than linear.
            import math

            ws = summarize([r.wall_s for r in small]).median
            wl = summarize([r.wall_s for r in large]).median
            k = math.log(wl / ws) / math.log(biggest / min(sizes))
            out.append(
                Metric(
                    f"{strategy}: wall-time growth exponent {min(sizes)}->{biggest}",
                    [k],
                    "",
                    "<= 1.0",
                    "log(wall ratio)/log(size ratio); 1 = linear"
                    + (
                        "; a lower bound: a large run did not finish"
                        if not all(r.completed for r in large)
                        else ""
                    ),
                )
            )
    return out


def _verb_note(r: RunResult) -> str:
    per = {k: round(v / r.pods, 2) for k, v in r.requests.items() if v / r.pods >= 0.005}
    return f"per pod by verb/resource ({r.pods} pods, first run): {per}"
