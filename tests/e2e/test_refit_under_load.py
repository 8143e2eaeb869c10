"""Refits under live traffic, on real parts: the `refit-operator` process on the real API
server refits two real vLLM CPU pods while a load generator (testbed/loadgen.py) keeps
sending completions to them, routed as a gateway that follows the pods' readiness would
(GateRouter: only pods whose readiness gate is True), and records every request's outcome,
latency, pod and the weight versions that produced its tokens (vLLM's per-output spans).

One fleet for the module, one refit per drain mode, each from what the last left:
``wait`` (checkpoint, Rolling), ``abort`` (checkpoint, AllAtOnce; a streaming client that
retries as a rollout worker would), ``keep`` (checkpoint, AllAtOnce), a wait drain
that a request outlives (DrainTimeout: one request of 8 long samples sent to a pod in its drain
delay, as from a gateway that lags), then ``wait`` again with the weights broadcast by a
trainer process (Rolling: one send per pod). Every test checks what
the issue asks of its mode on the load's own records and the pods' pass records: requests
admitted before a pod left traffic finish on the old weights (or are aborted cleanly, or,
with keep, finish on both versions, said so), none is served by unprobed weights, none is
lost without an error the client saw.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testbed.controlplane import ControlPlane
from testbed.fleet import ADMIN_SECRET, ENDED, Fleet, serving_fleet
from testbed.loadgen import OUTCOMES, GateRouter, LoadGenerator, Record
from testbed.operator_process import Operators
from testbed.tiny_model import TinyModel
from testbed.vllm_server import SERVED_MODEL, VllmServer, start_vllm_pods
from tests.fixtures.reload import admin
from tests.fixtures.trainer import train

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.timeout(900)]

PODS = ("vllm-0", "vllm-1")
HOSTS = ("127.0.0.4", "127.0.0.5")
# Room for samples that run for seconds (the DrainTimeout test's): the tiny model decodes a
# batch of 8 samples of 500 tokens in about a second here, too short to outlive a drain.
LONG_CONTEXT = 2048  # the tiny model has rotary positions for 4,096


@pytest.fixture(scope="module")
def servers(tiny_model: TinyModel) -> Iterator[list[VllmServer]]:
    """Two pods' servers on one port at two loopback addresses, started from A's files, with
    vLLM's token-in-token-out endpoint (--enable-scale-out: what the load speaks) and the
    refit-gloo engine (broadcast refits)."""
    from refit_worker.contract import TRANSFER_BACKEND

    transfer = json.dumps({"backend": TRANSFER_BACKEND})
    with start_vllm_pods(
        tiny_model, HOSTS, load_format="safetensors", model_dir=tiny_model.checkpoints["A"],
        admin_token="load-admin-token",
        extra_args=["--enable-scale-out", "--max-model-len", str(LONG_CONTEXT),
                    "--weight-transfer-config", transfer],
    ) as servers:  # fmt: skip
        yield servers


@pytest.fixture(scope="module")
def fleet(
    control_plane: ControlPlane,
    weightrefit_crd: str,
    servers: list[VllmServer],
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Fleet, Operators]]:
    """One namespace and operator (two replicas) for the module (the pods keep the fencing
    tokens they admitted, so one Lease serves every test), the two pods serving A after an
    idle refit."""
    # Two replicas (the chart's replicaCount: 2): on two cores under this load a leader may
    # miss its renewal deadline and stop (leader.py; it did once in CI); the standby then
    # takes over and resumes the pass, and every promise below must still hold.
    with serving_fleet(
        control_plane, servers, PODS, "A", tiny_model.checkpoints["A"], namespace="under-load",
        log_dir=tmp_path_factory.mktemp("under-load-logs"), replicas=2,
    ) as fleet:  # fmt: skip
        yield fleet


@pytest.fixture
def router(fleet: tuple[Fleet, Operators], servers: list[VllmServer]) -> Iterator[GateRouter]:
    fl, _ = fleet
    r = GateRouter(fl.pods, servers[0].port, interval=0.02).start()
    yield r
    r.stop()


def run_under_load(
    fl: Fleet, router: GateRouter, load: dict[str, Any], refit: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any], list[Record], LoadGenerator]:
    """``refit`` run while the load runs: the load starts first (every pod busy), stops once
    the refit ended and each pod served a few requests at its end state. What ``refit``
    returned, the load's records, the load."""
    gen = LoadGenerator(router.targets, deadline_s=200, timeout_s=60, **load).start()
    try:
        fl.wait_for(lambda: sum(r.outcome == "ok" for r in gen.records) >= 8, 60, "load")
        out = refit()
        seen = len(gen.records)
        fl.wait_for(lambda: len(gen.records) >= seen + 8, 60, "load after the refit")
    finally:
        records = gen.stop()
    return out, records, gen


