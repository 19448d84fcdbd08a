"""Layer 5, the top: the thin click layer and terminal rendering. ``gpudiag`` is
``gpudiag.cli.entry:run`` (a fast path, then the click commands of ``gpudiag.cli.commands``).
"""
