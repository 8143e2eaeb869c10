"""The test bed: real parts on loopback, for the tests, the benchmarks and the demo.

    controlplane      etcd + kube-apiserver (and `python -m testbed.controlplane up|down`)
    operator_process  the real `refit-operator` process: start, stop, kill, freeze, logs
    fleet             Pod objects of a namespace pointing at workers, refits applied and
                      waited for, and the invariant watcher (Ready only with a passed probe)
    pods              one Pod object for a worker on a loopback address
    simworker         the simulated vLLM worker server (`python -m testbed.simworker`) and,
                      in simworker.fleet, the handles on simulated fleets: SimFleet, SimPod
    tiny_model        the tiny Llama and its checkpoints (`python -m testbed.tiny_model`)
    vllm_server       real vLLM CPU servers running the refit_worker plugin
    prometheus        a real Prometheus

Nothing here imports pytest: the tests' fixtures live in tests/fixtures/. Not shipped: the
`refit` distribution holds refit_operator and refit_worker only.
"""
