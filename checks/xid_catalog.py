"""NVIDIA's Xid catalog as data: what each Xid means and what gpumon does about it.

Facts (mnemonic, NVIDIA's immediate action, workflow) are NVIDIA's, re-tabulated; the
one-line descriptions are our own words. The table covers every code of the Xid table in
the team's research note (shared/reference/xid-catalog.md, copied to
tests/data/xid-catalog.md); ``tests/checks/test_xid_catalog.py`` keeps the two in step.

This module only says what a single Xid means: the table, and the decode rules of the two
NVLink workflows (``decode_xid74``, ``decode_nvlink5``), which read one line's register
words. Counting, storms, "same GPU or many GPUs", repeats on one link and the root Xid
behind a Xid 45 are the xid check's business, not this module's.

Mapping from NVIDIA's immediate action to gpumon (applied by ``_verdict`` below):

    NVIDIA immediate action      gpumon severity / action
    ---------------------------  -------------------------------------------------------
    RESTART_APP                  WARN / RESTART_APP  (the GPU is fine, the application
                                 faulted; a storm on one GPU is escalated by the check)
    IGNORE                       OK / NONE
    RESET_GPU                    FAIL / RESET_GPU
    RESTART_BM (Xid 79)          FAIL / REBOOT_NODE
    RESTART_VM                   FAIL / REBOOT_NODE
    CONTACT_SUPPORT (immediate)  FAIL / INSPECT_HARDWARE  (Xid 56, 57, 58, 81)
    CHECK_MECHANICALS (Xid 54)   FAIL / INSPECT_HARDWARE
    CHECK_UVM (Xid 159)          WARN / RESTART_APP
    WORKFLOW_XID_45              OK / NONE, workflow XID_45 (the check follows the root Xid)
    WORKFLOW_XID_48              FAIL / RESET_GPU, workflow XID_48
    WORKFLOW_NVLINK_ERR (74)     FAIL / RESET_GPU, workflow NVLINK_ERR
    WORKFLOW_NVLINK5_ERR         FAIL / RESET_GPU, workflow NVLINK5_ERR (default; the check
      (144-150)                  refines it from the Fatal/Nonfatal word of the line)
    XID_154                      OK / NONE, workflow XID_154 (act on the Xid it accompanies)

Per-code exceptions (``_OVERRIDES``), each backed by NVIDIA's own documentation:

    63   IGNORE in the catalog, but the event means a row remap is *pending*, and NVIDIA's
         memory-error-management guide and NVML both say a GPU reset is needed for the
         remap to take effect -> WARN / RESET_GPU (schedule, do not rush).
    64   RESET_GPU / CONTACT_SUPPORT in the catalog; a row-remapping failure is the RMA
         criterion of NVIDIA's GPU memory error management guide
         (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/index.html, "RMA Policy
         Thresholds for Row Remapping"; awslabs/awsome-distributed-ai PR #1190 moved it to
         an isolate/RMA action for the same reason) -> FAIL / INSPECT_HARDWARE. Inspection
         outranks a reset (worst action wins), so the catalog's reset is not lost.
    171, 172  no action in the catalog (newest codes); they detail an Xid 48 (DRAM / SRAM
         uncorrectable error) -> FAIL / RESET_GPU like the Xid 48 they accompany.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gpumon.model import Action, Severity

CATALOG_SOURCE = (
    "NVIDIA XID catalog, https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html "
    "(also https://docs.nvidia.com/deploy/xid-errors/index.html), read through the machine-generated "
    "mirror leptonai/gpud components/accelerator/nvidia/xid/catalog_generated.go (generated 2025-10-29) "
    "at commit 4a8de33a3f02e207f39e9023d67125592d599731"
)


@dataclass(frozen=True)
class XidInfo:
    code: int
    mnemonic: str  # NVIDIA's mnemonic
    description: str  # one line, our words
    severity: Severity  # what gpumon reports for one occurrence
    action: Action  # gpumon's remedy vocabulary
    nvidia_action: str  # NVIDIA's immediate action token ("" where the catalog gives none)
    workflow: str | None  # NVIDIA workflow the check must run, e.g. "XID_48", "NVLINK5_ERR"


_BY_NVIDIA_ACTION: Mapping[str, tuple[Severity, Action]] = MappingProxyType(
    {
        "RESTART_APP": (Severity.WARN, Action.RESTART_APP),
        "IGNORE": (Severity.OK, Action.NONE),
        "RESET_GPU": (Severity.FAIL, Action.RESET_GPU),
        "RESTART_BM": (Severity.FAIL, Action.REBOOT_NODE),
        "RESTART_VM": (Severity.FAIL, Action.REBOOT_NODE),
        "CONTACT_SUPPORT": (Severity.FAIL, Action.INSPECT_HARDWARE),
        "CHECK_MECHANICALS": (Severity.FAIL, Action.INSPECT_HARDWARE),
        "CHECK_UVM": (Severity.WARN, Action.RESTART_APP),
        "WORKFLOW_XID_45": (Severity.OK, Action.NONE),
        "WORKFLOW_XID_48": (Severity.FAIL, Action.RESET_GPU),
        "WORKFLOW_NVLINK_ERR": (Severity.FAIL, Action.RESET_GPU),
        "WORKFLOW_NVLINK5_ERR": (Severity.FAIL, Action.RESET_GPU),
        "XID_154": (Severity.OK, Action.NONE),
    }
)

# Codes whose gpumon verdict is not the plain mapping of NVIDIA's immediate action
# (reasons in the module docstring).
_OVERRIDES: Mapping[int, tuple[Severity, Action]] = MappingProxyType(
    {
        63: (Severity.WARN, Action.RESET_GPU),
        64: (Severity.FAIL, Action.INSPECT_HARDWARE),
        171: (Severity.FAIL, Action.RESET_GPU),
        172: (Severity.FAIL, Action.RESET_GPU),
    }
)

# (code, NVIDIA mnemonic, NVIDIA immediate action, workflow, our one-line description)
# fmt: off
_ROWS: tuple[tuple[int, str, str, str | None, str], ...] = (
    (8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "RESTART_APP", None,
     "Channel idle timeout: the GPU stopped processing the application's work."),
    (11, "ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "RESTART_APP", None,
     "Malformed command (push buffer) stream from the application or driver."),
    (13, "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY", "RESTART_APP", "XID_13",
     "Graphics/compute engine exception (illegal address or instruction), usually an application bug."),
    (14, "ROBUST_CHANNEL_FAKE_ERROR", "IGNORE", None,
     "Test error injected by the driver (RC logging test); informational."),
    (25, "ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", "RESTART_APP", None,
     "Illegal notify in the command stream; application or driver software fault."),
    (31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP", "XID_31",
     "GPU MMU page fault: the application touched an unmapped virtual address."),
    (32, "ROBUST_CHANNEL_PBDMA_ERROR", "RESTART_APP", None,
     "PBDMA error: invalid or corrupted command stream, possibly after DMA/PCIe corruption."),
    (37, "ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD", "IGNORE", None,
     "Context-switch microcontroller hit an unimplemented firmware method; driver firmware fault."),
    (38, "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "IGNORE", None,
     "Context-switch microcontroller watchdog timeout; driver firmware fault."),
    (39, "ROBUST_CHANNEL_CE0_ERROR", "RESTART_APP", None,
     "Copy engine 0 exception while running the application's work."),
    (43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE", None,
     "Channel reset verification after an application fault (usually follows Xid 13 or 31)."),
    (44, "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "IGNORE", None,
     "Graphics engine fault during a context switch."),
    (45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45", "XID_45",
     "Preemptive channel cleanup caused by an earlier error; the root Xid says what to do."),
    (46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "RESET_GPU", None,
     "GPU-level timeout: the GPU stopped processing."),
    (48, "ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48", "XID_48",
     "Uncorrectable (double-bit) ECC error in GPU memory; row remapping decides the outcome."),
    (54, "SILENT_RUNNING_PWR_REDUCED_CLOCKING", "CHECK_MECHANICALS", None,
     "Auxiliary power missing or power-reduced clocking: power cabling or mechanical fault."),
    (56, "DISPLAY_CHANNEL_EXCEPTION", "CONTACT_SUPPORT", None,
     "Display engine channel exception; not expected on a data-center GPU."),
    (57, "FB_LINK_TRAINING_FAILURE_ERROR", "CONTACT_SUPPORT", None,
     "Framebuffer memory link training failed."),
    (58, "FB_MEMORY_ERROR", "CONTACT_SUPPORT", None,
     "Framebuffer memory error."),
    (62, "PMU_HALT_ERROR", "RESET_GPU", None,
     "Internal power-management microcontroller (PMU) halted."),
    (63, "INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE", None,
     "A memory row was marked for remapping (or a page retired); it takes effect at the next GPU reset."),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU", None,
     "Recording a memory row remap failed; NVIDIA's RMA criterion for GPU memory."),
    (68, "ROBUST_CHANNEL_NVDEC0_ERROR", "RESTART_APP", None,
     "Video decoder (NVDEC0) exception."),
    (69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "RESTART_APP", None,
     "Graphics engine class error (invalid class or BAR1 access failure)."),
    (74, "NVLINK_ERROR", "WORKFLOW_NVLINK_ERR", "NVLINK_ERR",
     "NVLink error on an NVLink 3/4 GPU; its register words tell link, ECC and mechanical faults apart."),
    (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM", None,
     "The GPU fell off the bus: the driver lost PCIe access to it."),
    (80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", "RESTART_APP", None,
     "Push buffer CRC mismatch: corrupted data was sent to the GPU."),
    (81, "ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR", "CONTACT_SUPPORT", None,
     "VGA subsystem error; not expected on a data-center GPU."),
    (92, "EXCESSIVE_SBE_INTERRUPTS", "IGNORE", None,
     "High rate of corrected single-bit ECC errors."),
    (93, "INFOROM_ERASE_LIMIT_EXCEEDED", "IGNORE", None,
     "InfoROM erase (wear) limit exceeded."),
    (94, "ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP", None,
     "Contained uncorrectable memory error: only the applications that used the bad memory are hit."),
    (95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU", None,
     "Uncontained uncorrectable memory error: all work on the GPU is hit and the GPU needs a reset."),
    (109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "RESET_GPU", None,
     "Context-switch timeout."),
    (110, "SEC_FAULT_ERROR", "RESET_GPU", None,
     "Security fault."),
    (119, "GSP_RPC_TIMEOUT", "RESET_GPU", None,
     "The GSP firmware did not answer a driver RPC in time."),
    (120, "GSP_ERROR", "RESET_GPU", None,
     "GSP firmware error."),
    (121, "C2C_ERROR", "IGNORE", None,
     "Chip-to-chip (C2C) link error on a Grace-attached GPU."),
    (136, "ALI_TRAINING_FAIL", "RESET_GPU", None,
     "NVLink link training (ALI) failed."),
    (137, "NVLINK_PRIV_ERR", "IGNORE", None,
     "NVLink fabric-address (FLA) privilege error."),
    (140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "RESET_GPU", None,
     "An uncorrectable ECC error escaped containment."),
    (143, "GPU_INIT_ERROR", "RESET_GPU", None,
     "GPU initialization failed."),
    (144, "NVLINK_SAW_ERROR", "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR",
     "NVLink5 SAW unit error; severity depends on the error-status word."),
    (145, "NVLINK_RLW_ERROR", "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR",
     "NVLink5 RLW unit error; mostly non-fatal, some error statuses fatal."),
    (146, "NVLINK_TLW_ERROR", "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR",
     "NVLink5 TLW unit error; severity depends on the error-status word."),
    (147, "NVLINK_TREX_ERROR", "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR",
     "NVLink5 TREX unit error; severity depends on the error-status word."),
    (148, "NVLINK_NVLPW_CTRL_ERROR", "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR",
     "NVLink5 NVLPW_CTRL unit error; severity depends on the error-status word."),
    (149, "NVLINK_NETIR_ERROR", "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR",
     "NVLink5 NETIR error: link-down events are link-fatal, bit-error-rate events non-fatal."),
    (150, "NVLINK_MSE_ERROR", "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR",
     "NVLink5 MSE (management firmware) watchdog."),
    (151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", "RESTART_VM", None,
     "Confidential-computing key rotation error."),
    (154, "GPU_RECOVERY_ACTION_CHANGED", "XID_154", "XID_154",
     "Informational: the recovery action the GPU needs for another Xid changed."),
    (155, "NVLINK_SW_DEFINED_ERROR", "RESET_GPU", None,
     "NVLink software-defined error."),
    (156, "RESOURCE_RETIREMENT_EVENT", "RESET_GPU", None,
     "Resource retirement event."),
    (157, "RESOURCE_RETIREMENT_FAILURE", "IGNORE", None,
     "Resource retirement failure."),
    (158, "GPU_FATAL_TIMEOUT", "RESET_GPU", None,
     "GPU fatal timeout."),
    (159, "ROBUST_CHANNEL_CHI_NON_DATA_ERROR", "CHECK_UVM", None,
     "Coherent-interconnect (CHI) non-data error on a Grace system; check Unified Memory use."),
    (160, "CHANNEL_RETIREMENT_EVENT", "IGNORE", None,
     "Channel retirement event."),
    (161, "CHANNEL_RETIREMENT_FAILURE", "IGNORE", None,
     "Channel retirement failure."),
    (171, "UNCORRECTABLE_DRAM_ERROR", "", None,
     "Uncorrectable DRAM error (detail accompanying an Xid 48)."),
    (172, "UNCORRECTABLE_SRAM_ERROR", "", None,
     "Uncorrectable SRAM error (detail accompanying an Xid 48)."),
)
# fmt: on


def _verdict(code: int, nvidia_action: str) -> tuple[Severity, Action]:
    override = _OVERRIDES.get(code)
    if override is not None:
        return override
    try:
        return _BY_NVIDIA_ACTION[nvidia_action]
    except KeyError:
        raise ValueError(f"Xid {code}: no gpumon rule for NVIDIA action {nvidia_action!r}") from None


def _build() -> Mapping[int, XidInfo]:
    table: dict[int, XidInfo] = {}
    for code, mnemonic, nvidia_action, workflow, description in _ROWS:
        if code in table:
            raise ValueError(f"Xid {code} listed twice")
        severity, action = _verdict(code, nvidia_action)
        table[code] = XidInfo(
            code=code,
            mnemonic=mnemonic,
            description=description,
            severity=severity,
            action=action,
            nvidia_action=nvidia_action,
            workflow=workflow,
        )
    return MappingProxyType(table)


XID_CATALOG: Mapping[int, XidInfo] = _build()


def lookup(code: int) -> XidInfo | None:
    """The catalog entry for ``code``, or None for a code NVIDIA's catalog does not list."""
    return XID_CATALOG.get(code)