def under_load(
    fl: Fleet, op: Operators, tiny_model: TinyModel, router: GateRouter, servers: list[VllmServer],
    name: str, version: str, *, load: dict[str, Any], **spec: Any,
) -> tuple[dict[str, Any], list[Record], LoadGenerator]:  # fmt: skip
    """A checkpoint refit to ``version`` under load (run_under_load): its status."""
    path = tiny_model.checkpoints[version]
    return run_under_load(
        fl,
        router,
        load,
        lambda: fl.refit_server_pods(op, name, version, path, servers[0].port, **spec),
    )


def sent_before(records: list[Record], pod: str, left_traffic: float) -> list[Record]:
    """The requests sent to ``pod`` before it left traffic that a wait drain let run: all but
    the ones aborted before any token (the callers check those). Sent is not arrived: on
    these loaded cores a request sent just before the pod left can reach vLLM after the
    pause, queued, and be aborted with the late arrivals (CI once saw one in the broadcast
    test below, where this list had kept it and its empty spans failed the check)."""
    return [
        r
        for r in by_pod(records, pod)
        if r.start < left_traffic and not (r.outcome == "aborted" and r.tokens == 0)
    ]


def pass_record(fl: Fleet, pod: str) -> dict[str, Any]:
    record = fl.progress(fl.pod(pod))
    assert record is not None
    return record


def by_pod(records: list[Record], pod: str) -> list[Record]:
    return [r for r in records if r.pod == pod]


def in_flight_at_drain(fl: Fleet, records: list[Record]) -> list[Record]:
    """Requests the drain met: admitted to their pod before its drain began and still running
    when the drain step ended (the pass record's ``drained_at`` less the step's seconds), so
    the engine held them while it paused. Not ``left_traffic``: the drain follows that
    record's write, which on these loaded cores took seconds, and a request may finish in
    between. Whether any request is met is up to timing: staging, which runs while the pod
    serves, stalls the pod's answers on these 2 cores, and the requests it held back tend to
    finish together right before the drain; the mode's rule is checked on every request it
    met (the run's records show how many)."""
    met = []
    for pod in PODS:
        began, ended = drain_window(pass_record(fl, pod))
        met += [r for r in by_pod(records, pod) if r.start < began and r.end > ended]
    return met


def drain_window(rec: dict[str, Any]) -> tuple[float, float]:
    """When the pod's drain step began and ended (epoch seconds), from its pass record."""
    return rec["drained_at"] - rec["step_seconds"]["drain"], rec["drained_at"]


KEEP_VERSIONS = (("A", "B"), ("B",), ("A",))


def kept_at_drain(rec: dict[str, Any]) -> int:
    """How many requests the pod's keep drain froze, by the engine's own count: the pass
    record's note "N requests kept in flight, to finish on V" (none: no note)."""
    note = rec.get("drained") or ""
    return int(note.split()[0]) if note else 0


def summary(records: list[Record]) -> str:
    return json.dumps([r.to_json() for r in records][-60:], indent=None)[:20000]


def check_no_unprobed_weights(fl: Fleet, records: list[Record], old: str, new: str) -> None:
    """For each pod: a request that reached it before its pass's probe passed (``finished``)
    has no token from the new weights, except a keep drain's frozen requests (caller); a
    request after it has only the new weights' tokens. Returns nothing; asserts."""
    for pod in PODS:
        done = pass_record(fl, pod)["finished"]
        for r in by_pod(records, pod):
            if r.outcome != "ok":
                continue
            if r.start < done:
                assert r.versions == (old,), (pod, done, r)
            else:
                assert r.versions == (new,), (pod, done, r)


