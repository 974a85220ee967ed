"""What the bundle tests build with: cache entries as a worker writes them, real key pairs, and real tars rewritten
as an attacker would (members replaced, digests recomputed, the manifest re-signed by a key of their own)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infervisor.supervisor.toolkit.bundle import stem_for
from infervisor.supervisor.toolkit.bundle_keys import generate_key_pair, load_signing_key, sign
from infervisor.supervisor.toolkit.bundle_tar import CanonicalReader, CanonicalWriter

#: `change(name, data)` returns a member's new bytes, or None to drop it.
Change = Callable[[str, bytes], bytes | None]


def fake_entry(cache: Path, here: dict[str, Any], model: str = "m", **differs: Any) -> str:
    """A package entry as a worker writes one (key, package, its sha256), for a key like this box's but `differs`."""
    key = {"format": 2, "model": model, "profile": "aoti", "inputs": [], "options": {}, **here, **differs}
    key.pop("openvino", None)
    stem = stem_for("aoti", key)
    (cache / f"{stem}.json").write_text(json.dumps(key))
    package = cache / f"{stem}.pt2"
    package.write_bytes(os.urandom(256))
    (cache / f"{stem}.sha256").write_text(f"{sha256(package.read_bytes())}  {package.name}\n")
    return stem


def sha256(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def key_pair(folder: Path, name: str) -> tuple[Path, Path]:
    """A new ed25519 key pair made by the command's own code: (private, public)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    private, public, _ = generate_key_pair(folder / name)
    return private, public


def members(bundle: Path) -> list[tuple[str, bytes]]:
    """Every member of a canonical bundle, in order."""
    found: list[tuple[str, bytes]] = []
    with bundle.open("rb") as stream:
        reader = CanonicalReader(stream, bundle.stat().st_size)
        while (member := reader.next_member(1 << 30)) is not None:
            found.append((member.name, reader.read_all(member)))
    return found


def write_bundle(path: Path, parts: list[tuple[str, bytes]], signer: Path | None) -> Path:
    """A canonical bundle of `parts` (its manifest signed again by `signer`, or left unsigned), mode 0644."""
    parts = [(n, d) for n, d in parts if n != "manifest.sig"]
    if signer is not None:
        manifest = dict(parts)["manifest.json"]
        parts.insert(1, ("manifest.sig", sign(manifest, load_signing_key(signer))))
    with path.open("wb") as stream:
        writer = CanonicalWriter(stream)
        for name, data in parts:
            writer.add_bytes(name, data)
        writer.close()
    path.chmod(0o644)
    return path


def forge(bundle: Path, out: Path, change: Change, signer: Path | None) -> Path:
    """`bundle` with members rewritten by `change` and the manifest's digests and sizes recomputed to agree, signed
    by `signer` (None: unsigned): what an attacker who cannot sign with a trusted key can make."""
    parts: list[tuple[str, bytes]] = []
    for name, data in members(bundle):
        replaced = change(name, data)
        if replaced is not None:
            parts.append((name, replaced))
    files = dict(parts)
    manifest = json.loads(files["manifest.json"])
    for entry in manifest["entries"]:
        for name in list(entry["files"]):
            data = files.get(f"packages/{name}")
            if data is None:
                del entry["files"][name]
            else:
                entry["files"][name] = {"sha256": sha256(data), "size": len(data)}
    parts = [(n, json.dumps(manifest).encode() if n == "manifest.json" else d) for n, d in parts]
    return write_bundle(out, parts, signer)