# -- WORKFLOW_NVLINK_ERR (Xid 74, NVLink 3/4) -------------------------------------------
#
# NVIDIA's catalog: split the seven hex words of the line; on Hopper the first, third, fourth
# and fifth are populated. Our notes (shared/reference/xid-catalog.md, WORKFLOW_NVLINK_ERR,
# quoting NVIDIA's text as given in NVIDIA/NVSentinel#364) give the bit classes of the FIRST
# word only, so only that word is decoded; anything else set keeps the catalog default
# (FAIL / RESET_GPU: the line says the link took a fatal error and a reset retrains it).

XID74_BITS: Mapping[str, frozenset[int]] = MappingProxyType({
    # "Can be safely ignored."
    "ignorable": frozenset({0, 23, 30}),
    # "Generally sympathetic or secondary errors": follow the other Xid/SXid seen with them.
    "sympathetic": frozenset({1, 20}),
    # "Likely HW issue with ECC/Parity": more than 2 times on the same link -> hardware.
    "ecc_parity": frozenset({4, 5}),
    # "Could possibly be a HW issue: check link mechanical connections and re-seat".
    "mechanical": frozenset({8, 9, 12, 16, 17, 24, 28}),
    # "Marginal channel SI issue": check link mechanical connections, run field diags.
    "marginal_si": frozenset({21, 22}),
})
# NVIDIA: ECC/parity bits "seen more than 2 times on the same link" -> report (hardware).
XID74_ECC_REPEAT_LIMIT = 2

