"""TRL's GRPOTrainer trains through Refit: ``GRPOTrainer(rollout_func=RefitRollout(...))``.

    from refit_client import RefitClient
    from refit_client.integrations.trl import RefitRollout

    rollout = RefitRollout(RefitClient(namespace="rl"), fleet_selector="app=rollout",
                           port=8000, probe_token_ids=ids, rendezvous=("10.0.0.5", 29600))
    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), reward_funcs=[...],
                          train_dataset=..., rollout_func=rollout, callbacks=[rollout.callback()])

TRL 1.16's ``rollout_func`` (experimental there) receives the prompts of one generation
batch (each repeated ``num_generations`` times, consecutively) and the trainer. When the
trainer's global step moved since the last publish, the policy in memory is published
through ``RefitClient`` (broadcast from memory by default, or a checkpoint written under
``checkpoint_root``) with a probe reference scored by that same model, and the verdict is
awaited: ``RefitFailed``/``RefitTimeout`` propagate, so no rollout is ever generated from
weights the operator has not probed. Generation then goes to the fleet's units the operator's
traffic gate admits and that serve the published version, by their records (spread across
them): each pod, or with ``groups`` (spec.fleet.groups: replicas that span several pods, a
LeaderWorkerSet group) each group's leader, the only pod of it with vLLM's API, judged by the
group's record and the run of every member (core/groups.py). The route is vLLM's
token-in/token-out ``/inference/v1/generate``, which
needs the pods started with ``--enable-scale-out``: it returns each output's weight-version
spans, and a completion whose spans are not exactly the published version raises
``StaleRollout``. ``route="completions"`` generates through ``/v1/completions`` instead (what
TRL's own client speaks; any vLLM server), which returns no spans: a pod's completions are
then taken at the published version only if its records say it served that version, probed
and in traffic, both before its requests and after them, with the same pass and no restart
in between (a pod, or a member of its group, refit, restarted or replaced meanwhile raises
``StaleRollout``). TRL's interface gives
the rollout function no hook at the end of training: ``callback()`` publishes the final
weights from ``on_train_end``.

TRL and torch are imported lazily (the operator's environment has neither).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from refit_operator.core import api
from refit_operator.core import groups as pod_groups
from refit_operator.core.gate import gate, served
from refit_operator.core.podview import PodView

from ..client import RefitClient
from ..refit_document import default_name, parse_selector

log = logging.getLogger(__name__)
READY_GATE = "refit.rollout.dev/weights-ready"  # refit_worker.contract.READINESS_GATE
# Where each route generates, and how a completion's version is known: the route's own
# weight-version spans, or the pod's records read before and after its requests.
ROUTES = {"generate": "/inference/v1/generate", "completions": "/v1/completions"}


RECORDS_KEPT = 1000  # the StepRecords a RefitRollout keeps, the newest


class StaleRollout(RuntimeError):
    """A completion was not generated (entirely) at the version the trainer published."""


@dataclass
class StepRecord:
    """What one GRPO step cost and showed: the publish and the rollouts generated after it."""

    step: int
    version: str
    refit: str = ""
    publish_seconds: float = 0.0  # reference + broadcast send or checkpoint write
    operator_seconds: float = 0.0  # WeightRefit created -> Succeeded (less the send)
    generation_seconds: float = 0.0
    # time.monotonic() of the trainer process when the publish began (the rollout function
    # entered after the optimizer step) and when the step's first generate request went out:
    # with the optimizer step's end they time how long the fleet kept the trainer waiting.
    publish_began_at: float | None = None
    first_request_at: float | None = None
    pods: dict[str, int] = field(default_factory=dict)  # completions per pod
    max_abs_logprob_diff: float | None = None  # trainer fp32 vs fleet, sampled tokens


def group_prompts(prompts: Sequence[Any]) -> list[tuple[int, int]]:
    """(start, count) of each run of equal consecutive prompts: TRL repeats each prompt
    ``num_generations`` times in a row, and one request with n=count serves a run."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


@dataclass(frozen=True)
class Endpoints:
    """Where a batch's rollouts may go: ``urls`` (unit name, base URL), sorted by name, and
    ``refused`` (unit name -> why not) for every other unit of the fleet."""

    urls: list[tuple[str, str]]
    refused: dict[str, str]


