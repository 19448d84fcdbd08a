"""The gpudiag version: one place, read by the records, the metrics and the CLI."""

__version__ = "0.1.0"
