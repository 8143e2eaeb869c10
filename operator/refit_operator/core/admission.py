"""Admission: what must hold of a fleet and of each pod before a refit touches any pod,
judged from the Pod objects first (before the admin token goes anywhere) and then from each
pod's refit_info. Pure: the engine gathers the answers, pod_pass asks for a late pod."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from refit_worker.contract import REQUIRED_CAPABILITIES, RefitInfo

from .api_spec import WeightRefitSpec
from .api_status import WeightRefitStatus
from .podview import PodView
from .reasons import Problem, Reason


@dataclass(frozen=True)
class PreflightResult:
    """What the fleet preflight found: refit_info per pod (or the error reaching it), and the
    fleet-level problems (missing Secret, unusable reference)."""

    infos: dict[str, RefitInfo | str] = field(default_factory=dict)  # str: why unreachable
    # A broadcast refit's: each pod's /get_world_size (str: why it did not answer).
    world_sizes: dict[str, int | str] = field(default_factory=dict)
    problem: Problem | None = None


def admission_problem(
    info: RefitInfo | str, allow_unsafe: bool, sleep_level: int, *, adapter: bool = False
) -> Problem | None:
    """Why a pod must not be refitted, judged from its refit_info and the spec's
    ``sequence.sleepLevel``; None when it may. An ``adapter`` refit (spec.adapter) never
    reloads the base weights, so what makes a reload unsafe does not concern it: it needs
    vLLM's runtime LoRA routes instead (adapter_problem)."""
    if isinstance(info, str):
        return Problem(Reason.PodUnreachable, info)
    if adapter:
        return adapter_problem(info)
    if allow_unsafe:
        return None
    missing = [c for c in REQUIRED_CAPABILITIES if c not in info.capabilities]
    if missing:
        return Problem(
            Reason.UnsafeBackend, f"image lacks reload-safe capabilities: {', '.join(missing)}"
        )
    if info.unsafe_reasons:
        return Problem(Reason.UnsafeConfiguration, "; ".join(info.unsafe_reasons))
    if info.kv_cache_scales and sleep_level == 2:
        # Level 2 discards the scale parameters with the weights and the wake does not
        # restore them; a reload whose checkpoint lacks them leaves zeros (vLLM #57163).
        return Problem(
            Reason.UnsafeSleepLevel,
            f"sleepLevel 2 discards the KV cache scales ({info.kv_cache_scales} checkpoint "
            "parameters) and waking does not restore them (vLLM #57163); use sleepLevel 1",
        )
    return None


def spec_problem(spec: WeightRefitSpec) -> Problem | None:
    """What the spec alone holds against the refit, judged before any pod is asked: a held
    adapter's re-probe on a new base (spec.adapters.onBaseRefit Reprobe) is not built yet, and
    a refit that asks for it must not run as if it had said Unload."""
    if spec.adapters is not None and spec.adapters.on_base_refit == "Reprobe":
        return Problem(
            Reason.AdapterReprobeUnsupported,
            "spec.adapters.onBaseRefit Reprobe is not supported yet: omit spec.adapters (or set "
            "Unload) to unload the pods' adapters, then refit each adapter for the new base",
        )
    return None


def adapter_problem(info: RefitInfo) -> Problem | None:
    """What keeps a pod from taking a LoRA adapter at runtime: vLLM started without LoRA, or
    without its runtime routes (they are not served at all then, so every load would 404)."""
    if info.max_lora_rank <= 0:
        return Problem(
            Reason.AdapterUnsupported,
            "vLLM runs without LoRA: start it with --enable-lora (and --max-lora-rank at least "
            "the adapter's rank)",
        )
    if not info.runtime_lora_updating:
        return Problem(
            Reason.AdapterUnsupported,
            "vLLM does not serve its runtime LoRA routes (/v1/load_lora_adapter): start it "
            "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
        )
    return None


