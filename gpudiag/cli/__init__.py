"""Layer 5, the top: the thin click layer and terminal rendering. ``gpudiag`` is
``gpudiag.cli.commands:main``.
"""
