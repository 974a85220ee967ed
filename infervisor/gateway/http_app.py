"""The OIP over HTTP/1.1 (aiohttp's server): health, metadata and infer with JSON or the binary tensor extension.

aiohttp parses HTTP (its C parser, with its caps on the request line and header fields: an oversized one is a
400 before a handler runs); the body is capped at `client_max_size`, answered 413 past it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from infervisor.gateway.serving import Gateway
from infervisor.gateway.status_codes import http_status
from infervisor.gateway.tensors import chosen_outputs, decode_json_request, encode_json_response
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import InferenceError, ProtocolError

HEADER_LENGTH = "Inference-Header-Content-Length"
_GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
#: Server metadata: the extensions are those of the Triton/KServe protocol this gateway implements.
SERVER_METADATA = {"name": "infervisor", "version": "1", "extensions": ["binary_tensor_data", "sequence"]}


def _error(code: ErrorCode, message: str) -> web.Response:
    return web.json_response({"error": f"{code}: {message}"}, status=http_status(code))


def _gateway(request: web.Request) -> Gateway:
    return request.app[_GATEWAY]


async def live(request: web.Request) -> web.Response:
    """Server live: the gateway answers, so it is."""
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    """Server ready: some model serves (the daemon is ready or degraded)."""
    is_ready = _gateway(request).catalog.ready
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    """Server metadata."""
    return web.json_response(SERVER_METADATA)


async def model_ready(request: web.Request) -> web.Response:
    """Model ready: some worker of it serves."""
    gateway, name = _gateway(request), request.match_info["model"]
    entry = gateway.catalog.models.get(name)
    if entry is None:
        error = gateway.unknown_model(name)
        return _error(error.code, error.message)
    return web.json_response({"name": name, "ready": entry.ready}, status=200 if entry.ready else 503)


async def model_metadata(request: web.Request) -> web.Response:
    """Model metadata: inputs from the config, outputs as last answered."""
    gateway, name = _gateway(request), request.match_info["model"]
    if name not in gateway.catalog.models:
        error = gateway.unknown_model(name)
        return _error(error.code, error.message)
    return web.json_response(gateway.catalog.metadata(name))


async def infer(request: web.Request) -> web.Response:
    """Infer: decode, run through the broker, encode as the request asked (JSON or binary data per output)."""
    gateway, model = _gateway(request), request.match_info["model"]
    raw_length = request.headers.get(HEADER_LENGTH)
    header_length = None
    if raw_length is not None:
        if not raw_length.isdigit():
            return _error(ErrorCode.BAD_REQUEST, f"{HEADER_LENGTH} {raw_length[:32]!r} is not an integer")
        header_length = int(raw_length)
    body = await request.read()
    try:
        decoded = decode_json_request(body, header_length, gateway.max_frame_bytes)
        outputs = await gateway.infer(model, decoded, None)
        chosen = chosen_outputs(outputs, decoded.outputs, decoded.binary_default)
    except (ProtocolError, InferenceError) as error:
        return _error(ErrorCode(error.code), error.message)
    payload, json_length = encode_json_response(model, decoded.request_id, chosen)
    if json_length is None:
        return web.Response(body=payload, content_type="application/json")
    return web.Response(
        body=payload, content_type="application/octet-stream", headers={HEADER_LENGTH: str(json_length)}
    )


def make_app(gateway: Gateway, max_body_bytes: int) -> web.Application:
    """The aiohttp application with every OIP route (with and without a model version)."""
    app = web.Application(client_max_size=max_body_bytes)
    app[_GATEWAY] = gateway
    routes: list[Any] = [
        web.get("/v2/health/live", live),
        web.get("/v2/health/ready", ready),
        web.get("/v2", server_metadata),
    ]
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            web.get(f"{prefix}/ready", model_ready),
            web.get(prefix, model_metadata),
            web.post(f"{prefix}/infer", infer),
        ]
    app.add_routes(routes)
    return app
