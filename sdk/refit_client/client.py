"""Trainer-side client: submit a WeightRefit for a checkpoint directory and wait for its verdict.

    from refit_client import RefitClient, RefitFailed

    refits = RefitClient()                         # in-cluster config, else KUBECONFIG
    name = refits.submit("/ckpt/step-100", "step-100", fleet_selector={"app": "rollout"},
                         namespace="rl", write_manifest=True)
    try:
        status = refits.wait(name, timeout=600)    # the final status dict on Succeeded
    except RefitFailed as e:                       # Failed, Halted, RolledBack, Superseded
        print(e.phase, e.reason, e.message, e.pod_failures)

Synchronous on purpose (the official `kubernetes` client): a training loop is not an event
loop. The document it submits is refit_document's; the files it writes into the checkpoint
first, checkpoint_files'; its cluster configuration, kubeconfig's.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException
from refit_operator.core import api, times
from refit_operator.core.api import SENDING_ANNOTATION
from refit_operator.core.reasons import Reason
from refit_worker.contract import API_GROUP, ContractError, ProbeReference, TransferManifest

from .checkpoint_files import write_checkpoint_files
from .kubeconfig import default_namespace, load_api_client
from .kubectl_text import reason_of
from .refit_document import API_VERSION, build_refit, default_name, stamped
from .refit_error import RefitError

log = logging.getLogger(__name__)
DEFAULT_TRANSFER_TIMEOUT_SECONDS = 600  # spec.broadcast.timeoutSeconds' default
CREATED_KEPT = 16  # refits created and not yet waited for whose create answer is kept

FAILED_PHASES: frozenset[api.Phase] = frozenset(api.TERMINAL_PHASES - {"Succeeded"})
# The operator's per-pod Events: "pod NAME: Reason: message" (runner._finish).
_POD_EVENT = re.compile(r"^pod (\S+): ([A-Za-z]+): (.*)$", re.S)


@dataclass(frozen=True)
class PodFailure:
    pod: str
    phase: str
    reason: str
    message: str


class RefitFailed(RefitError):
    """The operator ended the refit without success. ``reason`` and ``message`` are the
    operator's (from the Degraded/Ready condition); ``cause`` the reason that stopped the
    rollout (for RolledBack, the gate's reason before the rollback, e.g.
    FailureLimitExceeded); ``pod_failures`` the per-pod causes, including those a rollback
    has since replaced in the status."""

    def __init__(
        self,
        name: str,
        status: Mapping[str, Any],
        *,
        earlier: Sequence[PodFailure] = (),
        cause: str = "",
    ) -> None:
        self.name = name
        self.status = dict(status)
        self.phase = str(status.get("phase", ""))
        problem = reason_of(status)
        self.reason, self.message = problem.reason, problem.message
        self.cause = cause or self.reason
        now = {f.pod: f for f in pod_failures(status)}
        merged = {f.pod: f for f in earlier} | now
        self.pod_failures = [merged[k] for k in sorted(merged)]
        detail = "".join(
            f"\n  {f.pod}: {f.phase} {f.reason}: {f.message}" for f in self.pod_failures
        )
        why = f" (after {self.cause})" if self.cause != self.reason else ""
        super().__init__(
            f"WeightRefit {name} {self.phase}: {self.reason}{why}: {self.message}{detail}"
        )


class WatchedFailures:
    """What a refit showed while it was watched. A rollback rewrites the pods' results and
    the refit's reason afterwards, so the cause is kept from the statuses seen before."""

    def __init__(self) -> None:
        self.failures: dict[str, PodFailure] = {}
        self.cause = ""

    def observe(self, status: Mapping[str, Any]) -> None:
        for f in pod_failures(status):
            if f.reason:
                self.failures[f.pod] = f
        if status.get("phase") in ("RollingBack", "Halted", "Failed"):
            self.cause = reason_of(status).reason

    def failed(self, name: str, status: Mapping[str, Any]) -> RefitFailed:
        return RefitFailed(name, status, earlier=list(self.failures.values()), cause=self.cause)


