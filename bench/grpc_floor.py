"""A gRPC inference server that does nothing: what grpcio's asyncio server costs per request on its own.

    python bench/grpc_floor.py HOST:PORT

`ModelInfer` answers every request at once with one small constant output, as the gateway's servicer would after
the broker answered; nothing else runs. bench/oip.py drives it like the gateway and reads its CPU time per request:
no gateway built on this server can cost less.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

_OUTPUT = bytes(16)  # four float32s, as tiny's output


class _Constant(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="y", datatype="FP32", shape=[1, 4])
        response.raw_output_contents.append(_OUTPUT)
        return response


async def serve(listen: str) -> None:
    """Serve on `listen` until killed."""
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Constant(), server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
