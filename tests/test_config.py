"""config.json parsing: defaults, and every problem reported at once under the JSON path of the bad key."""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Final, get_type_hints

import numpy as np
import pytest
import zmq.auth

from infervisor.protocol.constants import DEFAULT_MAX_FRAME_BYTES, DTYPE_ITEMSIZE, MAX_NAME_LEN, MAX_RANK
from infervisor.protocol.launch import ModelSource
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.settings import config_docs
from infervisor.supervisor.settings.config import TOP_KEYS, Config, ConfigError, load_config, parse_config
from infervisor.supervisor.settings.config_diff import diff_configs, unclassified_keys
from infervisor.supervisor.settings.config_keys import (
    Applied,
    Choice,
    Custom,
    Flag,
    Fraction,
    Integer,
    Key,
    Number,
    Text,
)
from infervisor.supervisor.settings.model_entry import MODEL_KEYS, ModelConfig

ROOT: Final = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG: Final = ROOT / "configs" / "default.json"
BASE: Final = Path("/srv/infervisor")
TINY_INPUT: Final[dict[str, Any]] = {"name": "x", "dtype": "float32", "shape": [None, 16]}


class _Delete:
    """Marker for `remove this key` in config builders (with a stable repr for test ids)."""

    def __repr__(self) -> str:
        """Show as DELETE in test ids."""
        return "DELETE"


DELETE: Final = _Delete()


