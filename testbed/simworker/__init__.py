"""A simulated vLLM worker fleet: ONE subprocess serving many loopback addresses.

Each simulated pod listens on its own loopback address (127.x.y.z, all on one port) and
answers the endpoints :class:`refit_operator.edges.worker_client.WorkerClient` uses with the
response shapes of a real vLLM 0.32 pod running the refit_worker plugin
(tests/worker/test_contract.py holds the two to the same shapes): ``/health``, ``/refit/ready``,
``/metrics``, ``/v1/models``,
``/v1/completions`` (a token-id prompt or a list of them, ``prompt_logprobs``), ``/pause``,
``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``,
``/update_weight_version``, ``/weight_info``, vLLM's runtime LoRA routes
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, and ``/collective_rpc`` with the
extension's ``refit_info``, ``refit_preflight``, ``refit_stage``, ``refit_load``,
``refit_probe_reference`` and ``refit_adapter_check``. Faults are injected per pod and step.

One idea per module:

- model: the simulated model's scores (:func:`sim_logprobs`), the checkpoints and adapters
  it loads (:func:`make_sim_checkpoint`, :func:`make_sim_adapter`), and what a CPU server
  cannot show (SIM_UNSHOWN);
- pod: one pod's state (:class:`PodState`: what it loaded, its scheduler's pause and the
  executor's sleep, its fence) and the steps and faults a test sets on it;
- errors: vLLM's error answers;
- routes: vLLM's own routes (completions, pause, sleep and wake, the LoRA adapters, ...);
- extension: the refit_worker plugin's routes (``/refit/ready``, the ``/collective_rpc``
  methods: preflight, stage, load, ...);
- server: :class:`SimServer`: listening, dispatch (auth, fence, fault, route), crash and
  restart, the control API;
- __main__: the subprocess (``python -m testbed.simworker``);
- fleet: the test side's handles, ``SimFleet`` and ``SimPod`` (``from
  testbed.simworker.fleet import SimFleet``; not imported here, so that the subprocess starts
  without the client side's imports).

The names below are the package's interface (the fleet's apart); its modules import each
other, never this file.
"""

from testbed.simworker.errors import rpc_failure
from testbed.simworker.model import (
    SIM_ADAPTER_FILE,
    SIM_LORA_MODULES,
    SIM_MODEL,
    SIM_UNSHOWN,
    SIM_VOCAB,
    SIM_WEIGHTS_FILE,
    make_sim_adapter,
    make_sim_checkpoint,
    sim_logprobs,
)
from testbed.simworker.pod import (
    ANY_STEP_FAULTS,
    HTTP_STEPS,
    PAUSE_MODES,
    RPC_STEPS,
    STEP_FAULTS,
    STEPS,
    Fault,
    PodState,
)
from testbed.simworker.server import SimServer

__all__ = [
    "ANY_STEP_FAULTS",
    "HTTP_STEPS",
    "PAUSE_MODES",
    "RPC_STEPS",
    "SIM_ADAPTER_FILE",
    "SIM_LORA_MODULES",
    "SIM_MODEL",
    "SIM_UNSHOWN",
    "SIM_VOCAB",
    "SIM_WEIGHTS_FILE",
    "STEPS",
    "STEP_FAULTS",
    "Fault",
    "PodState",
    "SimServer",
    "make_sim_adapter",
    "make_sim_checkpoint",
    "rpc_failure",
    "sim_logprobs",
]
