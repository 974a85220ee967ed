"""Worker entry point: `python -m infervisor.worker LAUNCH_JSON`; pins itself before torch is imported."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from infervisor.common.strict_modes import UnsafePath, check_tree
from infervisor.protocol.constants import WorkerExitCode
from infervisor.worker.process_entry import enter_process


def main(argv: list[str]) -> int:
    """Parse the launch spec, pin, then import torch and serve."""
    launch = enter_process(argv, "worker", idle=False)
    if isinstance(launch, WorkerExitCode):
        return launch
    keep_inductor_out_of_unsafe_cache(launch.cache_dir)
    from infervisor.common.json_logs import adopt_library_handlers
    from infervisor.worker.logs import configure_logging

    configure_logging()
    # torch is imported only now, so its OpenMP pool is created inside the pinned cpu set.
    from infervisor.worker.serve import serve

    adopt_library_handlers()  # torch's import installed console handlers of its own
    return serve(launch)


def keep_inductor_out_of_unsafe_cache(cache_dir: str | None) -> None:
    """Before torch is imported: when the cache fails the strict modes, torch.compile's own cache (a compiled
    library there would be loaded as is) goes to a private temp folder instead of the one under cache_dir."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache_dir or not inductor or not Path(inductor).is_relative_to(cache_dir):
        return
    try:
        check_tree(Path(cache_dir), "cache_dir")
    except UnsafePath:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="infervisor-inductor-")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