# A model the pod serves, as /v1/models lists it: (id, parent). vLLM gives an adapter's card the
# base model's name as parent; a base model name (one per --served-model-name) has none.
ServedModel = tuple[str, str | None]
# The separator of a staged adapter name (podflow.staged_adapter_name: "<name>@<version>"):
# the CRD refuses it in spec.adapter.name; checked here too for an API server with an older CRD.
STAGED_SEPARATOR = "@"


def adapter_name_problem(name: str, served: Sequence[ServedModel], ours: bool) -> Problem | None:
    """Why an adapter refit may not serve its adapter under ``name`` on a pod that serves
    ``served``; ``ours``: the pod holds a record of this adapter track (a pass of it loaded
    what the pod serves under the name). None when it may.

    A base model's name: vLLM refuses every load under it ("conflicts with a served base
    model"), which a pass meets only after it took the pod out of traffic, three times. An
    adapter of that name loaded by someone else (--lora-modules, a load by hand): the pass's
    swap would replace it in place, and its record would say the track served before."""
    if STAGED_SEPARATOR in name:
        return Problem(
            Reason.AdapterNameConflict,
            f"adapter name {name!r} holds {STAGED_SEPARATOR!r}: a pass loads each new version "
            f"under the staged name <name>{STAGED_SEPARATOR}<version> before the swap",
        )
    for model, parent in served:
        if model != name:
            continue
        if not parent:
            return Problem(
                Reason.AdapterNameConflict,
                f"adapter name {name!r} is a base model name the pod serves (/v1/models): "
                "vLLM refuses to load an adapter under it",
            )
        if not ours:
            return Problem(
                Reason.AdapterNameConflict,
                f"an adapter named {name!r} is loaded already (on {parent}) and no refit of "
                "this adapter track loaded it: the refit would replace it",
            )
    return None


def reference_scorers(pods: Sequence[PodView]) -> list[PodView]:
    """The pods that may score the probe reference in the preflight, best first: those in
    traffic (they answer completions now), then the others by name; never one that
    may_be_paused. Regression: the preflight scored on the first pod by name, and a pod a
    DrainTimeout had left paused queued the score until probeTimeoutSeconds, so every later
    refit of the fleet failed PodUnreachable before touching any pod."""
    return sorted((p for p in pods if not p.may_be_paused), key=lambda p: (not p.ready, p.name))


def admitted_spec(spec: WeightRefitSpec, status: WeightRefitStatus) -> WeightRefitSpec:
    """The spec every decision and pass of a started refit acts on: spec.sequence as its
    preflight admitted it (status.sequence). The CRD refuses a change of spec.sequence, but an
    API server with an older CRD accepts one (e.g. sleepLevel 2 after level 1 was admitted):
    acting on it would skip the level-2 refusals and run another step set on pods slept at
    the old level. A refit not started yet (no record) is admitted with what it says then."""
    if status.sequence is None or status.sequence == spec.sequence:
        return spec
    return spec.model_copy(update={"sequence": status.sequence})


def fleet_problem(pods: Sequence[PodView]) -> Problem | None:
    """What the Pod objects alone hold against the fleet. Judged before the preflight calls
    any pod: the admin token goes only to pods that pass (PodView.vetted)."""
    if not pods:
        return Problem(Reason.NoPodsSelected, "the fleet selector matches no pods")
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.group_problem is not None:
            return pod.group_problem
        if not pod.has_gate:
            return Problem(
                Reason.MissingReadinessGate,
                f"pod {pod.name} does not declare the readiness gate in spec.readinessGates",
            )
        if not pod.running or not pod.ip:
            return Problem(Reason.PodNotRunning, f"pod {pod.name} is not Running with a pod IP")
    return None


