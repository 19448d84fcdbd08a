"""Layer 1, the bottom: the catalog, the model dataclasses, record renderings, parsers,
environment and visibility rules, pure classification and the clock.

Imports nothing else of gpudiag and does no probing: everything above builds on it.
"""
