"""The OIP over gRPC (grpcio's asyncio server): `inference.GRPCInferenceService` as Triton's clients call it.

The messages are tritonclient's generated modules (Triton's service is KServe's grpc_predict_v2 with extra
methods, under the same package and field numbers): the methods beyond KServe's answer UNIMPLEMENTED.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from infervisor.gateway.http_app import SERVER_METADATA
from infervisor.gateway.serving import Gateway
from infervisor.gateway.status_codes import grpc_status
from infervisor.gateway.tensors import (
    NUMPY_DTYPES,
    OipRequest,
    bad,
    chosen_outputs,
    from_json,
    from_raw,
    invalid,
    sequence_of,
    tensor_header,
    timeout_of,
)
from infervisor.protocol.constants import MAX_TENSORS, ErrorCode
from infervisor.protocol.errors import InferenceError, ProtocolError

#: Which typed `contents` field carries each datatype (FP16: raw contents only, as the protocol says).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def _parameters(parameters: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        values[key] = None if choice is None else getattr(value, choice)
    return values


def decode_grpc_request(message: Any, max_bytes: int) -> OipRequest:
    """Decode a ModelInferRequest: raw contents (one per input, in order) or each input's typed contents."""
    if not 0 < len(message.inputs) <= MAX_TENSORS:
        raise bad(f"inputs must be 1..{MAX_TENSORS} tensors")
    raw_contents = message.raw_input_contents
    if raw_contents and len(raw_contents) != len(message.inputs):
        raise invalid(f"{len(raw_contents)} raw_input_contents for {len(message.inputs)} inputs")
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    for index, tensor in enumerate(message.inputs):
        name, dtype, shape = tensor_header(
            {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}, max_bytes
        )
        if name in inputs:
            raise invalid(f"input {name!r} is given twice")
        if raw_contents:
            inputs[name] = from_raw(name, dtype, shape, raw_contents[index])
            continue
        field = _CONTENTS_FIELD.get(tensor.datatype)
        if field is None:
            raise invalid(f"input {name!r}: {tensor.datatype} travels as raw_input_contents only")
        inputs[name] = from_json(name, dtype, shape, list(getattr(tensor.contents, field)))
    parameters = _parameters(message.parameters)
    requested = {out.name: True for out in message.outputs} or None
    return OipRequest(message.id, inputs, requested, True, timeout_of(parameters), sequence_of(parameters))


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The servicer: each method reads the catalog or runs one infer through the gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any], code: ErrorCode, message: str) -> None:
        await context.abort(grpc_status(code), f"{code}: {message}")

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802
        """Server live."""
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802
        """Server ready: some model serves."""
        return service_pb2.ServerReadyResponse(ready=self.gateway.catalog.ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802
        """Server metadata."""
        return service_pb2.ServerMetadataResponse(**SERVER_METADATA)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802
        """Model ready (an unknown model is not ready, as Triton answers)."""
        entry = self.gateway.catalog.models.get(request.name)
        return service_pb2.ModelReadyResponse(ready=entry is not None and entry.ready)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802
        """Model metadata: inputs from the config, outputs as last answered."""
        if request.name not in self.gateway.catalog.models:
            error = self.gateway.unknown_model(request.name)
            await self._abort(context, error.code, error.message)
        return service_pb2.ModelMetadataResponse(**self.gateway.catalog.metadata(request.name))

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802
        """Infer: raw output contents, in the model's order (or the requested outputs')."""
        gateway = self.gateway
        try:
            decoded = decode_grpc_request(request, gateway.max_frame_bytes)
            outputs = await gateway.infer(request.model_name, decoded, context.time_remaining())
            chosen = chosen_outputs(outputs, decoded.outputs, True)
        except (ProtocolError, InferenceError) as error:
            await self._abort(context, ErrorCode(error.code), error.message)
            raise AssertionError("unreachable: abort raises") from None
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        for name, array, _ in chosen:
            response.outputs.add(name=name, datatype=NUMPY_DTYPES[array.dtype.name], shape=array.shape)
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
        return response


def make_server(gateway: Gateway, listen: str, max_message_bytes: int) -> grpc.aio.Server:
    """The gRPC server on `listen` (HOST:PORT), messages capped at `max_message_bytes`."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(gateway), server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    return server
