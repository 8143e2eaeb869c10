"""Suite `scale`: the real `refit-operator` process against a real kube-apiserver + etcd, with
simulated workers (one subprocess, one loopback address per pod, no added latency).

Per fleet size and strategy: wall time from `create WeightRefit` to phase Succeeded (every
pod probed and passed, checked in the status and in each simulated pod's version), operator
CPU seconds and peak RSS (/proc VmHWM of a fresh operator process per run), and API-server
requests per pod by verb, from the server's own apiserver_request_total before/after, minus
the requests this harness itself made in that window (one create, its status polls).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from bench import apiserver
from bench.results import Metric, summarize
from tests.support.controlplane import ControlPlane, kill_group
from tests.support.pods import register_pod
from tests.support.simworker import SimFleet, make_sim_checkpoint

OPERATOR = Path(sys.executable).with_name("refit-operator")
PY_SPY = Path(sys.executable).with_name("py-spy")
LABELS = {"app": "bench"}
GROUP, VERSION, PLURAL = "refit.rollout.dev", "v1alpha1", "weightrefits"
STRATEGIES = {
    "AllAtOnce": {"type": "AllAtOnce"},
    "Rolling25": {"type": "Rolling", "maxUnavailable": "25%"},
}
POLL_SECONDS = 0.25


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

    def per_pod(self, value: float) -> float:
        return value / self.pods


class Bench:
    def __init__(self, cp: ControlPlane, work: Path, profile: Path | None = None) -> None:
        self.cp, self.work = cp, work
        self.profile = profile  # py-spy flame data of each operator run goes here
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

    def make_pods(self, ns: str, ips: list[str]) -> None:
        def one(i_ip: tuple[int, str]) -> None:
            i, ip = i_ip
            register_pod(self.core, ns, f"pod-{i}", ip, labels=LABELS,
                         image="vllm/vllm-openai:bench")  # fmt: skip

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, enumerate(ips)))

    def start_operator(self, ns: str, lease: str) -> subprocess.Popen[bytes]:
        log = (self.work / f"{lease}.log").open("wb")
        wrap: list[str] = []
        if self.profile is not None:
            self.profile.mkdir(parents=True, exist_ok=True)
            out = self.profile / f"{lease}.txt"
            # Collapsed stacks (one line per stack, sample count last): grep-able, and
            # flamegraph tools read them. --idle off: only time the operator spends on CPU.
            wrap = [str(PY_SPY), "record", "--format", "raw", "--rate", "200", "-o", str(out), "--"]
        with log:
            proc = subprocess.Popen(
                [
                    *wrap,
                    str(OPERATOR),
                    "--kubeconfig",
                    str(self.cp.kubeconfig),
                    "--namespace",
                    ns,
                    "--metrics-port",
                    "0",
                    "--lease-namespace",
                    ns,
                    "--lease-name",
                    lease,
                    "--lease-seconds",
                    "15",
                    "--identity",
                    lease,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        coord: Any = k8s.CoordinationV1Api(self.api)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"operator exited: {self.log_tail(lease)}")
            try:
                if coord.read_namespaced_lease(lease, ns).spec.holder_identity:
                    break
            except k8s.ApiException:
                pass
            time.sleep(0.2)
        else:
            stop(proc)
            raise RuntimeError(f"operator took no lease in 60 s: {self.log_tail(lease)}")
        time.sleep(2.0)  # kopf's watches start after leadership
        return proc

    def log_tail(self, lease: str) -> str:
        return (self.work / f"{lease}.log").read_text(errors="replace")[-3000:]

    def run(
        self, ns: str, fleet: SimFleet, strategy: str, ckpt_root: Path, timeout: float
    ) -> RunResult:
        self.runs += 1
        n = len(fleet.pods)
        version = f"v{self.runs}"
        ckpt = make_sim_checkpoint(ckpt_root / version, version)
        lease = f"bench-{n}-{self.runs}"
        proc = self.start_operator(ns, lease)
        try:
            me = operator_process(proc)
            before = apiserver.request_totals(self.cp)
            cpu0 = sum(me.cpu_times()[:2])
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "WeightRefit",
                "metadata": {"name": version},
                "spec": {
                    "fleet": {"selector": {"matchLabels": LABELS}, "port": fleet.port},
                    "checkpoint": {"path": str(ckpt), "version": version},
                    "strategy": STRATEGIES[strategy],
                },
            }
            t0 = time.monotonic()
            self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
            polls = 0
            doc: dict[str, Any] = {}
            poll = POLL_SECONDS if n <= 100 else 1.0  # a 1000-pod status is ~300 kB
            completed = True
            while True:
                resp = self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, version, _preload_content=False
                )
                doc = json.loads(resp.data)
                polls += 1
                phase = (doc.get("status") or {}).get("phase")
                if phase in ("Succeeded", "Failed", "Halted", "RolledBack"):
                    break
                if time.monotonic() - t0 > timeout:
                    completed = False
                    break
                time.sleep(poll)
            wall = time.monotonic() - t0
            cpu = sum(me.cpu_times()[:2]) - cpu0
            after = apiserver.request_totals(self.cp)
            peak_kib = _vm_hwm_kib(me.pid)
        except BaseException:
            stop(proc)
            raise
        status = doc.get("status") or {}
        stop(proc)
        probed = int(status.get("probeSummary", {}).get("passed", 0))
        if completed:
            if status["phase"] != "Succeeded":
                raise RuntimeError(
                    f"{n} pods {strategy}: {status['phase']}: {status.get('message')}"
                )
            versions = Counter(s["weight_version"] for s in fleet.states().values())
            if probed != n or versions != Counter({version: n}):
                raise RuntimeError(f"{n} pods: {probed} probes passed, versions {dict(versions)}")
        counts = apiserver.diff(after, before)
        # This harness's own requests in the window.
        counts[("POST", PLURAL)] -= 1
        counts[("GET", PLURAL)] -= polls
        counts = +counts
        return RunResult(
            pods=n,
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
        )


def operator_process(proc: subprocess.Popen[bytes]) -> psutil.Process:
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


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        me = operator_process(proc)
        if me.pid != proc.pid:  # py-spy writes its profile once the operator has exited
            me.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
    if proc.poll() is None:
        kill_group(proc.pid, grace=15.0)
        proc.wait()


def run_suite(
    sizes: list[int],
    repeats: dict[int, int],
    log: Any,
    large_timeout: float = 360.0,
    strategies: list[str] | None = None,
    profile: Path | None = None,
) -> tuple[list[Metric], dict]:
    """Measure every (size, strategy) `repeats[size]` times; returns metrics and raw runs."""
    runs: list[RunResult] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="refit-bench-scale-") as tmp:
        work = Path(tmp)
        cp = ControlPlane(work / "cp")
        cp.start()
        bench: Bench | None = None
        try:
            cp.install_crds()
            bench = Bench(cp, work, profile)
            for n in sizes:
                ckpt_root = work / f"ckpt-{n}"
                ckpt_root.mkdir()
                timeout = 120.0 if n <= 100 else large_timeout
                fleet = SimFleet(n, allowed_root=ckpt_root, start_timeout=180)
                try:
                    for rep in range(repeats[n]):
                        for strategy in strategies or list(STRATEGIES):
                            # A fresh namespace per run: no earlier refit or pass in the way.
                            ns = cp.create_namespace(f"bench-{n}")
                            bench.make_pods(ns, [p.ip for p in fleet.pods])
                            try:
                                r = bench.run(ns, fleet, strategy, ckpt_root, timeout=timeout)
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
                                    f"{r.writes / n:.1f} writes/pod {r.verbs}"
                                )
                            if r is None or not r.completed:
                                # Pods left mid-pass: the next run gets a fresh simulator.
                                fleet.close()
                                fleet = SimFleet(n, allowed_root=ckpt_root, start_timeout=180)
                finally:
                    fleet.close()
        finally:
            if bench is not None:
                bench.close()
            cp.stop()
    return metrics_of(runs, sizes), {"runs": [r.__dict__ for r in runs], "failures": failures}


def metrics_of(runs: list[RunResult], sizes: list[int]) -> list[Metric]:
    out: list[Metric] = []
    biggest = max(sizes)
    for strategy in STRATEGIES:
        for n in sizes:
            rs = [r for r in runs if r.pods == n and r.strategy == strategy]
            if not rs:
                continue
            tag = f"{strategy} {n} pods"
            wall_target = "< 30" if (n == 1000 and strategy == "AllAtOnce") else None
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
                    None if partial else "<= 10",
                    partial + _verb_note(rs[0]),
                )
            )
            out.append(
                Metric(
                    f"{tag}: API requests per pod", [sum(r.verbs.values()) / n for r in rs], "req"
                )
            )
            out.append(Metric(f"{tag}: operator peak RSS", [r.peak_rss_mib for r in rs], "MiB"))
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
