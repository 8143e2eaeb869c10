"""The pure parts of refit_client.integrations.trl: how TRL's prompt batch is grouped, which
units generate (each pod, or each pod group's leader, judged by the group's record and the run of
every member), which sampling settings go to vLLM, and how a completion is checked against the
version the trainer published (the fail-closed part): by the route's weight-version spans, or,
on /v1/completions, by the unit's records before and after its requests."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from refit_client.integrations.trl import (
    READY_GATE,
    RECORDS_KEPT,
    RefitRollout,
    StaleRollout,
    choice_tokens,
    fleet_groups,
    fleet_units,
    group_prompts,
    parse_choice,
    rollout_endpoints,
    sampling_params,
    served_throughout,
)
from refit_client.refit_error import RefitError
from refit_operator.core.api_spec import LWS_GROUP_LABEL, LWS_INDEX_LABEL, Groups
from refit_operator.core.podview import PodView
from refit_worker.contract import READINESS_GATE

from tests.fixtures.rollout_pods import pod


def test_the_gate_name_is_the_contracts() -> None:
    assert READY_GATE == READINESS_GATE


def test_prompts_repeated_num_generations_times_make_one_request_each() -> None:
    assert group_prompts(["a", "a", "b", "b", "a", "a"]) == [(0, 2), (2, 2), (4, 2)]
    assert group_prompts([]) == []


def test_only_units_in_traffic_at_the_version_generate() -> None:
    pods = [
        pod("b", "10.0.0.2"),
        pod("a", "10.0.0.1", kubelet="True"),
        pod("c", "10.0.0.3", gate="False"),  # failed its probe
        pod("d", "10.0.0.4", kubelet="False"),  # the kubelet says not ready
        pod("e", None),
        pod("f", "10.0.0.6", version="v1"),  # the refit did not count it (another fleet's?)
        pod("g", "10.0.0.7", version=None),  # never probed
        pod("h", "10.0.0.8", restarts=1) | {"status": {  # restarted since its pass
            "phase": "Running", "podIP": "10.0.0.8", "containerStatuses": [{"restartCount": 2}],
            "conditions": [{"type": READY_GATE, "status": "True"}]}},
        pod("i", "10.0.0.9", outcome="", gate="True"),  # a pass runs on it
    ]  # fmt: skip
    got = rollout_endpoints(pods, 8000, "v2")
    assert got.urls == [("a", "http://10.0.0.1:8000"), ("b", "http://10.0.0.2:8000")]
    assert sorted(got.refused) == ["c", "d", "e", "f", "g", "h", "i"]
    assert got.refused["c"] == "out of traffic: the weights-ready condition is not True on the pod"
    assert got.refused["d"] == "the kubelet reports d not Ready"
    assert got.refused["e"] == "pod e has no pod IP"
    assert got.refused["f"] == "serves v1, not v2"
    assert got.refused["g"].startswith("NotProbed: ")
    assert got.refused["h"].startswith("ContainerRestarted")
    assert got.refused["i"].startswith("Refitting")


LWS = Groups()


def member(name: str, group: str, index: int, **over: object) -> dict:
    labels = {"app": "x", LWS_GROUP_LABEL: group, LWS_INDEX_LABEL: str(index)}
    return pod(name, **{"labels": labels, "version": None, **over})  # type: ignore[arg-type]


def group_of_two(key: str, ip: str, *, version: str = "v2", **follower: object) -> list[dict]:
    """A leader and its follower as a pass through the leader left them (the group's record
    on the leader, made with this follower), with ``follower`` changed afterwards."""
    pods = [member(f"{key}-0", key, 0, ip=ip), member(f"{key}-1", key, 1, ip=None, uid="f1")]
    incarnation = fleet_units(pods, LWS)[0].incarnation
    leader = member(f"{key}-0", key, 0, ip=ip, version=version, incarnation=incarnation)
    return [leader, member(f"{key}-1", key, 1, **{"ip": None, "uid": "f1", **follower})]


def test_a_group_generates_on_its_leader_only() -> None:
    """Followers carry no record and have no vLLM API: judged alone, none would be in traffic
    and the leader's record (made with its followers) would not match it alone; as a group,
    the leader generates for the whole group."""
    pods = group_of_two("g1", "10.0.1.1") + group_of_two("g2", "10.0.2.1")
    got = rollout_endpoints(pods, 8000, "v2", LWS)
    assert got.urls == [("g1-0", "http://10.0.1.1:8000"), ("g2-0", "http://10.0.2.1:8000")]
    assert got.refused == {}
    alone = rollout_endpoints(pods, 8000, "v2")  # the same pods without groups: none
    assert alone.urls == []
    # Judged alone, the leader's record names followers it no longer has.
    assert alone.refused["g1-0"].startswith("MemberReplaced")
    assert alone.refused["g1-1"].startswith("NotProbed: ")


@pytest.mark.parametrize(
    ("follower", "why"),
    [
        ({"restarts": 1}, r"^ContainerRestarted: "),  # its container restarted
        ({"uid": "f2"}, r"^MemberReplaced: a pod of group g1-0 was replaced"),  # a new Pod
        ({"phase": "Pending"}, r"^MemberNotRunning: .*group g1-0 .*\(g1-1: Pending\)$"),
        ({"gate": "False"}, "^out of traffic: .* not True on every pod of the group$"),
        ({"kubelet": "False"}, "^the kubelet reports g1-1 not Ready$"),
    ],
)  # fmt: skip
def test_a_follower_restarted_replaced_or_pending_makes_its_group_unusable(follower, why) -> None:
    pods = group_of_two("g1", "10.0.1.1", **follower) + group_of_two("g2", "10.0.2.1")
    got = rollout_endpoints(pods, 8000, "v2", LWS)
    assert got.urls == [("g2-0", "http://10.0.2.1:8000")]  # the other group carries on
    assert re.search(why, got.refused["g1-0"]), got.refused


def test_a_missing_follower_makes_its_group_unusable() -> None:
    pods = group_of_two("g1", "10.0.1.1")[:1] + group_of_two("g2", "10.0.2.1")
    got = rollout_endpoints(pods, 8000, "v2", LWS)
    assert got.urls == [("g2-0", "http://10.0.2.1:8000")]
    # The group's record names its followers (their Pod objects' digest), which no longer
    # match: the gate holds the group out (its reason reads as a restart, since no pod of
    # the group is left to say which member went).
    assert re.search(r"^(MemberReplaced|ContainerRestarted): ", got.refused["g1-0"])


def test_a_pod_without_group_labels_or_a_group_without_its_leader_never_generates() -> None:
    pods = [
        *group_of_two("g1", "10.0.1.1"),
        pod("stray", "10.0.9.9"),  # in traffic at v2, but of no group
        member("g3-1", "g3", 1, ip="10.0.3.2", version="v2"),  # its leader is gone
    ]
    got = rollout_endpoints(pods, 8000, "v2", LWS)
    assert got.urls == [("g1-0", "http://10.0.1.1:8000")]
    assert got.refused["stray"].startswith(
        f"GroupLabelMissing: pod stray has no label {LWS_GROUP_LABEL}"
    )
    assert got.refused["g3-1"].startswith("GroupLeaderMissing: group g3 (g3-1) has no single")


def test_groups_are_given_once_and_go_into_the_published_refits() -> None:
    spec, groups = fleet_groups({"strategy": "AllAtOnce"}, {})
    assert groups == LWS
    assert spec == {"strategy": "AllAtOnce", "spec_fields": {"fleet": {"groups": LWS.dump()}}}
    other = {"groupLabel": "g", "indexLabel": "i"}
    spec, groups = fleet_groups({"spec_fields": {"fleet": {"groups": other}, "x": 1}}, None)
    assert groups == Groups(group_label="g", index_label="i")
    assert spec["spec_fields"] == {"fleet": {"groups": other}, "x": 1}
    assert fleet_groups({}, None) == ({}, None)
    with pytest.raises(ValueError, match="disagree"):
        fleet_groups({"spec_fields": {"fleet": {"groups": other}}}, LWS)
    with pytest.raises(ValueError, match=r"unknown field.* groupKey"):
        fleet_groups({}, {"groupKey": "g"})


def test_sampling_settings_are_trls() -> None:
    trainer = SimpleNamespace(
        temperature=0.7, max_completion_length=12, top_p=0.9, top_k=None, min_p=None,
        repetition_penalty=1.0, args=SimpleNamespace(generation_kwargs={"seed": 3}),
    )  # fmt: skip
    assert sampling_params(trainer, 4) == {
        "n": 4, "temperature": 0.7, "max_tokens": 12, "logprobs": 0, "top_p": 0.9,
        "repetition_penalty": 1.0, "seed": 3,
    }  # fmt: skip


def choice(spans: list[dict] | None, ids: list[int], lps: list[float]) -> dict:
    return {
        "token_ids": ids,
        "weight_versions": spans,
        "logprobs": {
            "content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps, strict=True)]
        },
    }


def test_a_completion_at_the_published_version_is_taken() -> None:
    c = choice([{"version": "v2", "start": 0, "end": 2}], [5, 6], [-0.5, -1.5])
    assert parse_choice(c, "v2") == ([5, 6], [-0.5, -1.5])


@pytest.mark.parametrize(
    ("spans", "why"),
    [
        ([{"version": "v1", "start": 0, "end": 2}], r"\['v1'\], expected v2"),  # stale
        ([{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 2}],
         r"\['v1', 'v2'\]"),  # mixed: the weights changed mid-completion
        ([{"version": "v2", "start": 0, "end": 1}], "expected v2"),  # not every token covered
        (None, "no weight-version spans"),
    ],
)  # fmt: skip
def test_stale_mixed_or_unlabelled_completions_fail_closed(spans, why) -> None:
    with pytest.raises(StaleRollout, match=why):
        parse_choice(choice(spans, [5, 6], [-0.5, -1.5]), "v2")


def test_a_completions_choice_gives_its_tokens_and_logprobs() -> None:
    """/v1/completions with return_token_ids: ``token_ids`` and ``logprobs.token_logprobs``."""
    c = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.5], "tokens": ["a", "b"]}}
    assert choice_tokens(c) == ([5, 6], [-0.5, -1.5])
    with pytest.raises(StaleRollout, match="2 tokens but 1 logprobs"):
        choice_tokens({"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5]}})


def served(name: str, version: str, **over: object) -> PodView:
    """A pod whose last pass brought it to ``version`` (Succeeded), as PodView reads it."""
    return PodView.from_pod(pod(name, version=version, **over))  # type: ignore[arg-type]


def group(version: str = "v2", **follower: object) -> PodView:
    """Group g1 as one unit (its leader's view), ``follower`` changed since its pass."""
    return fleet_units(group_of_two("g1", "10.0.1.1", version=version, **follower), LWS)[0]


def test_a_unit_that_served_the_version_throughout_vouches_for_its_completions() -> None:
    assert served("a", "v2").serving == "v2"
    assert served_throughout(served("a", "v2"), served("a", "v2"), "v2") == ""
    assert group().serving == "v2"
    assert served_throughout(group(), group(), "v2") == ""


@pytest.mark.parametrize(
    ("before", "after", "why"),
    [
        (served("a", "v1"), served("a", "v1"), "before its requests: serves v1, not v2"),
        (served("a", "v2"), served("a", "v3"), "after its requests: serves v3"),
        # Out of traffic now (a refit began): no probed version to vouch.
        (served("a", "v2"), served("a", "v2", gate="False"), "after its requests: out of "),
        # Refit away and back to v2 in between: another pass record.
        (served("a", "v2"), served("a", "v2", started=9.0), "refit or restarted"),
        (served("a", "v2"), served("a", "v2", restarts=1), "refit or restarted"),
        (served("a", "v2"), served("a", "v2", uid="u2"), "refit or restarted"),  # replaced
        (served("a", "v2"), None, "left the fleet"),
        # A follower restarted, replaced or Pending while its leader generated.
        (group(), group(restarts=1), "after its requests: ContainerRestarted"),
        (group(), group(uid="f2"), "after its requests: MemberReplaced"),
        (group(), group(phase="Pending"), "after its requests: MemberNotRunning"),
    ],
)  # fmt: skip
def test_completions_without_spans_fail_closed_unless_the_unit_served_the_version_throughout(
    before, after, why
) -> None:
    assert re.search(why, served_throughout(before, after, "v2"))


def test_a_route_is_checked_when_the_rollout_is_made() -> None:
    common: dict[str, Any] = {"fleet_selector": "app=x", "port": 8000,
                              "probe_token_ids": [[1]], "rendezvous": ("127.0.0.1", 1)}  # fmt: skip
    with pytest.raises(ValueError, match="route 'grpc': one of generate, completions"):
        RefitRollout(SimpleNamespace(), route="grpc", **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the pods, not service_url"):
        RefitRollout(SimpleNamespace(),  # type: ignore[arg-type]
                     route="completions", service_url="http://svc", **common)  # fmt: skip


def test_a_long_run_keeps_a_bounded_record_and_an_early_selector_check() -> None:
    common: dict[str, Any] = dict(port=8000, probe_token_ids=[[1]], rendezvous=("127.0.0.1", 1))
    rollout = RefitRollout(SimpleNamespace(),  # type: ignore[arg-type]
                           fleet_selector={"app": "x", "pool": "a"}, **common)  # fmt: skip
    assert rollout.records.maxlen == RECORDS_KEPT  # memory stays flat over a long run
    assert rollout.label_selector == "app=x,pool=a"
    with pytest.raises(RefitError, match="not key=value"):
        RefitRollout(SimpleNamespace(), fleet_selector="app in (x)", **common)  # type: ignore[arg-type]


def test_with_no_unit_to_generate_from_a_step_fails_with_every_units_reason() -> None:
    common = {"fleet_selector": "app=x", "port": 8000, "probe_token_ids": [[1]],
              "rendezvous": ("127.0.0.1", 1)}  # fmt: skip
    pods = group_of_two("g1", "10.0.1.1", restarts=1)
    rollout = RefitRollout(SimpleNamespace(), groups={}, **common)  # type: ignore[arg-type]
    assert rollout.spec["spec_fields"] == {"fleet": {"groups": LWS.dump()}}
    with pytest.raises(StaleRollout, match=r"serves v2 in traffic to generate from: g1-0: Cont"):
        rollout.endpoints("v2", pods)
    # The same group's pods, its groups not given: a hint, as neither pod is usable alone.
    alone = RefitRollout(SimpleNamespace(), **common)  # type: ignore[arg-type]
    with pytest.raises(StaleRollout, match=r"group labels: pass groups=\): g1-0: .*; g1-1: "):
        alone.endpoints("v2", group_of_two("g1", "10.0.1.1"))
