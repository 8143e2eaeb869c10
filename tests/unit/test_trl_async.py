"""The pure parts of refit_client.integrations.trl_async: the staleness rule that decides which
samples an asynchronous run may train on (by the versions the pods served them with), how a
completion's served versions are read from its weight-version spans, what a sync publishes
by default, and the queue that drops (and counts) what the rule refuses."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from refit_client.integrations.trl_async import (
    RefitRolloutWorker,
    RefitWeightTransfer,
    reason_kind,
    served_versions,
    stale_reason,
    version_number,
)

from tests.fixtures.rollout_pods import pod

CLIENT: Any = SimpleNamespace()  # the pure parts never reach the cluster


@pytest.mark.parametrize(
    ("version", "number"),
    [("run-v1", 1), ("run-v12", 12), ("run-v", None), ("run-step-1", None),
     ("other-v1", None), ("run-v1x", None), ("A", None)],
)  # fmt: skip
def test_version_number(version: str, number: int | None) -> None:
    assert version_number(version, "run") == number


# (served versions, consuming version, max_staleness) -> reason kind ("" when trained on)
STALENESS = [
    (("run-v3",), 3, 0, ""),  # on-policy
    (("run-v3",), 4, 0, "stale"),  # one behind, none allowed
    (("run-v3",), 4, 1, ""),
    (("run-v2",), 4, 1, "stale"),
    (("run-v2",), 4, 2, ""),
    (("run-v2", "run-v3"), 4, 1, "stale"),  # frozen by a keep refit: its oldest tokens count
    (("run-v3", "run-v4"), 4, 1, ""),
    (("run-v5",), 4, 3, "ahead"),  # newer than the trainer: never happens, never trained
    (("A",), 1, 9, "foreign"),  # the fleet's version before the run's first sync
    (("run-v2", "other-v2"), 2, 9, "foreign"),
    ((), 2, 9, "unknown"),
]


@pytest.mark.parametrize(("served", "consuming", "max_staleness", "kind"), STALENESS)
def test_the_staleness_rule(
    served: tuple[str, ...], consuming: int, max_staleness: int, kind: str
) -> None:
    why = stale_reason(served, consuming, max_staleness, "run")
    assert (reason_kind(why) if why else "") == kind, why


def test_a_stale_reason_names_the_versions_and_the_bound() -> None:
    assert stale_reason(("run-v2",), 5, 2, "run") == (
        "stale: generated at run-v2, 3 versions behind run-v5 (max_staleness 2)"
    )


@pytest.mark.parametrize(
    ("spans", "tokens", "served", "why"),
    [
        ([{"version": "v1", "start": 0, "end": 4}], 4, ("v1",), ""),
        ([{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 4}], 4,
         ("v1", "v2"), ""),
        (None, 4, (), "no weight-version spans (the pod needs --enable-scale-out)"),
        ([{"version": "v1", "start": 0, "end": 3}], 4, (),
         "weight-version spans cover 3 of 4 tokens"),
        ([], 0, (), ""),
    ],
)  # fmt: skip
def test_served_versions_come_from_the_spans(
    spans: Any, tokens: int, served: tuple[str, ...], why: str
) -> None:
    choice = {} if spans is None else {"weight_versions": spans}
    assert served_versions(choice, tokens) == (served, why)
    if why:
        assert reason_kind(why) == "spans"


def transfer(**kw: Any) -> RefitWeightTransfer:
    return RefitWeightTransfer(
        CLIENT, object(), fleet_selector="app=x", port=8000, probe_token_ids=[[1, 2]],
        rendezvous=("127.0.0.1", 1), **kw,
    )  # fmt: skip


def test_a_sync_is_rolling_one_pod_at_a_time_keeping_requests_in_flight() -> None:
    assert transfer().spec == {"strategy": "Rolling", "max_unavailable": 1,
                               "sequence": {"drainMode": "keep"}}  # fmt: skip
    got = transfer(spec={"max_unavailable": 2, "sequence": {"sleepLevel": 0}}).spec
    assert got == {"strategy": "Rolling", "max_unavailable": 2,
                   "sequence": {"drainMode": "keep", "sleepLevel": 0}}  # fmt: skip


def test_a_transfer_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="probe_token_ids is empty"):
        RefitWeightTransfer(CLIENT, object(), fleet_selector="app=x", port=1,
                            probe_token_ids=[], rendezvous=("h", 1))  # fmt: skip


def worker(max_staleness: int) -> RefitRolloutWorker:
    return RefitRolloutWorker(
        CLIENT, fleet_selector="app=x", port=8000, prompts=["p"], reward_funcs=[],
        tokenizer=None, num_generations=2, max_tokens=4, max_staleness=max_staleness,
        version_prefix="run",
    )  # fmt: skip


def sample(*served: str, reason: str = "") -> SimpleNamespace:
    return SimpleNamespace(served=served, served_reason=reason, unit="vllm-0")


def test_the_queue_hands_over_only_what_the_rule_admits_and_counts_the_rest() -> None:
    w = worker(max_staleness=1)
    w.update_model_version(3)
    for s in [sample("run-v3"), sample("run-v1"), sample("run-v2", "run-v3"),
              sample(reason="weight-version spans cover 3 of 4 tokens"), sample("A"),
              sample("run-v2")]:  # fmt: skip
        w.rollout_buffer.put(s)
    got = w.rollout_buffer.get(timeout=0)
    assert got.served == ("run-v3",)
    assert w.rollout_buffer.get(timeout=0).served == ("run-v2", "run-v3")
    assert w.rollout_buffer.get(timeout=0).served == ("run-v2",)
    report = w.report()
    assert report["dropped"] == {"stale": 1, "spans": 1, "foreign": 1}
    assert report["dropExamples"]["stale"].startswith("stale: generated at run-v1, 2 versions")
    assert report["consumed"][3]["samples"] == 3
    assert report["consumed"][3]["staleness"] == {"0": 1, "1": 2}


def test_the_worker_generates_on_units_in_traffic_at_any_version() -> None:
    from refit_client.integrations.trl import rollout_endpoints

    pods = [pod("a", "10.0.0.1", version="run-v1"), pod("b", "10.0.0.2", version="run-v2"),
            pod("c", "10.0.0.3", gate="False")]  # fmt: skip
    got = rollout_endpoints(pods, 8000, None)
    assert got.urls == [("a", "http://10.0.0.1:8000"), ("b", "http://10.0.0.2:8000")]
    assert sorted(got.refused) == ["c"]


def test_a_worker_refuses_a_negative_bound() -> None:
    with pytest.raises(ValueError, match="max_staleness -1"):
        worker(-1)


def test_a_full_queue_drops_its_oldest_sample_for_the_new_one() -> None:
    """Generation never waits on the trainer: the freshest samples are the ones kept."""
    w = RefitRolloutWorker(
        CLIENT, fleet_selector="app=x", port=8000, prompts=["p"], reward_funcs=[],
        tokenizer=None, num_generations=2, max_tokens=4, max_staleness=2,
        version_prefix="run", queue_maxsize=2,
    )  # fmt: skip
    for v in ("run-v1", "run-v2", "run-v3"):
        w._put(sample(v))
    w.update_model_version(3)
    assert [w.rollout_buffer.get(timeout=0).served for _ in range(2)] == [("run-v2",), ("run-v3",)]
    report = w.report()
    assert report["dropped"] == {"evicted": 1}
    assert report["dropExamples"]["evicted"].endswith("served at run-v1")


def test_the_transfer_keeps_the_last_versions_weights_as_published(monkeypatch) -> None:
    """model_at gives a model at the weights a version was published with, not the live ones
    the optimizer stepped since, even with the live model's forward patched the way TRL's
    add_fused_lm_head does (a closure over the live model); only the last keep_versions."""
    import torch
    from refit_worker import reference
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(reference, "reference_from_model", lambda *a, **k: None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    ))  # fmt: skip
    live_forward = model.forward
    model.forward = lambda *a, **k: live_forward(*a, **k)
    client: Any = SimpleNamespace(broadcast=lambda *a, **k: None)
    t = RefitWeightTransfer(
        client, model, fleet_selector="app=x", port=8000, probe_token_ids=[[1, 2]],
        rendezvous=("127.0.0.1", 1), version_prefix="run", keep_versions=2,
    )  # fmt: skip
    x = torch.tensor([[1, 2, 3]])
    logits = {}
    for n in (1, 2, 3):
        with torch.no_grad():
            model.model.norm.weight.fill_(float(n))
            logits[f"run-v{n}"] = model(input_ids=x).logits
        t.send_weights(iter(model.named_parameters()))
    with torch.no_grad():
        model.model.norm.weight.fill_(9.0)  # the optimizer's next step, in place
    assert t.model_at("run-v1") is None and t.model_at("other-v3") is None
    for version in ("run-v2", "run-v3", "run-v2"):
        at = t.model_at(version)
        assert at is not model and float(at.model.norm.weight[0]) == float(version[-1])
        with torch.no_grad():
            assert torch.allclose(at(input_ids=x).logits, logits[version]), version
    assert [s.phase for s in t.syncs] == ["Succeeded"] * 3
