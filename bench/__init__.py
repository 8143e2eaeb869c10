"""Refit benchmarks: `python -m bench [--quick] [--only NAME]` (what `make bench` runs).

Each suite writes bench/results/<name>.json; README.md there is a table of the newest row of
every metric, each with the command that regenerates it (older runs: HISTORY.md there).
Suites run real parts (kube-apiserver + etcd, the `refit-operator` process, vLLM CPU
servers); the scale and soak suites and the overhead suite's floor use simulated workers.
"""
