"""`make demo`: Refit doing its job on real parts, in one command.

    .venv/bin/python -m demo [--pods 3] [--out DIR] [--grpo-steps 8] [--keep]

Starts, on loopback only: a real kube-apiserver + etcd with the WeightRefit CRD, the operator
(the real `refit-operator` process), N real vLLM CPU servers (tiny model, refit_worker plugin,
admin guard, worker extension) registered as Pods with the readiness gate and status.podIP =
each server's own loopback address, and a real Prometheus scraping the operator. Then:

    v1  checkpoint A      AllAtOnce           from the dummy-weights start   -> Succeeded
    v2  checkpoint B      Rolling, canary 1                                  -> Succeeded
    v3  checkpoint mixed  Rolling, canary 1   valid manifest, wrong weights  -> the probe
        rejects the canary, the rollout halts, the canary is rolled back     -> RolledBack
    v4  broadcast of A    AllAtOnce           a trainer process sends A's tensors over
        gloo (refit_operator.tools.client); each pod checks them against the trainer's promise
        before loading, then the probe gates it as for a checkpoint           -> Succeeded
    lora-v1  LoRA adapter "policy" v1 on A, Rolling (spec.adapter): each pod loads and probes
        it under a staged name while serving, then swaps it in; no sleep, no reload
                                                                               -> Succeeded
    GRPO  a short GRPO run through Refit (demo/grpo.py): TRL's GRPOTrainer publishes its
        policy at every step (demo-grpo-step-0..N, broadcast), the pods generate its
        rollouts                                       -> every refit and training Succeeded

with live per-pod progress, a summary table and PNG reports (refit_operator.tools.report; the GRPO
run's reward and refit time per step in grpo.png). Exit 0 only when every outcome is the
expected one, every GRPO step's completions came from that step's version, and every pod
serves the last base weights (v4, the adapter loads beside them; or the GRPO run's last step),
in traffic; otherwise it lists what was not.
Everything started is stopped at the end (also on Ctrl-C); `--keep` leaves it all running
until Ctrl-C and prints how to look at it and the fleet's namespace, selector, port and admin
Secret, with a refit to try from a trainer of one's own.

Runs from a checkout: it is built from the test bed (testbed/), and it is not part of the
installed package. torch and vLLM run only in the child processes, never in this one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from refit_operator.core.views import describe, duration, reason_of, table
from refit_operator.tools.client import RefitClient, RefitFailed, RefitTimeout
from refit_operator.tools.report import render_refit
from refit_worker.contract import READINESS_GATE, TRANSFER_BACKEND

from demo import grpo
from testbed import controlplane, prometheus, vllm_server
from testbed.operator_process import OperatorProcess
from testbed.pods import register_pod
from testbed.tiny_adapter import TinyAdapters
from testbed.tiny_model import TinyModel

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "refit-demo"
LABELS = {"app": "demo-rollout"}
SECRET = "vllm-admin-token"
FIRST_IP = 11  # pods listen on 127.0.0.11, .12, ...
REFIT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Step:
    name: str
    version: str
    checkpoint: str  # key of TinyModel.checkpoints
    strategy: dict[str, Any]
    expect: str  # the phase this step must end in
    what: str
    broadcast: bool = False  # sent by a trainer process instead of read from the directory
    # A LoRA adapter served under this name (spec.adapter); ``checkpoint`` is then a tiny
    # adapter's name (testbed/tiny_adapter.py), built on checkpoint A.
    adapter: str = ""


SCENARIO = (
    Step("demo-v1", "v1", "A", {"strategy": "AllAtOnce"}, "Succeeded",
         "checkpoint A into every pod at once, from the dummy-weights start"),
    Step("demo-v2", "v2", "B", {"strategy": "Rolling", "canary": 1, "max_unavailable": 1},
         "Succeeded", "checkpoint B, rolling, one canary first"),
    Step("demo-v3", "v3", "mixed", {"strategy": "Rolling", "canary": 1, "max_unavailable": 1},
         "RolledBack", "the mixed checkpoint: valid manifest, wrong weights; the probe must "
         "reject it and the fleet must end at v2"),
    Step("demo-v4", "v4", "A", {"strategy": "AllAtOnce"}, "Succeeded",
         "A's tensors broadcast by a trainer process (gloo), checked against its promise",
         broadcast=True),
    Step("demo-lora-v1", "lora-v1", "v1", {"strategy": "Rolling", "max_unavailable": 1},
         "Succeeded", "LoRA adapter 'policy' v1 on A: loaded and probed under a staged name "
         "while each pod serves, then swapped in (no sleep, no reload)", adapter="policy"),
)  # fmt: skip
# The servers take LoRA adapters at runtime (the adapter step): two loaded at once, the served
# one and the one staged beside it.
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


@dataclass
class Result:
    step: Step
    phase: str = ""
    reason: str = ""
    seconds: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)
    report: Path | None = None
    # Seen at any time during the refit: a rollback rewrites the pods' results afterwards.
    pod_reasons: set[str] = field(default_factory=set)
    worst: float = 0.0
    rejected: dict[str, Any] | None = None  # the last status showing a failed probe
    rejected_pods: list[dict[str, Any]] | None = None  # the fleet's Pod objects just then
    rejected_report: Path | None = None
    # The fleet's Pod objects when the refit ended: every pod's record is this refit's then
    # (status.pods lists only the pods that need attention; a later refit replaces records).
    pods: list[dict[str, Any]] | None = None

    def observe(self, status: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> None:
        listed = status.get("pods") or []
        self.pod_reasons |= {p["reason"] for p in listed if p.get("reason")}
        if any((p.get("probe") or {}).get("verdict") == "Fail" for p in listed) and (
            pods is not None or self.rejected is None
        ):
            self.rejected = status
            self.rejected_pods = pods
        worst = (status.get("probeSummary") or {}).get("worstMaxAbsLogprobDiff") or 0.0
        self.worst = max(self.worst, float(worst))

    @property
    def ok(self) -> bool:
        return self.phase == self.step.expect


class DemoError(RuntimeError):
    """The demo could not set something up; the message says what."""


# ------------------------------------------------------------------------------ set-up
def built_in_child(module: str, what: str) -> Path:
    """Build (or find) ``what`` by running the test bed's ``module`` in a child process, which
    prints its root last: torch stays out of this one."""
    proc = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    if proc.returncode != 0:
        raise DemoError(f"building {what} failed:\n{proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def tiny_model_root() -> Path:
    return built_in_child("testbed.tiny_model", "the tiny model")


def tiny_adapters_root() -> Path:
    return built_in_child("testbed.tiny_adapter", "the tiny LoRA adapters")


def common_free_port(ips: list[str]) -> int:
    """One port free on every address (the fleet has one spec.fleet.port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = int(s.getsockname()[1])
        try:
            for ip in ips[1:]:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise DemoError("no port is free on every pod address")


def start_servers(
    stack: ExitStack, model: Any, ips: list[str], port: int, token: str,
    say: Callable[[str], None],
) -> list[Any]:  # fmt: skip
    """Start the vLLM servers in parallel; every one that started is stopped by `stack`."""
    results: dict[str, Any] = {}
    # Servers starting together share the CPUs: the knob is per server (testbed/vllm_server.py).
    timeout = vllm_server.start_timeout(len(ips))

    # The refit-gloo engine receives broadcasts (v4, GRPO); --enable-scale-out serves vLLM's
    # token-in/token-out route, whose weight-version spans the GRPO run checks its rollouts by.
    extra = ["--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND}),
             "--enable-scale-out", *LORA_ARGS]  # fmt: skip

    def start(ip: str) -> None:
        cm: AbstractContextManager[Any] = vllm_server.start_vllm_server(
            model, host=ip, port=port, admin_token=token, extra_args=extra, timeout=timeout,
            progress=say, env=LORA_ENV,
        )  # fmt: skip
        try:
            results[ip] = (cm, cm.__enter__())
        except BaseException as e:  # reported below, after every thread ended
            results[ip] = e

    threads = [threading.Thread(target=start, args=(ip,), daemon=True) for ip in ips]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    servers, errors = [], []
    for ip in ips:
        r = results.get(ip)
        if isinstance(r, tuple):
            stack.push(r[0].__exit__)
            servers.append(r[1])
        else:
            errors.append(f"{ip}: {r}")
    if errors:
        raise DemoError("vLLM server(s) did not start:\n" + "\n".join(errors))
    say(f"{len(servers)} vLLM servers healthy in {time.monotonic() - began:.0f}s")
    return servers


def register_pods(core: Any, servers: list[Any]) -> list[str]:
    """One Pod object per server: the readiness gate, Running, status.podIP = its address."""
    names = [f"rollout-{i}" for i in range(len(servers))]
    for name, server in zip(names, servers, strict=True):
        register_pod(core, NAMESPACE, name, server.host, labels=LABELS,
                     image="refit-worker:cpu-demo")  # fmt: skip
    return names


@contextlib.contextmanager
def operator_process(kubeconfig: Path, metrics_port: int, log: Path) -> Iterator[OperatorProcess]:
    """The operator for the demo's namespace, once its /metrics answers."""
    op = OperatorProcess.start(
        kubeconfig, NAMESPACE, log, identity="demo", metrics_port=metrics_port,
        metrics_addr="127.0.0.1",
    )  # fmt: skip
    try:
        op.wait_metrics(timeout=60)
        yield op
    finally:
        op.stop(grace=15.0)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------- progress
class Live:
    """Per-pod progress of one refit: redrawn in place on a terminal, printed on change
    otherwise (a log, a test)."""

    def __init__(self, out: TextIO, core: Any) -> None:
        self.out = out
        self.core = core
        self.tty = out.isatty()
        self.shown = 0
        self.last = ""

    def pods(self) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_pod(
            NAMESPACE, label_selector="app=demo-rollout", _preload_content=False
        )
        items: list[dict[str, Any]] = json.loads(resp.data)["items"]
        return items

    def show(self, doc: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> None:
        text = describe(doc, self.pods() if pods is None else pods)
        key = text.split("\n", 1)[1] if not self.tty else text
        if key == self.last:
            return
        self.last = key
        if self.tty and self.shown:
            self.out.write(f"\x1b[{self.shown}F\x1b[J")
        self.out.write(text + "\n")
        self.out.flush()
        self.shown = text.count("\n") + 1

    def done(self) -> None:
        self.shown = 0
        self.last = ""
        self.out.write("\n")


def start_trainer(model: Any, step: Step, port: int, kubeconfig: Path, log: Path) -> Any:
    """The trainer of a broadcast step: its own process (torch stays out of this one),
    `testbed.broadcast_trainer`, which sends through refit_operator.tools.client."""
    spec = {"admin_token_secret": SECRET, "on_failure": "Rollback", **step.strategy}
    ckpt = model.checkpoints[step.checkpoint]
    cmd = [
        sys.executable, "-m", "testbed.broadcast_trainer", "--kubeconfig", str(kubeconfig),
        "--namespace", NAMESPACE, "--name", step.name, "--version", step.version,
        "--tensors", str(ckpt), "--reference", str(ckpt / "refit-probe.json"),
        "--port", str(controlplane.free_port()), "--fleet-port", str(port),
        "--selector", ",".join(f"{k}={v}" for k, v in LABELS.items()),
        "--timeout", str(REFIT_TIMEOUT), "--spec", json.dumps(spec),
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("wb"),
                            text=True)  # fmt: skip


def run_step(
    refits: RefitClient, live: Live, model: Any, step: Step, port: int, kubeconfig: Path,
    state: Path,
) -> Result:  # fmt: skip
    began = time.monotonic()
    trainer = None
    if step.broadcast:
        trainer = start_trainer(model, step, port, kubeconfig, state / f"{step.name}.log")
        name = step.name
    elif step.adapter:
        name = refits.submit(
            TinyAdapters(tiny_adapters_root()).dir(step.checkpoint), step.version,
            name=step.name, adapter=step.adapter, fleet_selector=LABELS, port=port,
            admin_token_secret=SECRET, on_failure="Rollback", **step.strategy,
        )  # fmt: skip
    else:
        name = refits.submit(
            model.checkpoints[step.checkpoint], step.version, name=step.name,
            fleet_selector=LABELS, port=port, admin_token_secret=SECRET, on_failure="Rollback",
            **step.strategy,
        )  # fmt: skip
    stop = threading.Event()

    result = Result(step)

    def poll() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # display only; wait() decides
                doc = refits.get(name)
                pods = live.pods()
                result.observe(doc.get("status") or {}, pods)
                live.show(doc, pods)
            stop.wait(0.4)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        if trainer is not None:
            said = trainer.communicate(timeout=REFIT_TIMEOUT + 60)[0].strip().splitlines()
            verdict = json.loads(said[-1]) if said else {"error": "the trainer said nothing"}
            if trainer.returncode or verdict.get("error"):
                raise DemoError(f"the trainer failed: {verdict}; log {state / name}.log")
            result.status = refits.get(name).get("status") or {}
            result.observe(result.status)
            result.reason = verdict.get("reason", "")
        else:
            result.status = refits.wait(name, REFIT_TIMEOUT, on_update=result.observe)
    except RefitFailed as e:
        result.status = e.status
        result.reason = e.cause
    except RefitTimeout as e:
        result.status = e.status
    finally:
        stop.set()
        poller.join()
    result.seconds = time.monotonic() - began
    result.pods = live.pods()
    live.show(refits.get(name), result.pods)
    live.done()
    result.phase = result.status.get("phase", "")
    result.reason = result.reason or reason_of(result.status).reason
    return result


# ----------------------------------------------------------------------------- checks
def fleet_versions(servers: list[Any]) -> dict[str, str]:
    """What each real pod reports as its weight version (through the admin guard)."""
    out = {}
    with httpx.Client() as http:
        for s in servers:
            r = http.get(f"{s.base_url}/weight_info", headers=s.admin_headers(), timeout=10)
            r.raise_for_status()
            out[s.host] = str(r.json()["weight_version"])
    return out


def in_traffic(core: Any, names: list[str]) -> dict[str, bool]:
    out = {}
    for name in names:
        pod = core.read_namespaced_pod_status(name, NAMESPACE)
        conds = {c.type: c.status for c in pod.status.conditions or []}
        out[name] = conds.get(READINESS_GATE) == "True"
    return out


def summary(results: list[Result]) -> str:
    rows = []
    for r in results:
        st = r.status
        rows.append([
            r.step.name, r.step.version,
            (f"adapter {r.step.adapter} {r.step.checkpoint}" if r.step.adapter else
             r.step.checkpoint + (" (broadcast)" if r.step.broadcast else "")),
            r.step.strategy["strategy"] + (" canary 1" if r.step.strategy.get("canary") else ""),
            r.phase or "-", r.reason if r.reason != r.phase else "",
            ",".join(sorted(r.pod_reasons)) or "-",
            f"{st.get('updatedPods', 0)}/{st.get('targetPods', 0)}",
            f"{r.worst:.2e}",
            duration(r.seconds) if r.seconds >= 1 else f"{r.seconds:.1f}s",
            "ok" if r.ok else f"EXPECTED {r.step.expect}",
        ])  # fmt: skip
    return table(("REFIT", "VERSION", "CKPT", "STRATEGY", "OUTCOME", "REASON", "POD REASONS",
                  "UPDATED", "WORST|Δ|", "TOOK", "CHECK"), rows)  # fmt: skip


def base_version(scenario: Sequence[Step] = SCENARIO) -> str:
    """The base weights' version every pod serves once the scenario ended: that of its last
    base-weights step meant to succeed. An adapter step loads beside the base weights (the
    pods' weight version stays), and a step meant to be rolled back leaves the one before."""
    return next(s.version for s in reversed(scenario) if not s.adapter and s.expect == "Succeeded")


def problems(
    results: Sequence[Result], trained: grpo.GrpoRun | None, versions: Mapping[str, str],
    traffic: Mapping[str, bool], scraped: Mapping[str, float],
) -> list[str]:  # fmt: skip
    """What did not go as expected, one line each (none: the outcome is as expected). The
    pods must serve the GRPO run's last version, or without a run (--grpo-steps 0) the
    scenario's base version, read back from each pod."""
    out = [f"{r.step.name} ended {r.phase or 'without a phase'}, not {r.step.expect}"
           for r in results if not r.ok]  # fmt: skip
    if trained is not None and not trained.ok:
        out.append("the GRPO run did not go as expected (its lines above say why)")
    final = trained.last_version if trained is not None else base_version()
    wrong = sorted(f"{host} serves {v}" for host, v in versions.items() if v != final)
    if wrong:
        out.append(f"every pod should serve {final}: " + ", ".join(wrong))
    if out_of_traffic := sorted(name for name, ready in traffic.items() if not ready):
        out.append(f"pods out of traffic at the end: {', '.join(out_of_traffic)}")
    if scraped.get("probe fail", 0) < 1:
        out.append("Prometheus scraped no failed probe from the operator")
    if scraped.get("refit rolled_back", 0) < 1:
        out.append("Prometheus scraped no rolled-back refit from the operator")
    for r in results:
        if r.step.expect == "RolledBack" and not {"LogprobDrift", "NllDrift"} & r.pod_reasons:
            out.append(f"{r.step.name}: no pod's probe reported LogprobDrift or NllDrift")
    return out


# -------------------------------------------------------------------------------- main
def run(args: argparse.Namespace, out: TextIO) -> int:
    def say(text: str) -> None:
        out.write(f"[{time.monotonic() - t0:6.1f}s] {text}\n")
        out.flush()

    t0 = time.monotonic()

    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="refit-demo-"))
    with ExitStack() as stack:
        say("building/finding the tiny model")
        model = TinyModel(tiny_model_root())

        say(
            "starting the control plane (kube-apiserver + etcd; the first run builds them from "
            "Go modules: 5-10 min on 2 cores, then cached)"
        )
        cp = controlplane.ControlPlane(state / "control-plane")
        cp.start()
        stack.callback(cp.stop)
        cp.install_crds()
        cp.kubectl("create", "namespace", NAMESPACE)
        api_client = k8s_config.new_client_from_config(str(cp.kubeconfig))
        stack.callback(api_client.close)
        core: Any = k8s.CoreV1Api(api_client)

        ips = [f"127.0.0.{FIRST_IP + i}" for i in range(args.pods)]
        port = common_free_port(ips)
        token = os.urandom(16).hex()
        say(f"starting {args.pods} vLLM CPU servers on {', '.join(ips)} port {port}")
        servers = start_servers(stack, model, ips, port, token, say)
        core.create_namespaced_secret(NAMESPACE, {
            "metadata": {"name": SECRET}, "stringData": {"token": token}})  # fmt: skip
        names = register_pods(core, servers)
        say(f"registered Pods {', '.join(names)} (readiness gate {READINESS_GATE})")

        metrics_port = controlplane.free_port()
        say("starting the operator")
        stack.enter_context(operator_process(cp.kubeconfig, metrics_port, state / "operator.log"))
        say("starting Prometheus")
        prom = prometheus.PrometheusServer(
            prometheus.install(), state / "prometheus", [f"127.0.0.1:{metrics_port}"],
            rule_files=[REPO / "monitoring" / "alerts.yaml"],
        )  # fmt: skip
        prom.start()
        stack.callback(prom.stop)

        refits = stack.enter_context(RefitClient(namespace=NAMESPACE, kubeconfig=cp.kubeconfig))
        live = Live(out, core)
        results = []
        for step in SCENARIO:
            say(f"refit {step.version}: {step.what}")
            results.append(run_step(refits, live, model, step, port, cp.kubeconfig, state))
        # Drawn now, as the scenario ended: the GRPO run's refits later supersede v4.
        draw_reports(refits, results, out_dir)

        trained = None
        if args.grpo_steps:
            say(f"GRPO: {args.grpo_steps} steps of TRL's GRPOTrainer through Refit, one "
                f"broadcast refit per step ({grpo.PREFIX}-step-0..{args.grpo_steps})")  # fmt: skip
            trained = grpo.run_grpo(
                model, cp.kubeconfig, NAMESPACE, ",".join(f"{k}={v}" for k, v in LABELS.items()),
                port, SECRET, args.grpo_steps, out_dir, state, say,
            )  # fmt: skip
            say(f"GRPO run ended in {trained.seconds:.0f}s")

        versions = fleet_versions(servers)
        traffic = in_traffic(core, names)
        # What Prometheus scraped from the operator: the failed probe and the rollback.
        with contextlib.suppress(prometheus.PrometheusError):
            prom.wait_for('sum(refit_refits_total{result="rolled_back"}) >= 1', timeout=20)
        scraped = {
            f"{what} {s['metric'].get('result', '?')}": float(s["value"][1])
            for what, expr in (("probe", "sum by (result) (refit_probe_verdicts_total)"),
                               ("refit", "sum by (result) (refit_refits_total)"))
            for s in prom.query(expr)
        }  # fmt: skip
        out.write("\n" + summary(results) + "\n\n")
        if trained is not None:
            out.write(grpo.summary(trained) + "\n")
            for problem in trained.problems():
                out.write(f"GRPO: {problem}\n")
            if not trained.ok:
                out.write(f"GRPO trainer log (tail):\n{_tail(trained.log)}\n")
            out.write("\n")
        out.write(table(("POD", "ADDRESS", "WEIGHT VERSION (read back)", "IN TRAFFIC"),
                        [[n, s.host, versions[s.host], "yes" if traffic[n] else "no"]
                         for n, s in zip(names, servers, strict=True)]) + "\n\n")  # fmt: skip
        out.write("Prometheus (scraped from the operator): "
                  + (", ".join(f"{k} {v:g}" for k, v in sorted(scraped.items()) if v) or "nothing")
                  + "\n")  # fmt: skip
        for r in results:
            for path in (r.report, r.rejected_report):
                if path is not None:
                    out.write(f"report: {path}\n")
        if trained is not None and (picture := grpo.picture(trained, out_dir / "grpo.png")):
            out.write(f"report: {picture}\n")
        wrong = problems(results, trained, versions, traffic, scraped)
        ok = not wrong
        out.write(f"\nwall time {time.monotonic() - t0:.0f}s; outcome "
                  f"{'as expected' if ok else 'NOT as expected'}\n")  # fmt: skip
        for problem in wrong:
            out.write(f"  - {problem}\n")
        if not ok:
            out.write(f"operator log (tail):\n{_tail(state / 'operator.log')}\n")
            out.write(f"logs and state kept in {state}\n")
        if args.keep:
            out.write(keep_text(
                kubeconfig=cp.kubeconfig, kubectl=cp.bin / "kubectl", port=port,
                metrics_port=metrics_port, prom_url=prom.url, state=state, model=model,
            ))  # fmt: skip
            out.flush()
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    if ok:  # logs and etcd data of a run that went as expected are not worth keeping
        shutil.rmtree(state, ignore_errors=True)
    return 0 if ok else 1


