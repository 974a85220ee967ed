"""Attacks on `infervisor build --import`, each a real tar run through the real command: a trojan package with its
digests recomputed, a sparse member declaring 2 GiB, a huge manifest, a manifest nested 200,000 deep. Each is refused
with exit 2 and a reason (never a traceback), nothing is installed, and the importer's peak memory stays bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from infervisor.supervisor.toolkit.bundle import capability_key, export_bundle
from infervisor.supervisor.toolkit.bundle_keys import load_signing_key
from infervisor.supervisor.toolkit.bundle_tar import CanonicalWriter
from tests.bundle_fixtures import fake_entry, forge, key_pair, members, sha256, write_bundle
from tests.conftest import ROOT, STATIC_TINY_INPUTS, model_entry

#: The importer's peak resident memory on any hostile bundle (issue 53's target).
MAX_IMPORT_RSS_MB = 300
_CONSTRUCTOR = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the constructor ran", f); fclose(f); }
}
"""


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A fleet box's config (its trusted key in bundle_keys), the fleet's and an attacker's keys, and a signed
    bundle of one package entry."""
    folder = tmp_path_factory.mktemp("box")
    fleet, attacker = key_pair(folder / "keys", "fleet"), key_pair(folder / "keys", "attacker")
    config = folder / "config.json"
    entry = model_entry({"builtin": "tiny"}, STATIC_TINY_INPUTS, outputs=["y"], profiles=["aoti", "eager"])
    config.write_text(json.dumps({"cache_dir": str(folder / "cache"), "bundle_keys": [str(fleet[1])],
                                  "models": {"tiny": entry}}))  # fmt: skip
    source = folder / "built"
    source.mkdir(mode=0o700)
    here = capability_key()
    stem = fake_entry(source, here)
    bundle = folder / "fleet.bundle"
    export_bundle(source, bundle, None, load_signing_key(fleet[0]), here)
    return {"folder": folder, "config": config, "fleet": fleet, "attacker": attacker, "bundle": bundle, "stem": stem}


#: Runs argv[2:] and writes its exit status and peak RSS (wait4's ru_maxrss, KB) to argv[1]. The command is forked
#: from this small launcher, not from pytest: a child's high-water RSS starts at its parent's at the fork.
_LAUNCHER = (
    "import os, subprocess, sys\n"
    "process = subprocess.Popen(sys.argv[2:])\n"
    "_, status, usage = os.wait4(process.pid, 0)\n"
    "open(sys.argv[1], 'w').write(f'{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}')\n"
)


def _import(box: dict[str, Any], bundle: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """`infervisor build --import` as its own process: its result and its own peak RSS in MB."""
    measured = bundle.with_suffix(".rusage")
    command = [sys.executable, "-m", "infervisor", "build", "--config", str(box["config"]), "--import", str(bundle)]
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, str(measured), *command, *extra], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, check=False)  # fmt: skip
    code, peak_kb = (int(word) for word in measured.read_text().split())
    return subprocess.CompletedProcess(command, code, done.stdout, done.stderr), peak_kb / 1024


def _refused(box: dict[str, Any], bundle: Path, reason: str, *extra: str) -> float:
    done, peak = _import(box, bundle, *extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "bundle refused, nothing installed" in done.stderr and reason in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    cache = box["folder"] / "cache"
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())
    return peak


def _trojan_package(folder: Path) -> tuple[bytes, Path]:
    """An AOTInductor-shaped package (a zip) whose wrapper library runs a constructor when loaded; its marker file."""
    marker = folder / "constructor-ran"
    source = folder / "planted.c"
    source.write_text(_CONSTRUCTOR.replace("MARKER", json.dumps(str(marker))))
    library = folder / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120)
    package = folder / "trojan.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.write(library, "model/data/aotinductor/model/model.wrapper.so")
    return package.read_bytes(), marker


def test_a_trojan_package_with_recomputed_digests_is_refused(box: dict[str, Any]) -> None:
    """The package replaced by one whose .so has a constructor, its .sha256 and the manifest's digests recomputed:
    unsigned, it is refused as not signed; re-signed by the attacker's key, as not signed by a trusted key; the
    constructor never runs and nothing is installed."""
    evil, marker = _trojan_package(box["folder"])
    stem = box["stem"]

    def plant(name: str, data: bytes) -> bytes:
        if name.endswith(".pt2"):
            return evil
        return f"{sha256(evil)}  {stem}.pt2\n".encode() if name.endswith(".sha256") else data

    unsigned = forge(box["bundle"], box["folder"] / "trojan-unsigned.bundle", plant, None)
    _refused(box, unsigned, "the bundle is not signed")
    resigned = forge(box["bundle"], box["folder"] / "trojan-resigned.bundle", plant, box["attacker"][0])
    _refused(box, resigned, "not signed by a trusted key: signed by key")
    assert not marker.exists(), "the planted constructor ran"


def test_a_sparse_member_declaring_2_gib_is_refused_within_300_mb(box: dict[str, Any], tmp_path: Path) -> None:
    """A 10 KB bundle whose package member is a GNU sparse file of 2 GiB (made by GNU tar from a real sparse file),
    after a manifest signed by the trusted key that lists it: refused as a sparse member, peak RSS under 300 MB;
    the whole GNU tar as a bundle is refused at its first header, the same way."""
    payload = tmp_path / "payload"
    (payload / "packages").mkdir(parents=True)
    sparse = payload / "packages" / f"{box['stem']}.pt2"
    with sparse.open("wb") as handle:
        handle.truncate(2 << 30)
    gnu = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-C", str(payload), "-cf", str(gnu),
                    f"packages/{sparse.name}"], check=True, timeout=120)  # fmt: skip
    assert gnu.stat().st_size < 20_000
    parts = members(box["bundle"])
    manifest = json.loads(dict(parts)["manifest.json"])
    manifest["entries"][0]["files"][f"{box['stem']}.pt2"]["size"] = 2 << 30
    signed = write_bundle(tmp_path / "head.tar", [("manifest.json", json.dumps(manifest).encode())], box["fleet"][0])
    head = signed.read_bytes()
    body = gnu.read_bytes()
    bundle = tmp_path / "sparse.bundle"
    # The signed manifest and its signature, then GNU tar's sparse member and its end.
    bundle.write_bytes(head[: _end_of_members(head)] + body)
    bundle.chmod(0o644)
    assert bundle.stat().st_size < 20_000
    peak = _refused(box, bundle, "not a plain file")
    print(f"sparse 2 GiB member in a {bundle.stat().st_size:,}-byte bundle: importer peak RSS {peak:.0f} MB")
    assert peak <= MAX_IMPORT_RSS_MB, f"importer peak RSS {peak:.0f} MB"
    gnu.chmod(0o644)
    _refused(box, gnu, "at byte 0 is a sparse file")


def _end_of_members(archive: bytes) -> int:
    """Where a canonical archive's members end (its zero end blocks start)."""
    offset = 0
    while archive[offset : offset + 512] != bytes(512):
        size = int(archive[offset + 124 : offset + 136].rstrip(b"\0 ") or b"0", 8)
        offset += 512 + size + (-size % 512)
    return offset


