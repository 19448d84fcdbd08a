"""NVML's probe child asked for first: ``gpudiag probe`` starts its fork server and asks for
the nvml child before it imports the registry, the classifier, the engine and the renderer.

Every GPU-touching probe of an inline run waits for NVML's reading (the busy-GPU round), so
the sooner that child runs, the sooner the round can start: asked for here, it runs on a
spare core while this process imports the rest (docs/benchmarks.md, "Probe overhead"). The
server is forked from this process while it is small and has one thread (before a
terminal's spinner starts its own). Only a ``--backend`` list that names nvml among others
asks here, from its raw text; any other list is planned as before (``cli.probing``), and a
list the plan then refuses only costs a child killed unclaimed.
"""

from __future__ import annotations

import os

from gpudiag.core.environment import probe_environment
from gpudiag.core.fingerprint_inputs import DEVICE_LAYER
from gpudiag.engine.forkclient import ForkServer


def nvml_ahead(backend_text: str | None) -> ForkServer | None:
    """A started fork server with NVML's child asked for, when ``backend_text`` (a raw
    ``--backend`` list; None: the default, every probe) names nvml and another probe; else
    None. The caller closes it (``with``); ``cli.probing.probe_verdict`` runs on it."""
    names = None if backend_text is None else {
        b.strip().lower() for b in backend_text.split(",") if b.strip()}
    if names is not None and ("nvml" not in names or len(names) < 2):
        return None
    child_env = probe_environment(os.environ)
    # The device layer's probes run here, never under a job's interpreter: the server
    # imports for those; another probe it forks imports its own module after the fork.
    forker = ForkServer(child_env, probes=sorted(DEVICE_LAYER if names is None
                                                 else names & DEVICE_LAYER), fork_here=True)
    forker.start()
    forker.ask_ahead("nvml", None, child_env)
    return forker
