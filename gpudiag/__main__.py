"""``python -m gpudiag`` is the ``gpudiag`` command."""

from gpudiag.cli.entry import run

run()
