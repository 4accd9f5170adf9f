"""``python -m ft_checkpoint.tools``: the ``ft-checkpoint`` command line."""

import sys

from ft_checkpoint.tools.cli import main

sys.exit(main())
