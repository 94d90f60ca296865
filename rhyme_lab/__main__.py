"""``python -m rhyme_lab COMMAND ...``: the lab's commands (``ablate``, ``analyze``, ``replay-drafts``)."""

import sys

from rhyme_lab.cli.main import main

sys.exit(main())
