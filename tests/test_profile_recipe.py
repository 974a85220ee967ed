"""docs/architecture.md "Adding an optimisation profile" tried whole: one declaration and one builder, then served.

The daemon and its workers import the package from a copy of the tree in which the two files are edited
the way the recipe says (a `Profile` appended to `_DECLARED`, a function registered with `@builds`), so
the test checks that nothing else lists profiles: config validation, the worker's chain, the gate and
status all take the new name from those two edits.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from infervisor.supervisor.settings.config import ConfigError, parse_config
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry

_DECLARATION = """
    Profile(
        name="fx",
        summary="torch.fx symbolic trace of the module, recompiled to Python",
        risk="symbolic tracing refuses data-dependent control flow",
        cpu=(),
    ),
)
"""

_BUILDER = """

@builds("fx")
def _fx(context: BuildContext) -> Built:
    try:
        traced = torch.fx.symbolic_trace(context.module)
    except Exception as error:  # torch.fx raises many kinds on untraceable code: each is a skip reason
        raise ProfileError(f"symbolic trace failed: {error}") from error
    return Built(traced, [f"fx graph of {len(traced.graph.nodes)} nodes"])
"""


def _with_the_recipe_applied(tree: Path) -> None:
    """Copies the package to `tree` and makes the recipe's two edits there."""
    package = tree / "infervisor"
    shutil.copytree(ROOT / "infervisor", package, ignore=shutil.ignore_patterns("__pycache__"))
    declarations = package / "common" / "profiles.py"
    text = declarations.read_text()
    end_of_declared = text.index("\n)\n", text.index("_DECLARED = ("))
    declarations.write_text(text[:end_of_declared] + _DECLARATION + text[end_of_declared + len("\n)\n") :])
    builders = package / "worker" / "profiles" / "build.py"
    builders.write_text(builders.read_text() + _BUILDER)


@pytest.fixture
def daemon_with_fx(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon run from the edited copy: one model chained fx then eager, one served eager as the reference."""
    tree = tmp_path / "tree"
    _with_the_recipe_applied(tree)
    (tmp_path / "d").mkdir()
    config = {
        "oversubscribe": True,
        "models": {
            "traced": model_entry({"builtin": "tiny"}, TINY_INPUTS, profiles=["fx", "eager"]),
            "reference": model_entry({"builtin": "tiny"}, TINY_INPUTS, profiles=["eager"]),
        },
    }
    # The working directory is the copy's parent: `python -m` puts it first on the path.
    daemon = Daemon(tmp_path / "d", config, env={"PYTHONPATH": str(tree)}, cwd=tree)
    yield daemon
    daemon.stop()


def test_a_profile_name_is_refused_until_it_is_declared() -> None:
    """Without the declaration the recipe adds, a config naming the profile is a config error."""
    text = json.dumps({"models": {"m": model_entry({"builtin": "tiny"}, TINY_INPUTS, profiles=["fx", "eager"])}})
    with pytest.raises(ConfigError) as caught:
        parse_config(text, Path("."))
    assert any(problem.startswith("models.m.profiles[0]:") for problem in caught.value.problems)


def test_a_profile_added_by_its_declaration_and_builder_is_gated_and_served(daemon_with_fx: Daemon) -> None:
    """The two edits alone make the new profile valid config, built, checked against eager and served."""
    status = daemon_with_fx.wait_ready(timeout=120)
    worker = status["models"]["traced"]["workers"][0]
    assert worker["profile"] == "fx", worker
    assert worker["profile_skipped"] == [], worker
    assert any(note.startswith("fx graph of ") for note in worker["profile_build"]), worker["profile_build"]
    x = np.random.default_rng(7).standard_normal((3, 16)).astype(np.float32)
    with daemon_with_fx.client() as client:
        served = client.infer("traced", {"x": x})
        reference = client.infer("reference", {"x": x})
    assert served.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_allclose(served[name], value, rtol=1e-6, atol=1e-6)
