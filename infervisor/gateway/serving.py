"""One OIP infer, whichever front end took it: through the broker link, the outputs learned, errors as ProtocolError."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from infervisor.gateway.broker_link import BrokerLink
from infervisor.gateway.catalog import Catalog
from infervisor.gateway.tensors import OipRequest
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError

#: The wait for an answer when the client sets none (the Python client's default timeout).
DEFAULT_TIMEOUT_S = 30.0


@dataclass
class Gateway:
    """What both front ends share: the broker link, the catalog and the daemon's limits."""

    link: BrokerLink
    catalog: Catalog
    max_frame_bytes: int

    def unknown_model(self, model: str) -> ProtocolError:
        """The broker's own UNKNOWN_MODEL refusal (routing/admission.py), for the metadata calls it never sees."""
        return ProtocolError(ErrorCode.UNKNOWN_MODEL, f"no model {model!r}; serving {sorted(self.catalog.models)}")

    async def infer(self, model: str, request: OipRequest, client_deadline_s: float | None) -> dict[str, Any]:
        """Run one request; its outputs (model order) or InferenceError with the daemon's code and message."""
        timeout_s = DEFAULT_TIMEOUT_S
        if request.timeout_us is not None:
            timeout_s = max(request.timeout_us / 1e6, 0.001)
        if client_deadline_s is not None:
            timeout_s = min(timeout_s, max(client_deadline_s, 0.001))
        sequence = request.sequence
        stream = None if sequence is None else (sequence.stream, sequence.start, sequence.end)
        outputs: dict[str, np.ndarray[Any, Any]] = await self.link.infer(model, request.inputs, timeout_s, stream)
        self.catalog.learn_outputs(model, outputs)
        return outputs