def check_routed_in_traffic(router: GateRouter, records: list[Record]) -> None:
    """Every request went to a pod the router had in traffic when it was sent (the
    gateway's view; the pods' own records say when each left and came back)."""
    for r in records:
        if not r.pod:
            continue
        for began, ended in router.out_of_traffic(r.pod):
            assert not began <= r.start < ended, (r, began, ended)


def check_nothing_lost(records: list[Record]) -> None:
    assert records, "no request was sent"
    odd = [r for r in records if r.outcome not in OUTCOMES]
    assert not odd, odd
    # Never a hang cut short or a body taken for complete: vLLM's abort is a clean answer.
    broken = [r for r in records if r.outcome in ("timeout", "truncated", "connection")]
    assert not broken, summary(broken)


def test_wait_rolling_checkpoint_under_load(fleet, servers, tiny_model, router):
    """Rolling, one pod at a time: the other pod serves throughout, requests admitted before
    a pod left traffic finish on A (none aborted), nothing reaches unprobed weights."""
    fl, op = fleet
    st, records, _ = under_load(
        fl, op, tiny_model, router, servers, "wait-b", "B",
        load={"streams": 4, "max_tokens": 200},
        strategy={"type": "Rolling", "maxUnavailable": 1},
        sequence={"drainMode": "wait"},
    )  # fmt: skip
    assert st["phase"] == "Succeeded", (st, op.logs())
    check_nothing_lost(records)
    # wait aborts nothing the pod had before it left traffic; Rolling always leaves one pod
    # in traffic. Only a request the router sent in the moment before it saw the pod leave
    # can reach it paused: queued by vLLM, it is aborted cleanly before the scheduler resumes
    # (tests/worker/test_late_arrivals.py), never run on weights no probe has passed.
    assert {r.outcome for r in records} <= {"ok", "aborted"}, summary(records)
    for r in records:
        if r.outcome == "aborted":
            # Never scheduled (queued at the paused engine), so no token: judged by the
            # engine's answer, not by when this process sent it (its clock lags on these
            # cores, and a request sent just before the pod left may reach vLLM after the
            # pause).
            assert r.tokens == 0 and r.finish_reason == "abort", r
    check_no_unprobed_weights(fl, records, "A", "B")
    check_routed_in_traffic(router, records)
    for pod in PODS:
        rec = pass_record(fl, pod)
        # Some requests were admitted before the pod left traffic and finished there on A
        # (sent_before: the aborted ones among them never ran, checked above).
        before = sent_before(records, pod, rec["left_traffic"])
        assert before and all(r.versions == ("A",) for r in before), (pod, rec)
        # The drain's wait was real: the pod had requests to wait for (wall time of the step).
        assert rec["step_seconds"]["drain"] > 0, rec["step_seconds"]
    # Rolling: the two pods were never out of traffic together.
    assert all(names for _, names in router.history[1:]), router.history


