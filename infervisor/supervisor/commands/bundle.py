"""`infervisor build --export FILE [--sign KEY]`, `--import FILE [--allow-unsigned]` and `--keygen PREFIX`: the cache
as a signed bundle a fleet shares (toolkit/bundle.py, toolkit/bundle_keys.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from infervisor.supervisor.toolkit.bundle import BundleError, export_bundle, import_bundle
from infervisor.supervisor.toolkit.bundle_keys import generate_key_pair, load_signing_key

#: Exit statuses: done; some entries refused (others installed); the bundle refused whole or the command failed.
EXIT_OK, EXIT_PARTIAL, EXIT_REFUSED = 0, 1, 2


def run_keygen(prefix: Path, say: Callable[[str], None]) -> int:
    """Write a new ed25519 key pair `PREFIX.key` (0600) and `PREFIX.pub`: 0, or 2 saying why not."""
    try:
        secret, public, key = generate_key_pair(prefix)
    except OSError as exc:
        print(f"infervisor build --keygen: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    say(f"key {key}: private {secret} (keep it in CI's secrets; it signs with --sign), public {public} (list it in "
        "each box's bundle_keys)")  # fmt: skip
    return EXIT_OK


def run_export(
    cache: Path, destination: Path, say: Callable[[str], None], refusals: list[dict[str, str]] | None = None,
    sign: str | None = None,
) -> int:  # fmt: skip
    """Write the cache's packages, picks and the build's refusals to `destination`: 0, or 2 saying why not."""
    try:
        key = load_signing_key(Path(sign)) if sign else None
        manifest = export_bundle(cache, destination, refusals, key)
    except (BundleError, OSError) as exc:
        print(f"infervisor build --export: no bundle written: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    box = manifest["capability"]
    signed = "signed" if key is not None else "NOT signed (no --sign: boxes refuse it without --allow-unsigned)"
    say(f"exported to {destination}, {signed}: {len(manifest['entries'])} package entries, "
        f"{len(manifest['records'])} records (picks), {len(manifest['refusals'])} build refusals "
        f"(cpu {box['cpu_capability']}, flags {box['cpu_flags']}, torch {box['torch']})")  # fmt: skip
    for entry in manifest["entries"]:
        say(f"  exported {entry['stem']}")
    for record in manifest["records"]:
        say(f"  exported record {record['name']}")
    for refusal in manifest["refusals"]:
        say(f"  not exported: {refusal['model']} {refusal['profile']} ({refusal['outcome']}): {refusal['reason']}")
    return EXIT_OK


def run_import(
    bundle: Path, cache: Path, say: Callable[[str], None], trusted: tuple[str, ...] = (), allow_unsigned: bool = False
) -> int:
    """Verify `bundle` and install what matches this box into `cache`: 0 all of it, 1 some refused, 2 none."""
    try:
        outcome = import_bundle(bundle, cache, trusted_keys=trusted, allow_unsigned=allow_unsigned)
    except (BundleError, OSError) as exc:
        print(f"infervisor build --import: bundle refused, nothing installed: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except Exception as exc:  # noqa: BLE001 - whatever a hostile bundle provokes is a refusal with its reason
        print(f"infervisor build --import: bundle refused, nothing installed: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        return EXIT_REFUSED
    say(f"bundle {bundle}: {outcome.signer}")
    for stem in outcome.installed:
        say(f"installed {stem}")
    for stem in outcome.present:
        say(f"already in the cache: {stem}")
    for name in outcome.records:
        say(f"installed record {name}")
    for refusal in outcome.build_refusals:
        say(f"the build refused {refusal['model']} {refusal['profile']} ({refusal['outcome']}): {refusal['reason']}")
    for stem, why in outcome.refused.items():
        print(f"infervisor build --import: refused {stem}: {why}", file=sys.stderr)
    if outcome.records_refused:
        print(f"infervisor build --import: records (picks) not installed: {outcome.records_refused}", file=sys.stderr)
    say(f"{len(outcome.installed)} installed, {len(outcome.present)} already present, {len(outcome.refused)} "
        f"refused, {len(outcome.records)} records, into {cache}")  # fmt: skip
    if outcome.refused:
        return EXIT_PARTIAL if outcome.installed or outcome.present else EXIT_REFUSED
    return EXIT_OK
