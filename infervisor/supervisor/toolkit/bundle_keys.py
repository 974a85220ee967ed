"""Who may sign a bundle: ed25519 key pairs (`cryptography`), the signature over the manifest, the trusted keys.

The signature covers the exact bytes of `manifest.json`, which names the capability key, the versions, every
file's sha256 and size, the records (the picks) and the build's refusals: a bundle whose signature verifies
with a trusted key is, byte for byte, what the key's holder exported. A private key is read only from a file
of ours that nobody else can read or write; a trusted public key (`bundle_keys` in config.json) only from a
file that passes the strict modes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from infervisor.common.strict_modes import UnsafePath, read_small_file
from infervisor.supervisor.toolkit.bundle_tar import BundleError

SIGNATURE = "manifest.sig"
ALGORITHM = "ed25519"
#: A signature member is a few hundred bytes; anything longer is not one.
MAX_SIGNATURE_BYTES = 4096


def key_id(public: Ed25519PublicKey) -> str:
    """A key's short name: the first 16 hex digits of the sha256 of its raw 32 bytes."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_key_pair(prefix: Path) -> tuple[Path, Path, str]:
    """Write `PREFIX.key` (private, 0600, never over an existing file) and `PREFIX.pub`; their key id."""
    private = Ed25519PrivateKey.generate()
    secret, public = prefix.with_name(prefix.name + ".key"), prefix.with_name(prefix.name + ".pub")
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
    for path, data, mode in ((secret, pem, 0o600), (public, _public_pem(private.public_key()), 0o644)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
    return secret, public, key_id(private.public_key())


def _public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """The private key of `path`: a file of ours that group and others can neither read nor write."""
    try:
        data = read_small_file(path, "signing key")
        mode = stat.S_IMODE(os.stat(os.path.realpath(path)).st_mode)
        if mode & 0o077:
            raise UnsafePath(f"signing key {path} may be read by group or others (mode {mode:04o}; chmod 600 it)")
        key = serialization.load_pem_private_key(data, password=None)
    except (UnsafePath, OSError, ValueError, TypeError) as exc:
        raise BundleError(f"signing key refused: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"signing key {path} is not an ed25519 key (`infervisor build --keygen` makes one)")
    return key


@dataclass(frozen=True)
class TrustedKey:
    """One key of `bundle_keys`: where it was read from and the key."""

    path: str
    key: Ed25519PublicKey


def load_trusted_keys(paths: tuple[str, ...]) -> dict[str, TrustedKey]:
    """The trusted public keys by key id; BundleError naming a file that is unsafe or not an ed25519 public key."""
    keys: dict[str, TrustedKey] = {}
    for path in paths:
        try:
            public = serialization.load_pem_public_key(read_small_file(Path(path), "trusted bundle key"))
        except (UnsafePath, ValueError, TypeError) as exc:
            raise BundleError(f"trusted key {path} (bundle_keys) refused: {exc}") from exc
        if not isinstance(public, Ed25519PublicKey):
            raise BundleError(f"trusted key {path} (bundle_keys) is not an ed25519 public key")
        keys[key_id(public)] = TrustedKey(path, public)
    return keys


def sign(manifest: bytes, private: Ed25519PrivateKey) -> bytes:
    """The signature member for `manifest`'s exact bytes."""
    signature = base64.b64encode(private.sign(manifest)).decode("ascii")
    return json.dumps({"algorithm": ALGORITHM, "key": key_id(private.public_key()), "signature": signature}).encode()


def verify(manifest: bytes, signature: bytes | None, trusted: dict[str, TrustedKey], allow_unsigned: bool) -> str:
    """Who signed `manifest` (one line for the operator); BundleError unless a trusted key did (or the operator
    allowed an unsigned bundle: then an unsigned or untrusted one passes, a damaged signature never)."""
    if signature is None:
        if allow_unsigned:
            return "not signed (accepted: --allow-unsigned)"
        raise BundleError("the bundle is not signed (no manifest.sig): refused (sign it with `infervisor build "
                          "--export FILE --sign KEY`, or import with --allow-unsigned)")  # fmt: skip
    try:
        claim = json.loads(signature)
        algorithm, signer = claim["algorithm"], str(claim["key"])
        raw = base64.b64decode(str(claim["signature"]), validate=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{SIGNATURE} is not a signature: {exc}") from exc
    if algorithm != ALGORITHM:
        raise BundleError(f"{SIGNATURE} uses {algorithm!r}; only {ALGORITHM} is accepted")
    holder = trusted.get(signer)
    if holder is None:
        if allow_unsigned:
            return f"signed by key {signer}, not a trusted key (accepted: --allow-unsigned)"
        known = ", ".join(f"{k} ({t.path})" for k, t in trusted.items()) or "none: bundle_keys is empty"
        raise BundleError(f"the bundle is not signed by a trusted key: signed by key {signer}; trusted: {known}")
    try:
        holder.key.verify(raw, manifest)
    except InvalidSignature as exc:
        raise BundleError(f"the signature by trusted key {signer} ({holder.path}) does not match manifest.json: "
                          "the manifest was changed after it was signed") from exc  # fmt: skip
    return f"signed by trusted key {signer} ({holder.path})"
