"""LoRA adapter passes on a real vLLM CPU server (runtime LoRA updating on, base checkpoint A) with
the tiny adapters the test bed builds (testbed/tiny_adapter.py).

The pass is walked by the pure core (podflow, source "adapter") and each step runs the
operator's own step code (sources.execute_step, adapter_source.restore_adapter) through the
operator's client under a fencing token; the probes score through the staged and the served
adapter name against the trainer's reference (base + adapter merged, scored by HF transformers).
What this module holds to real vLLM: the old adapter serves until the new one passed its probe;
a refused or failing adapter leaves the old one serving (restored) and the staged name unloaded;
a stale fence and a missing admin token are refused on vLLM's adapter routes; the base model is
never slept or reloaded (its weight version and its probe stay those of checkpoint A)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from refit_operator.controller import pod_pass, sources
from refit_operator.controller.sources import adapter as adapter_source
from refit_operator.core import podflow, probe, sequences
from refit_operator.core.api_spec import Sequence, Thresholds
from refit_operator.core.podflow import Progress, RunStep
from refit_operator.core.sequences import Step
from refit_operator.edges.worker_client import WorkerClient, WorkerError
from refit_worker import contract

from testbed.tiny_adapter import TinyAdapters, ensure_tiny_adapters
from testbed.tiny_model import TinyModel
from testbed.vllm_server import SERVED_MODEL, VllmServer, start_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SERVED = "policy"  # the adapter name clients send
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
SEQ = Sequence(drain_mode="keep", sleep_level=0, retries=0, drain_timeout_seconds=5)


@pytest.fixture(scope="module")
def adapters(tiny_model: TinyModel) -> TinyAdapters:
    return ensure_tiny_adapters(tiny_model)


@pytest.fixture(scope="module")
def server(tiny_model: TinyModel, adapters: TinyAdapters) -> Iterator[VllmServer]:
    with start_vllm_server(
        tiny_model,
        load_format="safetensors",
        model_dir=tiny_model.checkpoints["A"],
        extra_args=LORA_ARGS,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    ) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


_fence = iter(range(1000, 10**6))


def client(
    server: VllmServer, http: aiohttp.ClientSession, fence: int | None = None
) -> WorkerClient:
    return WorkerClient(
        server.base_url, http=http, admin_token=server.admin_token,
        fence=next(_fence) if fence is None else fence,
    )  # fmt: skip


def reader(server: VllmServer, http: aiohttp.ClientSession) -> WorkerClient:
    """A client without a fencing token (the guard admits it): checks between passes never
    raise the pod's newest token above the next pass's."""
    return WorkerClient(server.base_url, http=http, admin_token=server.admin_token)


async def judge(worker: WorkerClient, path: str, model: str | None) -> probe.ProbeOutcome:
    reference = await worker.probe_reference(path)
    scored = await worker.score_prompts([list(p.token_ids) for p in reference.prompts], model=model)
    return probe.evaluate(reference, scored, Thresholds())


async def run_pass(
    worker: WorkerClient, progress: Progress, *, after_staged_probe: object = None
) -> Progress:
    """Walk one adapter pass with the operator's step code; ``after_staged_probe`` (an async
    callable) runs once the staged probe passed, before the pod leaves traffic."""
    while not progress.finished_pass:
        action = podflow.next_action(progress, time.time())
        assert isinstance(action, RunStep), action
        step, began = action.step, time.monotonic()
        try:
            if step in (Step.probe, Step.probeStaged):
                outcome = await judge(worker, progress.path, progress.probe_model)
                progress = podflow.probe_judged(progress, outcome, time.time())
                if outcome.verdict == "Pass":
                    progress = podflow.step_done(progress, step, 0.0, time.time())
                    if step == Step.probeStaged:
                        # As the operator's staged probe does once it passed: nothing staged
                        # outlives it (the swap loads the files, checked again).
                        await adapter_source.unload_staged(
                            worker, progress, float(SEQ.step_timeout_seconds)
                        )
                    if step == Step.probeStaged and after_staged_probe is not None:
                        await after_staged_probe()  # type: ignore[operator]
            elif step == sequences.RESTORE:
                await adapter_source.restore_adapter(worker, SEQ, progress)
                progress = podflow.restored(progress, time.time())
            else:
                await sources.execute_step(worker, SEQ, progress, step, False)
                progress = podflow.step_done(progress, step, time.monotonic() - began, time.time())
        except WorkerError as e:
            reason, final = pod_pass.worker_error_reason(e, step)
            progress = podflow.step_failed(
                progress, step, reason, e.message, time.time(), retries=0, final=final
            )
    return progress


def start(adapters: TinyAdapters, name: str, serving: str = "") -> Progress:
    return podflow.start(
        "wr", "uid", name, str(adapters.dir(name)), time.time(), serving=serving,
        serving_path=str(adapters.dir(serving)) if serving else "", source="adapter",
        adapter=SERVED,
    )  # fmt: skip


async def assert_serves(worker: WorkerClient, adapters: TinyAdapters, version: str) -> None:
    outcome = await judge(worker, str(adapters.dir(version)), SERVED)
    assert outcome.verdict == "Pass", outcome.message
    assert await worker.adapters() == [SERVED]  # no staged name left behind


async def base_untouched(worker: WorkerClient, tiny_model: TinyModel) -> None:
    """The base model was never slept or reloaded: weight version and probe unchanged."""
    assert not await worker.is_sleeping()
    assert await worker.weight_version() == "default"
    # Named, so scored one prompt per request: on a LoRA-enabled vLLM 0.32 CPU server a batch
    # of prompt-logprob sequences kills the engine (punica_cpu add_lora_logits, einsum sizes).
    outcome = await judge(worker, str(tiny_model.checkpoints["A"]), SERVED_MODEL)
    assert outcome.verdict == "Pass", outcome.message


async def test_adapter_refits_serve_the_new_adapter_without_a_reload(
    server: VllmServer, http: aiohttp.ClientSession, adapters: TinyAdapters, tiny_model: TinyModel
) -> None:
    worker = reader(server, http)
    first = await run_pass(client(server, http), start(adapters, "v1"))
    assert first.outcome == "Succeeded", (first.reason, first.message)
    await assert_serves(worker, adapters, "v1")

    served_during: list[str] = []

    async def old_still_serves() -> None:
        # A reader without a fence (the guard admits it): the pass's token stays the newest.
        outcome = await judge(reader(server, http), str(adapters.dir("v1")), SERVED)
        served_during.append(outcome.verdict)

    second = await run_pass(
        client(server, http),
        start(adapters, "v2", serving="v1"),
        after_staged_probe=old_still_serves,
    )
    assert second.outcome == "Succeeded", (second.reason, second.message)
    assert served_during == ["Pass"]  # v1 served until v2 passed its staged probe
    await assert_serves(worker, adapters, "v2")
    # The two adapters differ by more than the probe's thresholds: the probe can tell them.
    wrong = await judge(worker, str(adapters.dir("v1")), SERVED)
    assert wrong.verdict == "Fail"
    seconds = podflow.out_of_traffic_seconds(second)
    assert seconds is not None and seconds < 5.0
    print(f"\nadapter pass: {second.step_seconds}, out of traffic {seconds:.3f} s")
    await base_untouched(worker, tiny_model)


@pytest.mark.parametrize(
    ("variant", "reason"), [("wrong", "LogprobDrift"), ("corrupt", "ManifestMismatch")]
)
async def test_a_bad_adapter_keeps_the_old_one_serving(
    server: VllmServer,
    http: aiohttp.ClientSession,
    adapters: TinyAdapters,
    tiny_model: TinyModel,
    variant: str,
    reason: str,
) -> None:
    worker = reader(server, http)
    if SERVED not in await worker.adapters():  # this test alone: bring v2 first
        assert (await run_pass(client(server, http), start(adapters, "v2"))).outcome == "Succeeded"
    await assert_serves(worker, adapters, "v2")
    done = await run_pass(client(server, http), start(adapters, variant, serving="v2"))
    assert done.outcome == "Failed" and done.restored, (done.reason, done.message)
    assert done.reason == reason
    assert not done.left_traffic  # the pod never left traffic
    ready = podflow.readiness(done)
    assert ready is not None and ready.ready and ready.reason == "PreviousAdapter"
    await assert_serves(worker, adapters, "v2")
    await base_untouched(worker, tiny_model)


async def test_adapter_routes_are_admin_and_fenced(
    server: VllmServer, http: aiohttp.ClientSession, adapters: TinyAdapters
) -> None:
    body = {"lora_name": "intruder", "lora_path": str(adapters.dir("v1"))}
    async with http.post(f"{server.base_url}/v1/load_lora_adapter", json=body) as r:
        assert r.status == 401  # vLLM alone would load it for anyone (no --api-key here)
    fence = next(_fence)
    newer = client(server, http, fence=fence)
    await newer.unload_adapter("nothing-loaded")  # the pod admits this fence (404 tolerated)
    older = client(server, http, fence=fence - 1)
    with pytest.raises(WorkerError) as err:
        await older.load_adapter("intruder", str(adapters.dir("v1")))
    assert err.value.code == contract.STALE_FENCE
    assert "intruder" not in await newer.adapters()
