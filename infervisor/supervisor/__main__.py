"""`python -m infervisor.supervisor` is the `infervisor` command."""

import sys

from infervisor.supervisor.cli import main

sys.exit(main())