_XID74_VERDICT: Mapping[str, tuple[Severity, Action]] = MappingProxyType({
    "ignorable": (Severity.WARN, Action.NONE),
    "sympathetic": (Severity.WARN, Action.NONE),
    "ecc_parity": (Severity.FAIL, Action.RESET_GPU),
    "mechanical": (Severity.FAIL, Action.CHECK_CABLES),
    "marginal_si": (Severity.FAIL, Action.CHECK_CABLES),
})


@dataclass(frozen=True)
class Xid74Decode:
    """One Xid 74 line's first register word, read with NVIDIA's bit classes."""

    classes: tuple[str, ...]  # bit classes present in the first word, in XID74_BITS order
    unknown_bits: tuple[int, ...]  # first-word bits NVIDIA's notes do not name
    undecoded_words: tuple[int, ...]  # indexes of later words that are non-zero (not decoded)
    severity: Severity
    action: Action

    @property
    def ecc_parity(self) -> bool:
        return "ecc_parity" in self.classes


def decode_xid74(words: Sequence[int]) -> Xid74Decode | None:
    """Verdict for one Xid 74 line from its register words; None when the line carried none."""
    if not words:
        return None
    first = words[0] & 0xFFFFFFFF
    bits = {b for b in range(32) if first >> b & 1}
    classes = tuple(name for name, members in XID74_BITS.items() if bits & members)
    known = frozenset().union(*XID74_BITS.values())
    unknown = tuple(sorted(bits - known))
    later = tuple(i for i, w in enumerate(words) if i > 0 and w)
    verdicts = [_XID74_VERDICT[c] for c in classes]
    if unknown or later or not bits:
        verdicts.append(_verdict(74, "WORKFLOW_NVLINK_ERR"))  # not decodable from our notes
    severity = max(v[0] for v in verdicts)
    action = max(v[1] for v in verdicts)
    return Xid74Decode(classes, unknown, later, severity, action)


