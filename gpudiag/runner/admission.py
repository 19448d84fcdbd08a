"""GPU admission: observe leaves, narrow to visibility, lock full UUIDs, re-observe under lock.

One direction only (docs/runner.md, "The admission state machine"): observe -> narrow
(never widen) -> pick FREE leaves with enough memory -> flock one file per full UUID ->
observe again while holding the locks -> abort on any change. Every refusal is a Verdict
whose blocker comes from the catalog, with the leaves and lock holders as evidence.
Observations run in a probe child (``python -m gpudiag.probes nvml``): this process never
loads NVML itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from gpudiag.core.classify import classify
from gpudiag.core.environment import (
    FULL_UUID,
    KnownDevice,
    Resolution,
    Visibility,
    is_full_uuid,
    job_environment,
    job_view,
)
from gpudiag.core.limits import MAX_DEVICES
from gpudiag.core.observations import ErrorInfo
from gpudiag.core.occupancy import BUSY, FREE, UNKNOWN, Leaf, leaves_from_nvml
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.readiness import GPU_FAULT_LAYERS
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Finding, Requirement, Verdict
from gpudiag.core.visibility import (
    CUDA_VISIBLE_DEVICES,
    NVIDIA_VISIBLE_DEVICES,
    VISIBILITY_VARIABLES,
    pinned_to,
)
from gpudiag.engine.inline import run_inline
from gpudiag.engine.isolation import run_probe
from gpudiag.engine.jobpython import JobPython
from gpudiag.engine.locks import (
    Holder,
    LockFailed,
    LockInfo,
    default_lock_dir,
    describe_holders,
    hold_waiting,
    holders,
    kernel_locks,
    let_go,
    lock_holder,
    release,
    try_lock,
    wait_for_free,
)
from gpudiag.engine.occupancy_view import any_lock_free, lock_answers
from gpudiag.engine.route import daemon_else_inline

DEFAULT_LOCK_TIMEOUT_S = 60.0
OBSERVE_TIMEOUT_S = 10.0
LOCK_POLL_S = 0.05
# Attempts that meet a lock free again at once (another reader's O(1) test held it for its
# microseconds) are retried this many times, even past the timeout (--lock-timeout 0 too).
RACE_RETRIES = 3
# While others hold the locks it waits for, a job looks afresh (an nvml child, ~0.15 CPU-s)
# only this often, doubling to REOBSERVE_MAX_S: a freed lock ends the wait at once anyway
# (the kernel's holders are polled), so these looks only find GPUs freed without a lock.
REOBSERVE_S = 5.0
REOBSERVE_MAX_S = 30.0


class AdmissionError(Exception):
    """Admission refused or failed; ``verdict`` says why, with a catalog blocker and evidence."""

    def __init__(self, verdict: Verdict) -> None:
        primary = verdict.primary
        super().__init__(f"{verdict.gpu_validation_blocker}: "
                         f"{primary.message if primary else 'not admitted'}")
        self.verdict = verdict


@dataclass(frozen=True)
class Observation:
    """The leaves NVML showed at one moment (``error`` set when NVML could not be read)."""

    leaves: tuple[Leaf, ...]
    observed_at: float  # time.time()
    duration_s: float
    error: str | None = None

    def leaf(self, uuid: str) -> Leaf | None:
        return next((lf for lf in self.leaves if lf.uuid == uuid), None)

    def topology(self) -> list[tuple[str | None, str, str | None]]:
        return sorted(((lf.uuid, lf.kind, lf.parent_uuid) for lf in self.leaves),
                      key=lambda t: (str(t[0]), t[1], str(t[2])))

    def record(self) -> dict[str, Any]:
        return {"observed_at": self.observed_at, "duration_s": round(self.duration_s, 4),
                "error": self.error, "leaves": [lf.record() for lf in self.leaves]}


def observation_from_run(run: ProbeRun) -> Observation:
    """An Observation from a finished ``nvml`` probe run."""
    obs = run.nvml
    if not run.ok or obs is None:
        return Observation((), time.time(), run.duration_s, run.error or "no observation")
    if not obs.ok:
        err = obs.error or ErrorInfo()
        return Observation((), time.time(), run.duration_s,
                           f"NVML failed: {err.name} ({err.code}): {err.message}")
    return Observation(leaves_from_nvml(obs), time.time(), run.duration_s)


def observe(env: Mapping[str, str], timeout_s: float = OBSERVE_TIMEOUT_S) -> Observation:
    """Observe every leaf now, in an ``nvml`` probe child."""
    return observation_from_run(run_probe("nvml", env=env, timeout_s=timeout_s))


# --- visibility -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Narrowing:
    """Which leaves the caller's visibility variables allow (``None``: no restriction)."""

    allowed: frozenset[str] | None
    blockers: tuple[Finding, ...] = ()
    cuda_visible_devices: str | None = None
    nvidia_visible_devices: str | None = None

    def record(self) -> dict[str, Any]:
        return {"allowed": None if self.allowed is None else sorted(self.allowed),
                CUDA_VISIBLE_DEVICES: self.cuda_visible_devices,
                NVIDIA_VISIBLE_DEVICES: self.nvidia_visible_devices,
                "blockers": [b.record() for b in self.blockers]}


