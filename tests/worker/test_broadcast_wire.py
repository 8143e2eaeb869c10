"""The broadcast wire (refit_worker.broadcast) without vLLM: a trainer and receivers on threads
of this process, a real gloo group on loopback. What a receiver gets is bit for bit what was
sent, across buckets and dtypes, to every receiver; the Verifier names what differs from the
promise; a receiver whose trainer never sends times out instead of hanging."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from refit_worker import broadcast
from refit_worker.contract import DRAFTER_PREFIX, TransferManifest
from refit_worker.transfer_manifest import tensor_digest


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "layers.0.w": torch.randn(64, 33, generator=gen),
        "layers.0.b": torch.randn(33, generator=gen).to(torch.bfloat16),  # odd size: misaligns
        "layers.1.w": torch.randn(33, 64, generator=gen).t(),  # not contiguous
        "step": torch.tensor(7, dtype=torch.int64),  # a scalar
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "fp8": torch.randn(5, generator=gen).to(torch.float8_e4m3fn),
        "big": torch.randn(300, 300, generator=gen),  # a bucket of its own
    }


def run_round(
    sent: dict[str, torch.Tensor],
    promise: TransferManifest | None,
    receivers: int = 2,
    bucket_bytes: int = 4096,
) -> tuple[broadcast.SendStats, dict[int, Any]]:
    """One Sender, `receivers` receiving threads; per rank: (tensors that passed, refusal,
    the received manifest)."""
    results: dict[int, Any] = {}
    with broadcast.Sender(receivers + 1, timeout_seconds=30, bucket_bytes=bucket_bytes) as sender:

        def receive(rank: int) -> None:
            group = broadcast.Group("127.0.0.1", sender.port, rank, receivers + 1, 30)
            verifier = broadcast.Verifier(promise)
            passed = {n: t.clone() for n, t in broadcast.receive(group) if verifier.check(n, t)}
            results[rank] = (passed, verifier.refusal(), verifier.manifest())
            group.close()

        threads = [threading.Thread(target=receive, args=(r,)) for r in range(1, receivers + 1)]
        for t in threads:
            t.start()
        sender.connect()
        stats = sender.send(sent)
        for t in threads:
            t.join(60)
    return stats, results


def test_every_receiver_gets_exactly_what_was_sent() -> None:
    sent = tensors()
    promise = broadcast.build_manifest(sent)
    stats, results = run_round(sent, promise)
    assert stats.tensors == len(sent) and stats.buckets > 2
    assert stats.bytes == sum(t.numel() * t.element_size() for t in sent.values())
    assert sorted(results) == [1, 2]
    for passed, refusal, received in results.values():
        assert refusal is None
        assert received == promise
        assert passed.keys() == sent.keys()
        for name, tensor in sent.items():
            got = passed[name]
            assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape)
            assert torch.equal(broadcast.raw_bytes(got), broadcast.raw_bytes(tensor))


def test_a_tensor_digest_is_its_row_major_bytes() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
    data = t.contiguous().numpy().tobytes()
    assert broadcast.digest_tensor("x", t).digest == tensor_digest("x", "F32", (3, 2), data)
    assert broadcast.digest_tensor("x", t).shape == (3, 2)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("corrupted", "layers.0.w: its bytes differ from the promise"),
        ("unsent", "promised but not sent: step"),
        ("unpromised", "extra was sent but not promised"),
        ("reshaped", "layers.0.w is F32[33, 64], promised F32[64, 33]"),
    ],
)
def test_the_verifier_names_what_differs_from_the_promise(case: str, expected: str) -> None:
    good = tensors()
    promise = broadcast.build_manifest(good)
    sent = dict(good)
    if case == "corrupted":
        sent["layers.0.w"] = good["layers.0.w"].clone()
        sent["layers.0.w"][3, 4] += 1
    elif case == "unsent":
        del sent["step"]
    elif case == "unpromised":
        sent["extra"] = torch.ones(2)
    else:
        sent["layers.0.w"] = good["layers.0.w"].reshape(33, 64)
    _, results = run_round(sent, promise, receivers=1)
    passed, refusal, received = results[1]
    assert refusal is not None and expected in refusal, refusal
    assert received.digest != promise.digest
    assert received == broadcast.build_manifest(sent)  # the record says what did arrive
    assert set(passed) == {n for n in sent if sent[n] is good.get(n)}  # the untouched ones


def test_without_a_promise_nothing_passes_but_the_round_is_drained_and_recorded() -> None:
    sent = tensors()
    _, results = run_round(sent, None, receivers=1)
    passed, refusal, received = results[1]
    assert passed == {} and refusal is None
    assert received == broadcast.build_manifest(sent)


def test_a_receiver_whose_trainer_never_sends_times_out() -> None:
    with broadcast.Sender(2, timeout_seconds=2) as sender:
        errors: list[BaseException] = []

        def receive() -> None:
            group = broadcast.Group("127.0.0.1", sender.port, 1, 2, 2)
            try:
                list(broadcast.receive(group))
            except broadcast.TransportError as exc:
                errors.append(exc)
            group.close()

        thread = threading.Thread(target=receive)
        thread.start()
        sender.connect()
        thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and "gloo broadcast failed" in str(errors[0])


def test_buckets_and_headers() -> None:
    assert broadcast.plan_buckets([], 10) == []
    assert broadcast.plan_buckets([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert broadcast.plan_buckets([20, 1, 1], 8) == [range(0, 1), range(1, 3)]
    assert broadcast.plan_buckets([0, 0, 9, 0], 8) == [range(0, 2), range(2, 3), range(3, 4)]
    entries = [broadcast.WireEntry("a", "BF16", (3, 1)), broadcast.WireEntry("b", "BOOL", ())]
    assert broadcast.decode_header(broadcast.encode_header(entries, 77)) == (entries, 77)
    assert [e.nbytes for e in entries] == [6, 1]
    for bad in (b"{", b'{"tensors": [["a", "X9", [1]]], "bucketBytes": 1}', b'{"tensors": []}'):
        with pytest.raises(broadcast.TransportError):
            broadcast.decode_header(bad)


def engine_with(method: str, drafter: Any = None) -> Any:
    """A refit-gloo engine (no vLLM worker behind it) whose server runs speculative `method`
    ("" for none), and whose worker extension reaches `drafter`."""
    from refit_worker.broadcast.gloo_engine import GlooWeightTransferEngine

    engine: Any = GlooWeightTransferEngine.__new__(GlooWeightTransferEngine)
    engine.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
    engine.model = "target-model"
    if drafter is not None:
        engine.find_drafter = lambda: drafter
    return engine


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, list[str], Any]]:
    """What _check_promise checks against which model: (model, tensor names, load rules)."""
    from refit_worker.broadcast import gloo_engine

    calls: list[tuple[Any, list[str], Any]] = []
    monkeypatch.setattr(gloo_engine.LoadRules, "of", staticmethod(lambda config: config))
    monkeypatch.setattr(
        gloo_engine,
        "verify_model_tensors",
        lambda model, tensors, rules: calls.append((model, sorted(tensors), rules)),
    )
    return calls


DRAFT = SimpleNamespace(model="draft-model", config="draft-config")


def test_a_drafter_travels_in_the_transfer_under_its_prefix_and_is_checked_alike() -> None:
    target, draft = tensors(), {"w": torch.ones(3), "layers.0.w": torch.zeros(2, 2)}
    sent = broadcast.with_drafter(target, draft)
    assert sorted(sent) == sorted([*target, f"{DRAFTER_PREFIX}w", f"{DRAFTER_PREFIX}layers.0.w"])
    assert broadcast.split_drafter(sent.items()) == (list(target.items()), list(draft.items()))
    with pytest.raises(ValueError, match="drafter prefix"):
        broadcast.with_drafter({f"{DRAFTER_PREFIX}x": torch.ones(1)}, {})
    promise = broadcast.build_manifest(sent)
    bad = dict(sent)
    bad[f"{DRAFTER_PREFIX}w"] = torch.full((3,), 2.0)
    _, results = run_round(bad, promise, receivers=1)
    passed, refusal, _ = results[1]
    assert refusal is not None and refusal.startswith(f"{DRAFTER_PREFIX}w: its bytes differ")
    assert set(passed) == set(sent) - {f"{DRAFTER_PREFIX}w"}


def test_a_broadcast_into_an_engine_with_a_drafter_is_refused_before_it_loads(
    verified: list[tuple[Any, list[str], Any]],
) -> None:
    """A promise of the target's tensors alone: an engine whose draft_model drafter the
    worker refits refuses it before checking it against the model (receive_weights then only
    drains the wire), so a new target never serves beside a stale drafter."""
    from refit_worker.broadcast.gloo_engine import Round

    promise = broadcast.build_manifest(tensors()).to_json_dict()
    for engine in (engine_with("draft_model", DRAFT), engine_with("draft_model")):
        got, refusal = engine._check_promise(Round(1), promise)
        assert got is None and refusal is not None and refusal.code == "DrafterMissing"
    assert verified == []
    # Drafter tensors, but no worker extension to reach the drafter with: refused alike.
    promise = broadcast.build_manifest(broadcast.with_drafter(tensors(), tensors())).to_json_dict()
    got, refusal = engine_with("draft_model")._check_promise(Round(1), promise)
    assert refusal is not None and refusal.code == "DrafterMissing", refusal
    assert "--worker-extension-cls" in refusal.detail and verified == []


def test_drafter_tensors_into_an_engine_without_a_drafter_are_refused(
    verified: list[tuple[Any, list[str], Any]],
) -> None:
    from refit_worker.broadcast.gloo_engine import Round

    promise = broadcast.build_manifest(broadcast.with_drafter(tensors(), {"w": torch.ones(1)}))
    for method in ("", "ngram"):
        got, refusal = engine_with(method)._check_promise(Round(1), promise.to_json_dict())
        assert got is None and refusal is not None and refusal.code == "TensorMismatch"
        assert "1 drafter tensors" in refusal.detail, refusal.detail
    assert verified == []


def test_target_and_drafter_tensors_are_each_checked_against_their_model(
    verified: list[tuple[Any, list[str], Any]],
) -> None:
    from refit_worker.broadcast.gloo_engine import Round

    draft = {"w": torch.ones(3), "layers.0.w": torch.zeros(2, 2)}
    promise = broadcast.build_manifest(broadcast.with_drafter(tensors(), draft))
    engine = engine_with("draft_model", DRAFT)
    got, refusal = engine._check_promise(Round(1), promise.to_json_dict())
    assert refusal is None and got == promise
    assert verified == [
        ("target-model", sorted(tensors()), engine.vllm_config),
        ("draft-model", sorted(draft), "draft-config"),
    ]
    # Without a drafter, a promise of the target alone means what it always meant.
    verified.clear()
    plain, engine = broadcast.build_manifest(tensors()), engine_with("")
    assert engine._check_promise(Round(1), plain.to_json_dict()) == (plain, None)
    assert verified == [("target-model", sorted(tensors()), engine.vllm_config)]
