"""Layer 4 (beside runner): the long-running daemon. Config, scheduler, snapshot, XID watcher,
exporter, history store, the HTTP app and its transport. It never imports jax, iree or a CUDA
library and never holds a GPU context: every probe is a child.
"""