def _devices(leaves: Sequence[Leaf]) -> list[KnownDevice]:
    """The physical GPUs behind the leaves, as the visibility resolver knows devices."""
    by_index: dict[int, KnownDevice] = {}
    for lf in leaves:
        dev = by_index.get(lf.index, KnownDevice(lf.index, ""))
        gpu_uuid = lf.parent_uuid if lf.kind == "mig" else lf.uuid
        migs = (*dev.mig_uuids, lf.uuid) if lf.kind == "mig" and lf.uuid else dev.mig_uuids
        by_index[lf.index] = KnownDevice(lf.index, dev.uuid or gpu_uuid or "", migs)
    return list(by_index.values())


def _allowed_by(vis: Visibility, res: Resolution, leaves: Sequence[Leaf]
                ) -> tuple[frozenset[str] | None, list[str]]:
    """The leaf UUIDs one resolved visibility variable selects, and the entries it misnames."""
    if vis.mode in ("unset", "all"):
        return None, []
    if vis.mode == "empty":
        return frozenset(), []
    known = [lf for lf in leaves if lf.uuid]
    allowed: set[str] = set()
    bad: list[str] = []
    for entry, picks in zip(vis.entries, res.picks, strict=True):
        # A GPU stands for all of its leaves (its MIG instances); a MIG UUID for one.
        match = [str(lf.uuid) for p in picks for lf in known if lf.index == p.index
                 and (p.mig_uuid is None or str(lf.uuid).lower() == p.mig_uuid.lower())]
        if not match:
            bad.append(entry.raw)
        allowed.update(match)
    return frozenset(allowed), bad


def narrow(leaves: Sequence[Leaf], env: Mapping[str, str]) -> Narrowing:
    """Apply CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES: they narrow, never widen.

    Admission's rule: an index or a full UUID; a prefix is never an identity for a lock.
    """
    view = job_view(env, _devices(leaves), FULL_UUID)
    cvd, nvd = view.cuda, view.nvidia
    allowed_n, bad_n = _allowed_by(nvd, view.nvidia_resolution, leaves)
    allowed_c, bad_c = _allowed_by(cvd, view.cuda_resolution, leaves)
    bad_c = [b for b in bad_c if b not in view.hidden]
    blockers: list[Finding] = []
    for vis, bad in ((cvd, bad_c), (nvd, bad_n)):
        if bad:
            blockers.append(Finding.of(
                "visible_devices_invalid",
                f"{vis.variable}={vis.raw!r}: {', '.join(repr(b) for b in bad)} names no "
                "observed GPU or MIG instance by index or full UUID (UUID prefixes are never "
                "identities for admission)"))
    # CUDA narrowing within NVIDIA's set is how containers work; naming a leaf NVIDIA's
    # list hides is the two disagreeing.
    outside = sorted((allowed_c or frozenset()) - (allowed_n or frozenset())) \
        if allowed_c is not None and allowed_n is not None else []
    if view.hidden or outside:
        hidden = ", ".join(repr(h) for h in (*view.hidden, *outside))
        blockers.append(Finding.of(
            "visible_devices_conflict",
            f"{cvd.variable}={cvd.raw!r} names {hidden}, which {nvd.variable}={nvd.raw!r} "
            f"hides (it selects {sorted(allowed_n or ())})"))
    allowed: frozenset[str] | None
    if allowed_c is None:
        allowed = allowed_n
    elif allowed_n is None:
        allowed = allowed_c
    else:
        allowed = allowed_c & allowed_n
    return Narrowing(allowed, tuple(blockers), cvd.raw, nvd.raw)


