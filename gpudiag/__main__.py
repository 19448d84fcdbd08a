"""``python -m gpudiag`` is the ``gpudiag`` command."""

import sys

from gpudiag.cli.entry import main

sys.exit(main())