def test_abort_all_at_once_checkpoint_under_load_with_a_retrying_client(
    fleet, servers, tiny_model, router
):
    """abort fails the requests in flight with vLLM's clean abort: a complete answer whose
    finish reason is "abort" (streamed: its final chunk and [DONE]), never a hang or a cut
    body. The client retries (as docs/concepts.md says a rollout worker should) and every
    logical request ends served; no token of the aborted ones came from B."""
    fl, op = fleet
    st, records, gen = under_load(
        fl, op, tiny_model, router, servers, "abort-a", "A",
        load={"streams": 4, "max_tokens": 400, "stream": True, "retries": 8},
        sequence={"drainMode": "abort"},
    )  # fmt: skip
    assert st["phase"] == "Succeeded", (st, op.logs())
    check_nothing_lost(records)
    aborted = [r for r in records if r.outcome == "aborted"]
    met = in_flight_at_drain(fl, records)
    # Each request the drain met was aborted, or the engine had finished it on B before the
    # pause and this process read its last chunk after the drain (all 400 tokens, B's
    # alone: an abort ends a request with finish reason "abort"). The client's clock lags
    # the engine's by seconds on these loaded cores: three such requests, read together
    # after the drain, failed the stricter check once (an AMD EPYC runner).
    finished_before = [r for r in met if r.outcome == "ok"]
    assert all(r.outcome in ("aborted", "ok") for r in met), summary(met)
    done = [r.finish_reason == "length" and r.tokens == 400 and r.versions == ("B",)
            for r in finished_before]  # fmt: skip
    assert all(done), summary(met)
    for r in aborted:
        assert r.finish_reason == "abort" and r.status == 200, r
        assert r.tokens < 400 and all(v == "B" for v in r.versions), r
        # Aborted by its pod's pass (the drain, or the abort of late arrivals before the
        # wake): sent before the pass ended, none of A's tokens. Not judged by its end: this
        # process reads the abort's chunk late on loaded cores (once 40 ms after the probe).
        assert r.start < pass_record(fl, r.pod)["finished"], r
    check_no_unprobed_weights(fl, [r for r in records if r.outcome == "ok"], "B", "A")
    check_routed_in_traffic(router, records)
    # The retrying client lost nothing: each logical request's last attempt was served.
    last: dict[int, Record] = {}
    for r in records:
        last[r.request] = r
    unserved = [r for r in last.values() if r.outcome != "ok"]
    # Only requests cut short when the load stopped may end unserved (one per stream).
    assert len(unserved) <= gen.streams, summary(unserved)
    assert all(r.end >= max(x.start for x in records) - 5 for r in unserved), unserved


def test_keep_all_at_once_checkpoint_under_load(fleet, servers, tiny_model, router):
    """keep freezes the requests in flight and finishes them after the refit: they complete,
    their spans name both versions (A's tokens, then B's), and each pod's record and readiness
    condition say how many its drain kept."""
    fl, op = fleet
    st, records, _ = under_load(
        fl, op, tiny_model, router, servers, "keep-b", "B",
        load={"streams": 4, "max_tokens": 400},
        sequence={"drainMode": "keep"},
    )  # fmt: skip
    assert st["phase"] == "Succeeded", (st, op.logs())
    check_nothing_lost(records)
    assert {r.outcome for r in records} <= {"ok", "no_target"}, summary(records)
    met = in_flight_at_drain(fl, records)
    # Nothing the drain met is lost or aborted. Each one was frozen and finished on B (its A
    # tokens first if it had been scheduled), or the engine had finished it on A before the
    # pause and this test process read its last chunk after the drain: the client's clock
    # lags the engine's by up to seconds on these loaded cores (CI once saw four 400-token
    # requests end 0.1 s after the drain, all on A). Which ones the engine froze is its own
    # count below, not the client's clock.
    assert all(r.outcome == "ok" and r.versions in KEEP_VERSIONS for r in met), summary(met)
    frozen: dict[str, list[Record]] = {}
    for pod in PODS:
        rec = pass_record(fl, pod)
        began, ended = drain_window(rec)
        frozen[pod] = [r for r in by_pod(records, pod) if r.start < ended and "B" in r.versions]
        # Every request the engine held at the pause (running or waiting, its /metrics once
        # the counts settled after the pause: steps._kept_in_flight) finished with B's
        # tokens, and none of them was lost.
        assert kept_at_drain(rec) <= len(frozen[pod]), (rec, summary(by_pod(records, pod)))
        for r in frozen[pod]:
            assert r.outcome == "ok" and r.versions in KEEP_VERSIONS, r
            if r.versions == ("A", "B"):
                # Admitted on A before the drain, finished on B after it. Not necessarily
                # after the probe: vLLM resumes at the KV wake (docs/concepts.md, keep).
                assert r.start < began and ended < r.end, (r, rec)
    # Every other request: A's tokens before the probe passed, B's after; keep's frozen
    # requests are its one stated exception.
    held = [r for rs in frozen.values() for r in rs]
    plain = [r for r in records if r.outcome == "ok" and r not in held]
    check_no_unprobed_weights(fl, plain, "A", "B")
    check_routed_in_traffic(router, records)
    for pod in PODS:
        rec = pass_record(fl, pod)
        # A request with A's tokens and B's was in the engine at the pause: the note says so.
        if any(r.versions == ("A", "B") for r in frozen[pod]):
            assert rec["drained"].endswith("requests kept in flight, to finish on B"), rec
            cond = next(
                c for c in fl.pod(pod)["status"]["conditions"] if c["type"].startswith("refit")
            )
            assert cond["message"] == f"weights B probed; {rec['drained']}", cond


