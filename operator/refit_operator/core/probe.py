"""Probe verdict: does a pod's teacher-forced scoring match the checkpoint's reference?

Pure: reference logprobs and the pod's logprobs for the same token ids in, a verdict out.

Decisions (documented in docs/operator.md):
- No data (the pod returned nothing, a timeout, a missing logprob) is Inconclusive.
- NaN or infinite logprobs are Inconclusive with reason ProbeNaN (the issue's rule: NaN never
  counts as Pass); with the default inconclusiveLimit 0 they fail the refit like a Fail does.
- A logprob above 0 or a wrong number of entries is garbage: Fail (ProbeGarbage).
- Otherwise mean and max per-token |Δlogprob| and |NLL_pod - NLL_ref| are held to the spec's
  thresholds, and the pod's NLL to the median NLL of pods already passed at the same version
  (podAgreement).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from refit_worker.contract import ProbeReference

from .api_spec import Thresholds
from .api_status import PodProbe, Verdict
from .reasons import Reason

# Logprobs a little above zero come from rounding in low precision, not from a broken model.
_LOGPROB_SLACK = 1e-3


@dataclass(frozen=True)
class ProbeOutcome:
    verdict: Verdict
    reason: str  # CamelCase; "ProbePassed" when verdict is Pass
    message: str
    nll: float = 0.0
    reference_nll: float = 0.0
    mean_abs_diff: float = 0.0
    max_abs_diff: float = 0.0
    tokens: int = 0
    draft_acceptance: float | None = None  # judge_drafter's measure, for a pod with a drafter

    def to_status(self) -> PodProbe:
        def finite(x: float) -> float:
            return x if math.isfinite(x) else 0.0

        return PodProbe(
            verdict=self.verdict,
            nll=finite(self.nll),
            reference_nll=finite(self.reference_nll),
            mean_abs_logprob_diff=finite(self.mean_abs_diff),
            max_abs_logprob_diff=finite(self.max_abs_diff),
            tokens=self.tokens,
            draft_acceptance=self.draft_acceptance,
        )


def judge_drafter(
    outcome: ProbeOutcome, drafted: float, accepted: float, minimum: float
) -> ProbeOutcome:
    """The target passed its probe; now its drafter (a speculative method with weights of its
    own, refitted from the checkpoint's drafter/). vLLM's drafts are greedy, so while the
    target decodes the probe prompts greedily a drafter on the weights it was trained with
    has its drafts accepted, and a stale or corrupted one far fewer: the share accepted
    (``accepted`` of ``drafted`` tokens, vLLM's spec-decode counters) must reach ``minimum``
    (thresholds.minDraftAcceptance; 0: not judged). Under sampling the share says little
    (measured 0.23 for a fresh drafter), so the probe decodes greedily."""
    if outcome.verdict != "Pass" or minimum <= 0:
        return outcome
    if drafted <= 0:
        message = "the drafter drafted no token while the probe decoded: no speculative decoding"
        return replace(outcome, verdict="Inconclusive", reason=Reason.DraftNoData, message=message)
    rate = accepted / drafted
    outcome = replace(outcome, draft_acceptance=rate)
    if rate >= minimum:
        return outcome
    message = (
        f"the target accepted {rate:.3f} of {drafted:.0f} drafted tokens while it decoded the "
        f"probe prompts greedily, below minDraftAcceptance {minimum}: the drafter's weights "
        "are not the ones trained for this target (stale or corrupted drafter/)"
    )
    return replace(outcome, verdict="Fail", reason=Reason.DraftAcceptanceLow, message=message)


def inconclusive(reason: str, message: str) -> ProbeOutcome:
    return ProbeOutcome("Inconclusive", reason, message)


class ReferenceMismatch(Exception):
    """A probe reference computed for another version than the one the refit brings."""

    reason = Reason.ReferenceVersionMismatch


def check_reference_version(reference: ProbeReference, version: str, where: str) -> None:
    """A reference held apart from the weights (a ConfigMap) is tied to them by its version
    alone: one of another version (a ConfigMap still holding the last step's) would fail
    every pod's probe after the pod was reloaded, so it is refused before (ReferenceMismatch).
    """
    if reference.version != version:
        raise ReferenceMismatch(
            f"{where} holds the probe reference of version {reference.version!r}, not of "
            f"{version!r}, the version this refit loads: write the reference computed for "
            f'{version!r} there (its "version" field says which), or point '
            "spec.probe.reference at the one that is"
        )


def evaluate(
    reference: ProbeReference,
    scored: Sequence[Sequence[float | None]] | None,
    thresholds: Thresholds,
    peer_nlls: Sequence[float] = (),
) -> ProbeOutcome:
    """Judge one pod. ``scored[i]`` is the pod's logprob list for ``reference.prompts[i]``."""
    if not scored:
        return inconclusive(Reason.ProbeNoData, "the pod returned no probe logprobs")
    if len(scored) != len(reference.prompts):
        return ProbeOutcome(
            "Fail",
            Reason.ProbeGarbage,
            f"the pod scored {len(scored)} prompts, the reference has {len(reference.prompts)}",
        )
    ref_lps: list[float] = []
    pod_lps: list[float] = []
    for i, (prompt, got) in enumerate(zip(reference.prompts, scored, strict=True)):
        if len(got) != len(prompt.token_ids):
            return ProbeOutcome(
                "Fail",
                Reason.ProbeGarbage,
                f"prompt {i}: {len(got)} logprobs for {len(prompt.token_ids)} tokens",
            )
        for j in range(1, len(prompt.token_ids)):
            ref, pod = prompt.logprobs[j], got[j]
            if ref is None:
                continue
            if pod is None:
                return inconclusive(
                    Reason.ProbeNoData, f"prompt {i} token {j}: no logprob returned"
                )
            if not isinstance(pod, int | float):
                return ProbeOutcome("Fail", Reason.ProbeGarbage, f"prompt {i} token {j}: {pod!r}")
            if not math.isfinite(pod):
                return inconclusive(Reason.ProbeNaN, f"prompt {i} token {j}: logprob is {pod}")
            if pod > _LOGPROB_SLACK:
                return ProbeOutcome(
                    "Fail", Reason.ProbeGarbage, f"prompt {i} token {j}: logprob {pod} is above 0"
                )
            ref_lps.append(float(ref))
            pod_lps.append(float(pod))
    if not ref_lps:
        return inconclusive(Reason.ProbeNoData, "the reference scores no tokens")
    if not all(math.isfinite(x) for x in ref_lps):
        return inconclusive(Reason.ReferenceInvalid, "the reference holds NaN or infinite logprobs")

    diffs = [abs(p - r) for p, r in zip(pod_lps, ref_lps, strict=True)]
    mean_abs, max_abs = sum(diffs) / len(diffs), max(diffs)
    nll, ref_nll = -sum(pod_lps) / len(pod_lps), -sum(ref_lps) / len(ref_lps)
    summary = (
        f"NLL {nll:.4f} vs reference {ref_nll:.4f}, mean |Δlogprob| {mean_abs:.4f}, "
        f"max {max_abs:.4f} over {len(diffs)} tokens"
    )
    passed = ProbeOutcome(
        "Pass", Reason.ProbePassed, summary, nll, ref_nll, mean_abs, max_abs, len(diffs)
    )
    checks = [
        (mean_abs > thresholds.mean_abs_logprob_diff, Reason.LogprobDrift, "mean |Δlogprob|"),
        (max_abs > thresholds.max_abs_logprob_diff, Reason.LogprobDrift, "max |Δlogprob|"),
        (abs(nll - ref_nll) > thresholds.nll_diff, Reason.NllDrift, "|NLL - reference NLL|"),
    ]
    for failed, reason, what in checks:
        if failed:
            return replace(
                passed, verdict="Fail", reason=reason, message=f"{what} over threshold: {summary}"
            )
    if peer_nlls:
        median = statistics.median(peer_nlls)
        if abs(nll - median) > thresholds.pod_agreement:
            message = (
                f"NLL {nll:.4f} differs from the median {median:.4f} of {len(peer_nlls)} pods "
                f"at the same version by more than {thresholds.pod_agreement}"
            )
            return replace(passed, verdict="Fail", reason=Reason.PodDisagreement, message=message)
    return passed
