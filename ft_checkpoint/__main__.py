"""``python -m ft_checkpoint``: the ``ft-checkpoint`` command line (see ``ft_checkpoint.tools.cli``)."""

import sys

from ft_checkpoint.tools.cli import main

sys.exit(main())
