"""``python -m gpudiag`` is the ``gpudiag`` command."""

from gpudiag.cli import main

main()