def fleet_units(pods: Sequence[Mapping[str, Any]], groups: api.Groups | None) -> list[PodView]:
    """The fleet's units as the operator counts them (core/groups.py): each pod, or with
    ``groups`` each pod group as its leader's view with the group folded in."""
    return pod_groups.units([PodView.from_pod(p) for p in pods], groups)


def refusal(unit: PodView, version: str | None) -> str:
    """Why rollouts taken at ``version`` may not be generated on ``unit`` ("" when they may):
    the operator's traffic gate holds it out (core/gate.py: every track's record on the pod,
    and for a group its record on the leader and every member present, running and in the run
    that record was made in), its weights-ready condition is not True on every pod of it, or
    its base weights serve another version. ``version`` None: any probed version will do (an
    asynchronous run, whose samples carry the version they were generated at)."""
    verdict = gate(unit)
    if not verdict.ready:
        return f"{verdict.reason}: {verdict.message}"
    if not unit.ready:
        pods = "every pod of the group" if unit.members else "the pod"
        return f"out of traffic: the weights-ready condition is not True on {pods}"
    serves = served(unit.records[""])  # the gate let it in: it has a base record
    if version is not None and serves != version:
        return f"serves {serves or 'no probed version'}, not {version}"
    return ""


def rollout_endpoints(
    pods: Sequence[Mapping[str, Any]],
    port: int,
    version: str | None,
    groups: api.Groups | None = None,
) -> Endpoints:
    """Where rollouts at ``version`` (None: any) may go: every unit ``refusal`` lets
    through, with a pod IP and, where a kubelet reports it, the Ready condition not False on
    each of its pods. A group generates on its leader only (its followers have no vLLM API)."""
    # What each pod's own object says, for the kubelet's word and a reason's details.
    phase = {
        p["metadata"]["name"]: "being deleted"
        if p["metadata"].get("deletionTimestamp")
        else str((p.get("status") or {}).get("phase") or "no phase")
        for p in pods
    }
    kubelet_ready = {
        p["metadata"]["name"]: all(
            c.get("status") != "False"
            for c in (p.get("status") or {}).get("conditions") or []
            if c.get("type") == "Ready"
        )
        for p in pods
    }
    urls: list[tuple[str, str]] = []
    refused: dict[str, str] = {}
    for unit in fleet_units(pods, groups):
        why = refusal(unit, version)
        down = [f"{n}: {phase[n]}" for n in (unit.name, *unit.members) if phase[n] != "Running"]
        if why and down and unit.members:
            why += f" ({', '.join(down)})"
        if not why:
            not_ready = [n for n in (unit.name, *unit.members) if not kubelet_ready.get(n, False)]
            if not_ready:
                why = f"the kubelet reports {', '.join(not_ready)} not Ready"
            elif not unit.ip:
                why = f"pod {unit.name} has no pod IP"
        if why:
            refused[unit.name] = why
        else:
            urls.append((unit.name, f"http://{unit.ip}:{port}"))
    return Endpoints(sorted(urls), refused)


def sampling_params(trainer: Any, n: int) -> dict[str, Any]:
    """vLLM sampling parameters from TRL's own settings on the trainer."""
    params: dict[str, Any] = {
        "n": n,
        "temperature": trainer.temperature,
        "max_tokens": trainer.max_completion_length,
        "logprobs": 0,
    }
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(trainer, name, None)
        if value is not None:
            params[name] = value
    params.update(getattr(trainer.args, "generation_kwargs", None) or {})
    return params


