"""A cache a fleet can share: `infervisor build --export` writes a bundle another box verifies and installs with
`infervisor build --import`; a bundle that is corrupted, lies, climbs out of its folder or was built for another
box is refused with the reason."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from infervisor.supervisor.toolkit.bundle import (
    BundleError,
    capability_key,
    export_bundle,
    import_bundle,
    stem_for,
)
from tests.conftest import STATIC_TINY_INPUTS, Daemon, model_entry

FIXED = STATIC_TINY_INPUTS


@pytest.fixture(scope="module")
def here() -> dict[str, Any]:
    """This box's capability key (one torch probe for the module)."""
    return capability_key()


def fake_entry(cache: Path, here: dict[str, Any], model: str = "m", **differs: Any) -> str:
    """A package entry as a worker writes one (key, package, its sha256), for a key like this box's but `differs`."""
    key = {"format": 2, "model": model, "profile": "aoti", "inputs": [], "options": {}, **here, **differs}
    key.pop("openvino", None)
    stem = stem_for("aoti", key)
    (cache / f"{stem}.json").write_text(json.dumps(key))
    package = cache / f"{stem}.pt2"
    package.write_bytes(os.urandom(256))
    digest = subprocess.run(["sha256sum", str(package)], capture_output=True, text=True, check=True).stdout.split()[0]
    (cache / f"{stem}.sha256").write_text(f"{digest}  {package.name}\n")
    return stem


def test_bundle_round_trip_installs_what_matches_and_refuses_another_cpu(tmp_path: Path, here: dict[str, Any]) -> None:
    """An entry for this box is installed byte for byte; one built for other CPU flags, and one for another torch,
    are refused each with the field that differs."""
    source, target = tmp_path / "a", tmp_path / "b"
    source.mkdir(mode=0o700)
    ours = fake_entry(source, here)
    other_cpu = fake_entry(source, here, model="n", cpu_flags="0123456789abcdef")
    other_torch = fake_entry(source, here, model="o", torch="1.0.0")
    export_bundle(source, tmp_path / "bundle.tar")
    outcome = import_bundle(tmp_path / "bundle.tar", target, here)
    assert outcome.installed == [ours]
    assert "cpu_flags" in outcome.refused[other_cpu] and "torch '1.0.0'" in outcome.refused[other_torch]
    assert (target / f"{ours}.pt2").read_bytes() == (source / f"{ours}.pt2").read_bytes()
    assert not list(target.glob(f"{other_cpu}*")) and not list(target.glob("*.tmp"))
    assert import_bundle(tmp_path / "bundle.tar", target, here).present == [ours]


def _rewrite(bundle: Path, change: Any) -> Path:
    """A copy of `bundle` whose members `change(name, data)` rewrites (None drops one)."""
    out = bundle.with_name("changed.tar")
    with tarfile.open(bundle) as source, tarfile.open(out, "w") as tar:
        for member in source:
            data = source.extractfile(member).read()  # type: ignore[union-attr]
            replaced = change(member.name, data)
            if replaced is not None:
                info = tarfile.TarInfo(member.name)
                info.size = len(replaced)
                tar.addfile(info, io.BytesIO(replaced))
    return out


def _exported(tmp_path: Path, here: dict[str, Any]) -> tuple[Path, str]:
    source = tmp_path / "a"
    source.mkdir(mode=0o700)
    stem = fake_entry(source, here)
    export_bundle(source, tmp_path / "bundle.tar")
    return tmp_path / "bundle.tar", stem


def _refused(bundle: Path, target: Path, here: dict[str, Any], reason: str) -> None:
    with pytest.raises(BundleError, match=reason):
        import_bundle(bundle, target, here)
    assert not target.exists() or not any(target.iterdir()), "something was installed"


