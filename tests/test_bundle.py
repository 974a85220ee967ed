"""A cache a fleet can share: `infervisor build --export` writes a signed bundle another box verifies and installs with
`infervisor build --import`; a bundle that is unsigned, signed by another key, changed by one byte, corrupted, lies,
climbs out of its folder, plants a refusal or was built for another box is refused with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from infervisor.supervisor.toolkit.bundle import BundleError, capability_key, export_bundle, import_bundle
from infervisor.supervisor.toolkit.bundle_keys import load_signing_key
from infervisor.supervisor.toolkit.bundle_tar import CanonicalWriter
from tests.bundle_fixtures import fake_entry, forge, key_pair, members, sha256, write_bundle
from tests.conftest import STATIC_TINY_INPUTS, Daemon, model_entry
from tests.fault_models import FAULT_INPUTS

FIXED = STATIC_TINY_INPUTS


@pytest.fixture(scope="module")
def here() -> dict[str, Any]:
    """This box's capability key (one torch probe for the module)."""
    return capability_key()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Real ed25519 key pairs: the fleet's current and previous keys (both trusted), and an attacker's."""
    folder = tmp_path_factory.mktemp("keys")
    return {name: key_pair(folder / name, name) for name in ("fleet", "previous", "attacker")}


def _trusted(keys: dict[str, tuple[Path, Path]]) -> tuple[str, ...]:
    return (str(keys["fleet"][1]), str(keys["previous"][1]))


def _exported(tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]], **extra: Any) -> tuple[
        Path, str]:  # fmt: skip
    source = tmp_path / "a"
    source.mkdir(mode=0o700)
    stem = fake_entry(source, here)
    (source / f"pick-{'a' * 32}.json").write_text(json.dumps({"profile": "aoti", "summary": "timed"}))
    signer = load_signing_key(keys["fleet"][0]) if extra.get("signed", True) else None
    export_bundle(source, tmp_path / "bundle.tar", extra.get("refusals"), signer, here)
    return tmp_path / "bundle.tar", stem


def _refused(bundle: Path, target: Path, here: dict[str, Any], reason: str, **how: Any) -> None:
    with pytest.raises(BundleError, match=reason):
        import_bundle(bundle, target, here, **how)
    assert not target.exists() or not any(target.iterdir()), f"something was installed: {list(target.iterdir())}"


def test_bundle_round_trip_installs_what_matches_and_refuses_another_cpu(
    tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]]
) -> None:
    """A signed entry for this box is installed byte for byte with its pick; one built for other CPU flags, and one
    for another torch, are refused each with the field that differs; the build's refusals are carried, not
    installed as markers."""
    source, target = tmp_path / "a", tmp_path / "b"
    source.mkdir(mode=0o700)
    ours = fake_entry(source, here)
    other_cpu = fake_entry(source, here, model="n", cpu_flags="0123456789abcdef")
    other_torch = fake_entry(source, here, model="o", torch="1.0.0")
    pick = f"pick-{'b' * 32}.json"
    (source / pick).write_text('{"profile": "aoti"}')
    refusal = {"model": "m", "profile": "int8_static", "outcome": "failed", "reason": "int8 fusion error"}
    export_bundle(source, tmp_path / "bundle.tar", [refusal], load_signing_key(keys["fleet"][0]), here)
    outcome = import_bundle(tmp_path / "bundle.tar", target, here, _trusted(keys))
    assert outcome.installed == [ours] and outcome.records == [pick] and outcome.build_refusals == [refusal]
    assert "signed by trusted key" in outcome.signer and str(keys["fleet"][1]) in outcome.signer
    assert "cpu_flags" in outcome.refused[other_cpu] and "torch '1.0.0'" in outcome.refused[other_torch]
    assert (target / f"{ours}.pt2").read_bytes() == (source / f"{ours}.pt2").read_bytes()
    assert (target / pick).read_bytes() == (source / pick).read_bytes()
    assert not list(target.glob(f"{other_cpu}*")) and not list(target.glob("*.failed"))
    assert not [p for p in target.iterdir() if p.name.startswith(".import-")], "the staging folder is removed"
    (target / ".import-999999999-dead").mkdir()  # what an import killed midway leaves
    (target / ".import-999999999-dead" / f"{ours}.pt2").write_bytes(b"half")
    assert import_bundle(tmp_path / "bundle.tar", target, here, _trusted(keys)).present == [ours]
    assert not (target / ".import-999999999-dead").exists(), "a dead import's staging folder is swept"


def test_an_unsigned_bundle_or_one_signed_by_an_untrusted_key_is_refused_unless_allowed(
    tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]]
) -> None:
    """Unsigned: refused saying so; signed by a key not in bundle_keys: refused naming the key; each accepted with
    --allow-unsigned; a bundle signed by the previous (rotated) key is accepted while it is listed."""
    bundle, stem = _exported(tmp_path, here, keys, signed=False)
    _refused(bundle, tmp_path / "b", here, "not signed", trusted_keys=_trusted(keys))
    assert import_bundle(bundle, tmp_path / "c", here, allow_unsigned=True).installed == [stem]
    foreign = forge(bundle, tmp_path / "foreign.tar", lambda n, d: d, keys["attacker"][0])
    _refused(foreign, tmp_path / "d", here, "not signed by a trusted key: signed by key", trusted_keys=_trusted(keys))
    assert import_bundle(foreign, tmp_path / "e", here, allow_unsigned=True).installed == [stem]
    rotated = forge(bundle, tmp_path / "rotated.tar", lambda n, d: d, keys["previous"][0])
    assert import_bundle(rotated, tmp_path / "f", here, _trusted(keys)).installed == [stem]
    _refused(rotated, tmp_path / "g", here, "not signed by a trusted key", trusted_keys=(str(keys["fleet"][1]),))


def test_a_one_byte_change_anywhere_is_refused(
    tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]]
) -> None:
    """A signed bundle with one byte changed in any header, the manifest, the signature, a package, a record,
    the padding or the end blocks: refused every time, nothing installed."""
    bundle, _ = _exported(tmp_path, here, keys)
    data = bundle.read_bytes()
    starts = [0]
    for _name, body in members(bundle):
        starts.append(starts[-1] + 512 + len(body) + (-len(body) % 512))
    # Every header's name, size, checksum and magic fields, the first, middle and last data bytes, a padding byte.
    positions = sorted({p for s in starts[:-1] for p in (s, s + 101, s + 130, s + 150, s + 260, s + 512, s + 600)}
                       | {starts[-1], starts[-1] + 700, len(data) - 1})  # fmt: skip
    for position in positions:
        changed = bytearray(data)
        changed[position] ^= 0x20
        flipped = tmp_path / "flipped.tar"
        flipped.write_bytes(bytes(changed))
        flipped.chmod(0o644)
        with pytest.raises(BundleError):
            import_bundle(flipped, tmp_path / "b", here, _trusted(keys))
        assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir()), position


def test_a_manifest_that_lies_about_a_digest_is_refused(
    tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]]
) -> None:
    """A package replaced together with its .sha256 but not in the (signed) manifest: refused whole."""
    bundle, stem = _exported(tmp_path, here, keys)
    evil = os.urandom(256)

    def swap(name: str, data: bytes) -> bytes:
        if name.endswith(".pt2"):
            return evil
        return f"{sha256(evil)}  {stem}.pt2\n".encode() if name.endswith(".sha256") else data

    lied = write_bundle(tmp_path / "lied.tar", [(n, swap(n, d)) for n, d in members(bundle)], keys["fleet"][0])
    _refused(lied, tmp_path / "b", here, r"sha256 .* differs from .* in manifest.json", trusted_keys=_trusted(keys))


def test_a_cut_bundle_is_refused(tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]]) -> None:
    """A bundle cut short: refused with the reason, nothing installed."""
    bundle, _ = _exported(tmp_path, here, keys)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(bundle.read_bytes()[:2500])
    cut.chmod(0o644)
    _refused(cut, tmp_path / "c", here, "cut short|more than the archive holds", trusted_keys=_trusted(keys))


@pytest.mark.parametrize("kind", ["traversal", "symlink", "absolute", "failed-marker"])
def test_a_member_the_manifest_does_not_list_is_refused(
    tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]], kind: str
) -> None:
    """A member named ../x, an absolute path, a symlink, or a `.failed` marker beside a signed entry: the bundle is
    refused whole, nothing written."""
    bundle, stem = _exported(tmp_path, here, keys)
    out = tmp_path / "planted.tar"
    with out.open("wb") as stream:
        writer = CanonicalWriter(stream)
        for name, data in members(bundle):
            writer.add_bytes(name, data)
        if kind == "symlink":
            info = tarfile.TarInfo("packages/link")
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, "/etc/passwd", 0
            writer.tar.addfile(info)
        else:
            name = {"traversal": "packages/../../escaped", "absolute": "/tmp/escaped-infervisor",
                    "failed-marker": f"packages/{stem}.failed"}[kind]  # fmt: skip
            writer.add_bytes(name, b"evil")
        writer.close()
    out.chmod(0o644)
    reason = "symbolic link, not a plain file" if kind == "symlink" else "not listed in manifest.json"
    _refused(out, tmp_path / "b", here, reason, trusted_keys=_trusted(keys))
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/escaped-infervisor").exists()


def test_a_refusal_planted_as_an_entry_file_is_refused_even_when_signed(
    tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]]
) -> None:
    """An entry of only `<stem>.json` + `<stem>.failed` (text of its writer's choosing), signed by a trusted key:
    refused, since a `.failed` marker is not an entry file; a refusal travels only in the manifest's list."""
    bundle, stem = _exported(tmp_path, here, keys)
    parts = [(n, d) for n, d in members(bundle) if not n.endswith((".pt2", ".sha256"))]
    manifest = json.loads(dict(parts)["manifest.json"])
    marker = b"skip the compiled profile for an hour"
    manifest["entries"][0]["files"] = {f"{stem}.json": manifest["entries"][0]["files"][f"{stem}.json"],
                                       f"{stem}.failed": {"sha256": sha256(marker), "size": len(marker)}}  # fmt: skip
    parts = [(n, json.dumps(manifest).encode() if n == "manifest.json" else d) for n, d in parts]
    planted = write_bundle(tmp_path / "planted.tar", [*parts, (f"packages/{stem}.failed", marker)], keys["fleet"][0])
    _refused(planted, tmp_path / "b", here, r"\.failed' is not a file of entry", trusted_keys=_trusted(keys))


def test_unsafe_bundles_and_keys_are_refused(
    tmp_path: Path, here: dict[str, Any], keys: dict[str, tuple[Path, Path]]
) -> None:
    """A bundle or a trusted key file writable by others is not read (strict modes); a signing key others may read
    does not sign."""
    bundle, _ = _exported(tmp_path, here, keys)
    bundle.chmod(0o666)
    _refused(bundle, tmp_path / "b", here, "writable by group and others", trusted_keys=_trusted(keys))
    bundle.chmod(0o644)
    loose = tmp_path / "loose.pub"
    shutil.copy(keys["fleet"][1], loose)
    loose.chmod(0o666)
    _refused(bundle, tmp_path / "c", here, "trusted key .* refused: .*writable", trusted_keys=(str(loose),))
    shared = tmp_path / "shared.key"
    shutil.copy(keys["fleet"][0], shared)
    shared.chmod(0o644)
    with pytest.raises(BundleError, match="may be read by group or others"):
        load_signing_key(shared)


def test_a_real_chain_with_a_profile_that_cannot_build_exports_and_serves_on_an_empty_cache(
    tmp_path: Path, built_tiny_aoti: Path
) -> None:
    """A config whose chains hold a profile that cannot build (torch.export refuses `bad`): `build --export --sign`
    exits 0 with the package, both fastest picks and the refusal; imported into an empty cache it installs them; the
    daemon on it serves tiny's aoti from the imported package with the pick decided on the golden box: no compile,
    no timing phase, and `bad`'s refused profile not tried again."""
    tiny = model_entry({"builtin": "tiny"}, FIXED, workers=1, outputs=["y"], profiles=["aoti", "eager"], pick="fastest")
    bad = model_entry({"python": "tests.fault_models:faulty"}, FAULT_INPUTS, workers=1, profiles=["aoti", "eager"],
                      pick="fastest")  # fmt: skip
    private, public = key_pair(tmp_path / "keys", "ci")
    configs = {}
    for name in ("golden", "fleet"):
        folder = tmp_path / name
        folder.mkdir()
        configs[name] = folder / "config.json"
        configs[name].write_text(json.dumps({"cache_dir": str(folder / "cache"), "bundle_keys": [str(public)],
                                             "oversubscribe": True, "models": {"tiny": tiny, "bad": bad}}))  # fmt: skip
    shutil.copytree(built_tiny_aoti, tmp_path / "golden" / "cache", symlinks=True)
    bundle = tmp_path / "fleet.bundle"
    cli = [sys.executable, "-m", "infervisor", "build"]
    built = subprocess.run([*cli, "--config", str(configs["golden"]), "--export", str(bundle), "--sign", str(private)],
                           capture_output=True, text=True, timeout=900)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    assert "exported to" in built.stdout and ", signed: 1 package entries, 2 records (picks), 1 build refusals" in (
        built.stdout), built.stdout  # fmt: skip
    assert "not exported: bad aoti (failed): aoti failed to build: torch.export failed" in built.stdout, built.stdout
    imported = subprocess.run([*cli, "--config", str(configs["fleet"]), "--import", str(bundle)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert "signed by trusted key" in imported.stdout and "1 installed" in imported.stdout, imported.stdout
    assert "2 records" in imported.stdout and "the build refused bad aoti (failed)" in imported.stdout
    assert not list((tmp_path / "fleet" / "cache").glob("*.failed")), "a refusal is never installed as a marker"
    started = time.monotonic()
    daemon = Daemon(tmp_path / "fleet", json.loads(configs["fleet"].read_text()))
    try:
        status = daemon.wait_ready(300)
        took = time.monotonic() - started
        (worker,) = status["models"]["tiny"]["workers"]
        assert worker["profile"] == "aoti", worker
        assert any(note.startswith("loaded cached package") for note in worker["profile_build"]), worker
        assert any("(decided earlier, pick-" in note for note in worker["profile_build"]), worker
        (refused,) = status["models"]["bad"]["workers"]
        decided = any("(decided earlier, pick-" in note for note in refused["profile_build"])
        assert refused["profile"] == "eager" and decided, refused
        events = daemon.log_events()
        phases = {(e.get("phase"), e.get("profile")) for e in events if e.get("event") == "worker_phase"}
        assert ("building", "aoti") in phases and ("timing", None) not in phases, phases
        assert not any(p == "timing" for p, _ in phases) and ("building", "aoti") not in {
            (e.get("phase"), e.get("profile")) for e in events if e.get("model") == "bad"}, phases  # fmt: skip
        assert not any("compiled and cached" in note for note in worker["profile_build"]), worker
        print(f"imported cache: every model serving {took:.1f} s after `serve` (tiny on aoti)")
    finally:
        daemon.stop()
