"""Is a daemon's answer an answer to the question asked? One check for every client path.

Whatever answers on the daemon's socket or port is checked before its verdict is printed or
acted on (docs/security.md, "Kernel facts decide"): the record's schema, its consistency
(``ready`` exactly when there is no blocker, and the primary blocker one of them), and that
it answers the question asked (the requirement's backends, ``gpus``, ``devices``, the
counts). A problem is one line; the caller says it on stderr and answers with probes run
here: fail closed, never the daemon's word. ``engine.client.ask_daemon`` (typed) and the
console entry's fast path (``cli/entry.py``, raw) both call ``check_answer``.

Extending it: a check is a function ``(record, question) -> str | None`` in ``CHECKS``.
Only ``re`` and core.recordtext are imported: the daemon-answered CLI call pays for this.
"""

from __future__ import annotations

from gpudiag.core.recordtext import SCHEMA

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpudiag/__init__)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

    Check = Callable[[Mapping[str, Any], "Question"], "str | None"]


class Question:
    """What was asked of the daemon (None: not asked, nothing to compare).

    ``backends`` are backend specs as ``Requirement.record()`` writes them (``cuda``,
    ``jax:cpu``), in any order. A plain class, not a dataclass: the fast path avoids the
    dataclasses import (docs/benchmarks.md, "CLI start").
    """

    __slots__ = ("backends", "devices", "gpus", "min_devices", "min_free_memory_bytes",
                 "question", "extra")

    def __init__(self, backends: tuple[str, ...] | None, *,
                 devices: tuple[str, ...] | None = None, gpus: int | None = None,
                 min_devices: int | None = None, min_free_memory_bytes: int | None = None,
                 question: str = "job", extra: Mapping[str, Any] | None = None) -> None:
        self.backends = backends
        self.devices = devices
        self.gpus = gpus
        self.min_devices = min_devices
        self.min_free_memory_bytes = min_free_memory_bytes
        self.question = question  # "job" or "node_health"
        self.extra = dict(extra or {})  # for checks added later (a runtime's fingerprint)


def raw_backends(text: str) -> tuple[str, ...]:
    """``--require`` as typed, in the record's spelling where that needs no parser
    (``JAX:GPU`` -> ``jax``); a spelling this misses only sends the call to the typed path."""
    out: list[str] = []
    for item in text.split(","):
        name, sep, platform = item.strip().lower().partition(":")
        spec = name if not sep or platform in ("gpu", "") else f"{name}:{platform}"
        if spec not in out:
            out.append(spec)
    return tuple(out)


def _schema(record: Mapping[str, Any], question: Question) -> str | None:
    if record.get("schema") != SCHEMA:
        return f"its schema is {str(record.get('schema'))[:40]!r}, not {SCHEMA}"
    for key, kind in (("ready", bool), ("gpu_validation_blocker", str), ("blockers", list),
                      ("warnings", list), ("requirement", dict), ("devices", list),
                      ("backends", dict)):
        if not isinstance(record.get(key), kind):
            return f"its {key} is not a {kind.__name__}"
    for item in record["blockers"]:
        if not isinstance(item, dict) or not isinstance(item.get("code"), str):
            return "a blocker without a code"
    return None


def _consistent(record: Mapping[str, Any], question: Question) -> str | None:
    ready, primary = record["ready"], record["gpu_validation_blocker"]
    codes = [b["code"] for b in record["blockers"]]
    if ready and codes:
        return f"it says ready with blockers ({', '.join(codes)[:80]!r})"
    if not ready and not codes:
        return "it says not ready without a blocker"
    if ready != (primary == "none"):
        return f"ready={str(ready).lower()} with gpu_validation_blocker={primary[:60]!r}"
    if codes and primary not in codes:
        return f"its gpu_validation_blocker {primary[:60]!r} is none of its blockers"
    return None


def _answers_question(record: Mapping[str, Any], question: Question) -> str | None:
    req = record["requirement"]
    if req.get("question", "job") != question.question:
        return f"it answers the {req.get('question')!r:.40} question, not {question.question}"
    got = req.get("backends")
    if question.backends is not None and (
            not isinstance(got, list) or sorted(map(str, got)) != sorted(question.backends)):
        return f"it answers require={got!r:.80}, not {','.join(question.backends)}"
    if req.get("gpus") != question.gpus:
        return f"it answers gpus={req.get('gpus')!r:.20}, not {question.gpus}"
    devices = req.get("devices")
    asked = None if question.devices is None else list(question.devices)
    if devices != asked:
        return f"it answers devices={devices!r:.80}, not {asked}"
    for key, value in (("min_devices", question.min_devices),
                       ("min_free_memory_bytes", question.min_free_memory_bytes)):
        if value is not None and req.get(key) != value:
            return f"it answers {key}={req.get(key)!r:.20}, not {value}"
    if record["ready"] and question.gpus is not None:
        free = [d for d in record["devices"] if isinstance(d, dict)
                and d.get("occupancy") == "free" and d.get("healthy") is not False]
        if len(free) < question.gpus:
            return f"it says ready for gpus={question.gpus} with {len(free)} free GPU(s) listed"
    return None


def fingerprint_of(query_value: str | None) -> dict[str, str]:
    """The ``fingerprint=`` parameter sent (``jax:ID,iree:ID``) as backend -> id."""
    pairs = (p.partition(":") for p in (query_value or "").split(",") if p)
    return {name: fid for name, _, fid in pairs}


def _proven_in_the_askers_environment(record: Mapping[str, Any], question: Question
                                      ) -> str | None:
    """Every backend whose fingerprint was sent is said to be proven in an environment with
    that fingerprint (a runtime's), or left to the asker: never another environment's."""
    sent: Mapping[str, str] = question.extra.get("fingerprint") or {}
    if not sent:
        return None
    evidence = record.get("evidence")
    proof = evidence.get("proof") if isinstance(evidence, dict) else None
    for backend, fid in sorted(sent.items()):
        entry = proof.get(backend) if isinstance(proof, dict) else None
        if not isinstance(entry, dict) or entry.get("where") not in ("daemon", "prove_here"):
            return f"it says nothing of where {backend} was proven (evidence.proof)"
        if entry.get("where") == "daemon" and entry.get("fingerprint") != fid:
            return (f"its {backend} proof was made in another environment (fingerprint "
                    f"{entry.get('fingerprint')!r:.24}, this one's {fid})")
    return None


# In order: a record that fails one is not read further.
CHECKS: tuple[Check, ...] = (_schema, _consistent, _answers_question,
                             _proven_in_the_askers_environment)


def check_answer(record: object, question: Question) -> str | None:
    """None when ``record`` is a consistent verdict answering ``question``; else why not."""
    if not isinstance(record, dict):
        return "it is not a JSON object"
    for check in CHECKS:
        try:
            problem = check(record, question)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            problem = f"it is malformed ({type(e).__name__})"
        if problem is not None:
            return problem
    return None


def untrusted(url: str, problem: str) -> str:
    """The one stderr line: which daemon, what is wrong, and that the answer is made here."""
    return (f"gpudiag: the daemon at {url} gave an answer that does not hold ({problem}); "
            "answering with probes run here")