def _apply(obj: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`obj` with keys replaced, added or (for DELETE) removed."""
    result = dict(obj)
    for key, value in changes.items():
        if value is DELETE:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def _model(**changes: Any) -> dict[str, Any]:
    """A valid model entry (builtin source, one float32[*,16] input) with changes."""
    return _apply({"source": {"builtin": "resnet50"}, "inputs": [dict(TINY_INPUT)]}, changes)


def _text(model: dict[str, Any] | None = None, /, *, name: str = "m", **top: Any) -> str:
    """Config JSON with one model `name` (default: a valid one) and top-level changes."""
    return json.dumps(_apply({"models": {name: model if model is not None else _model()}}, top))


def _top(key: str, value: object) -> str:
    """Config JSON with the valid model and one top-level key set (any name, `model` and `name` included)."""
    return json.dumps({"models": {"m": _model()}, key: value})


def _input(**changes: Any) -> str:
    """Config JSON whose model has one input with changes."""
    return _text(_model(inputs=[_apply(TINY_INPUT, changes)]))


def _parse(text: str, base: Path = BASE) -> Config:
    """parse_config with the test base directory."""
    return parse_config(text, base)


def _problems(text: str) -> list[str]:
    """The problems of the ConfigError that parsing `text` raises."""
    with pytest.raises(ConfigError) as info:
        _parse(text)
    problems = info.value.problems
    assert problems and all(isinstance(p, str) for p in problems)
    assert str(info.value) == "; ".join(problems)
    return problems


def _paths(problems: list[str]) -> list[str]:
    """The `path` part of each `path: why` problem."""
    return [p.split(": ", 1)[0] for p in problems]


def _assert_problem_at(text: str, path: str) -> list[str]:
    """Parsing `text` fails with a problem whose path is exactly `path`; returns all problems."""
    problems = _problems(text)
    assert path in _paths(problems), problems
    return problems


# ---------------------------------------------------------------------------------------------------------------
# valid configs


def test_default_config_parses() -> None:
    """configs/default.json is valid and serves resnet50 with its image input spec."""
    config = _parse(DEFAULT_CONFIG.read_text(), DEFAULT_CONFIG.parent)
    assert list(config.models) == ["resnet50"]
    model = config.models["resnet50"]
    assert model.name == "resnet50"
    assert model.source == ModelSource("builtin", name="resnet50")
    assert model.inputs == (TensorSpec("image", "float32", (None, 3, 224, 224)),)
    assert (model.workers, model.cores_per_worker, model.queue_size, model.max_retries) == (2, 1, 64, 2)
    assert (model.profiles, model.pick) == (("int8_static", "jit_onednn", "eager"), "fastest")
    assert model.tolerance == {
        "min_cosine": 0.98, "max_rel_error": 0.02, "max_abs_error": None, "top1": True, "max_channel_error": 0.4472,
        "max_element_error": 0.4472, "outputs": {}, "task_check": None, "task_check_dir": None,
    }  # fmt: skip
    assert (config.log_level, config.heartbeat_interval_ms, config.heartbeat_liveness) == ("info", 500, 10)
    assert config.shutdown_grace_s == 10.0


def test_load_config_reads_default_json_like_parse_config() -> None:
    """load_config gives what parse_config gives for the file's text and resolved directory."""
    assert load_config(DEFAULT_CONFIG) == _parse(DEFAULT_CONFIG.read_text(), DEFAULT_CONFIG.parent.resolve())


def test_minimal_config_gets_defaults() -> None:
    """A config with only a model source and inputs gets the documented defaults everywhere."""
    config = _parse(_text())
    model = config.models["m"]
    assert model.source == ModelSource("builtin", name="resnet50")
    assert model.inputs == (TensorSpec("x", "float32", (None, 16), allow_non_finite=False),)
    assert model.outputs is None
    assert (model.workers, model.cores_per_worker, model.use_smt, model.threads) == (1, 1, False, None)
    assert (model.queue_size, model.warmup_iterations, model.max_retries, model.prefetch) == (64, 3, 2, 1)
    assert config.runtime_dir is None
    assert config.log_level == "info"
    assert config.tcp_endpoint is None
    assert config.oversubscribe is False
    assert (config.heartbeat_interval_ms, config.heartbeat_liveness) == (500, 10)
    assert (config.hang_factor, config.hang_min_s) == (20.0, 10.0)
    assert (config.worker_start_timeout_s, config.shutdown_grace_s) == (300.0, 10.0)
    assert config.max_frame_bytes == DEFAULT_MAX_FRAME_BYTES
    assert (config.restart_window_s, config.max_restarts) == (60.0, 5)


def test_every_setting_can_be_given() -> None:
    """Explicit values for every key are taken as written (numbers as floats where the field is a float)."""
    model = _model(
        inputs=[{**TINY_INPUT, "allow_non_finite": True}, {"name": "s", "dtype": "int64", "shape": []}],
        outputs=["y", "z"],
        workers=3,
        cores_per_worker=2,
        use_smt=True,
        threads=4,
        queue_size=0,
        warmup_iterations=1,
        max_retries=0,
        prefetch=16,
    )
    text = _text(
        model,
        runtime_dir="/run/iv",
        log_level="debug",
        tcp_endpoint="tcp://127.0.0.1:5555",
        oversubscribe=True,
        heartbeat_interval_ms=100,
        heartbeat_liveness=3,
        hang_factor=2,
        hang_min_s=0.5,
        worker_start_timeout_s=30,
        shutdown_grace_s=0,
        max_frame_bytes=1024,
        restart_window_s=10,
        max_restarts=1,
    )
    config = _parse(text)
    m = config.models["m"]
    assert m.inputs == (TensorSpec("x", "float32", (None, 16), True), TensorSpec("s", "int64", ()))
    assert m.outputs == ("y", "z")
    assert (m.workers, m.cores_per_worker, m.use_smt, m.threads) == (3, 2, True, 4)
    assert (m.queue_size, m.warmup_iterations, m.max_retries, m.prefetch) == (0, 1, 0, 16)
    assert (config.runtime_dir, config.log_level, config.tcp_endpoint) == ("/run/iv", "debug", "tcp://127.0.0.1:5555")
    assert config.oversubscribe is True
    assert (config.heartbeat_interval_ms, config.heartbeat_liveness, config.max_frame_bytes) == (100, 3, 1024)
    floats = (config.hang_factor, config.hang_min_s, config.worker_start_timeout_s, config.shutdown_grace_s)
    assert floats == (2.0, 0.5, 30.0, 0.0) and all(type(f) is float for f in floats)
    assert (config.restart_window_s, config.max_restarts) == (10.0, 1)


def test_several_models_keep_their_order() -> None:
    """All models are parsed, in file order."""
    text = json.dumps({"models": {"b": _model(), "a": _model(workers=2), "c.v1-x_y": _model()}})
    assert list(_parse(text).models) == ["b", "a", "c.v1-x_y"]


@pytest.mark.parametrize("outputs", [None, []], ids=repr)
def test_null_or_empty_outputs_mean_all_outputs(outputs: list[str] | None) -> None:
    """outputs null or [] both mean the model's own outputs (None)."""
    assert _parse(_text(_model(outputs=outputs))).models["m"].outputs is None


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5555", "tcp://127.1.2.3:80", "tcp://localhost:1", "tcp://[::1]:5555"]
)
def test_loopback_tcp_endpoints_are_accepted(endpoint: str) -> None:
    """tcp_endpoint accepts IPv4 loopback, localhost and [::1] with a port."""
    assert _parse(_text(tcp_endpoint=endpoint)).tcp_endpoint == endpoint


def test_json_null_means_default_for_optional_strings() -> None:
    """runtime_dir, tcp_endpoint and threads may be null."""
    config = _parse(_text(_model(threads=None), runtime_dir=None, tcp_endpoint=None))
    assert (config.runtime_dir, config.tcp_endpoint, config.models["m"].threads) == (None, None, None)


# ---------------------------------------------------------------------------------------------------------------
# digest


def test_digest_is_stable_for_the_same_text() -> None:
    """Parsing the same text twice gives the same 16-hex-digit digest."""
    text = _text()
    digest = _parse(text).digest
    assert digest == _parse(text).digest
    assert len(digest) == 16 and int(digest, 16) >= 0


@pytest.mark.parametrize(
    "other",
    [_text(_model(workers=2)), _text() + "\n", _text(log_level="info"), _text(name="n")],
    ids=["value", "whitespace", "explicit-default", "model-name"],
)
def test_digest_changes_when_the_text_changes(other: str) -> None:
    """Any change to the text, even whitespace or spelling out a default, changes the digest."""
    assert _parse(other).digest != _parse(_text()).digest


# ---------------------------------------------------------------------------------------------------------------
# file-level problems


