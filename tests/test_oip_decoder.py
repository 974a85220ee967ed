"""The OIP request decoder and the `oip` config key, without a daemon: whatever arrives, a refusal or arrays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infervisor.gateway.status_codes import GRPC_STATUS, http_status
from infervisor.gateway.tensors import OIP_DTYPES, decode_json_request
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.supervisor.settings.config import ConfigError, parse_config

_LIMIT = 4096

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)
_inputs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["x", "", "y" * 200]) | _json_values,
        "datatype": st.sampled_from([*OIP_DTYPES, "BYTES", "BF16"]) | _json_values,
        "shape": st.lists(st.integers(-2, 40), max_size=10) | _json_values,
    },
    optional={"data": _json_values, "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-5, 300)})},
)
_documents = st.fixed_dictionaries(
    {"inputs": st.lists(_inputs, max_size=4) | _json_values},
    optional={"outputs": _json_values, "parameters": _json_values, "id": _json_values},
)


def _decode_or_refuse(body: bytes, header_length: int | None) -> None:
    try:
        request = decode_json_request(body, header_length, _LIMIT)
    except ProtocolError as error:
        assert error.code in (ErrorCode.BAD_REQUEST, ErrorCode.INVALID_INPUT)
        return
    for name, array in request.inputs.items():
        assert isinstance(name, str) and array.nbytes <= _LIMIT
        assert array.dtype.name in OIP_DTYPES.values()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=_documents, tail=st.binary(max_size=300))
def test_any_document_decodes_to_arrays_or_a_protocol_refusal(document: dict[str, Any], tail: bytes) -> None:
    """Structured OIP-like JSON with a binary tail: arrays within the frame limit, or BAD_REQUEST/INVALID_INPUT."""
    header = json.dumps(document).encode()
    _decode_or_refuse(header + tail, len(header) if tail else None)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=400), header_length=st.none() | st.integers(-10, 500))
def test_any_bytes_decode_to_arrays_or_a_protocol_refusal(body: bytes, header_length: int | None) -> None:
    """Random bytes and header lengths never raise anything but the protocol's refusal."""
    _decode_or_refuse(body, header_length)


def test_json_and_binary_inputs_decode_to_the_sent_values() -> None:
    """A JSON input and a binary one decode to exactly what was sent, in order."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[True, False]])
    header = json.dumps(
        {
            "id": "r1",
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": a.nbytes}},
                {"name": "b", "datatype": "BOOL", "shape": [1, 2], "data": [[True, False]]},
            ],
            "parameters": {"sequence_id": 7, "sequence_start": True},
        }
    ).encode()
    request = decode_json_request(header + a.tobytes(), len(header), _LIMIT)
    assert request.request_id == "r1" and request.sequence is not None and request.sequence.stream == "7"
    assert np.array_equal(request.inputs["a"], a) and np.array_equal(request.inputs["b"], b)


def test_every_error_code_has_a_grpc_and_an_http_status() -> None:
    """The mapping is total: no daemon code falls through to a default."""
    assert set(GRPC_STATUS) == set(ErrorCode)
    assert {http_status(code) for code in ErrorCode} <= {400, 404, 409, 429, 500, 503, 504}


def _config(oip: object, **extra: Any) -> str:
    return json.dumps(
        {
            "oip": oip,
            **extra,
            "models": {
                "m": {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}
            },
        }
    )


@pytest.mark.parametrize(
    "oip",
    [{"http": "0.0.0.0:8000"}, {"grpc": "10.0.0.1:8001"}, {"http": "a.example:80"}, {"http": "1:2:3"}, {}, [1]],
    ids=repr,
)
def test_oip_outside_loopback_or_malformed_is_refused(oip: object, tmp_path: Path) -> None:
    """Like metrics_listen: a non-loopback address needs `oip_allow_remote`, a name or a bad form is refused."""
    with pytest.raises(ConfigError, match="oip"):
        parse_config(_config(oip), tmp_path)


def test_oip_beyond_loopback_with_the_flag_is_accepted(tmp_path: Path) -> None:
    """`oip_allow_remote: true` lets the gateway listen on a pod's address."""
    config = parse_config(_config({"http": "0.0.0.0:8080", "grpc": None}, oip_allow_remote=True), tmp_path)
    assert config.oip is not None and (config.oip.http, config.oip.grpc) == ("0.0.0.0:8080", None)
