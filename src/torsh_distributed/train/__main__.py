"""``python -m torsh_distributed.train``: the trainer on one rank (what ``torsh-dist train`` launches)."""

import sys

from torsh_distributed.cli.train import main

sys.exit(main())
