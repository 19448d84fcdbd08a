"""NVIDIA's XID catalog: every XID -> the code it maps to, its description and the action.

One table, the only place that decides what an XID means to gpudiag (classify looks XIDs
up here; docs/xids.md is generated from it by scripts/gen_xid_docs.py). Source: NVIDIA's
published XID catalog for Ampere and newer GPUs (``SOURCE_URL``), its "Resolution Bucket
(Immediate Action)" column, mapped as ``BUCKET_CODES`` says. XIDs that the catalog marks
"Unused" are informational: current drivers do not log them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field

from gpudiag.core.catalog import BLOCKERS
from gpudiag.core.findings import XidEvent
from gpudiag.core.records import dataclass

SOURCE_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

LOST = "gpu_lost"
RESET = "gpu_reset_required"
REBOOT = "node_reboot_required"
APPLICATION = "gpu_xid_application"
# The codes an XID can map to; None is informational (counted and shown, never a finding).
XID_CODES: tuple[str, ...] = (LOST, RESET, REBOOT, APPLICATION)

# NVIDIA's immediate-action bucket -> (code, what to do). Rows may override both.
_BUCKETS: dict[str, tuple[str | None, str]] = {
    "RESTART_APP": (APPLICATION,
                    "Restart the application; if it recurs, debug it (compute-sanitizer, "
                    "cuda-gdb) before suspecting the GPU."),
    "RESET_GPU": (RESET,
                  "Drain the GPU, stop its processes and reset it (nvidia-smi -r); contact "
                  "the vendor if it recurs."),
    "RESTART_BM": (LOST,
                   "Drain and reboot the node; check PCIe seating, power and cooling if it "
                   "recurs."),
    "RESTART_VM": (REBOOT, "Restart the VM (reboot the node); contact support if it recurs."),
    "CHECK_MECHANICALS": (REBOOT,
                          "Power the node off and connect the GPU's auxiliary power cables."),
    "CHECK_UVM": (REBOOT,
                  "Reload the nvidia-uvm module or reboot the node; may be a sympathetic "
                  "report of another C2C-linked GPU."),
    "UPDATE_SWFW": (None, "Update the vGPU software and firmware."),
    "WORKFLOW_XID_48": (RESET,
                        "Uncorrectable ECC error: reset the GPU (or reboot); check "
                        "nvidia-smi -q -d ECC and the SRAM threshold, RMA if exceeded."),
    "WORKFLOW_NVLINK_ERR": (RESET,
                            "Reset the GPU or reboot the node; check nvidia-smi nvlink; the "
                            "fault may be at the remote end of the link."),
    "WORKFLOW_NVLINK5_ERR": (RESET,
                             "NVLink5 error: reset the GPU; the subcode and XID 154 say whether "
                             "it was fatal; check nvidia-smi nvlink."),
    "WORKFLOW_XID_45": (APPLICATION,
                        "Application torn down (Ctrl-C, kill, reset, or after another XID): "
                        "follow the other XID if there is one."),
    "IGNORE": (None, "No action: informational."),
    "XID_154": (None,
                "Informational: the new recovery action is read from NVML by the nvml probe "
                "(a reset or reboot need blocks there)."),
    "CONTACT_SUPPORT": (None, "Contact NVIDIA support if it is seen."),
    "UNUSED": (None, "Not logged by current drivers; contact NVIDIA support if it is seen."),
    "NONE": (None, "No action in the catalog: informational."),
}

# Buckets whose immediate action is a node reboot (RESTART_BM: "drain and reboot").
REBOOT_BUCKETS = ("RESTART_BM", "RESTART_VM", "CHECK_UVM")

# The daemon holds a blocking XID for xid.hold_s (an hour) because no NVML reading proves a
# repair: every blocking action ends by saying how to release it.
AFTER_REPAIR = ("After the repair run `gpudiag clear --gpu N` (the GPU's index, UUID or PCI "
                "bus id) so that the daemon releases the XID at once.")


def with_clear(code: str | None, action: str) -> str:
    """``action``, ending with how to release the held XID when ``code`` blocks."""
    if code in (LOST, RESET, REBOOT) and "gpudiag clear" not in action:
        return f"{action} {AFTER_REPAIR}"
    return action


BUCKET_CODES: dict[str, tuple[str | None, str]] = {
    bucket: (code, with_clear(code, action)) for bucket, (code, action) in _BUCKETS.items()}


@dataclass(frozen=True)
class XidEntry:
    """One XID of the catalog."""

    xid: int
    mnemonic: str
    description: str
    bucket: str  # NVIDIA's immediate-action resolution bucket (UNUSED for "Unused")
    code: str | None  # what it maps to in gpudiag's catalog; None = informational
    action: str  # what to do
    # False: the XID reports another one's consequence (45: "follow the other XID"); on a
    # GPU with another XID held it adds no finding of its own.
    solo: bool = True
    # The earlier XID this one ends on the same GPU (162 "re-engaged" ends 163 "disengaged").
    cancels: int | None = None
    # Application class only: this many occurrences on one GPU within ``PROMOTION_WINDOW_S``
    # make the warning a blocker (``[xid.promote]`` in the daemon config overrides it).
    promote_after: int | None = None

    @property
    def reboot_heals(self) -> bool:
        """Its action asks for a node reboot (and nothing a reboot cannot do, like cabling):
        held from an earlier boot, a clean fresh pass in this one releases it."""
        return self.code is not None and self.bucket != "CHECK_MECHANICALS" and (
            self.bucket in REBOOT_BUCKETS or self.code == REBOOT)

    @property
    def severity(self) -> str:
        """blocker, warning or info: how the code shows in a verdict."""
        if self.code is None:
            return "info"
        return "warning" if self.code == APPLICATION else "blocker"


_FROM_BUCKET = "from the bucket"


def _e(xid: int, mnemonic: str, description: str, bucket: str,
       code: str | None = _FROM_BUCKET, action: str | None = None, *, solo: bool = True,
       cancels: int | None = None, promote_after: int | None = None) -> XidEntry:
    default_code, default_action = BUCKET_CODES[bucket]
    code = default_code if code == _FROM_BUCKET else code
    return XidEntry(xid, mnemonic, description, bucket, code,
                    with_clear(code, action or default_action), solo, cancels, promote_after)


_RC = "ROBUST_CHANNEL_"
_UNUSED: dict[int, str] = {
    1: _RC + "FIFO_ERROR_FIFO_METHOD", 2: _RC + "FIFO_ERROR_SW_METHOD",
    3: _RC + "FIFO_ERROR_UNK_METHOD", 4: _RC + "FIFO_ERROR_CHANNEL_BUSY",
    5: _RC + "FIFO_ERROR_RUNOUT_OVERFLOW", 6: _RC + "FIFO_ERROR_PARSE_ERR",
    7: _RC + "FIFO_ERROR_PTE_ERR", 9: _RC + "GR_ERROR_INSTANCE",
    10: _RC + "GR_ERROR_SINGLE_STEP", 12: _RC + "GR_ERROR_SW_METHOD",
    15: _RC + "SCANLINE_TIMEOUT", 16: _RC + "VBLANK_CALLBACK_TIMEOUT",
    17: _RC + "PARAMETER_ERROR", 18: _RC + "BUS_MASTER_TIMEOUT_ERROR",
    19: _RC + "DISP_MISSED_NOTIFIER", 20: _RC + "MPEG_ERROR_SW_METHOD",
    21: _RC + "ME_ERROR_SW_METHOD", 22: _RC + "VP_ERROR_SW_METHOD",
    23: _RC + "RC_LOGGING_ENABLED", 24: _RC + "GR_SEMAPHORE_TIMEOUT",
    26: _RC + "FIFO_ERROR_FBISTATE_TIMEOUT", 27: _RC + "VP_ERROR", 28: _RC + "VP2_ERROR",
    29: _RC + "BSP_ERROR", 30: _RC + "BAD_ADDR_ACCESS", 33: _RC + "SEC_ERROR",
    34: _RC + "MSVLD_ERROR", 35: _RC + "MSPDEC_ERROR", 36: _RC + "MSPPP_ERROR",
    42: _RC + "VIC_ERROR", 47: _RC + "NVENC0_ERROR",
    49: "SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY",
    50: "SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR",
    51: "SILENT_RUNNING_STRESS_TEST_FAILURE", 52: "SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE",
    53: "SILENT_RUNNING_TEMP_REDUCED_CLOCKING", 55: "SILENT_RUNNING_TEMPERATURE_READ_ERROR",
    56: "DISPLAY_CHANNEL_EXCEPTION", 57: "FB_LINK_TRAINING_FAILURE_ERROR",
    58: "FB_MEMORY_ERROR", 59: "PMU_ERROR", 61: "PMU_BREAKPOINT",
    65: _RC + "NVENC1_ERROR", 73: _RC + "NVENC2_ERROR", 81: _RC + "VGA_SUBSYSTEM_ERROR",
    87: "NVTELEMETRY_DRIVER_REPORT", 90: "LTC_ERROR", 91: "RESERVED_XID",
    111: "BUNDLE_ERROR_EVENT", 112: "DISP_SUPERVISOR_ERROR", 113: "DP_LT_FAILURE",
    114: "HEAD_RG_UNDERFLOW", 115: "CORE_CHANNEL_REGS", 116: "WINDOW_CHANNEL_REGS",
    117: "CURSOR_CHANNEL_REGS", 118: "HEAD_REGS", 122: "SPI_PMU_RPC_READ_FAIL",
    123: "SPI_PMU_RPC_WRITE_FAIL", 124: "SPI_PMU_RPC_ERASE_FAIL", 125: "INFOROM_FS_ERROR",
    138: _RC + "DLA_ERROR",
}

_APP_DEBUG = ("Debug the application (compute-sanitizer memcheck, cuda-gdb, or "
              "CUDA_DEVICE_WAITS_ON_EXCEPTION=1); file a bug if that is inconclusive.")
_PSHC = "Power smoothing hardware circuitry"

_USED: list[XidEntry] = [
    _e(8, _RC + "FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", "RESTART_APP"),
    _e(11, _RC + "GR_ERROR_MISSING_HW", "Invalid or corrupted push buffer stream",
       "RESTART_APP"),
    _e(13, _RC + "GR_EXCEPTION", "Graphics engine exception (usually an out-of-bounds access "
       "or illegal instruction in the application)", "RESTART_APP", action=_APP_DEBUG,
       promote_after=5),
    _e(14, _RC + "FAKE_ERROR", "Fake or injected error from user space", "IGNORE"),
    _e(25, _RC + "GR_ILLEGAL_NOTIFY", "Invalid or illegal push buffer stream", "RESTART_APP"),
    _e(31, _RC + "FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault (an illegal address access)",
       "RESTART_APP", action=_APP_DEBUG, promote_after=5),
    _e(32, _RC + "PBDMA_ERROR", "Invalid or corrupted push buffer stream (DMA controller fault, "
       "often PCIe quality)", "RESTART_APP"),
    _e(37, _RC + "FECS_ERR_UNIMP_FIRMWARE_METHOD", "Driver firmware error", "IGNORE"),
    _e(38, _RC + "FECS_ERR_WATCHDOG_TIMEOUT", "Driver firmware error", "IGNORE"),
    _e(39, _RC + "CE0_ERROR", "Copy engine exception", "RESTART_APP"),
    _e(40, _RC + "CE1_ERROR", "Copy engine exception", "RESTART_APP"),
    _e(41, _RC + "CE2_ERROR", "Copy engine exception", "RESTART_APP"),
    # NVIDIA: IGNORE (the GPU stays healthy); kept the application warning gpudiag always
    # gave it, since the application that hit it had to terminate.
    _e(43, _RC + "RESETCHANNEL_VERIF_ERROR", "GPU stopped processing (a software-induced "
       "fault ended the application; the GPU stays healthy)", "IGNORE", APPLICATION,
       "Usually an application error: read the job's log.", promote_after=10),
    _e(44, _RC + "GR_FAULT_DURING_CTXSW", "Graphics engine fault during context switch",
       "IGNORE"),
    _e(45, _RC + "PREEMPTIVE_REMOVAL", "Preemptive cleanup after previous errors or an abort",
       "WORKFLOW_XID_45", solo=False),
    _e(46, _RC + "GPU_TIMEOUT_ERROR", "GPU stopped processing", "RESET_GPU"),
    _e(48, _RC + "GPU_ECC_DBE", "Double bit (uncorrectable) ECC error", "WORKFLOW_XID_48"),
    _e(54, "SILENT_RUNNING_PWR_REDUCED_CLOCKING",
       "Auxiliary power is not connected to the GPU board", "CHECK_MECHANICALS"),
    _e(60, _RC + "SEC2_ERROR", "Video processor exception", "RESTART_APP"),
    _e(62, "PMU_HALT_ERROR", "Internal micro-controller halt", "RESET_GPU"),
    _e(63, "INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping (row remap or page "
       "retirement) event", "IGNORE"),
    _e(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", "RESET_GPU"),
    _e(66, _RC + "FECS_ERR_REG_ACCESS_VIOLATION", "Illegal access by driver", "IGNORE"),
    _e(67, _RC + "FECS_ERR_VERIF_VIOLATION", "Illegal access by driver", "IGNORE"),
    _e(68, _RC + "NVDEC0_ERROR", "NVDEC0 exception", "RESTART_APP"),
    _e(69, _RC + "GR_CLASS_ERROR", "Graphics engine class error", "RESTART_APP"),
    _e(70, _RC + "CE3_ERROR", "CE3: unknown error", "RESTART_APP"),
    _e(71, _RC + "CE4_ERROR", "CE4: unknown error", "RESTART_APP"),
    _e(72, _RC + "CE5_ERROR", "CE5: unknown error", "RESTART_APP"),
    _e(74, "NVLINK_ERROR", "NVLink error", "WORKFLOW_NVLINK_ERR"),
    _e(75, _RC + "CE6_ERROR", "CE6: unknown error", "RESTART_APP"),
    _e(76, _RC + "CE7_ERROR", "CE7: unknown error", "RESTART_APP"),
    _e(77, _RC + "CE8_ERROR", "CE8: unknown error", "RESTART_APP"),
    _e(78, "VGPU_START_ERROR", "vGPU start error", "UPDATE_SWFW"),
    _e(79, _RC + "GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", "RESTART_BM"),
    _e(80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", "Corrupted data sent to GPU", "RESTART_APP"),
    _e(82, _RC + "NVJPG0_ERROR", "NVJPG0 error", "RESTART_APP"),
    _e(83, _RC + "NVDEC1_ERROR", "NVDEC1 error", "RESTART_APP"),
    _e(84, _RC + "NVDEC2_ERROR", "NVDEC2 error", "RESTART_APP"),
    _e(85, _RC + "CE9_ERROR", "CE9: unknown error", "RESTART_APP"),
    _e(86, _RC + "OFA0_ERROR", "OFA exception", "RESTART_APP"),
    _e(88, _RC + "NVDEC3_ERROR", "NVDEC3 error", "RESTART_APP"),
    _e(89, _RC + "NVDEC4_ERROR", "NVDEC4 error", "RESTART_APP"),
    _e(92, "EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate", "IGNORE"),
    _e(93, "INFOROM_ERASE_LIMIT_EXCEEDED", "Non-fatal violation of the provisioned InfoROM "
       "wear limit", "IGNORE",
       action="Clear the InfoROM erase limit with nvflash --elsessionclear."),
    _e(94, _RC + "CONTAINED_ERROR", "Contained memory error (one application affected)",
       "RESTART_APP", action="Restart the affected application; reset the GPU when "
       "convenient."),
    _e(95, _RC + "UNCONTAINED_ERROR", "Uncontained memory error (several applications "
       "affected)", "RESET_GPU"),
    _e(96, _RC + "NVDEC5_ERROR", "NVDEC5 error", "RESTART_APP"),
    _e(97, _RC + "NVDEC6_ERROR", "NVDEC6 error", "RESTART_APP"),
    _e(98, _RC + "NVDEC7_ERROR", "NVDEC7 error", "RESTART_APP"),
    _e(99, _RC + "NVJPG1_ERROR", "NVJPG1 error", "RESTART_APP"),
    _e(100, _RC + "NVJPG2_ERROR", "NVJPG2 error", "RESTART_APP"),
    _e(101, _RC + "NVJPG3_ERROR", "NVJPG3 error", "RESTART_APP"),
    _e(102, _RC + "NVJPG4_ERROR", "NVJPG4 error", "RESTART_APP"),
    _e(103, _RC + "NVJPG5_ERROR", "NVJPG5 error", "RESTART_APP"),
    _e(104, _RC + "NVJPG6_ERROR", "NVJPG6 error", "RESTART_APP"),
    _e(105, _RC + "NVJPG7_ERROR", "NVJPG7 error", "RESTART_APP"),
    _e(106, "SMBPBI_TEST_MESSAGE", "SMBPBI test message", "IGNORE"),
    _e(107, "SMBPBI_TEST_MESSAGE_SILENT", "SMBPBI test message (silent)", "IGNORE"),
    _e(108, "NVLINK_REMOTE_TRANSLATION_ERROR", "Unused", "IGNORE"),
    _e(109, _RC + "CTXSW_TIMEOUT_ERROR", "Context switch timeout error", "RESET_GPU"),
    _e(110, "SEC_FAULT_ERROR", "Security fault error", "RESET_GPU", REBOOT,
       "Revert recent hardware changes and cold-reset (power cycle) the node; contact the "
       "vendor if it persists."),
    _e(119, "GSP_RPC_TIMEOUT", "GSP RPC timeout", "RESET_GPU"),
    _e(120, "GSP_ERROR", "GSP error", "RESET_GPU"),
    _e(121, "C2C_ERROR", "Corrected errors on the C2C NVLink to a Grace CPU", "IGNORE",
       action="No operational impact; reset the GPU at a service window to retrain the link."),
    *[_e(126 + k, f"{_RC}CE{10 + k}_ERROR", f"CE{10 + k}: unknown error", "RESTART_APP")
      for k in range(10)],
    _e(136, "ALI_TRAINING_FAIL", "NVLink link training failed", "RESET_GPU"),
    _e(137, "NVLINK_PRIV_ERR", "NVLink privilege error (illegal peer-to-peer access)",
       "IGNORE", action=_APP_DEBUG),
    _e(139, _RC + "OFA1_ERROR", "OFA1 error", "RESTART_APP"),
    _e(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC unrecovered error", "RESET_GPU"),
    _e(141, _RC + "FAST_PATH_ERROR", "CUDA fast path error", "IGNORE"),
    _e(142, _RC + "NVENC3_ERROR", "NVENC3 error", "CONTACT_SUPPORT"),
    _e(143, "GPU_INIT_ERROR", "GPU initialization error", "RESET_GPU"),
    _e(144, "NVLINK_SAW_ERROR", "NVLink: SAW error", "WORKFLOW_NVLINK5_ERR"),
    _e(145, "NVLINK_RLW_ERROR", "NVLink: RLW error", "WORKFLOW_NVLINK5_ERR"),
    _e(146, "NVLINK_TLW_ERROR", "NVLink: TLW error", "WORKFLOW_NVLINK5_ERR"),
    _e(147, "NVLINK_TREX_ERROR", "NVLink: TREX error", "WORKFLOW_NVLINK5_ERR"),
    _e(148, "NVLINK_NVLPW_CTRL_ERROR", "NVLink: NVLPW_CTRL error", "WORKFLOW_NVLINK5_ERR"),
    _e(149, "NVLINK_NETIR_ERROR", "NVLink: NETIR error", "WORKFLOW_NVLINK5_ERR"),
    _e(150, "NVLINK_MSE_ERROR", "NVLink: MSE error", "WORKFLOW_NVLINK5_ERR"),
    _e(151, _RC + "KEY_ROTATION_ERROR", "Key rotation error", "RESTART_VM"),
    _e(152, _RC + "DLA_SMMU_ERROR", "DLA SMMU error", "IGNORE"),
    _e(153, _RC + "DLA_TIMEOUT", "DLA timeout error", "IGNORE"),
    _e(154, "GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed (summarizes the "
       "recovery another XID needs)", "XID_154"),
    _e(155, "NVLINK_SW_DEFINED_ERROR", "NVLink: software-defined error (an intentional link "
       "down)", "RESET_GPU"),
    _e(156, "RESOURCE_RETIREMENT_EVENT", "Resource retirement event", "RESET_GPU"),
    _e(157, "RESOURCE_RETIREMENT_FAILURE", "Resource retirement failure (no spare resources "
       "left; the XID may recur)", "IGNORE"),
    _e(158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", "RESET_GPU"),
    _e(159, _RC + "CHI_NON_DATA_ERROR", "CHI non-data error", "CHECK_UVM"),
    _e(160, "CHANNEL_RETIREMENT_EVENT", "Channel retirement event", "IGNORE"),
    _e(161, "CHANNEL_RETIREMENT_FAILURE", "Channel retirement failure", "IGNORE"),
    # 162-172 have no resolution bucket in the catalog yet; mapped from their descriptions.
    _e(162, "PSHC_REENGAGED", f"{_PSHC} capability re-engaged", "NONE", cancels=163),
    _e(163, "PSHC_DISENGAGED", f"{_PSHC} capability disengaged", "NONE",
       action="No GPU reset needed; resolve the thermal events if power smoothing is wanted."),
    _e(164, "PSHC_LOW_LIFETIME", f"{_PSHC} low lifetime reached", "NONE",
       action="Monitor power swings; power smoothing will be disabled soon."),
    _e(165, "PSHC_ZERO_LIFETIME", f"{_PSHC} lifetime exhausted", "NONE",
       action="Power smoothing is disabled; replace the GPU if power swings are unacceptable."),
    _e(166, "NVLINK_SECURE_CRYPTO_ERR", "Confidential-computing traffic before the link was "
       "configured for encryption", "NONE"),
    _e(167, "PCIE_FATAL_TIMEOUT", "PCIe fatal timeout", "NONE", RESET,
       BUCKET_CODES["RESET_GPU"][1]),
    _e(168, "REDUCED_GPU_MEMORY_CAPACITY", "Errors found in the write-protected region (WPR)",
       "NONE", REBOOT, "Enable ECC (row remapping) or reboot so the WPR is shifted."),
    _e(169, "SEC2_HALT_ERROR", "Internal micro-controller halt", "NONE", RESET,
       BUCKET_CODES["RESET_GPU"][1]),
    _e(170, "NVLINK_SECURE_OTHER", "Interrupt seen in confidential-computing mode", "NONE"),
    _e(171, "UNCORRECTABLE_DRAM_ERROR", "Uncorrectable DRAM error (details of an XID 48)",
       "NONE", RESET, BUCKET_CODES["WORKFLOW_XID_48"][1]),
    _e(172, "UNCORRECTABLE_SRAM_ERROR", "Uncorrectable SRAM error (details of an XID 48)",
       "NONE", RESET, BUCKET_CODES["WORKFLOW_XID_48"][1]),
]

XIDS: dict[int, XidEntry] = dict(sorted(
    [(e.xid, e) for e in _USED]
    + [(x, _e(x, m, "Unused", "UNUSED")) for x, m in _UNUSED.items()]))


def xid_entry(xid: int) -> XidEntry | None:
    """The catalog row of an XID, or None when NVIDIA's catalog does not list it."""
    return XIDS.get(xid)


