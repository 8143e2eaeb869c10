"""The broadcast wire (refit_worker.broadcast) without vLLM: a trainer and receivers on threads
of this process, a real gloo group on loopback. What a receiver gets is bit for bit what was
sent, across buckets and dtypes, to every receiver; the Verifier names what differs from the
promise; a receiver whose trainer never sends times out instead of hanging."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from refit_worker import broadcast
from refit_worker.contract import TransferManifest
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


def test_a_broadcast_into_an_engine_with_a_drafter_is_refused_before_it_loads() -> None:
    """A broadcast carries the target's tensors only: an engine whose draft_model drafter the
    worker refits from checkpoints (refit_worker.drafter) refuses it, before the promise is
    even read, and still drains the wire (receive_weights reads on after a refusal)."""
    from types import SimpleNamespace

    from refit_worker.broadcast.gloo_engine import GlooWeightTransferEngine, Round

    engine = GlooWeightTransferEngine.__new__(GlooWeightTransferEngine)
    spec = SimpleNamespace(method="draft_model")
    engine.vllm_config = SimpleNamespace(speculative_config=spec)
    promise, refusal = engine._check_promise(Round(1), {})
    assert promise is None and refusal is not None and refusal.code == "DrafterMissing"