# -- WORKFLOW_NVLINK5_ERR (Xids 144-150, Blackwell NVLink5) -------------------------------
#
# NVIDIA's "XID 144-150 Decode" sheet gives a severity (Non-fatal / Fatal / Link Fatal) per
# (unit, error status). The rules below are the ones our notes record (xid-catalog.md, notes
# on the table: NV-CAT decode sheet via gpud catalog_generated.go nvlinkRules); the error
# status is the second word of the line (gpud PR #1160 prints "err status" from it). A unit or
# status outside these rules falls back to the Fatal/Nonfatal word the driver printed.

_NONFATAL_ALL = frozenset({0x1, 0x2, 0x4, 0x8, 0x10, 0x20})
_PEER_OR_SI = "investigate link SI or the peer device (bits 24..29 of word 0)"


@dataclass(frozen=True)
class _Nvl5Rule:
    fatal_status: frozenset[int] = frozenset()
    nonfatal_status: frozenset[int] = frozenset()
    # a unit whose every status has one severity (status not consulted)
    always: str | None = None
    note: str = ""


_NVL5_RULES: Mapping[tuple[int, str], _Nvl5Rule] = MappingProxyType({
    (144, "SAW_MVB"): _Nvl5Rule(frozenset({0x2, 0x10}), frozenset({0x1, 0x4, 0x8, 0x20})),
    (145, "RLW_REMAP"): _Nvl5Rule(frozenset({0x40, 0x80}), _NONFATAL_ALL,
                                  note="follow the accompanying Xid 154 (XID_154_EVAL)"),
    (149, "NETIR_LINK_EVT"): _Nvl5Rule(always="Link Fatal", note=_PEER_OR_SI),
    (149, "NETIR_LINK_DOWN"): _Nvl5Rule(always="Link Fatal", note=_PEER_OR_SI),
    (149, "NETIR_BER_EVENT"): _Nvl5Rule(always="Non-fatal", note="bit-error-rate event: investigate cables"),
    (150, "MSE_WATCHDOG"): _Nvl5Rule(always="Fatal"),
})