# --- admission ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """Admitted leaves, the evidence of how they were chosen, and the locks that hold them."""

    requirement: Requirement
    verdict: Verdict
    gpus: int
    leaves: tuple[Leaf, ...]
    candidates: tuple[Leaf, ...]
    first: Observation | None
    locked: Observation | None
    locks: tuple[LockInfo, ...]
    narrowing: Narrowing | None
    lock_dir: str | None
    attempts: int = 1
    waited_s: float = 0.0
    # GPUs passed over because their lock file was unusable (planted): (uuid, why).
    unusable_locks: tuple[tuple[str, str], ...] = ()

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(str(lf.uuid) for lf in self.leaves)

    @property
    def jax_platforms(self) -> str | None:
        """JAX_PLATFORMS for the child: cuda when JAX must run on the GPU (no fallback)."""
        jax = self.requirement.backend("jax")
        if jax is None:
            return None
        return "cpu" if jax.platform == "cpu" else "cuda"

    def fingerprint(self) -> str:
        """A hash of what was admitted and how it looked under the locks."""
        payload = {"uuids": list(self.uuids),
                   "locked": [lf.record() for lf in (self.locked.leaves if self.locked else ())],
                   "locks": [lk.record() for lk in self.locks]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def release(self) -> None:
        """Drop this process's hold on the locks."""
        release(self.locks)

    def record(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "selected": list(self.uuids),
            "leaves": [lf.record() for lf in self.leaves],
            "candidates": [lf.record() for lf in self.candidates],
            "first_observation": self.first.record() if self.first else None,
            "locked_observation": self.locked.record() if self.locked else None,
            "locks": [lk.record() for lk in self.locks],
            "lock_dir": self.lock_dir,
            "narrowing": self.narrowing.record() if self.narrowing else None,
            "attempts": self.attempts,
            "waited_s": round(self.waited_s, 3),
            "fingerprint": self.fingerprint(),
            "unusable_locks": [{"uuid": u, "reason": r} for u, r in self.unusable_locks],
        }


def child_environment(admission: Admission, base_env: Mapping[str, str]) -> dict[str, str]:
    """The exact child environment: ``base_env`` plus the admitted GPUs and preallocation off.

    Both visibility variables name the admitted full UUIDs (empty when none was admitted, so
    the child cannot reach a GPU it was not given); JAX_PLATFORMS=cuda when JAX must run on
    the GPU, so a missing GPU backend fails loudly instead of falling back to the CPU.
    """
    return job_environment(base_env, admission.uuids, admission.jax_platforms)


Hook = Callable[[Observation], None]
# (requirement, job environment, admitted full UUIDs) -> the verdict of probes run on them.
Prover = Callable[[Requirement, Mapping[str, str], Sequence[str], "JobPython | None"], Verdict]
# A preflight proof of the admitted GPUs this recent stands in for one made under the lock
# (the daemon's answers are this old at most by default, too).
PROOF_MAX_AGE_S = 60.0


def _wall(rfc3339: str | None) -> float | None:
    if not rfc3339:
        return None
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def proven_on(verdict: Verdict, uuids: Sequence[str], *, now_wall: float,
              max_age_s: float = PROOF_MAX_AGE_S) -> bool:
    """Whether ``verdict`` proved every GPU backend it requires on ``uuids``, recently: each
    GPU's last proof (a CUDA context) within ``max_age_s``, and JAX/IREE proven on one of
    them (``detail.proven_on``). Admission proves again under its lock when not."""
    active = [b for b in verdict.requirement.backends if b.needs_gpu and b.name != "nvml"]
    if not active or not uuids:
        return True
    by_uuid = {d.uuid: d for d in verdict.devices}
    for uuid in uuids:
        device = by_uuid.get(uuid)
        proven = _wall(device.last_proven_at) if device is not None else None
        if proven is None or now_wall - proven > max_age_s:
            return False
    proof = verdict.evidence.get("proof")
    proofs = proof if isinstance(proof, Mapping) else {}
    for b in active:
        status = verdict.backends.get(b.name)
        if status is None or status.status != "ok":
            return False
        if b.name != "cuda" and status.detail.get("proven_on") not in uuids:
            return False
        # A backend proven in the job's environment by the daemon: that proof's own age
        # counts (a runtime's proof may be up to its maximum age old: an hour by default).
        entry = proofs.get(b.name)
        when = _wall(entry.get("proven_at")) if isinstance(entry, Mapping) else None
        if isinstance(entry, Mapping) and (when is None or now_wall - when > max_age_s):
            return False
    return True


def prove_under_lock(requirement: Requirement, env: Mapping[str, str],
                     uuids: Sequence[str], python: JobPython | None = None) -> Verdict:
    """Run the requirement's probes on the admitted GPUs, which this process holds locked:
    the job-readiness question on exactly those GPUs, as the job will see them (JAX and
    IREE under the job's interpreter, ``python``: engine/jobpython.py)."""
    job_env = {**env, **pinned_to(uuids)}
    req = replace(requirement, node_health=False, gpus=None, devices=None,
                  min_devices=len(uuids), min_free_memory_bytes=None)
    done = run_inline(req, env=job_env, held=uuids, python=python)
    return classify(done.runs, req, host=socket.gethostname(), checked_at=done.checked_at,
                    scope=done.scope)


@dataclass(frozen=True)
class Admitter:
    """Admits ``gpus`` leaves for a ready verdict; seams are fields with real defaults."""

    env: Mapping[str, str]
    lock_dir: Path
    gpus: int
    min_free_memory_bytes: int | None = None
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    observer: Callable[[Mapping[str, str]], Observation] = observe
    # Test seam: runs after the first observation, before the locks (inject a change here).
    after_first_observation: Hook | None = None
    # Proves the requirement on the admitted GPUs under their locks when the preflight did
    # not (docs/design-notes.md, "Admission proves what it admits"); None: never (tests).
    prover: Prover | None = prove_under_lock
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    # Told once per set of holders while the job waits for GPUs others hold (gpudiag run's
    # stderr): who holds them, as the kernel says.
    on_wait: Callable[[str], None] | None = None
    # The job's interpreter (engine/jobpython.py): what the proof under the locks runs JAX
    # and IREE under; None: found from ``env``.
    python: JobPython | None = None

    def admit(self, verdict: Verdict, first: Observation | None = None) -> Admission:
        """Admit or raise AdmissionError; ``first`` reuses an observation made just before."""
        requirement = replace(verdict.requirement, min_devices=self.gpus,
                              min_free_memory_bytes=self.min_free_memory_bytes)
        verdict = replace(verdict, requirement=requirement)
        both_lists = all(self.env.get(v, "").strip().lower() not in ("", "all", "void", "none")
                         for v in VISIBILITY_VARIABLES)
        if not verdict.ready and first is None and both_lists and self.gpus:
            first = self.observer(self.env)  # only to tell a conflict from a bad name
        if first is not None and first.error is None:
            narrowing = narrow(first.leaves, self.env)
            conflict = [b for b in narrowing.blockers if b.code == "visible_devices_conflict"]
            if conflict:
                # The preflight sees the disagreement only as a name that matches nothing
                # (or too few devices); the conflict is the cause, so it replaces those.
                kept = tuple(b for b in verdict.blockers if b.code not in (
                    "visible_devices_invalid", "insufficient_devices"))
                raise AdmissionError(replace(
                    verdict, blockers=(*kept, *conflict),
                    evidence={**verdict.evidence, "admission": {
                        "narrowing": narrowing.record(),
                        "first_observation": first.record()}}))
        # A fault on one GPU takes that GPU out of the choice, it does not refuse the run
        # (docs/design-notes.md "Busy GPUs"); on the GPUs admitted it is a warning naming the
        # faulty one.
        faulty = frozenset(b.device for b in verdict.blockers
                           if b.device and b.layer in GPU_FAULT_LAYERS) if self.gpus else (
            frozenset())
        if faulty and all(b.device in faulty for b in verdict.blockers):
            verdict = replace(verdict, blockers=(), warnings=(*verdict.warnings, *(
                Finding.of("gpu_fault_outside_selection",
                           f"{b.code} on {b.device}, which the job does not use: {b.message}",
                           backend=b.backend, device=b.device, warning=True)
                for b in verdict.blockers)))
        if self.gpus and self.prover is not None:
            # Unproven because no GPU was free to prove it on: admission waits for GPUs and
            # proves the backend on the ones it locks, so this is no refusal yet.
            verdict = replace(verdict, blockers=tuple(
                b for b in verdict.blockers if b.code != "backend_unproven"))
        if not verdict.ready:
            raise AdmissionError(verdict)
        if self.gpus == 0:
            return Admission(requirement, verdict, 0, (), (), None, None, (), None, None)
        started = self.clock()
        deadline = started + self.lock_timeout_s
        attempts = 0
        obs = first
        said: set[str] = set()
        while True:
            attempts += 1
            if obs is None:
                obs = self.observer(self.env)
            outcome = self._attempt(verdict, obs, deadline, faulty, attempts, said)
            if isinstance(outcome, Admission):
                return self._proven(replace(outcome, attempts=attempts,
                                            waited_s=self.clock() - started))
            obs = None  # held by others and freed since: observe afresh

    def _proven(self, admission: Admission) -> Admission:
        """The admission, once its GPUs are proven for the requirement (or refused)."""
        if self.prover is None or any(lf.kind != "gpu" for lf in admission.leaves):
            return admission  # MIG leaves: their parent GPU is shared, see design-notes
        if proven_on(admission.verdict, admission.uuids, now_wall=time.time()):
            return admission
        proof = self.prover(admission.requirement, self.env, admission.uuids, self.python)
        evidence = {"under_lock": True, "checked_at": proof.checked_at,
                    "gpu_validation_blocker": proof.gpu_validation_blocker,
                    "backends": {n: b.status for n, b in proof.backends.items()}}
        if not proof.ready:
            admission.release()
            raise AdmissionError(replace(proof, evidence={
                **proof.evidence, "proof": evidence,
                "admission": {**admission.record(), "proof": evidence}}))
        verdict = admission.verdict
        return replace(admission, verdict=replace(
            verdict, devices=proof.devices or verdict.devices,
            backends={**verdict.backends, **proof.backends},
            evidence={**verdict.evidence, "proof": evidence}))

    def _refuse(self, verdict: Verdict, code: str, message: str, evidence: Mapping[str, Any],
                extra: Sequence[Finding] = ()) -> AdmissionError:
        ev = dict(verdict.evidence)
        ev["admission"] = dict(evidence)
        blockers = (*verdict.blockers, *extra, Finding.of(code, message))
        return AdmissionError(replace(verdict, blockers=blockers, evidence=ev))

    def _attempt(self, verdict: Verdict, obs: Observation, deadline: float,
                 faulty: frozenset[str] = frozenset(), attempt: int = 1,
                 said: set[str] | None = None) -> Admission | None:
        said = set() if said is None else said  # wait lines told already (on_wait)
        lock_dir = self.lock_dir
        evidence: dict[str, Any] = {"gpus": self.gpus, "lock_dir": str(lock_dir),
                                    "min_free_memory_bytes": self.min_free_memory_bytes,
                                    "first_observation": obs.record()}
        if obs.error is not None:
            raise self._refuse(verdict, "device_state_unknown",
                               f"GPU occupancy could not be observed: {obs.error}", evidence)
        narrowing = narrow(obs.leaves, self.env)
        evidence["narrowing"] = narrowing.record()
        if narrowing.blockers:
            primary = narrowing.blockers[-1]
            raise self._refuse(verdict, primary.code, primary.message, evidence,
                               narrowing.blockers[:-1])
        candidates = [lf for lf in obs.leaves
                      if narrowing.allowed is None or (lf.uuid in narrowing.allowed)]
        # A lock file someone planted (a FIFO, a symlink) makes only its own GPU unusable.
        unusable: dict[str, str] = {}
        held, others = self._lock_free(candidates, self._eligible(verdict, candidates, faulty),
                                       unusable)
        if unusable:
            evidence["unusable_locks"] = [{"uuid": u, "reason": r} for u, r in unusable.items()]
        if len(held) == self.gpus:
            admitted = self._confirm(verdict, obs, narrowing, candidates, held, evidence)
            return replace(admitted, unusable_locks=tuple(unusable.items()))
        release(held)
        if unusable and len(held) + len(others) < self.gpus:
            raise self._refuse(verdict, "device_state_unknown",
                               f"asked for {self.gpus}; {len(unusable)} GPU(s) cannot be locked: "
                               + "; ".join(unusable.values()), evidence)
        evidence["candidates"] = [lf.record() for lf in candidates]
        # Who holds them is the kernel's word, named from one bounded reading of its table
        # (None, "unknown", past the bound); the record in the file is display only.
        table = kernel_locks()
        held_by = {str(lf.uuid): holders(lock_dir, str(lf.uuid), table) if table is not None
                   else None for lf in others}
        evidence["held_by_others"] = [
            {"uuid": uuid, "holder": found[0].record() if found else None,
             "holders": None if found is None else [h.record() for h in found],
             "record": _attested_record(lock_dir, uuid, found)}
            for uuid, found in held_by.items()]
        if len(held) + len(others) < self.gpus:
            raise self._shortage(verdict, candidates, evidence)
        named, qualifying = _held_text(held_by)
        if attempt <= RACE_RETRIES and any_lock_free(lock_dir, list(held_by)):
            # A lock that another reader's O(1) test held for its microseconds (or that was
            # let go just now): tried again, whatever the timeout, never refused for it.
            return None
        if self.clock() >= deadline:
            how_long = (f"for {self.lock_timeout_s:g} s" if self.lock_timeout_s > 0
                        else "(--lock-timeout 0: no wait)")
            raise self._refuse(
                verdict, "lock_timeout",
                f"{len(others)} GPU(s) that could serve this job stayed locked by others "
                f"{how_long} ({named})" + (f"; {QUALIFY_YIELDS}: give --lock-timeout a few "
                                           "seconds" if qualifying else ""), evidence)
        if self.on_wait is not None and named not in said:
            said.add(named)
            self.on_wait(f"waiting up to {max(0.0, deadline - self.clock()):.0f} s for "
                         f"{named}" + (f" ({QUALIFY_YIELDS})" if qualifying else ""))
        self._wait_for_release(lock_dir, list(held_by), deadline,
                               min(REOBSERVE_MAX_S, REOBSERVE_S * 2 ** (attempt - 1)))
        return None

    def _eligible(self, verdict: Verdict, candidates: Sequence[Leaf],
                  faulty: frozenset[str]) -> list[Leaf]:
        """The FREE candidates a job may take: full UUID, not blocked, enough free memory."""
        blocked_devices = {b.device for b in verdict.blockers if b.device} | faulty
        floor = self.min_free_memory_bytes
        return [lf for lf in candidates
                if lf.occupancy == FREE and lf.uuid and is_full_uuid(lf.uuid)
                and lf.uuid not in blocked_devices and lf.parent_uuid not in blocked_devices
                and (floor is None or (lf.memory_free_bytes or 0) >= floor)]

    def _lock_free(self, candidates: Sequence[Leaf], eligible: Sequence[Leaf],
                   unusable: dict[str, str]) -> tuple[list[LockInfo], list[Leaf]]:
        """Lock eligible leaves until enough are held; also the leaves other jobs hold."""
        lock_dir = self.lock_dir
        held: list[LockInfo] = []
        others: list[Leaf] = []  # eligible or busy leaves whose lock another job holds
        for lf in eligible:
            if len(held) == self.gpus:
                break
            lk = _try_lock_leaf(lock_dir, str(lf.uuid), unusable)
            if lk is False:
                continue
            if lk is None:
                others.append(lf)
            else:
                held.append(lk)
        # A BUSY leaf locked by another gpudiag job is busy with that job: wait for it. The
        # kernel says whether anyone holds its lock (engine/occupancy_view: nothing is taken).
        busy = [lf for lf in candidates
                if lf.occupancy == BUSY and lf.uuid and is_full_uuid(lf.uuid)]
        answers = lock_answers(lock_dir, [str(lf.uuid) for lf in busy])
        others += [lf for lf in busy if lf.uuid in answers.held]
        unusable.update(answers.unusable)
        return held, others

    def _wait_for_release(self, lock_dir: Path, uuids: Sequence[str], deadline: float,
                          reobserve_s: float = REOBSERVE_S) -> None:
        """Wait in the kernel until one of others' locks is free (a blocking lock attempt
        per lock file, engine/locks.wait_for_free), a fresh look is due, or the deadline
        passes: no table read, no poll.
        """
        # While it waits, the job holds each GPU's waiting mark: a qualification measuring
        # one of them sees it and stops within a second (probes/qualify.py).
        waiting = hold_waiting(lock_dir, uuids)
        try:
            until = min(deadline, self.clock() + reobserve_s)
            if wait_for_free(lock_dir, uuids, max(0.0, until - self.clock())) is not None:
                # Jitter so that waiters freed together do not race in lockstep.
                self.sleep(random.uniform(0.0, LOCK_POLL_S))
        finally:
            let_go(waiting)

    def _shortage(self, verdict: Verdict, candidates: Sequence[Leaf],
                  evidence: Mapping[str, Any]) -> AdmissionError:
        need = self.gpus
        free = [lf for lf in candidates if lf.occupancy == FREE]
        busy = [lf for lf in candidates if lf.occupancy == BUSY]
        unknown = [lf for lf in candidates if lf.occupancy == UNKNOWN]
        floor = self.min_free_memory_bytes
        short = [lf for lf in free
                 if floor is not None and (lf.memory_free_bytes or 0) < floor]
        parts = [f"{len(candidates)} visible leaf/leaves", f"{len(free)} FREE",
                 f"{len(busy)} BUSY", f"{len(unknown)} UNKNOWN"]
        summary = f"asked for {need}; " + ", ".join(parts)
        if busy and len(free) < need:
            detail = "; ".join(f"{lf.label}: {lf.reason}" for lf in busy)
            return self._refuse(verdict, "devices_busy", f"{summary}. {detail}", evidence)
        if unknown and len(free) < need:
            detail = "; ".join(f"{lf.label}: {lf.reason}" for lf in unknown)
            return self._refuse(verdict, "device_state_unknown", f"{summary}. {detail}",
                                evidence)
        if short:
            detail = "; ".join(f"{lf.label} has {lf.memory_free_bytes} bytes free"
                               for lf in short)
            return self._refuse(verdict, "insufficient_free_memory",
                                f"{summary}; need {floor} bytes free per leaf. {detail}",
                                evidence)
        return self._refuse(verdict, "insufficient_devices", summary, evidence)

    def _confirm(self, verdict: Verdict, first: Observation, narrowing: Narrowing,
                 candidates: Sequence[Leaf], held: list[LockInfo],
                 evidence: dict[str, Any]) -> Admission:
        """Observe again under the locks; any change that matters aborts (no retry)."""
        if self.after_first_observation is not None:
            self.after_first_observation(first)
        locked = self.observer(self.env)
        evidence["locked_observation"] = locked.record()
        changes = compare(first, locked, [lk.uuid for lk in held], narrowing, self.env)
        if changes:
            release(held)
            raise self._refuse(verdict, "admission_changed",
                               "changed between the first observation and the one under the "
                               "locks: " + "; ".join(changes), evidence | {"changes": changes})
        leaves = tuple(lf for uuid in (lk.uuid for lk in held)
                       if (lf := locked.leaf(uuid)) is not None)
        return Admission(verdict.requirement, verdict, self.gpus, leaves, tuple(candidates),
                         first, locked, tuple(held), narrowing, str(self.lock_dir))


# What a waiting job may count on (probes/qualify.py's watcher sees its waiting mark).
QUALIFY_YIELDS = "a qualification stops within 1 s for a job that waits for its GPU"


def _held_text(held_by: Mapping[str, Sequence[Holder] | None]) -> tuple[str, bool]:
    """``UUID: holder; ...`` as the kernel names them, and whether a qualification is one."""
    named = "; ".join(f"{uuid}: {describe_holders(found)}" for uuid, found in held_by.items())
    return named, any(h.qualifying for found in held_by.values() for h in found or ())


def _attested_record(lock_dir: Path, uuid: str, found: Sequence[Holder] | None
                     ) -> dict[str, Any] | None:
    """The lock file's holder record, for display, only when the kernel says its pid holds
    the lock now: a stale record (or a forged one) never names a holder."""
    record = lock_holder(lock_dir, uuid)
    pids = {h.pid for h in found or () if h.pid is not None}
    return record if record is not None and record.get("pid") in pids else None


def _try_lock_leaf(lock_dir: Path, uuid: str, unusable: dict[str, str], *,
                   shared: bool = False) -> LockInfo | None | Literal[False]:
    """try_lock for one leaf; False (and the reason in ``unusable``) when its lock file is
    unusable, so that one planted file costs one GPU, never the whole admission."""
    try:
        return try_lock(lock_dir, uuid, shared=shared)
    except LockFailed as e:
        unusable[uuid] = str(e)
        return False


def compare(first: Observation, locked: Observation, selected: Sequence[str],
            narrowing: Narrowing, env: Mapping[str, str]) -> list[str]:
    """What changed that matters: topology, visibility, and the selected leaves' state.

    Other leaves' occupancy is not compared: GPUs that other jobs hold legitimately change
    while we admit, and that does not affect ours.
    """
    changes: list[str] = []
    if locked.error is not None:
        return [f"the observation under the locks failed: {locked.error}"]
    if first.topology() != locked.topology():
        changes.append(f"topology {first.topology()} -> {locked.topology()}")
    again = narrow(locked.leaves, env)
    if again.allowed != narrowing.allowed or again.blockers:
        changes.append("visibility: the visible leaves differ")
    for uuid in selected:
        a, b = first.leaf(uuid), locked.leaf(uuid)
        if a is None or b is None:
            changes.append(f"{uuid} disappeared")
            continue
        if a.occupancy != b.occupancy or a.pids != b.pids:
            changes.append(f"{uuid} occupancy {a.occupancy} -> {b.occupancy}"
                           + (f" ({b.reason})" if b.reason else ""))
        if (a.memory_total_bytes, a.memory_free_bytes) != (b.memory_total_bytes,
                                                           b.memory_free_bytes):
            changes.append(f"{uuid} memory free {a.memory_free_bytes} -> "
                           f"{b.memory_free_bytes} bytes (total {a.memory_total_bytes} -> "
                           f"{b.memory_total_bytes})")
    return changes


# --- the public entry point -----------------------------------------------------------------


def preflight_for_admission(requirement: Requirement, gpus: int, env: Mapping[str, str],
                            timeout_s: float | None = None, daemon_url: str | None = None,
                            python: JobPython | None = None
                            ) -> tuple[Verdict, Observation | None]:
    """The preflight verdict, and the first observation when the probes ran here.

    The daemon at ``daemon_url`` answers first when one listens (milliseconds); otherwise
    the probes run inline, and their nvml run may double as the first observation. The
    preflight requirement asks for one healthy GPU: admission counts leaves itself (MIG
    instances are leaves the preflight does not count).
    """
    # The node-health question: another job on some GPU is no refusal (admission counts and
    # waits for FREE leaves itself), and a fault on one GPU only takes that GPU out.
    pre = replace(requirement, min_devices=min(gpus, 1) if requirement.needs_gpu or gpus
                  else requirement.min_devices, min_free_memory_bytes=None,
                  node_health=gpus > 0)
    if gpus > 0 and not pre.needs_gpu:
        # A CPU requirement that still asks for GPUs: NVML must be probed too.
        from gpudiag.core.verdict import BackendRequirement
        pre = replace(pre, backends=(*pre.backends, BackendRequirement("nvml")))
    routed = daemon_else_inline(pre, url=daemon_url, use_daemon=daemon_url is not None,
                                env=env, timeout_s=timeout_s, python=python)
    runs = routed.runs
    if runs is None:
        return routed.verdict, None
    nvml = runs.get("nvml")
    # The nvml run doubles as the first observation only when no probe that opens a GPU
    # context (cuda, jax, iree) ran beside it: on a real GPU that probe's own process and
    # memory would show up as occupancy and then vanish (a false BUSY or admission_changed).
    alone = set(runs) <= {"host", "nvml"}
    first = observation_from_run(nvml) if nvml is not None and alone else None
    return routed.verdict, first


@contextlib.contextmanager
def admit(gpus: int | None = None, *, min_free_memory: str | int | None = None,
          require: str | Requirement = "cuda", timeout: float = DEFAULT_LOCK_TIMEOUT_S,
          env: Mapping[str, str] | None = None, lock_dir: str | os.PathLike[str] | None = None,
          verdict: Verdict | None = None, probe_timeout_s: float | None = None,
          daemon_url: str | None = None,
          after_first_observation: Hook | None = None,
          python: str | None = None) -> Iterator[Admission]:
    """Preflight, then admit ``gpus`` leaves under full-UUID locks for the ``with`` block.

    Raises AdmissionError (its ``verdict`` names the blocker, with evidence) when refused.
    ``timeout`` is how long to wait for GPUs other jobs hold; ``verdict`` skips the
    preflight when the caller already has one for this requirement; ``daemon_url`` asks
    that gpudiag daemon for the verdict first (inline probes when none answers).
    ``python``: the job's interpreter (default: this one, ``sys.executable``: the caller is
    the job); JAX and IREE are proven under it.
    """
    from gpudiag.core.requirement import parse_requirement, parse_size
    from gpudiag.engine import jobpython

    requirement = require if isinstance(require, Requirement) else parse_requirement(require)
    n = (1 if requirement.needs_gpu else 0) if gpus is None else gpus
    if n < 0 or n > MAX_DEVICES:
        raise ValueError(f"gpus={n} must be between 0 and {MAX_DEVICES}")
    floor = parse_size(min_free_memory) if isinstance(min_free_memory, str) else min_free_memory
    base = dict(os.environ if env is None else env)
    job_python = (jobpython.this_process() if python is None
                  else jobpython.JobPython(jobpython.checked(python, "python="), "--python"))
    first: Observation | None = None
    if verdict is None:
        verdict, first = preflight_for_admission(requirement, n, base, probe_timeout_s,
                                                 daemon_url, job_python)
    admitter = Admitter(env=base, lock_dir=Path(lock_dir) if lock_dir else default_lock_dir(base),
                        gpus=n, min_free_memory_bytes=floor, lock_timeout_s=timeout,
                        after_first_observation=after_first_observation, python=job_python)
    admission = admitter.admit(replace(verdict, requirement=requirement), first)
    try:
        yield admission
    finally:
        admission.release()
