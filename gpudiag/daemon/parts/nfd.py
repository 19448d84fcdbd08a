"""The NFD part: node-feature-discovery labels from each snapshot (daemon/nfd.py)."""

from __future__ import annotations

from gpudiag.daemon.nfd import NfdFeatureFile
from gpudiag.daemon.part import BasePart, Listens, PartContext
from gpudiag.daemon.parts.incidents import IncidentsPart
from gpudiag.daemon.snapshot import Snapshot


class NfdPart(BasePart):
    """Writes ``nfd_features_file`` when one is configured."""

    name = "nfd"
    config_keys = ("nfd_features_file", "nfd_expiry_s")

    def __init__(self) -> None:
        self.file: NfdFeatureFile | None = None

    def build(self, context: PartContext) -> None:
        cfg = context.cfg
        if cfg.nfd_features_file is not None:
            tracker = context.part(IncidentsPart).tracker  # the label gpudiag.incident
            self.file = NfdFeatureFile(cfg.nfd_features_file, cfg.nfd_expiry_s,
                                       incident=tracker.id_for if tracker else None)

    def listens(self) -> Listens:
        return Listens(snapshots=self._label) if self.file is not None else Listens()

    def _label(self, snap: Snapshot) -> None:
        assert self.file is not None
        self.file.update(snap)