def xid_code(xid: int) -> str | None:
    """The code an XID maps to (None: informational or not in the catalog)."""
    found = XIDS.get(xid)
    return found.code if found is not None else None


def fatal_xid(xid: int) -> bool:
    """Whether an XID is a device fault (its code is a blocker: the GPU is lost or needs a
    reset), not a job's own (13, 31, 43, 45: gpu_xid_application, a warning) nor
    informational."""
    code = xid_code(xid)
    return code is not None and code in BLOCKERS


def xid_description(xid: int) -> str:
    """The catalog's description of an XID, for messages."""
    found = XIDS.get(xid)
    return found.description if found is not None else "not in NVIDIA's XID catalog"


# -- from held XIDs to findings: the catalog's semantics, not one code at a time ----------------
PROMOTION_WINDOW_S = 3600.0
PROMOTED_CODE = RESET  # an application XID that keeps coming back on one GPU points at the GPU


@dataclass(frozen=True)
class Promotion:
    """An application XID seen ``count`` times on one GPU within ``window_s`` blocks it."""

    count: int
    window_s: float = PROMOTION_WINDOW_S


DEFAULT_PROMOTIONS: dict[int, Promotion] = {
    e.xid: Promotion(e.promote_after) for e in XIDS.values() if e.promote_after is not None}


