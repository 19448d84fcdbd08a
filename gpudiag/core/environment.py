"""Visibility variables, the allow-listed evidence environment, and every child environment.

Two kinds of child, one set of rules here: a probe child (``probe_environment``: the caller's
environment, preallocation off unless the caller set it, never the daemon's systemd channel)
and the job ``gpudiag run`` starts (``job_environment``: the admitted full UUIDs in both
visibility variables, preallocation forced off; docs/runner.md's exact child environment).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Literal

from gpudiag.core.child import preallocation_off
from gpudiag.core.fingerprint_inputs import PREALLOCATION_OFF as PREALLOCATION_OFF
from gpudiag.core.records import dataclass
from gpudiag.core.redact import redact_environment
from gpudiag.core.visibility import CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES, pinned_to

# Evidence never holds a variable outside this allow-list: no secrets in records.
EVIDENCE_ALLOW_PATTERNS: tuple[str, ...] = (
    "CUDA_*", "NVIDIA_*", "XLA_*", "JAX_*", "TF_CPP_*", "IREE_*", "SLURM_*GPU*",
    "SLURM_JOB_ID", "LD_LIBRARY_PATH", "PATH",
)

# What a job's XLA allocator may be (`gpudiag run --xla-allocator`, the pytest plugin's
# gpu_xla_allocator): "platform" (the sharing default: memory is taken as needed and given
# back, slower) or "keep" (gpudiag sets only XLA_PYTHON_CLIENT_PREALLOCATE=false and leaves
# the allocator variables as the job has them: XLA's BFC allocator unless the job set one).
XLA_ALLOCATOR_CHOICES = ("platform", "keep")
XLA_ALLOCATOR_ENV = "GPUDIAG_XLA_ALLOCATOR"
_ALLOCATOR_ONLY = ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR")


def allow_listed(env: Mapping[str, str]) -> dict[str, str]:
    """The subset of ``env`` that evidence may record, with secrets redacted (core.redact)."""
    return redact_environment({k: v for k, v in sorted(env.items())
                               if any(fnmatch.fnmatchcase(k, p) for p in EVIDENCE_ALLOW_PATTERNS)})


def preallocation_disabled(env: Mapping[str, str]) -> bool:
    """Whether ``env`` (as a child really saw it) disables XLA preallocation."""
    # The rule lives in gpudiag.core.child, which must stay self-contained (it is copied into
    # the run's sitecustomize.py).
    return preallocation_off(env)


def job_preallocation(env: Mapping[str, str], jax_reading: bool | None = None) -> bool:
    """A verdict's ``preallocation_disabled`` for a job with environment ``env``, the one rule
    on every path (daemon, hybrid, inline): what a JAX child run here read, else what a child
    of the job's environment would see (``probe_environment``: preallocation off unless the
    job set it on). Never the daemon's environment."""
    if jax_reading is not None:
        return jax_reading
    return preallocation_disabled(probe_environment(env))


# Where probe children keep what they may reuse between rounds (the IREE probe's compiled
# module): a private folder; the daemon points it into its own state directory.
CACHE_VARIABLE = "GPUDIAG_CACHE_DIR"

# systemd's channel to the service it started (the daemon): a child must not speak for it.
SYSTEMD_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def probe_environment(base: Mapping[str, str]) -> dict[str, str]:
    """What a probe child runs with: the caller's environment, preallocation off by default.

    A value the caller already set is kept, so a leaked ``XLA_PYTHON_CLIENT_PREALLOCATE=true``
    reaches the probe and is reported (jax_preallocation_enabled) instead of hidden. The
    systemd channel is dropped: a probe of the daemon (or of a prolog run by a notify-type
    service) must never notify or pet the watchdog in its parent's name.
    """
    env = {k: v for k, v in base.items() if k not in SYSTEMD_ONLY}
    for key, value in PREALLOCATION_OFF.items():
        env.setdefault(key, value)
    return env


def gpudiag_variables(uuids: Sequence[str], jax_platforms: str | None,
                      xla_allocator: str = "platform") -> dict[str, str]:
    """The variables gpudiag sets in a job's child (docs/runner.md's exact child environment);
    ``xla_allocator="keep"`` leaves the two allocator variables out (preallocation stays off)."""
    if xla_allocator not in XLA_ALLOCATOR_CHOICES:
        raise ValueError(f"xla_allocator {xla_allocator!r}: one of {XLA_ALLOCATOR_CHOICES}")
    for u in uuids:
        if not is_full_uuid(u):
            raise ValueError(f"{u!r} is not a full GPU-/MIG- UUID")
    out = pinned_to(uuids)
    if jax_platforms is not None:
        out["JAX_PLATFORMS"] = jax_platforms
    out.update({k: v for k, v in PREALLOCATION_OFF.items()
                if xla_allocator == "platform" or k not in _ALLOCATOR_ONLY})
    return out


def job_environment(base: Mapping[str, str], uuids: Sequence[str],
                    jax_platforms: str | None) -> dict[str, str]:
    """A job's exact environment: ``base`` with gpudiag's variables set over it."""
    return {**base, **gpudiag_variables(uuids, jax_platforms)}


