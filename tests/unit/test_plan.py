from refit_operator.core import plan
from refit_operator.core.api import ProbeSpec, Strategy
from refit_operator.core.plan import RefitRef


def states(**kw: str) -> dict[str, plan.PodState]:
    return kw  # type: ignore[return-value]


def test_all_at_once_starts_everyone():
    s = states(a="todo", b="todo", c="passed")
    assert plan.next_pods(s, Strategy()) == ["a", "b"]


def test_rolling_respects_max_unavailable_int_and_percent():
    s: dict[str, plan.PodState] = {f"p{i}": "todo" for i in range(10)}
    assert len(plan.next_pods(s, Strategy(type="Rolling", max_unavailable=2))) == 2
    assert len(plan.next_pods(s, Strategy(type="Rolling", max_unavailable="30%"))) == 3
    s2 = states(a="active", b="todo", c="todo")
    assert plan.next_pods(s2, Strategy(type="Rolling", max_unavailable=1)) == []
    assert plan.next_pods(s2, Strategy(type="Rolling", max_unavailable="1%")) == []


def test_failed_pods_do_not_stall_rolling():
    s = states(a="failed", b="todo")
    assert plan.next_pods(s, Strategy(type="Rolling", max_unavailable=1)) == ["b"]


def test_canary_first_then_rest():
    s = states(a="todo", b="todo", c="todo")
    assert plan.next_pods(s, Strategy(canary=1)) == ["a"]
    assert plan.next_pods(states(a="active", b="todo", c="todo"), Strategy(canary=1)) == []
    assert plan.next_pods(states(a="passed", b="todo", c="todo"), Strategy(canary=1)) == ["b", "c"]
    assert plan.next_pods(states(a="failed", b="todo"), Strategy(canary=1)) == []


def test_rolling_stages_the_next_batch_ahead():
    rolling = Strategy(type="Rolling", max_unavailable=2)
    s: dict[str, plan.PodState] = {f"p{i}": "todo" for i in range(7)}
    starts = plan.next_pods(s, rolling)
    assert starts == ["p0", "p1"]
    assert plan.stage_ahead(s, rolling, starts) == ["p2", "p3"]
    # While a batch is out of traffic, the next one stages; the last batch may be short.
    s2 = {**s, **states(p0="passed", p1="passed", p2="active", p3="active", p4="passed")}
    assert plan.next_pods(s2, rolling) == []
    assert plan.stage_ahead(s2, rolling, []) == ["p5", "p6"]
    # Nothing to stage ahead: AllAtOnce starts every pod (each stages before its drain), and
    # a failed canary stops the rollout.
    assert plan.stage_ahead(s, Strategy(), plan.next_pods(s, Strategy())) == []
    canary = Strategy(type="Rolling", max_unavailable=1, canary=1)
    assert plan.stage_ahead(states(a="failed", b="todo"), canary, []) == []
    # During the canary only the canaries are eligible: the rest waits for its verdict.
    assert plan.stage_ahead(states(a="active", b="todo"), canary, []) == []


def test_gate_limits():
    assert not plan.gate(states(a="passed"), ProbeSpec()).tripped
    g = plan.gate(states(a="failed", b="passed"), ProbeSpec())
    assert g.tripped and g.reason == "FailureLimitExceeded"
    assert not plan.gate(states(a="failed"), ProbeSpec(failure_limit=1)).tripped
    g = plan.gate(states(a="inconclusive"), ProbeSpec(failure_limit=5))
    assert g.tripped and g.reason == "InconclusiveLimitExceeded"


def test_queue_fifo_by_creation():
    a = RefitRef("a", "2026-01-01T00:00:01Z", "Progressing")
    b = RefitRef("b", "2026-01-01T00:00:02Z", "Pending")
    c = RefitRef("c", "2026-01-01T00:00:03Z", "Queued")
    fleet = [c, a, b]
    assert plan.queue_role(a, fleet).role == "active"
    assert plan.queue_role(b, fleet) == plan.QueueDecision("queued", position=1, waiting_for="a")
    assert plan.queue_role(c, fleet) == plan.QueueDecision("queued", position=2, waiting_for="a")
    done = RefitRef("a", a.created, "Succeeded")
    assert plan.queue_role(b, [done, b, c]).role == "active"


def test_latest_wins_supersedes_queued_not_active():
    a = RefitRef("a", "2026-01-01T00:00:01Z", "Progressing")
    b = RefitRef("b", "2026-01-01T00:00:02Z", "Queued")
    c = RefitRef("c", "2026-01-01T00:00:03Z", "Pending", queue_policy="LatestWins")
    fleet = [a, b, c]
    assert plan.queue_role(a, fleet).role == "active"
    assert plan.queue_role(b, fleet) == plan.QueueDecision("superseded", superseded_by="c")
    assert plan.queue_role(c, fleet).role == "queued"


def test_started_refit_keeps_its_turn():
    old_pending = RefitRef("a", "2026-01-01T00:00:01Z", "Pending")
    running = RefitRef("b", "2026-01-01T00:00:02Z", "Progressing")
    assert plan.queue_role(running, [old_pending, running]).role == "active"
    assert plan.queue_role(old_pending, [old_pending, running]).role == "queued"


def test_fleet_target_is_newest_succeeded():
    a = RefitRef("a", "2026-01-01T00:00:01Z", "Succeeded")
    b = RefitRef("b", "2026-01-01T00:00:02Z", "Succeeded")
    c = RefitRef("c", "2026-01-01T00:00:03Z", "Halted")
    assert plan.fleet_target([a, b, c]) == "b"
    assert plan.fleet_target([c]) is None


def test_a_started_refit_is_never_queued_again():
    """Two refits that both started before they came to share pods (labels changed): both
    stay active; the pods' claims, not the queue, take turns between them."""
    a = RefitRef("a", "2026-01-01T00:00:01Z", "Progressing")
    b = RefitRef("b", "2026-01-01T00:00:02Z", "Progressing")
    assert plan.queue_role(a, [a, b]).role == "active"
    assert plan.queue_role(b, [a, b]).role == "active"
    c = RefitRef("c", "2026-01-01T00:00:03Z", "Pending")
    assert plan.queue_role(c, [a, b, c]) == plan.QueueDecision("queued", 2, waiting_for="a")


def test_pods_another_operator_holds_count_against_max_unavailable():
    """A blocked pod is out of traffic under another pass: Rolling counts it in flight."""
    strategy = Strategy(type="Rolling", max_unavailable=1)
    assert plan.next_pods(states(a="blocked", b="todo"), strategy) == []
    assert plan.next_pods(states(a="passed", b="todo"), strategy) == ["b"]