class RefitTimeout(RefitError, TimeoutError):
    """The refit did not reach a final phase in time; it may still be running."""

    def __init__(self, name: str, timeout: float, status: Mapping[str, Any]) -> None:
        self.name = name
        self.timeout = timeout
        self.status = dict(status)
        self.phase = str(status.get("phase", "") or "Pending")
        updated, target = status.get("updatedPods", 0), status.get("targetPods", 0)
        super().__init__(
            f"WeightRefit {name} not finished after {timeout:g}s: phase {self.phase}, "
            f"{updated}/{target} pods updated; {status.get('message') or 'no message yet'}"
        )


def pod_failures(status: Mapping[str, Any]) -> list[PodFailure]:
    """Pods that did not end at the target version, with the reason each one reports: from
    status.pods, which lists the pods that need attention (at most api.STATUS_PODS_LIMIT,
    failed ones first; status.podsOmitted counts the rest)."""
    out = []
    for p in status.get("pods") or []:
        if p.get("phase") in ("Failed", "Inconclusive", "Dropped") or (
            p.get("reason") and p.get("phase") != "Succeeded"
        ):
            out.append(
                PodFailure(p["name"], p.get("phase", ""), p.get("reason", ""), p.get("message", ""))
            )
    return out


class RefitClient:
    """Talks to one cluster. ``namespace`` is the default for every call."""

    def __init__(
        self,
        *,
        namespace: str | None = None,
        kubeconfig: str | Path | None = None,
        context: str | None = None,
        api_client: k8s.ApiClient | None = None,
    ) -> None:
        if api_client is None:
            api_client = load_api_client(kubeconfig, context)
        self.api_client = api_client
        # Any: the generated client's signatures say `object` for custom resources (dicts).
        self.custom: Any = k8s.CustomObjectsApi(api_client)
        self.namespace = namespace or default_namespace(kubeconfig, context)
        # (namespace, name) -> the WeightRefit as this client's create returned it: a wait
        # for it watches from there instead of reading it first (one use each).
        self._created: dict[tuple[str, str], dict[str, Any]] = {}

    def close(self) -> None:
        self.api_client.close()

    def __enter__(self) -> RefitClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- submit
    def submit(
        self,
        checkpoint_dir: str | Path,
        version: str,
        *,
        fleet_selector: Mapping[str, str] | str | api.LabelSelector,
        namespace: str | None = None,
        name: str | None = None,
        pod_path: str | None = None,
        write_manifest: bool = False,
        write_reference_texts: Sequence[str] | Path | None = None,
        reference_tokenizer_dir: str | Path | None = None,
        reference_dtype: str = "float32",
        reference_max_tokens: int = 128,
        **spec: Any,
    ) -> str:
        """Create a WeightRefit for ``checkpoint_dir`` at ``version``; returns its name.

        pod_path: the directory as mounted in the pods when it differs from the trainer's.
        write_manifest / write_reference_texts: write refit-manifest.json and the probe
        reference (from these texts, or a file of one text per line) into the directory
        first. ``adapter="name"``: the directory is a LoRA adapter, served under that name
        (spec.adapter). Other keywords (strategy, max_unavailable, canary, on_failure, port,
        admin_token_secret, queue_policy, thresholds, failure_limit, sequence, labels,
        spec_fields) set the matching spec fields (refit_document.build_refit); unset ones
        take the API defaults.

        Submitting the same name, path and version again returns the existing refit (a
        trainer that retries after a lost answer does not refit twice); the same name with
        another checkpoint is an error.
        """
        ns = namespace or self.namespace
        local = Path(checkpoint_dir)
        path = pod_path or str(checkpoint_dir)
        name = name or default_name(version)
        body = build_refit(name, path, version, fleet_selector=fleet_selector, **spec)
        if write_manifest or write_reference_texts is not None:
            write_checkpoint_files(
                local,
                version,
                write_manifest=write_manifest,
                reference_texts=write_reference_texts,
                tokenizer_dir=Path(reference_tokenizer_dir) if reference_tokenizer_dir else None,
                dtype=reference_dtype,
                max_tokens=reference_max_tokens,
            )
        try:
            created = self.custom.create_namespaced_custom_object(
                API_GROUP, api.VERSION, ns, api.PLURAL, stamped(body)
            )
            self._keep_created(ns, name, created)
        except ApiException as e:
            if e.status != 409:
                raise RefitError(f"creating WeightRefit {ns}/{name}: {_api_message(e)}") from e
            existing = self.get(name, namespace=ns)
            given = existing.get("spec", {})
            ck = given.get("checkpoint") or given.get("adapter") or {}
            if (ck.get("path"), ck.get("version")) != (path, version):
                raise RefitError(
                    f"WeightRefit {ns}/{name} already exists for {ck.get('version')} at "
                    f"{ck.get('path')}; pass another name"
                ) from e
        return name

    # ------------------------------------------------------------------- broadcast
    def broadcast(
        self,
        tensors: Mapping[str, Any],
        version: str,
        *,
        fleet_selector: Mapping[str, str] | str | api.LabelSelector,
        rendezvous: tuple[str, int],
        reference: ProbeReference | Mapping[str, Any] | Path,
        timeout: float,
        namespace: str | None = None,
        name: str | None = None,
        transfer_timeout_seconds: int | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
        on_send: Callable[[int, Any], None] | None = None,
        drafter: Mapping[str, Any] | None = None,
        **spec: Any,
    ) -> dict[str, Any]:
        """Refit the fleet to ``tensors`` (name -> torch tensor, the model's checkpoint names)
        sent from this process, and wait for the verdict: the final status on Succeeded,
        RefitFailed or RefitTimeout otherwise, as ``wait``.

        Writes a ConfigMap ``<name>-weights`` with the transfer manifest (every tensor's
        name, dtype, shape and digest) and the probe ``reference`` (a ProbeReference, its
        JSON document, or a refit-probe.json file), creates the WeightRefit (spec.broadcast
        with the manifest's digest; the ConfigMap is then owned by it), and sends the
        tensors once per round: each time the operator reports ReceiversReady for a round
        not sent yet, it opens the ``rendezvous`` (host, port: where the pods reach this
        process) for that round's world size, announces the round on the WeightRefit and
        sends. AllAtOnce is one round; Rolling and canary refits one per batch.
        ``on_send(round, stats)`` sees each send. ``drafter`` (name -> tensor) is the
        drafter's state for a fleet whose engines run a ``draft_model`` drafter: sent and
        promised in the same transfer under ``contract.DRAFTER_PREFIX`` (such pods refuse a
        broadcast without it, and other pods one with it). Other keywords set spec fields as
        for ``submit``.
        """
        from refit_worker import broadcast as wire  # torch: the trainer's environment only

        if drafter is not None:
            tensors = wire.with_drafter(tensors, drafter)
        ns = namespace or self.namespace
        name = self.create_broadcast(
            wire.build_manifest(tensors), version, fleet_selector=fleet_selector,
            rendezvous=rendezvous, reference=reference, namespace=ns, name=name,
            transfer_timeout_seconds=transfer_timeout_seconds, **spec,
        )  # fmt: skip
        rounds = BroadcastRounds(self, name, ns, timeout, on_update)
        transfer_timeout = transfer_timeout_seconds or DEFAULT_TRANSFER_TIMEOUT_SECONDS
        for number, world in rounds:
            try:
                with wire.Sender(world, host=rendezvous[0], port=rendezvous[1],
                                 timeout_seconds=transfer_timeout) as sender:  # fmt: skip
                    rounds.announce(number)
                    stats = sender.send(tensors)
                if on_send is not None:
                    on_send(number, stats)
            except (wire.TransportError, RuntimeError, OSError) as e:
                # The pods' receive fails too: the operator ends their passes, and the
                # refit's verdict says what happened to the fleet.
                log.warning("round %d of %s: the send failed: %s", number, name, e)
        return rounds.verdict()

    def create_broadcast(
        self,
        manifest: TransferManifest,
        version: str,
        *,
        fleet_selector: Mapping[str, str] | str | api.LabelSelector,
        rendezvous: tuple[str, int],
        reference: ProbeReference | Mapping[str, Any] | Path,
        namespace: str | None = None,
        name: str | None = None,
        transfer_timeout_seconds: int | None = None,
        **spec: Any,
    ) -> str:
        """The first half of ``broadcast``, for a sender of its own (a trainer engine through
        weight_sync.RefitWeightSyncClient): the ConfigMap ``<name>-weights`` with
        ``manifest`` (the promise of the tensors to be sent) and the probe ``reference``, and
        the WeightRefit pinning the manifest's digest; returns the refit's name. Follow its
        rounds with ``BroadcastRounds``."""
        ns = namespace or self.namespace
        name = name or default_name(version)
        # The reference of the tensors this call sends, so of ``version``: the operator
        # refuses a ConfigMap reference of any other version (a stale one).
        doc = {**_reference_doc(reference), "version": version}
        source: dict[str, Any] = {
            "rendezvous": {"host": rendezvous[0], "port": rendezvous[1]},
            "manifest": {"configMapRef": {"name": f"{name}-weights"}, "digest": manifest.digest},
        }
        if transfer_timeout_seconds is not None:
            source["timeoutSeconds"] = transfer_timeout_seconds
        body = build_refit(
            name, "", version, fleet_selector=fleet_selector, broadcast=source,
            probe_reference_config_map=f"{name}-weights", **spec,
        )  # fmt: skip
        core: Any = k8s.CoreV1Api(self.api_client)
        config_map = {
            "metadata": {"name": f"{name}-weights"},
            "data": {
                "transfer-manifest.json": json.dumps(manifest.to_json_dict()),
                "refit-probe.json": json.dumps(doc),
            },
        }
        try:  # before the WeightRefit: the operator's preflight reads it
            core.create_namespaced_config_map(ns, config_map)
        except ApiException as e:
            raise RefitError(f"creating ConfigMap {ns}/{name}-weights: {_api_message(e)}") from e
        try:
            created = self.custom.create_namespaced_custom_object(
                API_GROUP, api.VERSION, ns, api.PLURAL, stamped(body)
            )
        except ApiException as e:
            core.delete_namespaced_config_map(f"{name}-weights", ns)
            raise RefitError(f"creating WeightRefit {ns}/{name}: {_api_message(e)}") from e
        # Owned by the refit: the history policy's deletion of the refit takes it along.
        owner = {"apiVersion": API_VERSION, "kind": api.KIND, "name": name,
                 "uid": created["metadata"]["uid"]}  # fmt: skip
        core.patch_namespaced_config_map(
            f"{name}-weights", ns, {"metadata": {"ownerReferences": [owner]}}
        )
        self._keep_created(ns, name, created)
        return name

    def _keep_created(self, ns: str, name: str, created: Any) -> None:
        """The create's answer, for the wait that follows: it watches from its
        resourceVersion instead of a GET."""
        if isinstance(created, dict) and "metadata" in created:
            self._created[(ns, name)] = created
            while len(self._created) > CREATED_KEPT:  # submitted, never waited for
                del self._created[next(iter(self._created))]

    def _announce(self, name: str, ns: str, number: int) -> None:
        """Tell the operator this process listens for round ``number`` (rounds.py)."""
        patch = {"metadata": {"annotations": {SENDING_ANNOTATION: str(number)}}}
        try:
            self.custom.patch_namespaced_custom_object(
                API_GROUP, api.VERSION, ns, api.PLURAL, name, patch
            )
        except ApiException as e:
            raise RefitError(f"announcing round {number} on {ns}/{name}: {_api_message(e)}") from e

    # ------------------------------------------------------------------------ read
    def get(self, name: str, *, namespace: str | None = None) -> dict[str, Any]:
        ns = namespace or self.namespace
        try:
            doc: dict[str, Any] = self.custom.get_namespaced_custom_object(
                API_GROUP, api.VERSION, ns, api.PLURAL, name
            )
        except ApiException as e:
            if e.status == 404:
                raise RefitError(f"WeightRefit {ns}/{name} not found") from e
            raise RefitError(f"reading WeightRefit {ns}/{name}: {_api_message(e)}") from e
        return doc

    def list_refits(self, *, namespace: str | None = None) -> list[dict[str, Any]]:
        """The namespace's WeightRefits, oldest first."""
        ns = namespace or self.namespace
        try:
            doc = self.custom.list_namespaced_custom_object(API_GROUP, api.VERSION, ns, api.PLURAL)
        except ApiException as e:
            raise RefitError(f"listing WeightRefits in {ns}: {_api_message(e)}") from e
        items: list[dict[str, Any]] = doc.get("items", [])
        return sorted(
            items,
            key=lambda d: times.order_key(times.order_of(d["metadata"]), d["metadata"]["name"]),
        )

    # ------------------------------------------------------------------------ wait
    def wait(
        self,
        name: str,
        timeout: float,
        *,
        namespace: str | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Block until the refit reaches a final phase: its status on Succeeded; RefitFailed
        (with the operator's reason) on Failed, Halted, RolledBack or Superseded;
        RefitTimeout after ``timeout`` seconds. ``on_update`` sees every status change."""
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        ns = namespace or self.namespace
        watched = WatchedFailures()
        last: dict[str, Any] | None = None
        for status in self._statuses(name, ns, timeout, self._created.pop((ns, name), None)):
            last = _follow(status, last, on_update, watched)
            if _final(status):
                return self._verdict(name, ns, status, watched)
        raise AssertionError("unreachable: _statuses ends only by raising")

    def _statuses(
        self, name: str, ns: str, timeout: float, created: dict[str, Any] | None = None
    ) -> Iterator[dict[str, Any]]:
        """The refit's status now and at each change after it, for as long as the caller
        iterates; RefitTimeout once ``timeout`` seconds have passed. A read, then a watch
        from the version just read (no change is missed between them); when the watch ends
        (its timeout, an expired resourceVersion, a dropped connection) the same again.
        ``created``: the refit as this client's create returned it, which stands for the
        first read (the watch starts from the version the create wrote)."""
        deadline = time.monotonic() + timeout
        while True:
            doc, created = created or self.get(name, namespace=ns), None
            status = doc.get("status") or {}
            yield status
            left = deadline - time.monotonic()
            if left <= 0:
                raise RefitTimeout(name, timeout, status)
            for status in self._watch(name, ns, doc["metadata"]["resourceVersion"], left):
                yield status
                if time.monotonic() > deadline:
                    raise RefitTimeout(name, timeout, status)

    def _verdict(
        self, name: str, ns: str, status: dict[str, Any], watched: WatchedFailures
    ) -> dict[str, Any]:
        if status.get("phase") == "Succeeded":
            return status
        if status.get("phase") == "RolledBack" and not watched.failures:
            self._failures_from_events(name, ns, watched)
        raise watched.failed(name, status)

    def _failures_from_events(self, name: str, ns: str, watched: WatchedFailures) -> None:
        """The refit ended before we watched it: its Events still say what failed."""
        try:
            core: Any = k8s.CoreV1Api(self.api_client)
            resp = core.list_namespaced_event(
                ns, field_selector=f"involvedObject.name={name}", _preload_content=False
            )
            events = sorted(json.loads(resp.data)["items"],
                            key=lambda e: e.get("lastTimestamp") or "")  # fmt: skip
        except (ApiException, ValueError, KeyError):
            return  # Events are best effort; the status still says how the refit ended
        for e in events:
            m = _POD_EVENT.match(e.get("message", ""))
            if e.get("reason") in (Reason.PodRefitFailed, Reason.PodRefitInconclusive) and m:
                phase = e["reason"].removeprefix("PodRefit")
                watched.failures[m[1]] = PodFailure(m[1], phase, m[2], m[3])
            elif e.get("type") == "Warning" and "rolling back to" in e.get("message", ""):
                watched.cause = str(e.get("reason", ""))

    def _watch(self, name: str, ns: str, rv: str, left: float) -> Any:
        w = k8s_watch.Watch()
        try:
            stream = w.stream(
                self.custom.list_namespaced_custom_object,
                API_GROUP,
                api.VERSION,
                ns,
                api.PLURAL,
                field_selector=f"metadata.name={name}",
                resource_version=rv,
                timeout_seconds=max(1, min(int(left), 60)),
                _request_timeout=min(left, 60) + 5,
            )
            for event in stream:
                if event["type"] == "DELETED":
                    raise RefitError(f"WeightRefit {ns}/{name} was deleted while waiting")
                if event["type"] in ("ADDED", "MODIFIED"):
                    yield event["object"].get("status") or {}
        except ApiException as e:
            if e.status != 410:  # 410 Gone: resourceVersion too old; re-read and watch again
                raise RefitError(f"watching WeightRefit {ns}/{name}: {_api_message(e)}") from e
        except (OSError, ValueError, urllib3.exceptions.HTTPError):
            # The connection dropped or timed out: the caller re-reads and watches again.
            return
        finally:
            w.stop()


class BroadcastRounds:
    """The trainer's side of a broadcast refit's handshake (docs/broadcast.md, "The
    handshake"), for whoever sends: iterating yields ``(round, world size)`` for each round
    the operator reports ReceiversReady and that was not yielded before, and ends once the
    refit's phase is final; the sender opens the rendezvous for that world, ``announce``s
    the round, and sends. ``verdict()`` waits for the final phase (skipping rounds nobody
    sends) and returns its status on Succeeded, raises RefitFailed with the operator's
    reason otherwise, RefitTimeout once ``timeout`` seconds have passed since this was made.
    """

    def __init__(
        self,
        refits: RefitClient,
        name: str,
        namespace: str,
        timeout: float,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.refits, self.name, self.namespace = refits, name, namespace
        self.on_update = on_update
        self.watched = WatchedFailures()
        self.final: dict[str, Any] | None = None
        created = refits._created.pop((namespace, name), None)  # create_broadcast's answer
        self._statuses = refits._statuses(name, namespace, timeout, created)
        self._yielded = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        last: dict[str, Any] | None = None
        for status in self._statuses:
            last = _follow(status, last, self.on_update, self.watched)
            if _final(status):
                self.final = status
                return
            ready = _round_ready(status)
            if ready is not None and ready[0] > self._yielded:
                self._yielded = ready[0]
                yield ready

    def announce(self, number: int) -> None:
        """Tell the operator this process listens for round ``number`` (rounds.py)."""
        self.refits._announce(self.name, self.namespace, number)

    def verdict(self) -> dict[str, Any]:
        if self.final is None:
            for _ in self:
                pass
        assert self.final is not None  # _statuses ends only by raising
        return self.refits._verdict(self.name, self.namespace, self.final, self.watched)


def _follow(
    status: dict[str, Any],
    last: dict[str, Any] | None,
    on_update: Callable[[dict[str, Any]], None] | None,
    watched: WatchedFailures,
) -> dict[str, Any]:
    """One status read while following a refit: ``on_update`` on a change, the failures
    kept; returns the status as the new ``last``."""
    if status != last and on_update is not None:
        on_update(status)
    watched.observe(status)
    return status


def _round_ready(status: Mapping[str, Any]) -> tuple[int, int] | None:
    """(round, world size) while the operator reports a round's receivers ready."""
    ready = any(
        c.get("type") == Reason.ReceiversReady and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    b = status.get("broadcast") or {}
    if not ready or b.get("state") not in ("Ready", "Sending") or int(b.get("worldSize", 0)) < 2:
        return None
    return int(b["round"]), int(b["worldSize"])


def _reference_doc(reference: ProbeReference | Mapping[str, Any] | Path) -> dict[str, Any]:
    """The probe reference as refit-probe.json's document, checked."""
    try:
        if isinstance(reference, ProbeReference):
            return reference.to_json_dict()
        doc = json.loads(reference.read_text()) if isinstance(reference, Path) else reference
        return ProbeReference.from_json_dict(doc).to_json_dict()
    except (ContractError, OSError, ValueError) as e:
        raise RefitError(f"probe reference unusable: {e}") from e


def _final(status: Mapping[str, Any]) -> bool:
    return status.get("phase") in api.TERMINAL_PHASES


def _api_message(e: ApiException) -> str:
    try:
        body = json.loads(e.body or "")
        return str(body.get("message") or e.reason)
    except ValueError:
        return f"HTTP {e.status} {e.reason}"


# ------------------------------------------------------------ module-level shortcuts
def submit(
    checkpoint_dir: str | Path,
    version: str,
    *,
    fleet_selector: Mapping[str, str] | str | api.LabelSelector,
    namespace: str | None = None,
    kubeconfig: str | Path | None = None,
    **kwargs: Any,
) -> str:
    """RefitClient(...).submit(...) with a client made for this one call."""
    with RefitClient(namespace=namespace, kubeconfig=kubeconfig) as c:
        return c.submit(checkpoint_dir, version, fleet_selector=fleet_selector, **kwargs)


def wait(
    name: str,
    timeout: float,
    *,
    namespace: str | None = None,
    kubeconfig: str | Path | None = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """RefitClient(...).wait(...) with a client made for this one call."""
    with RefitClient(namespace=namespace, kubeconfig=kubeconfig) as c:
        return c.wait(name, timeout, on_update=on_update)
