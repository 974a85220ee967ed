"""`python -m infervisor` is the `infervisor` command."""

import sys

from infervisor.supervisor.cli import main

sys.exit(main())
