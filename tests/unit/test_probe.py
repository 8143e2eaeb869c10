import math

from refit_operator.core.api_spec import Thresholds
from refit_operator.core.probe import evaluate
from refit_worker.contract import ProbePrompt, ProbeReference

REF = ProbeReference(
    version="v1",
    dtype="float32",
    prompts=(
        ProbePrompt((1, 2, 3, 4), (None, -1.0, -2.0, -0.5)),
        ProbePrompt((5, 6, 7), (None, -3.0, -1.5)),
    ),
)
EXACT = [[None, -1.0, -2.0, -0.5], [None, -3.0, -1.5]]


def test_exact_match_passes_with_numbers():
    out = evaluate(REF, EXACT, Thresholds())
    assert out.verdict == "Pass"
    assert out.tokens == 5
    assert out.max_abs_diff == 0.0
    assert math.isclose(out.nll, 8.0 / 5) and math.isclose(out.reference_nll, 8.0 / 5)


def test_bf16_sized_noise_passes():
    noisy = [[None, -1.02, -1.98, -0.53], [None, -3.01, -1.47]]
    assert evaluate(REF, noisy, Thresholds()).verdict == "Pass"


def test_drift_fails_on_mean_and_nll():
    drift = [[None, -1.3, -2.3, -0.8], [None, -3.3, -1.8]]
    out = evaluate(REF, drift, Thresholds())
    assert out.verdict == "Fail" and out.reason == "LogprobDrift"
    assert math.isclose(out.mean_abs_diff, 0.3)


def test_one_bad_token_fails_on_max():
    bad = [[None, -1.0, -2.0, -0.5], [None, -3.0, -4.5]]
    out = evaluate(REF, bad, Thresholds(mean_abs_logprob_diff=10, nll_diff=10))
    assert out.verdict == "Fail" and "max" in out.message


def test_no_data_and_nan_are_inconclusive_never_pass():
    assert evaluate(REF, None, Thresholds()).verdict == "Inconclusive"
    assert evaluate(REF, [], Thresholds()).reason == "ProbeNoData"
    nan = [[None, math.nan, -2.0, -0.5], [None, -3.0, -1.5]]
    assert evaluate(REF, nan, Thresholds()).reason == "ProbeNaN"
    missing = [[None, None, -2.0, -0.5], [None, -3.0, -1.5]]
    assert evaluate(REF, missing, Thresholds()).verdict == "Inconclusive"


def test_garbage_fails():
    positive = [[None, 2.0, -2.0, -0.5], [None, -3.0, -1.5]]
    assert evaluate(REF, positive, Thresholds()).reason == "ProbeGarbage"
    short = [[None, -1.0], [None, -3.0, -1.5]]
    assert evaluate(REF, short, Thresholds()).verdict == "Fail"
    assert evaluate(REF, EXACT[:1], Thresholds()).verdict == "Fail"


def test_pod_agreement_against_peers():
    t = Thresholds(nll_diff=1.0, mean_abs_logprob_diff=1.0, max_abs_logprob_diff=1.0)
    shifted = [[None, -1.1, -2.1, -0.6], [None, -3.1, -1.6]]
    assert evaluate(REF, shifted, t, peer_nlls=[1.6, 1.6]).reason == "PodDisagreement"
    assert evaluate(REF, shifted, t, peer_nlls=[1.7]).verdict == "Pass"


def test_status_form_is_finite():
    out = evaluate(REF, EXACT, Thresholds()).to_status()
    assert out.verdict == "Pass" and out.tokens == 5


def test_a_reference_of_another_version_is_refused():
    import pytest
    from refit_operator.core.probe import ReferenceMismatch, check_reference_version

    check_reference_version(REF, "v1", "ConfigMap ref")
    with pytest.raises(ReferenceMismatch) as e:
        check_reference_version(REF, "v2", "ConfigMap ref key 'refit-probe.json'")
    assert e.value.reason == "ReferenceVersionMismatch"
    assert "'v1'" in str(e.value) and "'v2'" in str(e.value) and "ConfigMap ref" in str(e.value)
    # Versions are names: no normalising, a prefix or a case difference is another version.
    for other in ("V1", "v1 ", "v10", ""):
        with pytest.raises(ReferenceMismatch):
            check_reference_version(REF, other, "x")
