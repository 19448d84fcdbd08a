"""What gpudiag knows of one backend, in one record: the spec every backend module declares.

A backend is a probe child plus what the parent does with its JSON. Its spec says it all once
(docs/design-notes.md, "The backend registry"): the child's entry module, the typed
observation (which is also its JSON schema), the classifier, the daemon's default interval,
deadline and switch, what a requirement may say about it, which build-info labels its
versions fill, and a line for the docs. gpudiag.core.registry lists the specs; every table
that used to name backends one by one is derived from that list.

The spec holds the probe's entry point as a module path (a string): core is pure and the
probe modules import drivers, so only the child (gpudiag.probes) imports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field

from gpudiag.core.records import dataclass

# The classifier and the typed observation are named by "module:attribute" and imported on
# first use: parsing a requirement (the CLI's daemon-answered fast path, docs/benchmarks.md)
# needs the specs' names and platforms, not the classifiers and observation models. So is
# typing: only the type checker reads the Protocol and the aliases below.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    from gpudiag.core.findings import Findings, GpuContext
    from gpudiag.core.fingerprint_inputs import EnvironmentDecl
    from gpudiag.core.verdict import BackendRequirement, BackendStatus

    class BackendRun(Protocol):
        """What a classifier reads of one probe run (gpudiag.core.probe_run.ProbeRun has it)."""

        @property
        def duration_s(self) -> float: ...

        @property
        def ok(self) -> bool: ...

        @property
        def error(self) -> str | None: ...

        @property
        def stderr_tail(self) -> str: ...

        @property
        def parsed(self) -> object: ...


    # classifier(run, requirement, gpu_context, findings) -> the backend's status (and findings)
    BackendClassifier = Callable[[BackendRun, BackendRequirement, GpuContext, Findings],
                                 BackendStatus]
    # The probe options a requirement's entries of this backend ask for (None: no options).
    OptionsFor = Callable[[Sequence[BackendRequirement]], "dict[str, Any] | None"]
    # Whether a child run with these options makes a GPU context (the busy-GPU rule applies).
    TouchesGpu = Callable[[Mapping[str, Any]], bool]


# The GPUs an active run proves a backend on (``BackendSpec.proves_on``): every GPU the round
# claimed (cuda's contexts), or one free healthy GPU per round (JAX, IREE).
EVERY_GPU, ONE_GPU = "every", "one"
# How its child is pointed at them (``BackendSpec.pointed_by``): the ``contexts_on`` option
# (a list of full UUIDs), or both visibility variables set to them.
POINT_BY_OPTION, POINT_BY_VISIBILITY = "contexts_on", "visibility"


def _never(options: Mapping[str, Any]) -> bool:
    return False


def _no_options(entries: Sequence[BackendRequirement]) -> dict[str, Any] | None:
    return None


@dataclass(frozen=True)
class BackendSpec:
    """One backend, declared once (a module under gpudiag.core.backends)."""

    name: str
    summary: str                      # one line for docs/reference.md's backend table
    layer: str                        # the catalog layer of its blockers (core.catalog)
    probe_module: str                 # the child's module: ``probe(options) -> dict``
    # The typed observation ("module:Class", imported on first use, or the class itself):
    # a frozen dataclass that is the JSON's schema too (gpudiag.core.decode reads it).
    observation: type | str
    # "module:function" (or the function); None: a device-layer probe (below).
    classify: BackendClassifier | str | None = None
    interval_s: float = 300.0         # the daemon's default interval
    timeout_s: float = 60.0           # the child's deadline, inline and in the daemon
    enabled: bool = True              # scheduled by the daemon unless configured off
    # The device layer (host, nvml, cuda) feeds the GPU context classify.py builds before
    # any backend classifier runs; classify.py reads those three itself (design-notes).
    device_layer: bool = False
    requirable: bool = True           # may be named in ``--require``
    # Platforms ``NAME:PLATFORM`` may name (None: no platform); aliases map to one spelling.
    platforms: tuple[str, ...] | None = None
    platform_aliases: Mapping[str, str] = field(default_factory=dict)
    platform_word: str = "platform"   # how errors name it ("IREE driver")
    platform_help: str = "is not one of {choices}"  # the rest of that error
    options: OptionsFor = _no_options
    # The options the daemon's scheduled run uses (a plain requirement of the backend).
    scheduled_options: Mapping[str, Any] | None = None
    touches_gpu: TouchesGpu = _never
    # The GPUs an active run proves it on (EVERY_GPU or ONE_GPU) and how its child is pointed
    # at them (POINT_BY_OPTION or POINT_BY_VISIBILITY): engine/round.py reads both.
    proves_on: str = ONE_GPU
    pointed_by: str = POINT_BY_VISIBILITY
    # What of the job's environment decides how it comes up (None: a device-layer probe,
    # the node's fact, shared by every job).
    environment: EnvironmentDecl | None = None  # gpudiag.core.fingerprint_inputs
    # gpudiag_build_info labels: label -> the version keys it reads, first found wins.
    version_labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Whether its node-health proof is published (snapshot.backends_proven, NFD, fleet).
    published: bool = False
    # Its own keys under ``[backends.NAME]`` besides enabled/interval_s/deadline_s, and the
    # "module:function" that checks them (raises ValueError naming the key); the probe
    # child reads them from the same file (GPUDIAG_CONFIG).
    settings_keys: tuple[str, ...] = ()
    check_settings: Callable[[Mapping[str, Any]], object] | str | None = None

    def settings_checked(self, raw: Mapping[str, Any]) -> None:
        """Raise ValueError when ``raw`` (its own keys) cannot be used."""
        if self.check_settings is not None:
            _resolve(self.check_settings)(raw)

    def observation_type(self) -> type:
        """The typed observation class (imported on first use)."""
        found = _resolve(self.observation)
        assert isinstance(found, type), f"{self.name}: {self.observation!r} is not a class"
        return found

    def classifier(self) -> BackendClassifier | None:
        """The backend's classifier (imported on first use); None for the device layer."""
        if self.classify is None:
            return None
        found: BackendClassifier = _resolve(self.classify)
        return found


_RESOLVED: dict[str, object] = {}


def _resolve(ref: object) -> Any:
    """``module:attribute`` imported once (anything else is already the object)."""
    if not isinstance(ref, str):
        return ref
    if ref not in _RESOLVED:
        module, _, attribute = ref.partition(":")
        _RESOLVED[ref] = getattr(importlib.import_module(module), attribute)
    return _RESOLVED[ref]
