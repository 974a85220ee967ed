"""`infervisor build --export FILE` and `--import FILE`: the cache as a bundle a fleet shares (toolkit/bundle.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from infervisor.supervisor.toolkit.bundle import BundleError, export_bundle, import_bundle

#: Exit statuses: done; some entries refused (others installed); the bundle refused whole or the command failed.
EXIT_OK, EXIT_PARTIAL, EXIT_REFUSED = 0, 1, 2


def run_export(cache: Path, destination: Path, say: Callable[[str], None]) -> int:
    """Write the cache's packages to `destination`: 0, or 2 saying why not."""
    try:
        manifest = export_bundle(cache, destination)
    except (BundleError, OSError) as exc:
        print(f"infervisor build --export: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    box = manifest["capability"]
    say(f"exported {len(manifest['entries'])} package entries of {cache} to {destination} "
        f"(cpu {box['cpu_capability']}, flags {box['cpu_flags']}, torch {box['torch']})")  # fmt: skip
    return EXIT_OK


def run_import(bundle: Path, cache: Path, say: Callable[[str], None]) -> int:
    """Verify `bundle` and install what matches this box into `cache`: 0 all of it, 1 some refused, 2 none."""
    try:
        outcome = import_bundle(bundle, cache)
    except (BundleError, OSError) as exc:
        print(f"infervisor build --import: bundle refused, nothing installed: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    for stem in outcome.installed:
        say(f"installed {stem}")
    for stem in outcome.present:
        say(f"already in the cache: {stem}")
    for stem, why in outcome.refused.items():
        print(f"infervisor build --import: refused {stem}: {why}", file=sys.stderr)
    say(f"{len(outcome.installed)} installed, {len(outcome.present)} already present, {len(outcome.refused)} "
        f"refused, into {cache}")  # fmt: skip
    if outcome.refused:
        return EXIT_PARTIAL if outcome.installed or outcome.present else EXIT_REFUSED
    return EXIT_OK
