"""The verdicts store (infervisor/common/verdicts.py): what live traffic refused or passed, kept per spec key in the
cache, 0600 and written whole; a damaged or unsafe file is never honoured; a changed spec is another key."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from infervisor.common import verdicts
from infervisor.common.profiles import PROFILES
from infervisor.common.strict_modes import UnsafePath
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.lifecycle.background_build import needs_builder
from infervisor.supervisor.settings.config import Config, ConfigError, parse_config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.launcher import launch_spec

INPUTS = [["x", "float32", [None, 8]]]
REFUSAL = {"by": "shadow", "why": "row 0 off", "measure": "cosine 0.0 < 0.999", "cosine": 0.0, "input_shape": "x[1, 8]"}


def _key(tolerance: dict[str, object] | None = None, digest: str = "weights") -> str:
    return verdicts.spec_key(digest, INPUTS, tolerance or {"min_cosine": 0.999}, "", False)


def test_a_refusal_is_kept_0600_read_back_and_replaces_a_pass(tmp_path: Path) -> None:
    """A pass then a refusal of the same profile: the file is 0600, the refusal reads back with its figures and the
    pass is gone; the skip reason names who refused it."""
    key = _key()
    verdicts.record(tmp_path, key, "m", "bf16", {"by": "shadow", "why": "200 rows"}, refused=False)
    assert "bf16" in verdicts.read(tmp_path, key).passed
    verdicts.record(tmp_path, key, "m", "bf16", REFUSAL, refused=True)
    path = verdicts.path_for(tmp_path, key)
    assert path.name == f"verdicts-{key}.json" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    found = verdicts.read(tmp_path, key)
    assert found.model == "m" and "bf16" not in found.passed, found
    assert found.refused["bf16"]["input_shape"] == "x[1, 8]" and found.refused["bf16"]["spec_key"] == key, found
    assert found.refusal("bf16") == "refused by shadow on live traffic: row 0 off"
    assert found.refusal("jit") is None and [v.key for v in verdicts.of_model(tmp_path, "m")] == [key]


def test_new_weights_or_another_tolerance_is_another_key_and_the_builder_forgets_the_old(tmp_path: Path) -> None:
    """The key follows the weights digest and the tolerance; forget_others drops the model's other keys, clear all."""
    old, new = _key(), _key({"min_cosine": 0.99})
    assert old != new and _key(digest="other") != old
    verdicts.record(tmp_path, old, "m", "bf16", REFUSAL, refused=True)
    verdicts.record(tmp_path, _key(digest="n"), "n", "bf16", REFUSAL, refused=True)
    assert verdicts.read(tmp_path, new).refusal("bf16") is None
    verdicts.forget_others(tmp_path, "m", new)
    assert not verdicts.path_for(tmp_path, old).exists() and verdicts.of_model(tmp_path, "n")
    verdicts.record(tmp_path, new, "m", "int8_static", REFUSAL, refused=True)
    assert verdicts.clear(tmp_path, "m") == 1 and not verdicts.of_model(tmp_path, "m")
    assert verdicts.of_model(tmp_path, "n")


def test_a_damaged_or_group_writable_file_is_refused_never_honoured(tmp_path: Path) -> None:
    """A truncated file is a ValueError, a group-writable one UnsafePath; neither is listed, and a new record replaces
    the damaged file whole instead of merging from it."""
    key = _key()
    verdicts.record(tmp_path, key, "m", "bf16", REFUSAL, refused=True)
    path = verdicts.path_for(tmp_path, key)
    path.chmod(0o660)
    with pytest.raises(UnsafePath):
        verdicts.read(tmp_path, key)
    path.chmod(0o600)
    path.write_text(path.read_text()[:40])
    with pytest.raises(ValueError):
        verdicts.read(tmp_path, key)
    assert verdicts.of_model(tmp_path, "m") == []
    verdicts.record(tmp_path, key, "m", "int8_static", REFUSAL, refused=True)
    assert set(verdicts.read(tmp_path, key).refused) == {"int8_static"}


def _config(tmp_path: Path, **keys: object) -> Config:
    entry = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}], **keys}
    return parse_config(json.dumps({"models": {"m": entry}}), tmp_path)


def _model(tmp_path: Path, **keys: object) -> ModelConfig:
    return _config(tmp_path, **keys).models["m"]


def _held(tmp_path: Path, **keys: object) -> bool:
    """Whether a worker of this model is launched held to the shadow."""
    config = _config(tmp_path, **keys)
    return launch_spec(config.models["m"], Assignment("m", 0, (0,), 0, 1, False), config, "m.0", 3).shadow


def test_the_shadow_keys_default_on_hold_lossy_profiles_only_behind_a_builder_and_refuse_nonsense(
    tmp_path: Path,
) -> None:
    """shadow on, 200 rows, a quarter core by default; workers are held to it only with `build: background` (no builder
    to shadow otherwise) and not with `shadow: off`; lossy is what changes numerics; a bad value is refused."""
    model = _model(tmp_path, profiles=["int8_static", "eager"])
    assert (model.shadow, model.shadow_rows, model.shadow_budget) == ("on", 200, 0.25)
    assert _held(tmp_path, profiles=["int8_static", "eager"]) and needs_builder(model)
    assert needs_builder(_model(tmp_path, profiles=["bf16", "eager"])), "nothing to build, but a pick to shadow"
    assert not _held(tmp_path, profiles=["int8_static", "eager"], shadow="off")
    assert not _held(tmp_path, profiles=["int8_static", "eager"], build="at_start")
    assert [p for p in PROFILES if verdicts.lossy(p)] == [
        "int8_static", "int8_dynamic", "bf16", "openvino_bf16", "openvino_int8"
    ]  # fmt: skip
    for bad in ({"shadow": "maybe"}, {"shadow_rows": 0}, {"shadow_budget": 2}):
        with pytest.raises(ConfigError):
            _model(tmp_path, **bad)
