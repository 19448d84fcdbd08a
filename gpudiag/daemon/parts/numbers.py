"""The numbers part: time to detect, catch rate, false blockers (daemon/numbers.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from prometheus_client.registry import Collector

from gpudiag.daemon.numbers import Numbers, NumbersCollector
from gpudiag.daemon.part import BasePart, Cleared, Listens, PartContext
from gpudiag.daemon.store import HistoryError, HistoryStore


class NumbersPart(BasePart):
    """Fed by the XIDs, the verdicts, the clears and (through the runs part) the jobs."""

    name = "numbers"
    metrics = ("gpudiag_fault_to_verdict_seconds", "gpudiag_faults",
               "gpudiag_faults_flagged_before_xid", "gpudiag_false_blockers",
               "gpudiag_gpu_incident_interval_seconds", "gpudiag_job_gpu_energy_joules",
               "gpudiag_preflight_blocks")

    def __init__(self) -> None:
        self.numbers = Numbers()

    def build(self, context: PartContext) -> None:
        """Each serial's last incident from the history, so that a restart keeps intervals."""
        store = context.recorder.store
        if isinstance(store, HistoryStore):
            with contextlib.suppress(HistoryError):  # intervals then start afresh
                self.numbers.seed_incidents(store.incident_times())

    def listens(self) -> Listens:
        return Listens(snapshots=self.numbers.verdict, xids=self.numbers.fault,
                       clears=self._cleared)

    def collectors(self) -> Sequence[Collector]:
        return (NumbersCollector(self.numbers.state),)

    def _cleared(self, cleared: Cleared) -> list[str]:
        return self.numbers.cleared(cleared.gpu, cleared.no_repair)