@pytest.mark.parametrize("text", ["", "{", '{"models": }', "models: {}", '{"a": 1,}', "{'models': {}}"], ids=repr)
def test_invalid_json_is_a_file_problem(text: str) -> None:
    """Text that is not JSON gives one problem under (file) saying so."""
    problems = _problems(text)
    assert len(problems) == 1
    assert problems[0].startswith("(file): not valid JSON")


@pytest.mark.parametrize("text", ["[]", '"models"', "1", "null", "true"])
def test_non_object_top_level_is_a_problem(text: str) -> None:
    """A JSON document that is not an object gives one problem under (file)."""
    assert _problems(text) == ["(file): must be a JSON object"]


def test_unreadable_file_is_a_file_problem(tmp_path: Path) -> None:
    """load_config of a missing file raises ConfigError under (file) naming the path."""
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.json")
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("(file): cannot read")
    assert "missing.json" in info.value.problems[0]


# ---------------------------------------------------------------------------------------------------------------
# top-level keys


@pytest.mark.parametrize("key", ["model", "name", "Models", "workers", "log-level", ""])
def test_unknown_top_level_key_is_a_problem(key: str) -> None:
    """A top-level key the daemon does not know is reported at its bare name, listing the allowed keys."""
    problems = _assert_problem_at(_top(key, 1), key)
    assert "unknown key" in problems[0] and "tcp_endpoint" in problems[0]


@pytest.mark.parametrize("models", [DELETE, {}, [], None, "m", [_model()]], ids=repr)
def test_missing_or_empty_models_is_a_problem(models: object) -> None:
    """models must be a non-empty object."""
    text = json.dumps(_apply({"models": {}}, {"models": models}))
    assert _problems(text) == ["models: must be a non-empty object of model name -> model"]


@pytest.mark.parametrize("level", ["verbose", "INFO", "Info", "", 1, None, ["info"]], ids=repr)
def test_bad_log_level_is_a_problem(level: object) -> None:
    """log_level must be one of debug, info, warning, error (lowercase)."""
    problems = _assert_problem_at(_text(log_level=level), "log_level")
    assert "debug, info, warning, error" in problems[0]


@pytest.mark.parametrize(
    "endpoint",
    [
        "localhost:5555",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:",
        "tcp://127.0.0.1:port",
        "tcp://:5555",
        "ipc:///tmp/x.sock",
        "udp://127.0.0.1:5555",
        "tcp://127.0.0.1:5555/path",
        " tcp://127.0.0.1:5555",
    ],
)
def test_malformed_tcp_endpoint_is_a_problem(endpoint: str) -> None:
    """A tcp_endpoint string that is not tcp://host:port is reported at tcp_endpoint."""
    problems = _assert_problem_at(_text(tcp_endpoint=endpoint), "tcp_endpoint")
    assert "tcp://127.0.0.1:5555" in problems[0]


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "tcp://[::]:5555"])
def test_non_loopback_tcp_endpoint_is_a_problem(endpoint: str) -> None:
    """tcp_endpoint may only bind a loopback address (requests are unauthenticated)."""
    problems = _assert_problem_at(_text(tcp_endpoint=endpoint), "tcp_endpoint")
    assert "loopback" in problems[0]


@pytest.mark.parametrize("endpoint", [5, "", [], {"host": "127.0.0.1"}, True], ids=repr)
def test_non_string_tcp_endpoint_is_a_problem(endpoint: object) -> None:
    """A tcp_endpoint that is not a non-empty string is reported at tcp_endpoint."""
    _assert_problem_at(_text(tcp_endpoint=endpoint), "tcp_endpoint")


@pytest.mark.parametrize("runtime_dir", ["", 5, [], False], ids=repr)
def test_bad_runtime_dir_is_a_problem(runtime_dir: object) -> None:
    """runtime_dir must be a non-empty string or null."""
    _assert_problem_at(_text(runtime_dir=runtime_dir), "runtime_dir")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("oversubscribe", "yes"),
        ("oversubscribe", 1),
        ("oversubscribe", None),
        ("heartbeat_interval_ms", 9),
        ("heartbeat_interval_ms", 60_001),
        ("heartbeat_interval_ms", "500"),
        ("heartbeat_interval_ms", 500.0),
        ("heartbeat_interval_ms", True),
        ("heartbeat_liveness", 1),
        ("hang_factor", 0.5),
        ("hang_factor", "20"),
        ("hang_factor", True),
        ("hang_factor", None),
        ("hang_min_s", 0),
        ("worker_start_timeout_s", 0.5),
        ("shutdown_grace_s", -1),
        ("max_frame_bytes", 1023),
        ("max_frame_bytes", 2**40 + 1),
        ("restart_window_s", 0),
        ("max_restarts", 0),
        ("max_restarts", 1001),
    ],
    ids=repr,
)
def test_bad_top_level_number_or_flag_is_a_problem(key: str, value: object) -> None:
    """Top-level numbers out of range or of the wrong type, and non-bool flags, are reported at the bare key."""
    problems = _assert_problem_at(_top(key, value), key)
    assert repr(value) in problems[0]