@dataclass(frozen=True)
class XidRules:
    """How held XIDs become findings (the daemon's ``[xid.promote]`` fills ``promotions``)."""

    promotions: Mapping[int, Promotion] = field(default_factory=lambda: dict(DEFAULT_PROMOTIONS))


@dataclass(frozen=True)
class JudgedXid:
    """One (GPU, XID) among the held XIDs, and what it makes of its GPU."""

    event: XidEvent  # the latest occurrence
    code: str
    occurrences: int  # held occurrences on this GPU (a folded storm is one)
    promoted: Promotion | None = None  # set when the count made an application XID block


def _gpu(event: XidEvent) -> tuple[str | None, int | None]:
    return (event.uuid, None) if event.uuid else (None, event.device_index)


def judge_xids(events: Sequence[XidEvent], rules: XidRules | None = None) -> list[JudgedXid]:
    """At most one judgement per (GPU, XID): a cancelled XID is gone (163 then 162), a
    not-solo XID (45) beside another XID with a code on its GPU adds nothing (that one says
    what happened), and an application XID seen often enough in its window is promoted."""
    rules = rules if rules is not None else XidRules()
    ordered = sorted(events, key=lambda x: x.timestamp)
    kept: list[XidEvent] = []
    for x in ordered:
        entry = XIDS.get(x.xid)
        if entry is not None and entry.cancels is not None:
            kept = [k for k in kept if not (k.xid == entry.cancels and _gpu(k) == _gpu(x))]
        kept.append(x)
    groups: dict[tuple[tuple[str | None, int | None], int], list[XidEvent]] = {}
    for x in kept:
        groups.setdefault((_gpu(x), x.xid), []).append(x)
    coded = {key for key in groups
             if (e := XIDS.get(key[1])) is not None and e.code is not None and e.solo}
    judged: list[JudgedXid] = []
    for (gpu, xid), group in groups.items():
        entry = XIDS.get(xid)
        if entry is None or entry.code is None:
            continue
        if not entry.solo and any(g == gpu for g, _ in coded):
            continue
        latest = group[-1]
        rule = rules.promotions.get(xid) if entry.code == APPLICATION else None
        if rule is not None and rule.count > 0 and sum(
                1 for g in group if latest.timestamp - g.timestamp <= rule.window_s
        ) >= rule.count:
            judged.append(JudgedXid(latest, PROMOTED_CODE, len(group), rule))
        else:
            judged.append(JudgedXid(latest, entry.code, len(group)))
    return judged
