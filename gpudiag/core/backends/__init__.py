"""One module per backend, each declaring its ``SPEC`` (gpudiag.core.backend.BackendSpec).

gpudiag.core.registry lists them; add a backend with one module here and one registry line.
"""