def parse_choice(choice: Mapping[str, Any], version: str) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from one /inference/v1/generate choice; StaleRollout
    unless its weight-version spans say every token came from ``version``."""
    ids, logprobs = choice_tokens(choice)
    spans = choice.get("weight_versions")
    if spans is None:
        raise StaleRollout("the pod returned no weight-version spans (--enable-scale-out?)")
    got = {s["version"] for s in spans}
    covered = sum(int(s["end"]) - int(s["start"]) for s in spans)
    if got != {version} or covered != len(ids):
        raise StaleRollout(f"completion generated at {sorted(got)}, expected {version}")
    return ids, logprobs


def choice_tokens(choice: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from a choice of either route: /inference/v1/generate
    (``logprobs.content``) or /v1/completions with ``return_token_ids`` (``token_logprobs``)."""
    ids = list(choice.get("token_ids") or [])
    got = choice.get("logprobs") or {}
    if "content" in got:
        logprobs = [float(c["logprob"]) for c in got.get("content") or []]
    else:
        logprobs = [float(x) for x in got.get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise StaleRollout(f"{len(ids)} tokens but {len(logprobs)} logprobs")
    return ids, logprobs


def served_throughout(before: PodView | None, after: PodView | None, version: str) -> str:
    """Why a unit's completions, returned without weight-version spans, cannot be taken at
    ``version`` ("" when they can): by its records it served ``version`` (``refusal``: the
    gate lets it through, probed, in traffic) before its requests and after them, with the
    same pass record, the same pod object, no container restart and, for a group, the same
    followers in between. A refit away and back to the same version in between changes the
    pass record, so it is caught too."""
    if before is None or after is None:
        return "the pod left the fleet while it generated"
    for when, view in (("before", before), ("after", after)):
        why = refusal(view, version)
        if why:
            return f"{when} its requests: {why}"
    if (before.uid, before.restarts, before.incarnation, before.progress) != (
        after.uid, after.restarts, after.incarnation, after.progress,
    ):  # fmt: skip
        return "the pod (or a member of its group) was refit or restarted while it generated"
    return ""


def fleet_groups(
    spec: Mapping[str, Any], groups: api.Groups | Mapping[str, str] | None
) -> tuple[dict[str, Any], api.Groups | None]:
    """The publish keywords (``spec``, for RefitClient) with spec.fleet.groups set from
    ``groups``, and the groups the fleet's units are made of: from ``groups``, else from
    ``spec_fields={"fleet": {"groups": ...}}`` in ``spec``. Given in both places, they must
    agree; an unknown field of a mapping is refused (the model would drop it silently)."""
    out = dict(spec)
    fields = dict(out.get("spec_fields") or {})
    fleet = dict(fields.get("fleet") or {})
    found = []
    for given in (groups, fleet.get("groups")):
        if given is None or isinstance(given, api.Groups):
            found.append(given)
            continue
        known = {n for f, info in api.Groups.model_fields.items() for n in (f, info.alias)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(
                f"groups: unknown field(s) {', '.join(unknown)} (groupLabel, indexLabel)"
            )
        found.append(api.Groups.model_validate(dict(given)))
    mine, theirs = found
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError("groups and spec_fields' fleet.groups disagree: give them once")
    chosen = mine if mine is not None else theirs
    if chosen is not None:
        out["spec_fields"] = {**fields, "fleet": {**fleet, "groups": chosen.dump()}}
    return out, chosen


class RefitRollout:
    """The ``rollout_func`` (see the module's docstring). ``records`` holds a StepRecord per
    published step, the last RECORDS_KEPT of them (a long run's memory stays flat).
    ``groups`` (an api.Groups, or its fields as the API spells them: ``{}`` for
    LeaderWorkerSet's labels) makes the fleet one of pod groups (``fleet_groups``)."""

    def __init__(
        self,
        client: RefitClient,
        *,
        fleet_selector: str | Mapping[str, str],
        port: int,
        probe_token_ids: Sequence[Sequence[int]],
        rendezvous: tuple[str, int] | None = None,
        checkpoint_root: Path | None = None,
        pod_root: str | None = None,
        service_url: str | None = None,
        model_name: str | None = None,
        version_prefix: str = "grpo",
        refit_timeout: float = 600,
        request_timeout: float = 300,
        spec: Mapping[str, Any] | None = None,
        route: str = "generate",
        groups: api.Groups | Mapping[str, str] | None = None,
    ) -> None:
        if route not in ROUTES:
            raise ValueError(f"route {route!r}: one of {', '.join(ROUTES)}")
        if route == "completions" and service_url:
            # Behind a Service the pod that answered is unknown, so its records cannot vouch.
            raise ValueError(
                "route 'completions' needs the pods, not service_url: only the generate "
                "route's spans name the version behind a Service"
            )
        if (rendezvous is None) == (checkpoint_root is None):
            raise ValueError("give exactly one of rendezvous (broadcast) and checkpoint_root")
        if not probe_token_ids:
            raise ValueError("probe_token_ids is empty: the operator's probe needs prompts")
        self.client, self.selector, self.port = client, fleet_selector, port
        # The pods to list, as a label-selector string (a bad selector fails here, early).
        self.label_selector = parse_selector(fleet_selector).canonical()
        self.probe_token_ids = [list(ids) for ids in probe_token_ids]
        self.rendezvous, self.checkpoint_root, self.pod_root = rendezvous, checkpoint_root, pod_root
        self.service_url, self.model_name = service_url, model_name
        self.version_prefix, self.refit_timeout = version_prefix, refit_timeout
        # Pod groups (spec.fleet.groups), given here or in spec's spec_fields: the refits
        # published say so, and generation goes to the groups' leaders.
        self.spec, self.groups = fleet_groups({"strategy": "AllAtOnce", **(spec or {})}, groups)
        self.route = route
        from refit_worker.contract import CLIENT_KEEPALIVE_SECONDS  # lazily, as everywhere here

        # Idle connections expire before vLLM closes them (CLIENT_KEEPALIVE_SECONDS).
        keepalive = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_SECONDS)
        self.http = httpx.Client(timeout=request_timeout, limits=keepalive)
        self.records: deque[StepRecord] = deque(maxlen=RECORDS_KEPT)
        self.published: StepRecord | None = None
        self._next_pod = 0

    # ------------------------------------------------------------------ publish
    def publish(self, model: Any, step: int) -> StepRecord:
        """Refit the fleet to ``model`` as ``<prefix>-step-<step>`` and wait for Succeeded."""
        from refit_worker import checkpoint, reference
        from refit_worker.broadcast import model_tensors

        version = f"{self.version_prefix}-step-{step}"
        rec = StepRecord(step=step, version=version, refit=default_name(version))
        started = rec.publish_began_at = time.monotonic()
        ref = reference.reference_from_model(
            model,
            self.probe_token_ids,
            version=version,
            tool="refit_client.integrations.trl",
        )
        referenced = time.monotonic()
        if self.rendezvous is not None:
            sent: list[float] = []
            self.client.broadcast(
                model_tensors(model), version, fleet_selector=self.selector,
                rendezvous=self.rendezvous, reference=ref, timeout=self.refit_timeout,
                name=rec.refit, port=self.port, on_send=lambda _n, s: sent.append(s.seconds),
                **self.spec,
            )  # fmt: skip
            total = time.monotonic() - started
            rec.publish_seconds = referenced - started + sum(sent)
            rec.operator_seconds = total - rec.publish_seconds
        else:
            assert self.checkpoint_root is not None
            directory = self.checkpoint_root / version
            model.save_pretrained(directory, safe_serialization=True)
            checkpoint.write_manifest(directory)  # after every shard: the pods verify it
            reference.write_reference(directory, ref)
            rec.publish_seconds = time.monotonic() - started
            pod_path = f"{self.pod_root}/{version}" if self.pod_root else None
            self.client.submit(
                directory, version, fleet_selector=self.selector, name=rec.refit,
                pod_path=pod_path, port=self.port, **self.spec,
            )  # fmt: skip
            self.client.wait(rec.refit, self.refit_timeout)
            rec.operator_seconds = time.monotonic() - started - rec.publish_seconds
        self.published = rec
        self.records.append(rec)
        return rec

    # ---------------------------------------------------------------- generate
    def fleet_pods(self) -> list[dict[str, Any]]:
        """The fleet's Pod objects as the API server returns them."""
        from kubernetes import client as k8s

        core: Any = k8s.CoreV1Api(self.client.api_client)
        items = core.list_namespaced_pod(self.client.namespace, label_selector=self.label_selector)
        return [self.client.api_client.sanitize_for_serialization(p) for p in items.items]

    def endpoints(
        self, version: str, pods: Sequence[Mapping[str, Any]] | None = None
    ) -> list[tuple[str, str]]:
        """(name, base URL) to generate from at ``version``: the Service, else the units
        ``rollout_endpoints`` admits (each group's leader). StaleRollout, with every unit's
        reason, when none is admitted."""
        if self.service_url:
            return [("service", self.service_url)]
        listed = self.fleet_pods() if pods is None else pods
        found = rollout_endpoints(listed, self.port, version, self.groups)
        refused = "; ".join(f"{name}: {why}" for name, why in sorted(found.refused.items()))
        if not found.urls:
            hint = ""
            if self.groups is None and any(
                api.LWS_GROUP_LABEL in (p["metadata"].get("labels") or {}) for p in listed
            ):
                hint = " (the pods carry LeaderWorkerSet's group labels: pass groups=)"
            raise StaleRollout(
                f"no unit selected by {self.label_selector!r} serves {version} in traffic "
                f"to generate from{hint}: {refused or 'no pods'}"
            )
        if refused:
            log.warning("not generating at %s on: %s", version, refused)
        return found.urls

    def _request(self, url: str, ids: list[int], params: dict[str, Any]) -> list[Any]:
        """One prompt's ``n`` completions from one pod, by the rollout's route."""
        body: dict[str, Any]
        if self.route == "generate":
            body = {"token_ids": ids, "sampling_params": params}
        else:
            body = {"prompt": ids, "return_token_ids": True, **params}
        if self.model_name:
            body["model"] = self.model_name
        resp = self.http.post(url + ROUTES[self.route], json=body)
        resp.raise_for_status()
        return list(resp.json()["choices"])

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        model = trainer.accelerator.unwrap_model(trainer.model)
        step = int(trainer.state.global_step)
        if self.published is None or self.published.step != step:
            self.publish(model, step)
        rec = self.published
        assert rec is not None
        tok = trainer.processing_class
        started = time.monotonic()
        prompt_ids: list[list[int]] = []
        completion_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        pods: list[str] = []
        listed = None if self.service_url else self.fleet_pods()
        urls = self.endpoints(rec.version, listed)
        for start, count in group_prompts(prompts):
            ids = list(tok(text=prompts[start])["input_ids"])
            name, url = urls[self._next_pod % len(urls)]  # spread the prompts over the units
            self._next_pod += 1
            if rec.first_request_at is None:
                rec.first_request_at = time.monotonic()
            for choice in self._request(url, ids, sampling_params(trainer, count)):
                if self.route == "generate":
                    got_ids, got_lp = parse_choice(choice, rec.version)
                else:
                    got_ids, got_lp = choice_tokens(choice)
                prompt_ids.append(ids)
                completion_ids.append(got_ids)
                logprobs.append(got_lp)
                pods.append(name)
        if self.route == "completions":
            assert listed is not None
            self._check_served(listed, set(pods), rec.version)
        rec.generation_seconds += time.monotonic() - started
        for name in pods:
            rec.pods[name] = rec.pods.get(name, 0) + 1
        diff = max_abs_logprob_diff(model, prompt_ids, completion_ids, logprobs)
        rec.max_abs_logprob_diff = max(rec.max_abs_logprob_diff or 0.0, diff)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "weight_version": [rec.version] * len(pods),
            "pod": pods,
        }

    def _check_served(
        self, listed: Sequence[Mapping[str, Any]], used: set[str], version: str
    ) -> None:
        """StaleRollout unless each unit that generated served ``version`` throughout, by its
        records (a group's: its leader's and every member's) read before its requests
        (``listed``) and now."""
        before = {v.name: v for v in fleet_units(listed, self.groups)}
        after = {v.name: v for v in fleet_units(self.fleet_pods(), self.groups)}
        for name in sorted(used):
            why = served_throughout(before.get(name), after.get(name), version)
            if why:
                raise StaleRollout(f"pod {name}: {why}")

    def callback(self) -> Any:
        """A TrainerCallback that publishes the final weights when training ends."""
        from transformers import TrainerCallback

        rollout = self

        class PublishFinal(TrainerCallback):
            def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if rollout.published is None or rollout.published.step != state.global_step:
                    rollout.publish(kw["model"], int(state.global_step))

        return PublishFinal()


def max_abs_logprob_diff(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    fleet_logprobs: Sequence[Sequence[float]],
) -> float:
    """The training-inference mismatch: the largest |trainer fp32 logprob - fleet logprob|
    over the sampled tokens (vLLM's default raw logprobs: before temperature)."""
    import torch

    worst = 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for p, c, lp in zip(prompt_ids, completion_ids, fleet_logprobs, strict=True):
                if not c:
                    continue
                x = torch.tensor([list(p) + list(c)], device=model.device)
                logits = model(input_ids=x).logits[0, len(p) - 1 : -1].float()
                mine = torch.log_softmax(logits, -1).gather(1, x[0, len(p) :, None])[:, 0]
                theirs = torch.tensor(lp, dtype=mine.dtype)
                worst = max(worst, float((mine.cpu() - theirs).abs().max()))
    finally:
        model.train(was_training)
    return worst
