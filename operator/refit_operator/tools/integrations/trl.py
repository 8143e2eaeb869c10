"""TRL's GRPOTrainer trains through Refit: ``GRPOTrainer(rollout_func=RefitRollout(...))``.

    from refit_operator.tools.client import RefitClient
    from refit_operator.tools.integrations.trl import RefitRollout

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
weights the operator has not probed. Generation then goes to the fleet's Ready pods (spread
across them) through vLLM's token-in/token-out route ``/inference/v1/generate``, which
needs the pods started with ``--enable-scale-out``: it returns each output's weight-version
spans, and a completion whose spans are not exactly the published version raises
``StaleRollout``. ``route="completions"`` generates through ``/v1/completions`` instead (what
TRL's own client speaks; any vLLM server), which returns no spans: a pod's completions are
then taken at the published version only if its records say it served that version, probed
and in traffic, both before its requests and after them, with the same pass and no restart
in between (a pod refit or restarted meanwhile raises ``StaleRollout``). TRL's interface gives
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

from ...core.podview import PodView
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


def ready_pod_urls(pods: Sequence[Mapping[str, Any]], port: int) -> list[tuple[str, str]]:
    """(pod name, base URL) of the pods in traffic, sorted by name: the Refit readiness gate
    True and, where a kubelet reports it, the Ready condition not False."""
    out = []
    for pod in pods:
        conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
        ip = pod.get("status", {}).get("podIP")
        if conds.get(READY_GATE) == "True" and conds.get("Ready") != "False" and ip:
            out.append((pod["metadata"]["name"], f"http://{ip}:{port}"))
    return sorted(out)


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
    """Why a pod's completions, returned without weight-version spans, cannot be taken at
    ``version`` ("" when they can): by its records it served ``version`` (probed, in
    traffic, no restart since) before its requests and after them, with the same pass
    record, the same pod object and no container restart in between. A refit away and back
    to the same version in between changes the pass record, so it is caught too."""
    if before is None or after is None:
        return "the pod left the fleet while it generated"
    for when, view in (("before", before), ("after", after)):
        if view.serving != version:
            served = view.serving or "no probed version"
            return f"the pod served {served} {when} its requests, not {version}"
    if (before.uid, before.restarts, before.progress) != (after.uid, after.restarts,
                                                           after.progress):  # fmt: skip
        return "the pod was refit or restarted while it generated"
    return ""


class RefitRollout:
    """The ``rollout_func`` (see the module's docstring). ``records`` holds a StepRecord per
    published step, the last RECORDS_KEPT of them (a long run's memory stays flat)."""

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
        self.spec = {"strategy": "AllAtOnce", **(spec or {})}
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
            tool="refit_operator.tools.integrations.trl",
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

    def endpoints(self, pods: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[str, str]]:
        """(name, base URL) to generate from: the Service, else the Ready pods."""
        if self.service_url:
            return [("service", self.service_url)]
        urls = ready_pod_urls(self.fleet_pods() if pods is None else pods, self.port)
        if not urls:
            raise StaleRollout(f"no Ready pod selected by {self.label_selector!r} to generate from")
        return urls

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
        urls = self.endpoints(listed)
        for start, count in group_prompts(prompts):
            ids = list(tok(text=prompts[start])["input_ids"])
            name, url = urls[self._next_pod % len(urls)]  # spread the groups over the pods
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
        """StaleRollout unless each pod that generated served ``version`` throughout, by its
        records read before its requests (``listed``) and now."""
        before = {v.name: v for v in map(PodView.from_pod, listed)}
        after = {v.name: v for v in map(PodView.from_pod, self.fleet_pods())}
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
