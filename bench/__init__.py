"""Refit benchmarks: `python -m bench [--quick] [--only NAME]` (what `make bench` runs).

Each suite writes bench/results/<name>.json; README.md there is a table of all of them.
Suites run real parts (kube-apiserver + etcd, the `refit-operator` process, vLLM CPU
servers); only the scale suite uses simulated workers. See bench/results/README.md.
"""
