"""What of a job's environment decides how each backend comes up: the fingerprint's inputs.

The backend layer (whatever imports the job's libraries: JAX, IREE) is proven in the
environment the job runs in (docs/design-notes.md, "Whose environment is proven"). Each
backend's spec holds its ``EnvironmentDecl`` (``BackendSpec.environment``); the built-in ones
are written here, as plain data with no imports, because the daemon-answered CLI call
computes the job's fingerprint before anything else is imported (docs/benchmarks.md): a
backend registered from outside (a test's toy) declares its own in its spec, and the fast
path then leaves the call to the click path, which reads the registry.
"""

from __future__ import annotations


class EnvironmentDecl:
    """Distributions, modules and variables whose state decides how a backend comes up.

    Two environments with the same interpreter, the same of these distributions (their files:
    path, inode, size, mtime) and modules on the search path, and the same values of these
    variables are one proof. ``distributions``: fnmatch patterns over normalized names (lower
    case, ``_`` for ``-`` and ``.``); ``modules``: top-level import names whose locations on
    the search path count (a namespace package such as ``jax_plugins`` in every folder that
    holds it); ``variables``: fnmatch patterns of names (the visibility variables never count:
    they travel with every question on their own); ``installed_by``: the distribution whose
    presence means the backend is installed there. A plain class with slots, not a
    dataclass: see the module's docstring.
    """

    __slots__ = ("distributions", "modules", "variables", "installed_by")

    def __init__(self, *, distributions: tuple[str, ...] = (), modules: tuple[str, ...] = (),
                 variables: tuple[str, ...] = (), installed_by: str = "") -> None:
        self.distributions, self.modules, self.variables, self.installed_by = (
            distributions, modules, variables, installed_by)

    def __repr__(self) -> str:
        return (f"EnvironmentDecl(distributions={self.distributions!r}, "
                f"modules={self.modules!r}, variables={self.variables!r}, "
                f"installed_by={self.installed_by!r})")


# The child environment that disables JAX/XLA preallocation (docs/runner.md): what every probe
# child and job child gets unless the caller set its own value (core.environment).
PREALLOCATION_OFF: dict[str, str] = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
    "XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR": "false",
}

# What loads a CUDA stack, for every GPU backend. PYTHONPATH is not among them: what it makes
# importable is read on the search path itself (a job's own code on it changes nothing).
_LOADER_VARIABLES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")

# JAX, its plugins (PJRT), NVIDIA's CUDA wheels and what decides how JAX comes up.
JAX = EnvironmentDecl(
    distributions=("jax", "jaxlib", "jax_cuda*", "jax_rocm*", "jax_plugins*", "nvidia_*",
                   "ml_dtypes"),
    modules=("jax", "jaxlib", "jax_plugins"),
    variables=("JAX_*", "XLA_*", "TF_CPP_*", *_LOADER_VARIABLES),
    installed_by="jax")

# IREE's runtime and compiler wheels and what decides which HAL drivers load.
IREE = EnvironmentDecl(
    distributions=("iree_*",),
    modules=("iree",),
    variables=("IREE_*", *_LOADER_VARIABLES),
    installed_by="iree_base_runtime")

# The built-in declarations by backend name, for the fast path only (tests/test_fingerprint.py
# checks that each is the one its spec holds).
BUILT_IN = {"jax": JAX, "iree": IREE}
# The built-in backends proven on the node, never in a job's environment (their specs declare
# none): the device layer. Plain data for the daemon-answered CLI call, which reads no
# registry; tests/test_fingerprint.py keeps it equal to the registry's word
# (``registry.environment_dependent``), so the layer is named once.
DEVICE_LAYER = frozenset({"host", "nvml", "cuda", "nic"})


def backend_names(listed: str) -> set[str]:
    """The backend names of a ``--require`` or ``--backend`` list (``jax:cpu,cuda``)."""
    return {part.split(":", 1)[0].strip().lower() for part in listed.split(",")} - {""}
