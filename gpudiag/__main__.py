"""``python -m gpudiag`` is the ``gpudiag`` command."""

from gpudiag.cli.commands import main

main()