def test_nan_is_not_a_valid_number() -> None:
    """A NaN (which Python's json accepts) fails the range check of a float setting."""
    text = _text().replace('"models"', '"hang_factor": NaN, "models"')
    assert math.isnan(json.loads(text)["hang_factor"])
    _assert_problem_at(text, "hang_factor")


# ---------------------------------------------------------------------------------------------------------------
# model keys


@pytest.mark.parametrize("key", ["worker", "Workers", "batch_size", "input"])
def test_unknown_model_key_is_a_problem(key: str) -> None:
    """A model key the daemon does not know is reported at models.<name>.<key>."""
    problems = _assert_problem_at(_text(_model(**{key: 1})), f"models.m.{key}")
    assert "unknown key" in problems[0]


@pytest.mark.parametrize("name", ["bad name", "-m", "_m", ".m", "m/x", "m:1", "é", "m" * (MAX_NAME_LEN + 1)])
def test_bad_model_name_is_a_problem(name: str) -> None:
    """Model names use letters, digits, '_', '.', '-', start with a letter or digit and fit MAX_NAME_LEN."""
    _assert_problem_at(_text(name=name), f"models.{name}")


@pytest.mark.parametrize("model", [[], "resnet50", 1, None], ids=repr)
def test_model_that_is_not_an_object_is_a_problem(model: object) -> None:
    """Each model entry must be an object."""
    text = json.dumps({"models": {"m": model}})
    assert _problems(text) == ["models.m: must be an object"]


@pytest.mark.parametrize(
    ("source", "path"),
    [
        ({"builtin": "resnet50", "torchscript": "m.pt"}, "models.m.source"),
        ({}, "models.m.source"),
        (DELETE, "models.m.source"),
        (None, "models.m.source"),
        ("resnet50", "models.m.source"),
        (["builtin", "resnet50"], "models.m.source"),
        ({"onnx": "m.onnx"}, "models.m.source.onnx"),
        ({"Builtin": "resnet50"}, "models.m.source.Builtin"),
        ({"builtin": ""}, "models.m.source.builtin"),
        ({"torchscript": ""}, "models.m.source.torchscript"),
        ({"exported": 5}, "models.m.source.exported"),
        ({"builtin": None}, "models.m.source.builtin"),
    ],
    ids=repr,
)
def test_bad_source_is_a_problem(source: object, path: str) -> None:
    """A source that is not exactly one known kind with a non-empty string is reported at its path."""
    _assert_problem_at(_text(_model(source=source)), path)


