"""The fixtures live in tests/fixtures/ (over the test bed in testbed/), one plugin per area:

cluster     control_plane, weightrefit_crd, namespace, harness (the operator + a fleet)
workers     sim_fleet, tiny_model, vllm_server
prometheus  prometheus_bin, promtool, prometheus
"""

import pytest

# The test bed's own checks (testbed.fleet.assert_one_driver) report like the tests' asserts.
pytest.register_assert_rewrite("testbed")

pytest_plugins = [
    "tests.fixtures.cluster",
    "tests.fixtures.workers",
    "tests.fixtures.prometheus",
]
