"""``python -m rhyme_jax.cli ...`` is ``rhyme-jax ...``."""

import sys

from rhyme_jax.cli.main import main

sys.exit(main())