def test_a_manifest_that_lies_about_a_digest_is_refused(tmp_path: Path, here: dict[str, Any]) -> None:
    """A package replaced together with its .sha256 but not in the manifest: refused whole, nothing installed."""
    bundle, stem = _exported(tmp_path, here)
    evil = os.urandom(256)

    def swap(name: str, data: bytes) -> bytes:
        if name.endswith(".pt2"):
            return evil
        if name.endswith(".sha256"):
            digest = subprocess.run(["sha256sum"], input=evil, capture_output=True, check=True).stdout.split()[0]
            return digest + f"  {stem}.pt2\n".encode()
        return data

    _refused(_rewrite(bundle, swap), tmp_path / "b", here, r"sha256 .* differs from .* in manifest.json")


def test_a_corrupted_bundle_is_refused(tmp_path: Path, here: dict[str, Any]) -> None:
    """A bundle with bytes flipped in a package, and one cut short: refused with the reason, nothing installed."""
    bundle, stem = _exported(tmp_path, here)
    data = bytearray(bundle.read_bytes())
    data[data.index((tmp_path / "a" / f"{stem}.pt2").read_bytes()) + 100] ^= 0xFF  # one bit of rot in the package
    flipped = tmp_path / "flipped.tar"
    flipped.write_bytes(bytes(data))
    _refused(flipped, tmp_path / "b", here, f"{stem}.pt2: sha256 .* differs")
    cut = tmp_path / "cut.tar"
    cut.write_bytes(bundle.read_bytes()[:700])
    _refused(cut, tmp_path / "c", here, "not a readable bundle|differ")


@pytest.mark.parametrize("kind", ["traversal", "symlink", "absolute"])
def test_a_bundle_member_that_leaves_its_folder_is_refused(tmp_path: Path, here: dict[str, Any], kind: str) -> None:
    """A member named ../x, an absolute path, or a symlink: the bundle is refused whole, nothing written."""
    bundle, _ = _exported(tmp_path, here)
    with tarfile.open(bundle, "a") as tar:
        info = tarfile.TarInfo({"traversal": "packages/../../escaped", "symlink": "packages/link",
                                "absolute": "/tmp/escaped-infervisor"}[kind])  # fmt: skip
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    _refused(bundle, tmp_path / "b", here, "refused")
    assert not (tmp_path / "escaped").exists()


def test_a_bundle_others_can_write_is_refused(tmp_path: Path, here: dict[str, Any]) -> None:
    """A bundle file writable by others is not read (strict modes)."""
    bundle, _ = _exported(tmp_path, here)
    bundle.chmod(0o666)
    _refused(bundle, tmp_path / "b", here, "writable by group and others")


def test_an_exported_bundle_serves_the_optimized_profile_without_building(
    tmp_path: Path, built_tiny_aoti: Path
) -> None:
    """`build --export` on a built cache, `build --import` into an empty one: the daemon on it serves aoti from the
    imported package at once (loaded, never compiled)."""
    chain = {"tiny": model_entry({"builtin": "tiny"}, FIXED, workers=1, outputs=["y"], profiles=["aoti", "eager"])}
    configs = {}
    for name in ("golden", "fleet"):
        folder = tmp_path / name
        folder.mkdir()
        configs[name] = folder / "config.json"
        configs[name].write_text(json.dumps({"cache_dir": str(folder / "cache"), "models": chain}))
    shutil.copytree(built_tiny_aoti, tmp_path / "golden" / "cache", symlinks=True)
    bundle = tmp_path / "fleet.bundle"
    cli = [sys.executable, "-m", "infervisor", "build"]
    built = subprocess.run([*cli, "--config", str(configs["golden"]), "--export", str(bundle)],
                           capture_output=True, text=True, timeout=900)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    imported = subprocess.run([*cli, "--config", str(configs["fleet"]), "--import", str(bundle)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert imported.returncode == 0 and "1 installed" in imported.stdout, imported.stdout + imported.stderr
    daemon = Daemon(tmp_path / "fleet", {"cache_dir": str(tmp_path / "fleet" / "cache"), "models": chain})
    try:
        (worker,) = daemon.wait_ready(300)["models"]["tiny"]["workers"]
        assert worker["profile"] == "aoti", worker
        assert any(note.startswith("loaded cached package") for note in worker["profile_build"]), worker
        assert not any("compiled and cached" in note for note in worker["profile_build"]), worker
        assert "restarted after building" not in daemon.log_text()
    finally:
        daemon.stop()
