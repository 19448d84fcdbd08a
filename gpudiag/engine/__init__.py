"""Layer 3: from a requirement to a verdict. Probe isolation (a child per probe), which probes a
requirement needs, the inline run, the daemon client, and the public ``preflight()`` API.

Named ``engine`` and not ``preflight`` because ``gpudiag.preflight`` is the public function.
"""