# The wait between vllm-0 leaving traffic and its pause, in which the DrainTimeout test's
# request reaches it: long enough for this process to see the pod leave (it polls every
# 0.2 s) and send, short enough that the request, which runs for seconds, is still running
# when the pause's second runs out.
DRAIN_DELAY_SECONDS = 2
SAMPLES = 8  # the servers' --max-num-seqs: every sample runs, none waits queued
SAMPLE_TOKENS = 1500  # a batch of 8 runs about 10 s


def engine_running(server: VllmServer, http: httpx.Client) -> float:
    """vLLM's own count of requests it is generating (its /metrics, open to all). Running
    only: WorkerClient.requests_in_flight adds the queued ones, which a wait pause does not
    wait for."""
    r = http.get(f"{server.base_url}/metrics")
    r.raise_for_status()
    for family in text_string_to_metric_families(r.text):
        if family.name == "vllm:num_requests_running":
            return sum(s.value for s in family.samples)
    raise AssertionError("vLLM's /metrics has no vllm:num_requests_running")


def test_a_request_that_outlives_the_drain_timeout_fails_the_pass_closed(
    fleet, servers, tiny_model
):
    """DrainTimeout on real vLLM. vllm-0's pass takes it out of traffic and pauses it
    drainDelaySeconds later, as for a gateway that lags; in that delay a request of 8 samples
    of 1,500 tokens each (about 10 s on these cores, all running at once) reaches it directly.
    The wait drain with drainTimeoutSeconds 1 (and no retries) meets it: the pass fails
    closed, the pod paused, out of traffic and on its old weights, the refit Halted; every
    sample still finishes, on the old weights, as wait promises. The next refit takes the
    paused pod through its pass and back into traffic.

    Not a request sent before the refit: vLLM runs a collective RPC (the preflight's, the
    stage's) only after the requests in flight finish, so the drain would never meet it
    (docs/concepts.md, "Drain modes"). The request goes out as soon as the pod's record says
    it left traffic, and the test checks that the engine runs it before the pause is due:
    a request that only reached the pod paused would be queued, not waited for."""
    fl, op = fleet
    server = servers[0]
    rolling = {"type": "Rolling", "maxUnavailable": 1}
    answers: list[tuple[httpx.Response, float]] = []
    body = {"model": SERVED_MODEL, "prompt": [5, 6, 7, 8], "n": SAMPLES,
            "max_tokens": SAMPLE_TOKENS, "min_tokens": SAMPLE_TOKENS, "ignore_eos": True,
            "temperature": 1.0}  # fmt: skip

    def long_request() -> None:
        url, sent = f"{server.base_url}/v1/completions", time.time()
        answer = httpx.post(url, json=body, headers=server.api_headers(), timeout=300)
        answers.append((answer, time.time() - sent))

    def left_traffic() -> bool:
        record = fl.progress(fl.pod(PODS[0]))
        return bool(record and record["refit"] == "drain-timeout" and record["left_traffic"])

    with httpx.Client(timeout=30) as http:
        before = admin(server, http, "GET", "/weight_info")["weight_version"]
        target = "B" if before == "A" else "A"  # a version the pods do not serve
        path = tiny_model.checkpoints[target]
        fl.apply_refit(
            "drain-timeout", target, path, server.port, strategy=rolling,
            fleet={"adminTokenSecretRef": {"name": ADMIN_SECRET}},
            sequence={"sleepLevel": 1, "drainMode": "wait", "drainTimeoutSeconds": 1,
                      "drainDelaySeconds": DRAIN_DELAY_SECONDS, "retries": 0},
        )  # fmt: skip
        fl.wait_for(left_traffic, 120, "vllm-0 out of traffic")
        request = threading.Thread(target=long_request, daemon=True)
        request.start()
        fl.wait_for(lambda: engine_running(server, http) > 0, 4, "the request running")
        running = time.time()
        due = pass_record(fl, PODS[0])["left_traffic"] + DRAIN_DELAY_SECONDS
        assert running < due, f"the request ran {running - due:.2f}s after the pause was due"
        st = fl.wait_phase("drain-timeout", ENDED, 240, op)["status"]
        record = pass_record(fl, PODS[0])
        timing = {k: record[k] for k in ("left_traffic", "drained_at", "step_seconds")}
        request.join(240)
        assert answers, "the request never answered"
        answer, seconds = answers[0]
        assert st["phase"] == "Halted", (running, seconds, timing, op.logs()[-3000:])
        assert record["reason"] == "DrainTimeout", record
        assert admin(server, http, "GET", "/is_paused") == {"is_paused": True}
        assert fl.ready(fl.pod(PODS[0])) is False and fl.ready(fl.pod(PODS[1])) is True
        assert answer.status_code == 200, answer.text[:500]
        choices = answer.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["length"] * SAMPLES, choices
        assert admin(server, http, "GET", "/weight_info")["weight_version"] == before
        # The next refit, with a probe timeout a score queued on the paused pod would miss.
        st = fl.refit_server_pods(
            op, "after-drain-timeout", target, path, server.port, strategy=rolling,
            sequence={"probeTimeoutSeconds": 20},
        )  # fmt: skip
        probes = {pod: (r.get("reason"), r.get("message"), r.get("probe"))
                  for pod in PODS for r in [pass_record(fl, pod)]}  # fmt: skip
        assert st["phase"] == "Succeeded", (st["message"], probes, op.logs()[-3000:])
        for pod, s in zip(PODS, servers, strict=True):
            assert fl.ready(fl.pod(pod)) is True
            assert admin(s, http, "GET", "/is_paused") == {"is_paused": False}
            assert admin(s, http, "GET", "/weight_info")["weight_version"] == target