@pytest.mark.parametrize("shape", ["huge", "deep", "listed-twice", "big-key-file"])
def test_a_hostile_manifest_is_refused_with_a_reason(box: dict[str, Any], tmp_path: Path, shape: str) -> None:
    """A 5 MB manifest (over its cap, refused from its header), a manifest nested 200,000 deep, one listing a file
    twice and one declaring a 2 MB key file (one the import reads into memory; all signed by the trusted key):
    exit 2 with the reason, no traceback, bounded memory."""
    if shape == "huge":
        manifest, reason = b" " * (5 << 20) + b"{}", "over the 4,194,304-byte cap"
    elif shape == "deep":
        manifest, reason = b"[" * 200_000 + b"]" * 200_000, "not valid JSON of a sane depth"
    elif shape == "listed-twice":
        body = json.loads(dict(members(box["bundle"]))["manifest.json"])
        body["entries"].append(body["entries"][0])
        manifest, reason = json.dumps(body).encode(), "listed twice"
    else:
        body = json.loads(dict(members(box["bundle"]))["manifest.json"])
        body["entries"][0]["files"][f"{box['stem']}.json"]["size"] = 2 << 20
        manifest, reason = json.dumps(body).encode(), "over the 1,048,576-byte cap of a key, digest or record file"
    bundle = write_bundle(tmp_path / f"{shape}.bundle", [("manifest.json", manifest)], box["fleet"][0])
    peak = _refused(box, bundle, reason)
    print(f"{shape} manifest: importer peak RSS {peak:.0f} MB")
    assert peak <= MAX_IMPORT_RSS_MB, f"importer peak RSS {peak:.0f} MB"


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path: Path) -> None:
    """`infervisor build --keygen PREFIX`: PREFIX.key 0600 and PREFIX.pub; never over an existing key."""
    command = [sys.executable, "-m", "infervisor", "build", "--keygen", str(tmp_path / "ci")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0 and "key " in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "ci.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "ci.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert again.returncode == 2 and "exists" in again.stderr, again.stderr


def test_a_bundle_streams_members_without_holding_them(tmp_path: Path) -> None:
    """The canonical writer streams a file member; the reader hands it back chunk by chunk (sizes only in headers)."""
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 << 20))
    out = tmp_path / "out.tar"
    with out.open("wb") as stream:
        writer = CanonicalWriter(stream)
        writer.add_file("packages/big", big)
        writer.close()
    assert members(out) == [("packages/big", big.read_bytes())]
