"""Session-wide fixtures live in tests/support/*; each module registers its own."""

pytest_plugins = [
    "tests.support.controlplane",
    "tests.support.vllm_testbed",
    "tests.support.simworker",
    "tests.support.prometheus",
]
