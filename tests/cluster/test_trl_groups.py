"""The TRL integration (refit_operator.tools.integrations.trl.RefitRollout) on a fleet of pod
groups (spec.fleet.groups), on the real API server with the real operator and simulated
workers: two groups of two, labelled as LeaderWorkerSet labels them (tests/cluster/
test_operator_groups.py). Each step publishes through the operator (the refit carries the
groups), and its rollouts go to the groups' leaders only, judged by the group's record on the
leader and the run of every member; a group with a follower Pending is left out, with why.

What stands in for the trainer: the model's save_pretrained writes a simulated checkpoint (the
simulated workers score by their own rule, not a torch model's, so the reference is the
checkpoint's own), and the pods' generate and completions routes (which the simulated worker
does not serve with logprobs) answer through an httpx transport that records which pod each
request went to and answers with the weight version that pod's simulated worker holds."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from refit_operator.core.api import LWS_GROUP_LABEL, LWS_INDEX_LABEL
from refit_operator.tools.client import RefitClient
from refit_operator.tools.integrations import trl
from refit_worker import reference

from testbed.fleet import LABELS
from testbed.simworker import make_sim_checkpoint

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

PROMPTS = ["a", "a", "b", "b", "c", "c", "d", "d"]  # 4 prompts, num_generations 2


def add_group(fleet: Any, sims: list[Any], key: str) -> None:
    """Pods ``<key>-0`` (the leader) and ``<key>-1``, each on a simulated worker of its own."""
    for index, sim in enumerate(sims):
        labels = {**LABELS, LWS_GROUP_LABEL: key, LWS_INDEX_LABEL: str(index)}
        fleet.add_pod(f"{key}-{index}", sim, labels=labels)


def trainer_at(step: int) -> Any:
    """What RefitRollout reads of TRL's GRPOTrainer; its model writes a simulated checkpoint."""
    model = SimpleNamespace(
        save_pretrained=lambda d, safe_serialization: make_sim_checkpoint(Path(d), Path(d).name)
    )
    return SimpleNamespace(
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        model=model,
        state=SimpleNamespace(global_step=step),
        processing_class=lambda text: {"input_ids": [2, 3 + ord(text[0]) % 50]},
        temperature=1.0,
        max_completion_length=3,
        args=SimpleNamespace(generation_kwargs=None),
    )


def test_rollouts_on_groups_go_to_the_leaders_judged_by_every_member(
    harness, sim_fleet, tmp_path, control_plane, monkeypatch
):
    fleet, op = harness
    sims = sim_fleet(4, allowed_root=tmp_path)
    add_group(fleet, sims[0:2], "g1")
    add_group(fleet, sims[2:4], "g2")
    op.start()
    # The simulated checkpoint carries its own probe reference (what the simulated workers
    # score); no torch model to score one, nor to compare logprobs with.
    monkeypatch.setattr(reference, "reference_from_model", lambda *a, **kw: None)
    monkeypatch.setattr(reference, "write_reference", lambda *a, **kw: None)
    monkeypatch.setattr(trl, "max_abs_logprob_diff", lambda *a: 0.0)

    by_ip = {s.ip: s for s in sims}
    sent: list[str] = []  # the pod IP of each request

    def answer(request: httpx.Request) -> httpx.Response:
        """The pod's answer: n completions at the version its simulated worker holds."""
        ip = request.url.host
        sent.append(ip)
        body = json.loads(request.content)
        version = by_ip[ip].state()["weight_version"]
        n = body["sampling_params"]["n"] if "sampling_params" in body else body["n"]
        ids, lps = [5, 6, 7], [-1.0, -2.0, -3.0]
        if request.url.path == trl.ROUTES["generate"]:
            logprobs: dict[str, Any] = {"content": [{"logprob": lp} for lp in lps]}
            spans = [{"version": version, "start": 0, "end": len(ids)}]
            choice = {"token_ids": ids, "logprobs": logprobs, "weight_versions": spans}
        else:
            choice = {"token_ids": ids, "logprobs": {"token_logprobs": lps}}
        return httpx.Response(200, json={"choices": [choice] * n})

    leaders = {sims[0].ip, sims[2].ip}
    with RefitClient(namespace=fleet.ns, kubeconfig=control_plane.kubeconfig) as client:
        rollout = trl.RefitRollout(
            client, fleet_selector=LABELS, port=sims[0].port, probe_token_ids=[[2, 3]],
            checkpoint_root=tmp_path / "ckpt", groups={}, refit_timeout=120,
        )  # fmt: skip
        rollout.http = httpx.Client(transport=httpx.MockTransport(answer))

        # Step 1 (the generate route): published through the operator as groups, rollouts on
        # both leaders, each at the published version by its spans.
        out = rollout(PROMPTS, trainer_at(1))
        refit = fleet.refit("refit-grpo-step-1")
        assert refit["spec"]["fleet"]["groups"] is not None
        assert (refit["status"]["phase"], refit["status"]["targetPods"]) == ("Succeeded", 2)
        assert set(out["weight_version"]) == {"grpo-step-1"} and len(out["pod"]) == len(PROMPTS)
        assert rollout.records[-1].pods == {"g1-0": 4, "g2-0": 4}  # each leader, never a follower
        assert set(sent) == leaders

        # Step 2 (the completions route: no spans, the version is the records' before and
        # after the requests): the group's record on its leader, every member in its run.
        rollout.route = "completions"
        sent.clear()
        out = rollout(PROMPTS, trainer_at(2))
        assert set(out["weight_version"]) == {"grpo-step-2"}
        assert rollout.records[-1].pods == {"g1-0": 4, "g2-0": 4}
        assert set(sent) == leaders
        assert all(s.state()["weight_version"] == "grpo-step-2" for s in (sims[0], sims[2]))

        # A follower of g2 Pending (its node lost, say): g2 is left out, g1 carries the batch.
        fleet.core.patch_namespaced_pod_status("g2-1", fleet.ns, {"status": {"phase": "Pending"}})
        sent.clear()
        out = rollout(PROMPTS, trainer_at(2))  # the same step: no publish
        assert set(out["pod"]) == {"g1-0"} and set(sent) == {sims[0].ip}
        found = trl.rollout_endpoints(rollout.fleet_pods(), sims[0].port, "grpo-step-2",
                                      rollout.groups)  # fmt: skip
        assert [name for name, _ in found.urls] == ["g1-0"]
        assert found.refused == {
            "g2-0": "MemberNotRunning: a pod of group g2-0 is not running (g2-1: Pending)"
        }
    assert all(s.calls() == [] for s in (sims[1], sims[3]))  # followers: never called
