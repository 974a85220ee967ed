"""`python -m supervisor` is the `infervisor` command."""

import sys

from supervisor.cli import main

sys.exit(main())