_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]+$")
_INDEX_RE = re.compile(r"^[0-9]+$")


@dataclass(frozen=True)
class VisibleEntry:
    """One entry of a visibility list."""

    raw: str
    kind: str  # "index" | "uuid" | "uuid_prefix" | "mig_uuid" | "mig_legacy" | "invalid"


@dataclass(frozen=True)
class Visibility:
    """A parsed CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES value."""

    variable: str
    raw: str | None
    mode: str  # "unset" | "all" | "empty" | "list"
    entries: tuple[VisibleEntry, ...] = ()
    reason: str | None = None

    def record(self) -> dict[str, object]:
        return {"variable": self.variable, "raw": self.raw, "mode": self.mode,
                "entries": [{"raw": e.raw, "kind": e.kind} for e in self.entries],
                "reason": self.reason}


def _entry(token: str) -> VisibleEntry:
    if _INDEX_RE.match(token):
        return VisibleEntry(token, "index")
    if token.startswith("MIG-GPU-") or (token.startswith("MIG-") and "/" in token):
        return VisibleEntry(token, "mig_legacy")
    if _UUID_RE.match(token):
        kind = "mig_uuid" if token.startswith("MIG-") else "uuid"
        # A full GPU UUID has 5 groups of 8-4-4-4-12 hex digits.
        if kind == "uuid" and len(token) < len("GPU-") + 36:
            kind = "uuid_prefix"
        return VisibleEntry(token, kind)
    return VisibleEntry(token, "invalid")


def parse_cuda_visible_devices(raw: str | None) -> Visibility:
    """Parse CUDA_VISIBLE_DEVICES the way the CUDA driver reads it."""
    var = CUDA_VISIBLE_DEVICES
    if raw is None:
        return Visibility(var, None, "unset")
    value = raw.strip()
    if value in ("", "-1", "NoDevFiles"):
        return Visibility(var, raw, "empty", reason=f"{var}={raw!r} hides every GPU")
    entries = tuple(_entry(t.strip()) for t in value.split(","))
    return Visibility(var, raw, "list", entries)


def parse_nvidia_visible_devices(raw: str | None) -> Visibility:
    """Parse NVIDIA_VISIBLE_DEVICES as the NVIDIA container runtime reads it."""
    var = NVIDIA_VISIBLE_DEVICES
    if raw is None:
        return Visibility(var, None, "unset")
    value = raw.strip()
    if value.lower() == "all":
        return Visibility(var, raw, "all")
    if value.lower() in ("void", "none", ""):
        return Visibility(var, raw, "empty",
                          reason=f"{var}={raw!r} exposes no GPU")
    entries = tuple(_entry(t.strip()) for t in value.split(","))
    return Visibility(var, raw, "list", entries)


# One resolver, two rules (docs/design-notes.md, "Devices and visibility"):
# PREFIX is how the CUDA driver reads a visibility list, so preflight judges what a job will
# see: an index, a unique GPU UUID prefix, or a MIG UUID. FULL_UUID is admission's rule:
# only an index or a complete UUID names a GPU, because a prefix is never an identity for a
# lock. Both read indices as NVML indices and MIG UUIDs as one instance of their GPU.
Rule = Literal["prefix", "full_uuid"]
PREFIX: Rule = "prefix"
FULL_UUID: Rule = "full_uuid"


@dataclass(frozen=True)
class KnownDevice:
    """What resolution needs to know of a device: its index and full UUIDs."""

    index: int
    uuid: str
    mig_uuids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pick:
    """What one entry named: a device, or one MIG instance of it (``mig_uuid``)."""

    index: int
    mig_uuid: str | None = None


@dataclass(frozen=True)
class Resolution:
    """A visibility list resolved against the real devices."""

    indices: tuple[int, ...]
    unresolved: tuple[str, ...]  # entries that name no device (or are ambiguous)
    ambiguous: tuple[str, ...] = ()
    # Per entry of the list, in its order: what it named (empty: nothing; two or more:
    # ambiguous). Empty for unset/all/empty lists.
    picks: tuple[tuple[Pick, ...], ...] = ()


def entry_of(token: str) -> VisibleEntry:
    """One visibility-list token classified (index, uuid, uuid_prefix, mig_uuid, ...)."""
    return _entry(token)


def match_entry(entry: VisibleEntry, devices: Sequence[KnownDevice], rule: Rule
                ) -> tuple[Pick, ...]:
    """What one entry names among ``devices`` under ``rule`` (two or more: ambiguous)."""
    raw = entry.raw.lower()
    if entry.kind == "index":
        return tuple(Pick(d.index) for d in devices if d.index == int(entry.raw))
    if entry.kind == "uuid" or (entry.kind == "uuid_prefix" and rule == PREFIX):
        if rule == PREFIX:
            return tuple(Pick(d.index) for d in devices if d.uuid.lower().startswith(raw))
        return tuple(Pick(d.index) for d in devices if d.uuid and d.uuid.lower() == raw)
    if entry.kind == "mig_uuid":
        return tuple(Pick(d.index, m) for d in devices for m in d.mig_uuids
                     if m.lower() == raw)
    return ()  # mig_legacy and invalid entries never name a device