def layout_problem(infos: Mapping[str, RefitInfo | str]) -> Problem | None:
    """The fleet's pods must share one parallel layout (TP, PP, DP): one checkpoint, one
    probe reference and one rank plan serve them all."""
    pods_of: dict[str, list[str]] = {}
    for name, info in sorted(infos.items()):
        if isinstance(info, RefitInfo):
            pods_of.setdefault(info.layout, []).append(name)
    if len(pods_of) < 2:
        return None
    shown = "; ".join(
        f"{layout}: {', '.join(names[:3])}{' and more' if len(names) > 3 else ''}"
        for layout, names in sorted(pods_of.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )
    return Problem(
        Reason.ParallelLayoutMismatch,
        f"the fleet's pods disagree on their parallel layout ({shown})",
    )


def fleet_layout(infos: Mapping[str, RefitInfo | str]) -> str:
    """The layout the fleet's pods share (after layout_problem found none other); "" when no
    pod answered."""
    return next((i.layout for _, i in sorted(infos.items()) if isinstance(i, RefitInfo)), "")


def joins_layout(fleet: str, info: RefitInfo) -> Problem | None:
    """A pod that joins after the preflight must run the layout the preflight found the fleet
    in (status.layout), as layout_problem holds the fleet to one: the checkpoint, the probe
    reference and the broadcast's rank plan were judged for that layout. "" (a refit whose
    status predates the record): nothing to hold the pod to."""
    if not fleet or info.layout == fleet:
        return None
    return Problem(
        Reason.ParallelLayoutMismatch,
        f"the pod runs {info.layout}, the fleet {fleet} as its preflight found it: one "
        "checkpoint, one probe reference and one rank plan serve them all",
    )


def reach_problem(info: RefitInfo, world_size: int | str) -> Problem | None:
    """Every worker of the pod must be one the refit hears from: it verifies, loads and reads
    back through /collective_rpc and judges the pod by the workers' answers. vLLM's API server
    counts its workers in /get_world_size (TP x PP x DP); refit_info answers for the workers
    whose results come back. Under data parallelism vLLM runs an engine per DP rank, sends
    each /collective_rpc to every engine and answers with the first engine's results only
    (DPLBAsyncMPClient.call_utility_async); with a dense model each engine also reports DP 1
    (ParallelConfig.reconfigure_for_independent_dp_rank), so the counts differ. Workers agree
    within an engine only (refit_worker.peers): one engine could refuse a load the other
    applied, and the other engines' versions and read-backs go unseen. Measured on vLLM 0.32
    CPU (tests/worker/test_data_parallel.py)."""
    if isinstance(world_size, str):
        return Problem(Reason.PodUnreachable, world_size)
    if info.data_parallel_size > 1:
        return Problem(
            Reason.WorkersOutOfReach,
            f"data parallelism {info.data_parallel_size} behind one API server: its "
            "/collective_rpc answers with the first engine's results only, so the others' "
            "loads could not be checked; run one engine per pod",
        )
    if world_size != info.workers:
        return Problem(
            Reason.WorkersOutOfReach,
            f"/get_world_size counts {world_size} workers but refit_info answers for "
            f"{info.workers} ({info.layout}): the refit would not hear from the others "
            "(--data-parallel-size above 1 runs an engine per rank, and /collective_rpc "
            "answers with the first engine's results only); run one engine per pod",
        )
    return None


def world_size_problem(
    infos: Mapping[str, RefitInfo | str], world_sizes: Mapping[str, int | str]
) -> Problem | None:
    """The fleet's pods, by name (reach_problem); pods without both answers were refused
    before (admission_problem) or were not asked."""
    for name, size in sorted(world_sizes.items()):
        info = infos.get(name)
        problem = reach_problem(info, size) if isinstance(info, RefitInfo) else None
        if problem is not None:
            return Problem(problem.reason, f"pod {name}: {problem.message}")
    return None


def preflight_problem(
    pods: Sequence[PodView],
    result: PreflightResult,
    allow_unsafe: bool,
    sleep_level: int,
    *,
    adapter: bool = False,
) -> Problem | None:
    problem = fleet_problem(pods)
    if problem is not None:
        return problem
    if result.problem is not None:
        return result.problem
    for pod in sorted(pods, key=lambda p: p.name):
        info = result.infos.get(pod.name, "no refit_info answer")
        problem = admission_problem(info, allow_unsafe, sleep_level, adapter=adapter)
        if problem is not None:
            return Problem(problem.reason, f"pod {pod.name}: {problem.message}")
    return layout_problem(result.infos) or world_size_problem(result.infos, result.world_sizes)
