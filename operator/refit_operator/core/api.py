"""The WeightRefit API as typed models: the object, its spec (api_spec.py, what the operator
reads) and its status (api_status.py, what it writes).

The single source of the API: `make generate` (hack/gen_crd.py) writes crds/weightrefit.yaml
from these models, their field docstrings (the CRD's descriptions) and what api_crd.crd adds
(CEL rules, lengths, patterns). The API server applies the defaults the models declare; the
models apply the same ones, so plain-data unit tests and a CR read back from the server mean
the same thing. To add a field: declare it with its type and default and a docstring saying what it
means to a user (the CRD's description; the generator refuses a field without one), add
``Annotated[type, crd(...)]`` for what only the API server checks, and run `make generate`.
"""

from __future__ import annotations

from typing import Any

from refit_worker.contract import API_GROUP

from .api_crd import ApiModel

# The object's two halves, and names re-exported for the modules other work is editing or
# moving now (engine, steps, core/podflow, core/reconcile, tools/ and core/views, which the
# tools use): the rest import them from api_spec or api_status, where they are defined; drop
# the re-exports once those modules do too.
from .api_spec import LWS_GROUP_LABEL as LWS_GROUP_LABEL
from .api_spec import Broadcast as Broadcast
from .api_spec import Groups as Groups
from .api_spec import LabelSelector as LabelSelector
from .api_spec import Sequence as Sequence
from .api_spec import Thresholds as Thresholds
from .api_spec import WeightRefitSpec as WeightRefitSpec
from .api_spec import max_unavailable_count as max_unavailable_count
from .api_status import STATUS_PODS_LIMIT as STATUS_PODS_LIMIT
from .api_status import TERMINAL_PHASES as TERMINAL_PHASES
from .api_status import BroadcastRound as BroadcastRound
from .api_status import OutOfTrafficSummary as OutOfTrafficSummary
from .api_status import Phase as Phase
from .api_status import PodProbe as PodProbe
from .api_status import PodResult as PodResult
from .api_status import Previous as Previous
from .api_status import WeightRefitStatus as WeightRefitStatus

VERSION = "v1alpha1"
PLURAL = "weightrefits"
KIND = "WeightRefit"
# The trainer's announcement on the WeightRefit: "I listen for round N" (the round's number).
SENDING_ANNOTATION = f"{API_GROUP}/broadcast-sending"


class WeightRefit(ApiModel):
    """WeightRefit hot-reloads new weights into every vLLM pod of a fleet. The operator takes
    each pod out of traffic, pauses and sleeps it, reloads the checkpoint layer by layer (or
    receives the weights the trainer broadcasts), stamps the weight version, probes the pod's
    logprobs against a reference, and lets it back into traffic only when the probe passes."""

    api_version: str | None = None
    """APIVersion defines the versioned schema of this representation of an object."""
    kind: str | None = None
    """Kind is a string value representing the REST resource this object represents."""
    metadata: dict[str, Any] | None = None
    spec: WeightRefitSpec
    """What to load into which pods, and how carefully."""
    status: WeightRefitStatus | None = None
    """What the operator observed and did. Written only by the operator."""