@pytest.mark.parametrize("kind", ["torchscript", "exported"])
def test_relative_model_file_resolves_against_base(kind: str, tmp_path: Path) -> None:
    """A relative torchscript/exported path is joined to the base directory; an absolute one is kept."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.pt").write_bytes(b"")
    relative = parse_config(_text(_model(source={kind: "models/m.pt"})), tmp_path).models["m"].source
    assert relative == ModelSource(kind, path=str(tmp_path / "models" / "m.pt"))
    absolute = parse_config(_text(_model(source={kind: str(tmp_path / "models" / "m.pt")})), BASE).models["m"].source
    assert absolute == ModelSource(kind, path=str(tmp_path / "models" / "m.pt"))


@pytest.mark.parametrize("kind", ["torchscript", "exported"])
def test_missing_model_file_is_a_problem(kind: str, tmp_path: Path) -> None:
    """A model file that does not exist is refused at load (a reload to it changes nothing)."""
    with pytest.raises(ConfigError) as caught:
        parse_config(_text(_model(source={kind: "missing.pt"})), tmp_path)
    assert any(p.startswith(f"models.m.source.{kind}:") and "not an existing file" in p for p in caught.value.problems)


def test_load_config_resolves_relative_paths_against_the_config_directory(tmp_path: Path) -> None:
    """Through load_config a relative model file is found next to the config file, wherever the cwd is."""
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "m.pt").write_bytes(b"")
    (folder / "config.json").write_text(_text(_model(source={"torchscript": "m.pt"})))
    source = load_config(folder / "config.json").models["m"].source
    assert source == ModelSource("torchscript", path=str(folder.resolve() / "m.pt"))


@pytest.mark.parametrize(
    ("key", "value"), [("inputs", DELETE), ("inputs", []), ("inputs", {}), ("inputs", "x")], ids=repr
)
def test_missing_or_empty_inputs_is_a_problem(key: str, value: object) -> None:
    """inputs must be a non-empty array."""
    _assert_problem_at(_text(_model(**{key: value})), "models.m.inputs")


@pytest.mark.parametrize("item", [1, "x", None, ["x", "float32", [1]]], ids=repr)
def test_input_that_is_not_an_object_is_a_problem(item: object) -> None:
    """Each input must be an object, reported at models.m.inputs[i]."""
    _assert_problem_at(_text(_model(inputs=[dict(TINY_INPUT), item])), "models.m.inputs[1]")


@pytest.mark.parametrize("name", [DELETE, "", 5, None, "n" * (MAX_NAME_LEN + 1)], ids=repr)
def test_bad_input_name_is_a_problem(name: object) -> None:
    """An input name must be a 1..128 character string."""
    _assert_problem_at(_input(name=name), "models.m.inputs[0].name")


@pytest.mark.parametrize("dtype", ["float", "Float32", "f4", "complex64", "uint16", "", 5, None, DELETE], ids=repr)
def test_bad_input_dtype_is_a_problem(dtype: object) -> None:
    """An input dtype off the wire whitelist is reported at models.m.inputs[0].dtype, listing the allowed ones."""
    problems = _assert_problem_at(_input(dtype=dtype), "models.m.inputs[0].dtype")
    assert all(d in problems[0] for d in DTYPE_ITEMSIZE)


@pytest.mark.parametrize(
    "shape", [[0], [None, 0], [-1], [1, "a"], "abc", "[1]", [True], [1.5], [[1]], None, DELETE, {"0": 1}], ids=repr
)
def test_bad_input_shape_is_a_problem(shape: object) -> None:
    """A shape that is not an array of dims is reported at models.m.inputs[0].shape, a bad dim at shape[i]."""
    paths = _paths(_problems(_input(shape=shape)))
    assert any(p == "models.m.inputs[0].shape" or p.startswith("models.m.inputs[0].shape[") for p in paths), paths


@pytest.mark.parametrize("value", ["yes", 1, None], ids=repr)
def test_bad_allow_non_finite_is_a_problem(value: object) -> None:
    """allow_non_finite must be a boolean."""
    _assert_problem_at(_input(allow_non_finite=value), "models.m.inputs[0].allow_non_finite")


def test_unknown_input_key_is_a_problem() -> None:
    """An input key other than name, dtype, shape, allow_non_finite is reported at its path."""
    _assert_problem_at(_input(layout="NCHW"), "models.m.inputs[0].layout")


def test_problem_in_a_later_input_names_its_index() -> None:
    """Problems in the second input are reported under inputs[1]."""
    inputs = [dict(TINY_INPUT), {"name": "y", "dtype": "float", "shape": [1]}]
    assert _paths(_problems(_text(_model(inputs=inputs)))) == ["models.m.inputs[1].dtype"]


@pytest.mark.parametrize("outputs", ["y", [""], [1], [None], {"y": 1}, ["y", 2]], ids=repr)
def test_bad_outputs_is_a_problem(outputs: object) -> None:
    """outputs must be an array of non-empty names, or null."""
    _assert_problem_at(_text(_model(outputs=outputs)), "models.m.outputs")


@pytest.mark.parametrize("workers", [0, -1, 257, True, False, "2", 1.0, 1.5, None, [1]], ids=repr)
def test_bad_workers_is_a_problem(workers: object) -> None:
    """workers must be an integer in [1, 256] (not a bool, string or float)."""
    problems = _assert_problem_at(_text(_model(workers=workers)), "models.m.workers")
    assert "[1, 256]" in problems[0]


@pytest.mark.parametrize("threads", [0, -1, True, False, "4", 1.5, 2.0, [2]], ids=repr)
def test_bad_threads_is_a_problem(threads: object) -> None:
    """threads must be a positive integer or null."""
    _assert_problem_at(_text(_model(threads=threads)), "models.m.threads")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cores_per_worker", 0),
        ("cores_per_worker", 1025),
        ("use_smt", "yes"),
        ("use_smt", 0),
        ("queue_size", -1),
        ("queue_size", 1_000_001),
        ("warmup_iterations", 0),
        ("warmup_iterations", 1001),
        ("max_retries", -1),
        ("max_retries", 11),
        ("max_retries", True),
        ("prefetch", 0),
        ("prefetch", 17),
        ("prefetch", 1.0),
    ],
    ids=repr,
)
def test_bad_model_number_or_flag_is_a_problem(key: str, value: object) -> None:
    """Model numbers out of range or of the wrong type, and non-bool flags, are reported at models.m.<key>."""
    _assert_problem_at(_text(_model(**{key: value})), f"models.m.{key}")


# ---------------------------------------------------------------------------------------------------------------
# several problems


def test_all_problems_are_reported_at_once() -> None:
    """One parse reports every problem in the file, each under its own path."""
    bad_model = _model(
        source={"onnx": "x"},
        inputs=[{"name": "x", "dtype": "float", "shape": [1]}, {"name": "y", "dtype": "int8", "shape": [0]}],
        workers=0,
        colour="red",
    )
    text = json.dumps(
        {
            "models": {"a": bad_model, "b": _model(threads=0), "ok": _model()},
            "log_level": "loud",
            "tcp_endpoint": "tcp://127.0.0.1",
            "heartbeat_liveness": 0,
            "bogus": True,
        }
    )
    assert sorted(_paths(_problems(text))) == sorted(
        [
            "bogus",
            "models.a.colour",
            "models.a.source.onnx",
            "models.a.inputs[0].dtype",
            "models.a.inputs[1].shape[0]",
            "models.a.workers",
            "models.b.threads",
            "log_level",
            "tcp_endpoint",
            "heartbeat_liveness",
        ]
    )


def test_problems_are_one_line_each() -> None:
    """Every problem is a single `path: why` line."""
    problems = _problems(_text(_model(workers=0, threads=0), log_level="x", max_restarts=0))
    assert len(problems) == 4
    assert all("\n" not in p and ": " in p for p in problems)


# ---------------------------------------------------------------------------------------------------------------
# edge cases: unhashable values, parser depth, wire limits, strict matching


@pytest.mark.parametrize("dtype", [[], ["float32"], {"float32": 1}], ids=repr)
def test_unhashable_input_dtype_is_a_problem(dtype: object) -> None:
    """An array or object dtype is reported at models.m.inputs[0].dtype like any other bad dtype."""
    _assert_problem_at(_input(dtype=dtype), "models.m.inputs[0].dtype")


def test_deeply_nested_json_is_a_file_problem() -> None:
    """JSON nested deeper than the parser can go is reported as a (file) problem, not a RecursionError."""
    assert _paths(_problems("[" * 100_000)) == ["(file)"]


def test_duplicate_input_names_are_a_problem() -> None:
    """Two inputs with the same name are reported at the second one's name."""
    inputs = [dict(TINY_INPUT), {"name": "x", "dtype": "int64", "shape": [1]}]
    _assert_problem_at(_text(_model(inputs=inputs)), "models.m.inputs[1].name")