@dataclass(frozen=True)
class Nvlink5Decode:
    level: str  # "Fatal", "Link Fatal" or "Non-fatal"
    basis: str  # how it was decided, for the finding's message and evidence
    severity: Severity
    action: Action
    status: int | None  # the error-status word, when the line had one


def _nvl5_verdict(code: int, unit: str, level: str) -> tuple[Severity, Action]:
    if level in ("Fatal", "Link Fatal"):
        return Severity.FAIL, Action.RESET_GPU
    # Non-fatal: the link keeps running. A BER event is the cable/connector's doing
    # (NV-CAT: investigate cables); other non-fatal statuses need nothing on their own.
    return Severity.WARN, Action.CHECK_CABLES if (code, unit) == (149, "NETIR_BER_EVENT") else Action.NONE


def _status_level(rule: _Nvl5Rule, status: int | None) -> str | None:
    if rule.always is not None:
        return rule.always
    if not status:
        return None
    bits = {1 << b for b in range(64) if status >> b & 1}
    if bits & rule.fatal_status:
        return "Fatal"
    if bits <= rule.nonfatal_status:
        return "Non-fatal"
    return None  # a status the rules do not list


def decode_nvlink5(code: int, unit: str | None, fatal_word: bool | None,
                   words: Sequence[int]) -> Nvlink5Decode | None:
    """Severity of one Xid 144-150 line: the decode rules first, else the Fatal/Nonfatal word.

    None when neither is available (a damaged line, or an NVML event without the line).
    """
    status = words[1] if len(words) >= 2 else None
    rule = _NVL5_RULES.get((code, unit or ""))
    level = _status_level(rule, status) if rule is not None else None
    if rule is not None and level is not None:
        basis = f"NVIDIA decode: {unit}" + (f" status {status:#x}" if rule.always is None and status else "")
        basis += f" is {level}"
        if rule.note and (rule.always is not None or level == "Non-fatal"):
            basis += f"; {rule.note}"
    elif fatal_word is not None:
        level = "Fatal" if fatal_word else "Non-fatal"
        basis = f"{unit or 'unit'} printed {'Fatal' if fatal_word else 'Nonfatal'}"
        if rule is not None:
            basis += f" (status {status:#x} not in NVIDIA's decode rules)" if status else ""
    else:
        return None
    severity, action = _nvl5_verdict(code, unit or "", level)
    return Nvlink5Decode(level, basis, severity, action, status)
