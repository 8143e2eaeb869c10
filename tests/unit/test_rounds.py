"""rounds.Rounds: the rounds of a broadcast refit (docs/broadcast.md, "A broadcast refit"):
who receives one send of the trainer, at which ranks, and when the pods may join it."""

from __future__ import annotations

import asyncio

import pytest
from refit_operator.controller.rounds import Rounds, TrainerTimeout, rank_problem
from refit_operator.core.api import SENDING_ANNOTATION, BroadcastRound

WAIT = 5.0  # seconds a join may wait in these tests: never reached unless a test fails


class Changes:
    """An on_change callback that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


async def settle() -> None:
    """Let every task that can run, run."""
    for _ in range(5):
        await asyncio.sleep(0)


def shown(rounds: Rounds) -> BroadcastRound:
    """The round the status shows: there is one once a round was opened."""
    view = rounds.view()
    assert view is not None
    return view


def joining(rounds: Rounds, *pods: str, seconds: float = WAIT) -> dict[str, asyncio.Task]:
    return {p: asyncio.create_task(rounds.join(p, seconds)) for p in pods}


async def test_a_round_is_ready_only_once_every_member_joined() -> None:
    rounds = Rounds(0, Changes())
    assert rounds.view() is None  # no round yet
    rounds.open(["b", "a", "c"])
    tasks = joining(rounds, "a", "b")
    await settle()
    assert rounds.view() == BroadcastRound(round=1, world_size=0, receivers=3, state="Joining")
    tasks |= joining(rounds, "c")
    await settle()
    assert rounds.view() == BroadcastRound(round=1, world_size=4, receivers=3, state="Ready")
    assert not any(t.done() for t in tasks.values())  # ready, not announced: still waiting
    rounds.trainer_sending(1)
    await settle()
    assert {p: t.result() for p, t in tasks.items()} == {"a": (1, 4), "b": (2, 4), "c": (3, 4)}


async def test_ranks_go_by_pod_name_from_one_and_the_trainer_is_rank_zero() -> None:
    rounds = Rounds(0, Changes())
    names = ["rollout-2", "rollout-10", "rollout-0", "rollout-1"]
    rounds.open(names)
    tasks = joining(rounds, *names)  # the order of joining does not matter
    await settle()
    rounds.trainer_sending(1)
    await settle()
    got = {p: t.result() for p, t in tasks.items()}
    # By name (string order), ranks 1..n; the world is the n pods and the trainer.
    assert got == {
        "rollout-0": (1, 5), "rollout-1": (2, 5), "rollout-10": (3, 5), "rollout-2": (4, 5),
    }  # fmt: skip


async def test_a_member_that_leaves_before_joining_shrinks_the_round() -> None:
    rounds = Rounds(0, Changes())
    rounds.open(["a", "b", "c"])
    tasks = joining(rounds, "a", "c")
    await settle()
    assert shown(rounds).state == "Joining"
    rounds.leave("b")  # its pass failed before the receive
    await settle()
    assert rounds.view() == BroadcastRound(round=1, world_size=3, receivers=2, state="Ready")
    rounds.trainer_sending(1)
    await settle()
    assert {p: t.result() for p, t in tasks.items()} == {"a": (1, 3), "c": (2, 3)}
    rounds.leave("b")  # idempotent
    assert shown(rounds).receivers == 2


async def test_a_member_that_leaves_after_the_round_was_ready_keeps_its_rank() -> None:
    rounds = Rounds(0, Changes())
    rounds.open(["a", "b"])
    tasks = joining(rounds, "a", "b")
    await settle()
    tasks["a"].cancel()
    rounds.leave("a")  # the trainer may already have opened a world of size 3
    await settle()
    assert rounds.view() == BroadcastRound(round=1, world_size=3, receivers=2, state="Ready")
    rounds.trainer_sending(1)
    assert await tasks["b"] == (2, 3)


async def test_join_waits_for_the_trainers_announcement_of_its_round() -> None:
    rounds = Rounds(0, Changes())
    rounds.open(["a"])
    task = asyncio.create_task(rounds.join("a", WAIT))
    await settle()
    assert shown(rounds).state == "Ready" and not task.done()
    rounds.trainer_sending(2)  # another round's number releases nothing
    await settle()
    assert not task.done()
    rounds.trainer_sending(1)
    assert await task == (1, 2)
    assert shown(rounds).state == "Sending"


async def test_join_times_out_when_the_trainer_never_announces() -> None:
    rounds = Rounds(0, Changes())
    rounds.open(["a"])
    with pytest.raises(TrainerTimeout) as e:
        await rounds.join("a", 0.05)
    assert "round 1 never announced" in str(e.value) and SENDING_ANNOTATION in str(e.value)
    # A round whose other members never arrive times out as well, and says so.
    rounds.open(["b", "c"])
    rounds.leave("a")
    with pytest.raises(TrainerTimeout) as e:
        await rounds.join("b", 0.05)
    assert "round 2 never became ready" in str(e.value) and "1/2 pods joined" in str(e.value)


async def test_rounds_are_ready_one_at_a_time_in_order() -> None:
    rounds = Rounds(0, Changes())
    rounds.open(["a"])
    rounds.open(["b"])
    second = asyncio.create_task(rounds.join("b", WAIT))
    await settle()
    # Every member of round 2 joined, but round 1 is not done: round 2 waits.
    assert rounds.view() == BroadcastRound(round=1, world_size=0, receivers=1, state="Joining")
    rounds.trainer_sending(2)  # the trainer cannot announce a round that is not ready
    first = asyncio.create_task(rounds.join("a", WAIT))
    await settle()
    assert shown(rounds).round == 1 and shown(rounds).state == "Ready"
    rounds.trainer_sending(1)
    assert await first == (1, 2)
    await settle()
    assert not second.done()
    rounds.leave("a")  # past its receive: round 1 is done, round 2 is next
    assert rounds.view() == BroadcastRound(round=2, world_size=2, receivers=1, state="Ready")
    rounds.trainer_sending(2)
    assert await second == (1, 2)  # a round's ranks start from 1 again


async def test_the_view_walks_joining_ready_sending_done() -> None:
    rounds = Rounds(0, Changes())
    rounds.open(["a", "b"])
    states = [shown(rounds).state]
    tasks = joining(rounds, "a", "b")
    await settle()
    states.append(shown(rounds).state)
    rounds.trainer_sending(1)
    await settle()
    states.append(shown(rounds).state)
    rounds.leave("a")
    states.append(shown(rounds).state)  # one pod still receiving
    rounds.leave("b")
    states.append(shown(rounds).state)
    assert states == ["Joining", "Ready", "Sending", "Sending", "Done"]
    assert all(t.done() for t in tasks.values())
    # The last round stays in view, Done, until another opens.
    assert rounds.view() == BroadcastRound(round=1, world_size=3, receivers=2, state="Done")
    rounds.open(["a"])
    assert rounds.view() == BroadcastRound(round=2, world_size=0, receivers=1, state="Joining")


async def test_on_change_is_called_when_a_round_becomes_ready_or_done() -> None:
    changes = Changes()
    rounds = Rounds(0, changes)
    rounds.open(["a", "b"])
    task = asyncio.create_task(rounds.join("a", WAIT))
    await settle()
    assert changes.calls == 0  # still joining: nothing for the status to show yet
    second = asyncio.create_task(rounds.join("b", WAIT))
    await settle()
    assert changes.calls == 1  # Ready: the status must say ReceiversReady
    rounds.trainer_sending(1)
    await asyncio.gather(task, second)
    rounds.leave("a")
    before = changes.calls
    rounds.leave("b")
    assert changes.calls > before  # Done


async def test_numbering_continues_after_the_round_the_status_shows() -> None:
    rounds = Rounds(4, Changes())  # an operator restarted after round 4
    rounds.open(["a"])
    assert shown(rounds).round == 5
    rounds.open(["a", "b"])  # a stays in its unfinished round; b gets a new one
    assert shown(rounds).receivers == 1
    rounds.leave("a")
    assert rounds.view() == BroadcastRound(round=6, world_size=0, receivers=1, state="Joining")
    rounds.open([])  # nothing to open
    rounds.open(["b"])
    assert shown(rounds).round == 6


async def test_a_pass_outside_every_round_joins_one_of_its_own() -> None:
    rounds = Rounds(0, Changes())
    task = asyncio.create_task(rounds.join("x", WAIT))
    await settle()
    assert rounds.view() == BroadcastRound(round=1, world_size=2, receivers=1, state="Ready")
    rounds.trainer_sending(1)
    assert await task == (1, 2)


async def test_a_pod_takes_one_rank_per_receiving_worker() -> None:
    """A TP-2 pod (/get_world_size 2) takes two consecutive ranks; the world counts workers."""
    rounds = Rounds(0, Changes())
    rounds.open(["a", "b", "c"])
    tasks = {
        "a": asyncio.create_task(rounds.join("a", WAIT, 2)),
        "b": asyncio.create_task(rounds.join("b", WAIT, 1)),
        "c": asyncio.create_task(rounds.join("c", WAIT, 4)),
    }
    await settle()
    assert rounds.view() == BroadcastRound(round=1, world_size=8, receivers=3, state="Ready")
    rounds.trainer_sending(1)
    await settle()
    assert {p: t.result() for p, t in tasks.items()} == {"a": (1, 8), "b": (3, 8), "c": (4, 8)}


async def test_a_pod_without_workers_cannot_join() -> None:
    rounds = Rounds(0, Changes())
    rounds.open(["a"])
    with pytest.raises(ValueError, match="pod a: 0 receiving workers"):
        await rounds.join("a", WAIT, 0)


def test_the_pods_first_worker_must_sit_where_the_round_put_it() -> None:
    assert rank_problem({"rank": 3, "worldSize": 8}, 3, 8) is None
    assert rank_problem({}, 3, 8) is None  # an older worker does not say
    problem = rank_problem({"rank": 1, "worldSize": 3}, 3, 8)
    assert problem is not None and problem.reason == "BroadcastWorldSizeMismatch"
    assert problem.message == (
        "the pod's first worker joined as rank 1 of 3, the round gave it rank 3 of 8"
    )