@pytest.mark.parametrize(
    ("shape", "path"),
    [([1] * (MAX_RANK + 1), "shape"), ([None, 2**31], "shape[1]"), ([[1, 2**31]], "shape[0]")],
    ids=["rank", "dim", "range"],
)
def test_input_shape_beyond_wire_limits_is_a_problem(shape: list[Any], path: str) -> None:
    """A shape no request could ever carry is reported at models.m.inputs[0].shape (a dim at shape[i])."""
    _assert_problem_at(_input(shape=shape), f"models.m.inputs[0].{path}")


@pytest.mark.parametrize(
    ("model_name", "endpoint", "path"),
    [("m\n", None, "models.m\n"), ("m", "tcp://127.0.0.1:5555\n", "tcp_endpoint")],
    ids=["model-name", "tcp-endpoint"],
)
def test_trailing_newline_is_not_accepted(model_name: str, endpoint: str | None, path: str) -> None:
    """A model name or tcp_endpoint with a trailing newline is reported."""
    _assert_problem_at(_text(name=model_name, tcp_endpoint=endpoint), path)


@pytest.mark.parametrize(
    "port",
    ["0", "65536", "99999", "123456", "\u0665\u0665\u0665\u0665"],
    ids=["0", "65536", "99999", "6-digits", "arabic-indic"],
)
def test_tcp_port_out_of_range_is_a_problem(port: str) -> None:
    """A port that is not 1..65535 in ASCII digits is reported at tcp_endpoint."""
    _assert_problem_at(_text(tcp_endpoint=f"tcp://127.0.0.1:{port}"), "tcp_endpoint")


@pytest.mark.parametrize("host", ["127.example.com", "127.0.0.1.nip.io"])
def test_host_name_starting_with_127_is_not_loopback(host: str) -> None:
    """Only IPv4 addresses in 127.0.0.0/8 count as loopback, not names that begin with '127.'."""
    _assert_problem_at(_text(tcp_endpoint=f"tcp://{host}:5555"), "tcp_endpoint")


def test_a_key_is_always_reported_under_the_same_path() -> None:
    """A wrongly typed and a malformed tcp_endpoint are reported under the same path."""
    (typed,) = _paths(_problems(_text(tcp_endpoint=5)))
    (malformed,) = _paths(_problems(_text(tcp_endpoint="nope")))
    assert typed == malformed


def test_a_config_file_that_is_not_utf8_is_a_file_problem(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are refused as a (file) problem, not an exception out of the daemon."""
    path = tmp_path / "config.json"
    path.write_bytes(b'{"models": \xff\xfe}')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems[0].startswith("(file):") and "UTF-8" in caught.value.problems[0]


def test_optimisation_keys_are_read_and_checked(tmp_path: Path) -> None:
    """pick, calibration (resolved against the config's folder) and cache_dir parse; bad values name their path."""
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, x=np.zeros((4, 16), np.float32))
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((4, 8), np.float32))
    config = parse_config(
        _text(_model(pick="fastest", calibration="calib.npz", profiles=["int8_static", "aoti", "eager"]),
              cache_dir="/var/tmp/iv-cache"),
        tmp_path,
    )  # fmt: skip
    model = config.models["m"]
    assert (model.pick, model.calibration, config.cache_dir) == ("fastest", str(calibration), "/var/tmp/iv-cache")
    assert model.profiles == ("int8_static", "aoti", "eager")
    _assert_problem_at(_text(_model(pick="quickest")), "models.m.pick")
    _assert_problem_at(_text(_model(calibration="nowhere.npz")), "models.m.calibration")
    with pytest.raises(ConfigError) as caught:
        parse_config(_text(_model(validation="wrong.npz")), tmp_path)
    assert any(p.startswith("models.m.validation: array 'x' is float32[4, 8]") for p in caught.value.problems)
    _assert_problem_at(_text(cache_dir=""), "cache_dir")