def test_wait_rolling_broadcast_under_load(fleet, servers, tiny_model, router):
    """A broadcast refit under the load and the rules of the wait refit above: the trainer
    process (testbed.broadcast_trainer) sends the tensors over gloo, one round per Rolling
    batch, to a pod drained, asleep and woken for its weights while the other pod serves.
    Requests admitted before a pod left traffic finish on the old version; none reaches the
    new weights before the pod's probe passed; nothing is lost."""
    fl, op = fleet
    with httpx.Client(timeout=30) as http:
        before = admin(servers[0], http, "GET", "/weight_info")["weight_version"]
    tensors = "B" if before == "A" else "A"  # after the test above: A or B, both pods
    target = f"{tensors}-bcast"

    def refit() -> dict[str, Any]:
        return train(
            fl, tiny_model, servers, "bcast-under-load", target, tensors=tensors,
            reference=tensors, strategy="Rolling", max_unavailable=1,
            sequence={"sleepLevel": 1, "drainMode": "wait"},
        )  # fmt: skip

    out, records, _ = run_under_load(fl, router, {"streams": 4, "max_tokens": 200}, refit)
    assert out["phase"] == "Succeeded", (out, op.logs())
    assert [r["round"] for r in out["rounds"]] == [1, 2], out["rounds"]  # one send per batch
    check_nothing_lost(records)
    # As under the checkpoint's wait: only a request sent in the moment before the router saw
    # its pod leave can reach the paused engine, queued, and is aborted before any token.
    assert {r.outcome for r in records} <= {"ok", "aborted"}, summary(records)
    for r in records:
        if r.outcome == "aborted":
            assert r.tokens == 0 and r.finish_reason == "abort", r
    check_no_unprobed_weights(fl, records, before, target)
    check_routed_in_traffic(router, records)
    for pod in PODS:
        rec = pass_record(fl, pod)
        assert (rec["version"], rec["source"]) == (target, "broadcast"), rec
        assert rec["probe"]["verdict"] == "Pass", rec["probe"]
        admitted = sent_before(records, pod, rec["left_traffic"])
        assert admitted and all(r.versions == (before,) for r in admitted), (pod, rec)
    assert all(names for _, names in router.history[1:]), router.history
    assert fl.serving(PODS, servers) == {p: (target, True) for p in PODS}
