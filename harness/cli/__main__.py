"""`python -m harness.cli …` runs `dsv4-drift …` (the GPU machine has no installed console script)."""

import sys

from harness.cli.main import main

sys.exit(main())