def draw_reports(refits: RefitClient, results: list[Result], out_dir: Path) -> None:
    """Each refit's PNG report, and the moment the probe rejected one."""
    for r in results:
        doc = refits.get(r.step.name)
        if r.pods or doc.get("status", {}).get("pods"):
            r.report = render_refit(doc, out_dir / f"{r.step.name}.png", pods=r.pods)
        if r.rejected is not None:  # the moment the probe said no, before the rollback
            r.rejected_report = render_refit(
                {**doc, "status": r.rejected}, out_dir / f"{r.step.name}-rejected.png",
                pods=r.rejected_pods,
                title=f"{r.step.name} → {r.step.version}: the probe rejects the checkpoint",
            )  # fmt: skip


def keep_text(
    *, kubeconfig: Path, kubectl: Path, port: int, metrics_port: int, prom_url: str,
    state: Path, model: Any,
) -> str:  # fmt: skip
    """What --keep prints: how to look at what runs, and the fleet's coordinates (namespace,
    selector, port, admin Secret) with a refit to try from a trainer of one's own."""
    selector = ",".join(f"{k}={v}" for k, v in LABELS.items())
    ckpt = model.checkpoints["B"]
    return (
        "\nEverything is still running. In another terminal:\n"
        f"  export KUBECONFIG={kubeconfig}\n"
        f"  {kubectl} get wr -n {NAMESPACE}\n"
        f"  {kubectl} get wr -n {NAMESPACE} -o wide\n"
        f"  .venv/bin/python -m refit_operator.tools.kubectl_plugin history -n {NAMESPACE}\n"
        f"  operator metrics: http://127.0.0.1:{metrics_port}/metrics\n"
        f"  Prometheus:       {prom_url} (API: {prom_url}/api/v1/query?query=refit_refits_total)\n"
        f"  logs and state:   {state}\n"
        "\nThe fleet, for a trainer of your own (RefitClient, RefitRollout; docs/integrations.md):"
        "\n"
        f"  namespace:        {NAMESPACE}\n"
        f"  pods:             selector {selector}, vLLM port {port}\n"
        f"  admin token:      Secret {SECRET}, key token (spec.fleet.adminTokenSecretRef)\n"
        f"  checkpoints:      the pods load only under {model.allowed_root} (A and B are the\n"
        "                    demo's; a checkpoint of your own goes beside them)\n"
        "  a refit to checkpoint B, from Python (.venv/bin/python, PYTHONPATH as for the demo):\n"
        "    from refit_operator.tools.client import RefitClient\n"
        f'    with RefitClient(namespace="{NAMESPACE}", kubeconfig="{kubeconfig}") as refits:\n'
        f'        name = refits.submit("{ckpt}", "mine-1", fleet_selector="{selector}",\n'
        f'                             port={port}, admin_token_secret="{SECRET}")\n'
        f'        print(refits.wait(name, {REFIT_TIMEOUT:.0f}).get("phase"))\n'
        "Press Ctrl-C to stop everything.\n"
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: everything started is stopped


def arg_parser() -> argparse.ArgumentParser:
    """The demo's flags (parse_args checks their values)."""
    p = argparse.ArgumentParser(
        prog="python -m demo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--pods", type=int, default=3, help="vLLM servers (default 3, ~3 GB each)")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "refit-demo"),
                   help="where the PNG reports (and the GRPO run's grpo-run.json) go "
                   "(default %(default)s)")  # fmt: skip
    p.add_argument("--grpo-steps", type=int, default=8,
                   help="steps of the closing GRPO run (default 8; 0 skips it)")  # fmt: skip
    p.add_argument("--keep", action="store_true",
                   help="leave everything running until Ctrl-C and print how to reach it: "
                   "kubectl, metrics, the fleet's selector, port and admin Secret")  # fmt: skip
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's flags; a bad value exits 2 with argparse's message, before anything starts."""
    p = arg_parser()
    args = p.parse_args(argv)
    if not 1 <= args.pods <= 8:
        p.error("--pods must be between 1 and 8")
    if args.grpo_steps < 0:
        p.error("--grpo-steps must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args, sys.stdout)
    except RuntimeError as e:  # DemoError, ControlPlaneError, OperatorError, PrometheusError
        print(f"demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