# ---------------------------------------------------------------------------------------------------------------
# declarations: the parser, the reload diff and the docs tables all follow them

_DERIVED: Final = {"name", "digest"}
_BY_LEVEL: Final = [(Config, TOP_KEYS), (ModelConfig, MODEL_KEYS)]


@pytest.mark.parametrize(("cls", "keys"), _BY_LEVEL, ids=["top", "model"])
def test_every_field_is_a_declared_key_of_the_same_type(cls: type, keys: tuple[Key, ...]) -> None:
    """Each dataclass field but the derived ones is declared once, reading the type the field is annotated with."""
    names = [key.name for key in keys]
    assert len(names) == len(set(names))
    assert set(names) == {f.name for f in fields(cls)} - _DERIVED
    hints = get_type_hints(cls)
    assert {key.name: key.value.value_type() for key in keys} == {name: hints[name] for name in names}


def test_every_config_key_has_a_reload_rule() -> None:
    """Each declared key is applied in a way the diff knows at its level, and no field lacks a declaration."""
    assert unclassified_keys() == set()


def test_docs_key_tables_match_the_declarations() -> None:
    """docs/configuration.md shows the tables the declarations render (`config_docs --write`)."""
    text = config_docs.DOCS.read_text()
    assert config_docs.render(text) == text, f"the docs tables are stale: run `{config_docs.COMMAND}`"
    assert config_docs.main([]) == 0


def test_docs_without_the_generated_blocks_are_refused() -> None:
    """Rendering text that lacks a generated block is an error, not a silent no-op."""
    with pytest.raises(ValueError, match="generated blocks"):
        config_docs.render("# config.json\n")


def _explicit(key: Key, value: object) -> str:
    """Config JSON with the valid model and `key` (top level or model, by where it is declared) set to `value`."""
    if key in MODEL_KEYS:
        return _text(_model(**{key.name: value}))
    return _top(key.name, value)


def _field(config: Config, key: Key) -> object:
    """The parsed value of `key` from `config` (of model m for a model key)."""
    return getattr(config.models["m"] if key in MODEL_KEYS else config, key.name)


_OPTIONAL: Final = [key for key in TOP_KEYS + MODEL_KEYS if not (isinstance(key.value, Custom) and key.value.required)]


@pytest.mark.parametrize("key", _OPTIONAL, ids=lambda key: key.name)
def test_the_declared_default_is_what_an_absent_key_reads_as(key: Key) -> None:
    """Writing out a key's documented default parses exactly as leaving the key out."""
    absent = _parse(_text())
    default = json.loads(key.value.default_text().strip("`"))
    assert _field(_parse(_explicit(key, default)), key) == _field(absent, key)