def resolve_list(vis: Visibility, devices: Sequence[KnownDevice], rule: Rule = PREFIX
            ) -> Resolution:
    """Which physical devices a visibility list selects, in its order, and what it misnames."""
    if vis.mode in ("unset", "all"):
        return Resolution(tuple(d.index for d in devices), ())
    if vis.mode == "empty":
        return Resolution((), ())
    chosen: list[int] = []
    unresolved: list[str] = []
    ambiguous: list[str] = []
    picks: list[tuple[Pick, ...]] = []
    for e in vis.entries:
        found = match_entry(e, devices, rule)
        picks.append(found)
        indices = {p.index for p in found}
        if len(indices) > 1:
            ambiguous.append(e.raw)
            unresolved.append(e.raw)
        elif not found:
            unresolved.append(e.raw)
        elif found[0].index not in chosen:
            chosen.append(found[0].index)
    return Resolution(tuple(chosen), tuple(unresolved), tuple(ambiguous), tuple(picks))


@dataclass(frozen=True)
class JobView:
    """A job's two visibility variables, resolved once against the real devices.

    The one place visibility is resolved: the verdict (core/classify), the busy-GPU round
    (engine/guard.visible_uuids) and admission (runner/admission.narrow) read this and apply
    only their own policy on top. CUDA reads its list inside what the container runtime
    exposes, so CUDA_VISIBLE_DEVICES is resolved among the devices NVIDIA_VISIBLE_DEVICES
    selects (down to the MIG instances it names, when it names only instances).
    """

    cuda: Visibility
    nvidia: Visibility
    nvidia_resolution: Resolution  # against every device
    cuda_resolution: Resolution  # against the devices NVIDIA_VISIBLE_DEVICES selects
    # CUDA entries that name only devices NVIDIA_VISIBLE_DEVICES hides (the two disagree);
    # they are among cuda_resolution.unresolved too.
    hidden: tuple[str, ...] = ()

    @property
    def empties(self) -> tuple[Visibility, ...]:
        """The variables that hide every GPU (NVIDIA's first: the container's view)."""
        return tuple(v for v in (self.cuda, self.nvidia) if v.mode == "empty")

    @property
    def indices(self) -> tuple[int, ...]:
        """The devices the job sees, in the order CUDA numbers them (none when one hides all)."""
        return () if self.empties else self.cuda_resolution.indices

    def resolution(self, vis: Visibility) -> Resolution:
        """What ``vis`` (this view's cuda or nvidia) resolved to."""
        return self.cuda_resolution if vis is self.cuda else self.nvidia_resolution


def job_view(env: Mapping[str, str | None], devices: Sequence[KnownDevice],
             rule: Rule = PREFIX) -> JobView:
    """``env``'s visibility variables resolved against ``devices`` under ``rule``."""
    cvd = parse_cuda_visible_devices(env.get(CUDA_VISIBLE_DEVICES))
    nvd = parse_nvidia_visible_devices(env.get(NVIDIA_VISIBLE_DEVICES))
    res_n = resolve_list(nvd, devices, rule)
    inside = _exposed(devices, nvd, res_n)
    res_c = resolve_list(cvd, inside, rule)
    hidden: tuple[str, ...] = ()
    if nvd.mode == "list" and cvd.mode == "list":
        hidden = tuple(e.raw for e, picks in zip(cvd.entries, res_c.picks, strict=True)
                       if not picks and match_entry(e, devices, rule))
    return JobView(cvd, nvd, res_n, res_c, hidden)


def _exposed(devices: Sequence[KnownDevice], nvd: Visibility, res: Resolution
             ) -> list[KnownDevice]:
    """The devices NVIDIA_VISIBLE_DEVICES exposes, in its order; a GPU it names only by MIG
    instances keeps only those instances."""
    if nvd.mode != "list":
        return list(devices)
    whole = {p.index for picks in res.picks if len(picks) == 1 for p in picks
             if p.mig_uuid is None}
    migs: dict[int, list[str]] = {}
    for picks in res.picks:
        for p in picks if len(picks) == 1 else ():
            if p.mig_uuid is not None:
                migs.setdefault(p.index, []).append(p.mig_uuid)
    by_index = {d.index: d for d in devices}
    exposed = [by_index[i] if i in whole else
               KnownDevice(i, by_index[i].uuid, tuple(migs.get(i, ())))
               for i in res.indices if i in by_index]
    # A device whose UUID could not be read may be one the list names: it stays in sight
    # (the device fault, not the variable, is then what the verdict reports).
    return exposed + [d for d in devices if not d.uuid and d.index not in res.indices]


_FULL_UUID_RE = re.compile(
    r"^(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def is_full_uuid(text: str) -> bool:
    """Whether ``text`` is a complete GPU-/MIG- UUID (prefixes are never identities)."""
    return bool(_FULL_UUID_RE.match(text))
