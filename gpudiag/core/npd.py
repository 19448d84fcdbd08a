"""node-problem-detector's custom-plugin contract, as gpudiag answers it (pure: no I/O).

NPD runs a plugin and reads its exit code (0 OK, 1 NonOK: the condition turns True, 2
Unknown) and the first ``max_output_length`` characters of its stdout as the condition's
message. gpudiag answers the node-health question there: a busy node is healthy in use, and
gpudiag not answering is not a broken GPU (Unknown, never NonOK).

On Kubernetes the answer travels through a status file (docs/operations.md "node-problem-
detector"): ``gpudiag npd-relay`` in a sidecar of NPD's pod asks the daemon and writes it;
the plugin in NPD's container (deploy/kubernetes/npd/gpudiag-npd.sh, bash builtins only)
reads it. The file, schema ``gpudiag.npd/1``, is two lines::

    gpudiag.npd/1 WRITTEN_AT_EPOCH_S EXIT_CODE
    MESSAGE
"""

from __future__ import annotations

from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Verdict

NPD_OK, NPD_PROBLEM, NPD_UNKNOWN = 0, 1, 2
# deploy/kubernetes/npd/gpudiag-plugin.json's max_output_length: NPD cuts the message there.
MAX_MESSAGE_CHARS = 80
STATUS_SCHEMA = "gpudiag.npd/1"
# Where the sidecar writes the status file and the plugin reads it: an emptyDir both
# containers of NPD's pod mount (deploy/kubernetes/npd/daemonset-patch.yaml).
DEFAULT_STATUS_FILE = "/run/gpudiag/npd/status"
# Blocked, but nothing known broken: never NonOK. The same codes as the Slurm scripts'
# GPUDIAG_NOT_BROKEN_CODES default (deploy/slurm/gpudiag-common.sh; a test keeps them equal).
NOT_BROKEN_CODES = frozenset({"backend_unproven", "devices_busy", "lock_timeout"})


@dataclass(frozen=True)
class NpdAnswer:
    """What the plugin tells NPD: its exit code and its one-line message."""

    exit_code: int
    message: str


def _cut(text: str) -> str:
    """One line of at most MAX_MESSAGE_CHARS printable ASCII characters: what NPD keeps."""
    line = "".join(c if " " <= c <= "~" else " " for c in text).strip()
    if len(line) <= MAX_MESSAGE_CHARS:
        return line
    return line[:MAX_MESSAGE_CHARS - 3].rstrip() + "..."


def from_verdict(verdict: Verdict) -> NpdAnswer:
    """A node-health verdict as NPD's answer: ready OK, a fault NonOK, not-broken Unknown.

    With the daemon's open incident in the evidence (core.incident), a fault's message is
    ``<incident id>: <its reason>``: the same for the whole incident (codes joining it change
    nothing, so NPD's condition keeps its transition time), and the id the history, the
    metrics and the NFD label carry."""
    code = verdict.gpu_validation_blocker
    if verdict.ready:
        return NpdAnswer(NPD_OK, "gpudiag: ready")
    if code in NOT_BROKEN_CODES:
        return NpdAnswer(NPD_UNKNOWN, _cut(f"gpudiag: {code} (nothing known broken)"))
    incident = verdict.evidence.get("incident")
    if isinstance(incident, dict) and incident.get("open") is True and isinstance(
            incident.get("id"), str) and isinstance(incident.get("code"), str):
        return NpdAnswer(NPD_PROBLEM, _cut(f"{incident['id']}: {incident['code']}"))
    return NpdAnswer(NPD_PROBLEM, _cut(f"gpudiag: {code}"))


def without_answer(reason: str, *, refused: bool = False, untrusted: bool = False
                   ) -> NpdAnswer:
    """Unknown, when the daemon gave no usable answer. The message names the kind only (a
    stable message: NPD updates the condition whenever it changes); the reason is logged."""
    if refused:
        what = "refused an answer not from the daemon's user"
    elif untrusted:
        what = "the daemon's answer did not hold"
    elif reason.startswith("no daemon at "):
        what = "daemon not answering on its socket"
    elif " answered 503 " in reason:
        what = "daemon has no answer yet (first probe round)"
    elif " did not answer" in reason:
        what = "daemon did not answer in time"
    else:
        what = "no usable daemon answer (see the relay's log)"
    return NpdAnswer(NPD_UNKNOWN, _cut(f"gpudiag: {what}"))


def status_text(answer: NpdAnswer, written_at_s: float) -> str:
    """The status file's text for ``answer``, written at ``written_at_s`` (epoch seconds)."""
    return f"{STATUS_SCHEMA} {int(written_at_s)} {answer.exit_code}\n{_cut(answer.message)}\n"