def _another(key: Key, folder: Path) -> object:
    """A valid JSON value for `key` other than its default (files it names are made in `folder`)."""
    value = key.value
    if isinstance(value, Integer):
        if value.default is None:
            return value.low
        return value.default + 1 if value.default < value.high else value.low
    if isinstance(value, Number):
        return value.low if value.default is None else value.default + 1
    if isinstance(value, Fraction):
        return value.default / 2
    if isinstance(value, Flag):
        return not value.default
    if isinstance(value, Choice):
        return next(choice for choice in value.choices if choice != value.default)
    if isinstance(value, Text):
        return "/elsewhere"
    np.savez(folder / "samples.npz", x=np.zeros((4, 16), np.float32))
    # Real key files: an empty one is refused when the config is read (no public-key line).
    (folder / "clients").mkdir(exist_ok=True)
    Path(zmq.auth.create_certificates(folder, "server")[1]).chmod(0o600)  # a secret others can read is refused
    zmq.auth.create_certificates(folder / "clients", "client")
    custom: dict[str, object] = {
        "source": {"builtin": "tiny"},
        "inputs": [{**TINY_INPUT, "allow_non_finite": True}],
        "outputs": ["y"],
        "state": [{"input": "x", "output": "y"}],
        "profiles": ["jit", "eager"],
        "calibration": "samples.npz",
        "validation": "samples.npz",
        "tolerance": {"min_cosine": 0.9},
        "typical_shape": {"x": [2, 16]},
        "batching": {"max_batch_size": 8},
        "audit": {"budget": 0.1, "action": "report"},
        "curve": {"server_secret_key": "server.key_secret", "authorized_clients": "clients"},
        "tcp_endpoint": "tcp://127.0.0.1:5555",
        "metrics_listen": "127.0.0.1:9464",
        "oip": {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"},
        "bundle_keys": ["fleet.pub"],
        "socket_group": os.getegid(),  # a gid is taken as it is: one that exists on any box
    }
    return custom[key.name]


def _expected_diff(key: Key) -> dict[str, object]:
    """What diff_configs should report when only `key` changed, from its declaration."""
    if key in MODEL_KEYS:
        return {
            Applied.LIVE: {"model_live": {"m": [key.name]}},
            Applied.ROLLING: {"rolling": {"m": [key.name]}},
            Applied.SCALED: {"scaled": {"m": (1, 2)}},
        }[key.applied]
    return {
        Applied.LIVE: {"live": [key.name]},
        Applied.ROLLING: {"rolling": {"m": [key.name]}},
        Applied.DAEMON_RESTART: {"needs_daemon_restart": [key.name]},
    }[key.applied]


@pytest.mark.parametrize("key", [k for k in TOP_KEYS + MODEL_KEYS if k.name != "models"], ids=lambda key: key.name)
def test_a_change_of_one_key_is_classified_as_declared(key: Key, tmp_path: Path) -> None:
    """diff_configs puts a change of any one key where its declaration's `applied` says, and nowhere else."""
    before = parse_config(_text(), tmp_path)
    after = parse_config(_explicit(key, _another(key, tmp_path)), tmp_path)
    assert _field(before, key) != _field(after, key)
    assert diff_configs(before, after).summary() == _expected_diff(key)


def test_models_added_and_removed_are_reported_by_name() -> None:
    """A model entry that appears or disappears is `added` or `removed`; the kept one is unchanged."""
    one = _parse(_text())
    two = _parse(json.dumps({"models": {"m": _model(), "n": _model()}}))
    assert diff_configs(one, two).summary() == {"added": ["n"]}
    assert diff_configs(two, one).summary() == {"removed": ["n"]}
    assert diff_configs(one, one).empty


def test_a_retired_key_is_refused_with_what_to_do() -> None:
    """keep_warm_ms, which earlier versions read, is refused with a sentence saying it was removed, not as unknown."""
    with pytest.raises(ConfigError) as caught:
        _parse(_text(keep_warm_ms=1))
    assert caught.value.problems == [
        "keep_warm_ms: removed: the broker no longer rehearses its request path (no measured gain); delete the key"
    ]


def _state_entry(tmp_path: Path, state: object, inputs: object = None) -> list[str]:
    """The problems of a model entry with `state` (an empty list when it is accepted)."""
    entry = {
        "source": {"builtin": "tiny"},
        "inputs": inputs
        or [
            {"name": "x", "dtype": "float32", "shape": [None, 16]},
            {"name": "h", "dtype": "float32", "shape": [None, 2, 8]},
        ],
        "state": state,
    }
    try:
        parse_config(json.dumps({"models": {"m": entry}}), tmp_path)
    except ConfigError as exc:
        return exc.problems
    return []


def test_a_state_pair_is_read_against_its_input(tmp_path: Path) -> None:
    """A state pair takes its dtype and one stream's shape from the declared input it names."""
    config = parse_config(
        json.dumps(
            {
                "models": {
                    "m": {
                        "source": {"builtin": "tiny"},
                        "inputs": [{"name": "h", "dtype": "float32", "shape": [None, 2, 8]}],
                        "state": [{"input": "h", "output": "h_next"}],
                    }
                }
            }
        ),
        tmp_path,
    )
    (pair,) = config.models["m"].state
    assert (pair.input, pair.output, pair.dtype, pair.shape, pair.initial) == ("h", "h_next", "float32", (2, 8), None)


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ([{"input": "nope", "output": "o"}], "must name a declared input"),
        ([{"input": "x", "output": ""}], "must be an output name"),
        ([{"input": "h", "output": "o", "dtype": "int64"}], "is 'int64' but input 'h' is float32"),
        ([{"input": "h", "output": "o", "shape": [8, 2]}], "holds one stream's state as [2, 8]"),
        ([{"input": "h", "output": "o"}, {"input": "h", "output": "p"}], "names one input in two pairs"),
        ([{"input": "h", "output": "o", "initial": "ones"}], 'must be "zeros", null or a path to a .npy'),
        ([{"input": "h", "output": "o", "initial": "missing.npy"}], "cannot read"),
        ({"input": "h"}, "must be an array"),
    ],
)
def test_a_bad_state_pair_is_named(tmp_path: Path, state: object, problem: str) -> None:
    """Each mistake in a state pair is a config problem naming the pair's key."""
    problems = _state_entry(tmp_path, state)
    assert any(problem in p and p.startswith("models.m.state") for p in problems), problems


def test_a_state_input_must_hold_a_fixed_state_per_stream(tmp_path: Path) -> None:
    """An input whose non-batch dims are open cannot hold one stream's state."""
    inputs = [{"name": "h", "dtype": "float32", "shape": [None, None]}]
    problems = _state_entry(tmp_path, [{"input": "h", "output": "o"}], inputs)
    assert any("must be [null, ...fixed dims]" in p for p in problems), problems


def test_an_initial_state_file_must_match_the_state(tmp_path: Path) -> None:
    """An initial .npy of another shape is refused; one of the right dtype and shape is kept as an absolute path."""
    np.save(tmp_path / "wrong.npy", np.zeros((8, 2), dtype=np.float32))
    np.save(tmp_path / "right.npy", np.ones((2, 8), dtype=np.float32))
    problems = _state_entry(tmp_path, [{"input": "h", "output": "o", "initial": "wrong.npy"}])
    assert any("holds float32[8, 2]; the state is float32[2, 8]" in p for p in problems), problems
    assert _state_entry(tmp_path, [{"input": "h", "output": "o", "initial": "right.npy"}]) == []
