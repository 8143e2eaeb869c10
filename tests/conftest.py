"""The fixtures live in tests/fixtures/ (over the test bed in testbed/), one plugin per area:

cluster     control_plane, weightrefit_crd, namespace, harness (the operator + a fleet)
workers     sim_fleet, tiny_model, vllm_server
prometheus  prometheus_bin, promtool, prometheus

Beside them, helpers the tests import (no test module imports another):

refits       a WeightRefit and its pods as plain data for decision.decide
checkpoints  a small checkpoint on real files, and the refusal a call must raise
reload       calls on a real vLLM server: admin requests, refit orders, probe scores
broadcast    a broadcast refit of a real vLLM server with the test process as the trainer
"""

import pytest

# The test bed's own checks (testbed.fleet.assert_one_driver) and the shared helpers' asserts
# report like the tests' own.
pytest.register_assert_rewrite("testbed", "tests.fixtures")

pytest_plugins = [
    "tests.fixtures.cluster",
    "tests.fixtures.workers",
    "tests.fixtures.prometheus",
]
