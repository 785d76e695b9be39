"""NVIDIA's Xid catalog, and what gpumon does about each code.

NVIDIA's facts (every code 1-172 with its mnemonic, immediate and investigatory action, the
"XID 144-150 Decode" sheet and the workflow texts) are data in ``catalog_data``, generated
from the team's extract of NVIDIA's ``Xid-Catalog.xlsx`` by ``tools/gen_xid_catalog.py`` (a new
NVIDIA release is one regeneration; provenance in tests/data/peer-fixtures/SOURCES.md). This
module says what gpumon does with them: one mapping from NVIDIA's action tokens to gpumon's
severity and action (``NVIDIA_ACTIONS``), one table of the codes where gpumon deliberately departs
from it, each with its reason (``OVERRIDES``), and the decode rules of the two NVLink workflows
(``decode_xid74``, ``decode_nvlink5``), which read one line's register words. Counting, storms,
repeats on one link, the root Xid behind a Xid 45 and the Xid 154 that accompanies an NVLink5
error are the xid check's business, not this module's.

NVIDIA immediate action      gpumon severity / action
---------------------------  -----------------------------------------------------------------
RESTART_APP                  warn / restart_app (the GPU is fine, the application faulted)
IGNORE                       ok / none: not a fault, not reported
RESET_GPU                    fail / reset_gpu
RESTART_BM                   fail / reboot_node
RESTART_VM                   fail / reboot_node (the VM is the node gpumon runs on)
CONTACT_SUPPORT              fail / inspect_hardware (NVIDIA support is the RMA path)
CHECK_MECHANICALS            fail / inspect_hardware, advice: power cabling and mechanicals
UPDATE_SWFW                  warn / none, advice: update the driver and firmware
CHECK_UVM                    warn / reset_gpu, advice: reset if UVM or vGPU is in use, else ignore
WORKFLOW_XID_45              ok / none; the check acts on the root Xid, a solo Xid 45 warns
WORKFLOW_XID_48              fail / reset_gpu (NVIDIA: solo RESET_GPU, with 63/64 drain and reset)
WORKFLOW_NVLINK_ERR (74)     fail / reset_gpu until the register words say otherwise
WORKFLOW_NVLINK5_ERR         fail / reset_gpu until NVIDIA's decode sheet says otherwise
  (144-150)
XID_154                      ok / none; the check acts on the recovery action the line announces
(no action: 162-170)         warn / inspect_hardware, as an unknown code
unknown code                 warn / inspect_hardware

An unknown code (not in NVIDIA's catalog, or listed without an action) is ``warn`` /
``inspect_hardware``: the action of CONTACT_SUPPORT, which is what NVIDIA's own NVSentinel falls
back to for a code its catalog does not resolve, so someone looks at it; but ``warn``, not
``fail``, because nothing says the GPU is unusable. The same holds for a Xid 154 line whose new
recovery action cannot be read (the check).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gpumon.model import Action, Severity

from . import catalog_data as _data

CATALOG_SOURCE = (
    "NVIDIA XID catalog, https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html "
    "(also https://docs.nvidia.com/deploy/xid-errors/index.html): " + _data.SOURCE
    + "; generated into checks/xid/catalog_data.py by tools/gen_xid_catalog.py"
)

#: NVIDIA's text for each workflow token (WORKFLOW_NVLINK_ERR, XID_154_EVAL, ...)
WORKFLOW_TEXT: Mapping[str, str] = MappingProxyType(dict(_data.WORKFLOWS))


@dataclass(frozen=True)
class XidInfo:
    code: int
    mnemonic: str  # NVIDIA's mnemonic
    description: str  # one line, our words
    severity: Severity  # what gpumon reports for one occurrence
    action: Action  # gpumon's remedy vocabulary
    nvidia_action: str  # NVIDIA's immediate action token ("" where the catalog gives none)
    workflow: str | None  # NVIDIA workflow the check must run, e.g. "XID_48", "NVLINK5_ERR"
    nvidia_investigatory: str = ""  # NVIDIA's investigatory action ("" where none)
    advice: str = ""  # what to do, where severity and action do not say it all
    override: str | None = None  # why gpumon departs from NVIDIA's action (OVERRIDES); None: it does not


@dataclass(frozen=True)
class Verdict:
    severity: Severity
    action: Action
    advice: str = ""


#: The one mapping from NVIDIA's immediate action to gpumon's (module docstring).
NVIDIA_ACTIONS: Mapping[str, Verdict] = MappingProxyType({
    "RESTART_APP": Verdict(Severity.WARN, Action.RESTART_APP),
    "IGNORE": Verdict(Severity.OK, Action.NONE),
    "RESET_GPU": Verdict(Severity.FAIL, Action.RESET_GPU),
    "RESTART_BM": Verdict(Severity.FAIL, Action.REBOOT_NODE),
    "RESTART_VM": Verdict(Severity.FAIL, Action.REBOOT_NODE, "NVIDIA: restart the VM (RESTART_VM)"),
    "CONTACT_SUPPORT": Verdict(Severity.FAIL, Action.INSPECT_HARDWARE),
    "CHECK_MECHANICALS": Verdict(Severity.FAIL, Action.INSPECT_HARDWARE,
                                 "NVIDIA: check the GPU's power cabling and mechanicals (CHECK_MECHANICALS)"),
    "UPDATE_SWFW": Verdict(Severity.WARN, Action.NONE,
                           "NVIDIA: update the GPU driver and firmware (UPDATE_SWFW)"),
    "CHECK_UVM": Verdict(Severity.WARN, Action.RESET_GPU,
                         "NVIDIA: reset the GPU if UVM or vGPU is in use, otherwise ignore it (CHECK_UVM)"),
    "WORKFLOW_XID_45": Verdict(Severity.OK, Action.NONE),
    "WORKFLOW_XID_48": Verdict(Severity.FAIL, Action.RESET_GPU),
    "WORKFLOW_NVLINK_ERR": Verdict(Severity.FAIL, Action.RESET_GPU),
    "WORKFLOW_NVLINK5_ERR": Verdict(Severity.FAIL, Action.RESET_GPU),
    "XID_154": Verdict(Severity.OK, Action.NONE),
    "": Verdict(Severity.WARN, Action.INSPECT_HARDWARE,
                "NVIDIA's catalog gives no action for this code: have it looked at"),
})

#: What gpumon reports for a code NVIDIA's catalog does not list (module docstring).
UNKNOWN = Verdict(Severity.WARN, Action.INSPECT_HARDWARE,
                  "not in NVIDIA's Xid catalog: have it looked at (NVIDIA's NVSentinel treats an "
                  "unlisted code as CONTACT_SUPPORT)")


@dataclass(frozen=True)
class Override:
    severity: Severity
    action: Action
    reason: str


#: Every code where gpumon's verdict is not the mapping of NVIDIA's immediate action, and why.
OVERRIDES: Mapping[int, Override] = MappingProxyType({
    63: Override(
        Severity.WARN, Action.RESET_GPU,
        "IGNORE in the catalog, but the event means a row remap is pending, and NVIDIA's memory-error-"
        "management guide and NVML both say a GPU reset applies it: schedule a reset (warn), do not "
        "rush. The check asks NVML whether the remap is still pending and reports ok once it is not."),
    64: Override(
        Severity.FAIL, Action.INSPECT_HARDWARE,
        "RESET_GPU / CONTACT_SUPPORT in the catalog; a row-remapping failure is the RMA criterion of "
        "NVIDIA's GPU memory error management guide (https://docs.nvidia.com/deploy/"
        "a100-gpu-mem-error-mgmt/index.html, 'RMA Policy Thresholds for Row Remapping'; "
        "awslabs/awsome-distributed-ai PR #1190 moved it to an isolate/RMA action for the same "
        "reason). Inspection outranks a reset (worst action wins), so the catalog's reset is not lost."),
    171: Override(
        Severity.FAIL, Action.RESET_GPU,
        "no action in the catalog (newest code); it details the Xid 48 (uncorrectable DRAM error) it "
        "accompanies, so it takes Xid 48's solo action, RESET_GPU (WORKFLOW_XID_48)."),
    172: Override(
        Severity.FAIL, Action.RESET_GPU,
        "no action in the catalog (newest code); it details the Xid 48 (uncorrectable SRAM error) it "
        "accompanies, so it takes Xid 48's solo action, RESET_GPU (WORKFLOW_XID_48)."),
})

# Our one-line descriptions; codes without one get a line built from NVIDIA's mnemonic.
_DESCRIPTIONS: Mapping[int, str] = MappingProxyType({
    8: "Channel idle timeout: the GPU stopped processing the application's work.",
    11: "Malformed command (push buffer) stream from the application or driver.",
    13: "Graphics/compute engine exception (illegal address or instruction), usually an application bug.",
    14: "Test error injected by the driver (RC logging test); informational.",
    25: "Illegal notify in the command stream; application or driver software fault.",
    31: "GPU MMU page fault: the application touched an unmapped virtual address.",
    32: "PBDMA error: invalid or corrupted command stream, possibly after DMA/PCIe corruption.",
    37: "Context-switch microcontroller hit an unimplemented firmware method; driver firmware fault.",
    38: "Context-switch microcontroller watchdog timeout; driver firmware fault.",
    43: "Channel reset verification after an application fault (usually follows Xid 13 or 31).",
    44: "Graphics engine fault during a context switch.",
    45: "Preemptive channel cleanup caused by an earlier error; the root Xid says what to do.",
    46: "GPU-level timeout: the GPU stopped processing.",
    48: "Uncorrectable (double-bit) ECC error in GPU memory; row remapping decides the outcome.",
    54: "Auxiliary power missing or power-reduced clocking: power cabling or mechanical fault.",
    56: "Display engine channel exception; not expected on a data-center GPU.",
    57: "Framebuffer memory link training failed.",
    58: "Framebuffer memory error.",
    62: "Internal power-management microcontroller (PMU) halted.",
    63: "A memory row was marked for remapping (or a page retired); it takes effect at the next GPU reset.",
    64: "Recording a memory row remap failed; NVIDIA's RMA criterion for GPU memory.",
    69: "Graphics engine class error (invalid class or BAR1 access failure).",
    74: "NVLink error on an NVLink 3/4 GPU; its register words tell link, ECC and mechanical faults apart.",
    78: "vGPU start error; NVIDIA asks for a driver/firmware update.",
    79: "The GPU fell off the bus: the driver lost PCIe access to it.",
    80: "Push buffer CRC mismatch: corrupted data was sent to the GPU.",
    81: "VGA subsystem error; not expected on a data-center GPU.",
    92: "High rate of corrected single-bit ECC errors.",
    93: "InfoROM erase (wear) limit exceeded.",
    94: "Contained uncorrectable memory error: only the applications that used the bad memory are hit.",
    95: "Uncontained uncorrectable memory error: all work on the GPU is hit and the GPU needs a reset.",
    109: "Context-switch timeout.",
    110: "Security fault.",
    119: "The GSP firmware did not answer a driver RPC in time.",
    120: "GSP firmware error.",
    121: "Chip-to-chip (C2C) link error on a Grace-attached GPU.",
    136: "NVLink link training (ALI) failed.",
    137: "NVLink fabric-address (FLA) privilege error.",
    140: "An uncorrectable ECC error escaped containment.",
    143: "GPU initialization failed.",
    144: "NVLink5 SAW unit error; NVIDIA's decode sheet says what each error status needs.",
    145: "NVLink5 RLW unit error; mostly non-fatal, some error statuses fatal or tied to a Xid 154.",
    146: "NVLink5 TLW unit error; NVIDIA's decode sheet says what each error status needs.",
    147: "NVLink5 TREX unit error; NVIDIA's decode sheet says what each error status needs.",
    148: "NVLink5 NVLPW_CTRL unit error; NVIDIA's decode sheet says what each error status needs.",
    149: "NVLink5 NETIR error: link-down events (by sub-code), bit-error-rate and MFDE events.",
    150: "NVLink5 MSE (management firmware) watchdog or degradation.",
    151: "Confidential-computing key rotation error.",
    154: "Informational: the recovery action the GPU needs for another Xid changed.",
    155: "NVLink software-defined error.",
    156: "Resource retirement event.",
    157: "Resource retirement failure.",
    158: "GPU fatal timeout.",
    159: "Coherent-interconnect (CHI) non-data error on a Grace system; check Unified Memory use.",
    160: "Channel retirement event.",
    161: "Channel retirement failure.",
    171: "Uncorrectable DRAM error (detail accompanying an Xid 48).",
    172: "Uncorrectable SRAM error (detail accompanying an Xid 48).",
})

_ENGINES = {"CE": "copy engine", "NVDEC": "video decoder", "NVJPG": "JPEG decoder", "NVENC": "video encoder",
            "OFA": "optical-flow accelerator"}
_ENGINE_RE = re.compile(r"ROBUST_CHANNEL_(CE|NVDEC|NVJPG|NVENC|OFA)(\d+)_ERROR")


def _description(code: int, mnemonic: str) -> str:
    ours = _DESCRIPTIONS.get(code)
    if ours is not None:
        return ours
    m = _ENGINE_RE.fullmatch(mnemonic)
    if m is not None:
        engine, n = m.groups()
        return f"Exception in {_ENGINES[engine]} {n} ({engine}{n}) while running work."
    return f"As NVIDIA names it: {mnemonic} (no description of ours)."


def _workflow(immediate: str, investigatory: str) -> str | None:
    for token in (immediate, investigatory):
        if token.startswith("WORKFLOW_"):
            return token.removeprefix("WORKFLOW_")
    return "XID_154" if immediate == "XID_154" else None


def _build() -> Mapping[int, XidInfo]:
    table: dict[int, XidInfo] = {}
    for code, mnemonic, immediate, investigatory in _data.XIDS:
        if code in table:
            raise ValueError(f"Xid {code} listed twice")
        mapped = NVIDIA_ACTIONS.get(immediate)
        if mapped is None:
            raise ValueError(f"Xid {code}: no gpumon rule for NVIDIA action {immediate!r}: add it to "
                             "NVIDIA_ACTIONS (or the code to OVERRIDES)")
        override = OVERRIDES.get(code)
        severity, action = (override.severity, override.action) if override else (mapped.severity,
                                                                                 mapped.action)
        table[code] = XidInfo(
            code=code,
            mnemonic=mnemonic,
            description=_description(code, mnemonic),
            severity=severity,
            action=action,
            nvidia_action=immediate,
            workflow=_workflow(immediate, investigatory),
            nvidia_investigatory=investigatory,
            advice="" if override else mapped.advice,
            override=override.reason if override else None,
        )
    missing = set(OVERRIDES) - set(table)
    if missing:
        raise ValueError(f"overrides for codes NVIDIA does not list: {sorted(missing)}")
    return MappingProxyType(table)


XID_CATALOG: Mapping[int, XidInfo] = _build()


def lookup(code: int) -> XidInfo | None:
    """The catalog entry for ``code``, or None for a code NVIDIA's catalog does not list (``UNKNOWN``)."""
    return XID_CATALOG.get(code)


# -- WORKFLOW_NVLINK_ERR (Xid 74, NVLink 3/4) -------------------------------------------
#
# NVIDIA's workflow (WORKFLOW_TEXT["WORKFLOW_NVLINK_ERR"]): split the seven hex words of the line;
# on Hopper the first, third, fourth and fifth are populated; "if bits other than those
# specifically outlined below are seen, please report a bug". Each rule below is one of NVIDIA's
# bit lists, with gpumon's verdict for one line and, where NVIDIA's advice depends on repeats
# ("if seen more than 2 times on the same link", "if seen repeatedly", "if the issue persists"),
# for more than XID74_REPEAT_LIMIT lines on the same link. How NVIDIA's words map:
#   "can be safely ignored", "continue operation"           -> ok / none
#   "sympathetic: follow the resolution of the other bits or Xid/SXid" -> warn / none
#   "a reset ... is required"                                -> fail / reset_gpu
#   "check link mechanical connections, re-seat" (SI too)    -> fail / check_cables;
#                                                             persists -> fail / inspect_hardware
#   "likely HW issue with ECC/parity"                        -> fail / reset_gpu (the line is a fatal
#                                                             link error); repeated -> inspect_hardware
#   "if seen repeatedly, run field diags / report a bug"     -> warn / none; repeated: CONTACT_SUPPORT's
#                                                             fail / inspect_hardware
#   a bit NVIDIA does not list, bit 13 ("not expected")      -> the catalog default, fail / reset_gpu
# "Report a bug" is NVIDIA's CONTACT_SUPPORT, the investigatory action of Xid 74 in the catalog.

#: NVIDIA: ECC/parity bits "seen more than 2 times on the same link"; used for every repeat rule
XID74_REPEAT_LIMIT = 2

_OK = (Severity.OK, Action.NONE)
_NOTE = (Severity.WARN, Action.NONE)
_RESET = (Severity.FAIL, Action.RESET_GPU)
_CABLES = (Severity.FAIL, Action.CHECK_CABLES)
_HW = (Severity.FAIL, Action.INSPECT_HARDWARE)


@dataclass(frozen=True)
class Xid74Rule:
    register: int  # 0-based: 0 is NVIDIA's "first register"
    bits: frozenset[int]
    name: str
    once: tuple[Severity, Action]
    repeated: tuple[Severity, Action] | None  # past XID74_REPEAT_LIMIT lines on one link
    nvidia: str  # NVIDIA's words, abridged


XID74_RULES: tuple[Xid74Rule, ...] = (
    Xid74Rule(0, frozenset({0, 23, 30}), "ignorable", _OK, None, "can be safely ignored"),
    Xid74Rule(0, frozenset({1, 20}), "sympathetic", _NOTE, None,
              "sympathetic or secondary: follow the other bits or Xid/SXid; solo, report a bug"),
    Xid74Rule(0, frozenset({4, 5}), "ecc_parity", _RESET, _HW,
              "likely HW issue with ECC/parity: more than 2 times on the same link, report a bug"),
    Xid74Rule(0, frozenset({8, 9, 12, 16, 17, 24, 28}), "mechanical", _CABLES, _HW,
              "possibly HW: check link mechanical connections and re-seat; run diags if it persists"),
    Xid74Rule(0, frozenset({21, 22}), "marginal_si", _CABLES, _HW,
              "marginal channel SI: check link mechanical connections, run field diags"),
    Xid74Rule(0, frozenset({27, 29}), "repeat_report", _NOTE, _HW, "if seen repeatedly, report a bug"),
    Xid74Rule(2, frozenset({0, 1, 2, 6}), "ecc_parity", _RESET, _HW,
              "likely HW issue with ECC/parity: more than 2 times on the same link, report a bug"),
    Xid74Rule(2, frozenset({13}), "unexpected", _RESET, None,
              "not expected in production: if seen, report a bug"),
    Xid74Rule(2, frozenset({16, 19}), "repeat_field_diag", _NOTE, _HW,
              "if seen repeatedly, run field diags and report a bug"),
    Xid74Rule(2, frozenset({17, 18}), "repeat_report", _NOTE, _HW, "if seen repeatedly, report a bug"),
    Xid74Rule(3, frozenset({16, 17}), "sympathetic", _NOTE, None,
              "sympathetic or secondary: follow the other bits or Xid/SXid; solo, report a bug"),
    Xid74Rule(3, frozenset({18}), "fabric_reset", _RESET, None,
              "sympathetic or secondary, though a reset of the fabric is required"),
    Xid74Rule(4, frozenset({18, 19, 21, 22, 24, 25, 27, 28}), "ecc_parity", _RESET, _HW,
              "likely HW issue with ECC/parity: more than 2 times on the same link, report a bug"),
    Xid74Rule(4, frozenset({20, 23, 26, 29}), "ecc_threshold", _OK, None,
              "ECC threshold exceeded, no uncorrectable error: continue operation"),
)
_XID74_DESCRIBED = frozenset(r.register for r in XID74_RULES)  # the registers NVIDIA describes
_XID74_DEFAULT = (NVIDIA_ACTIONS["WORKFLOW_NVLINK_ERR"].severity,
                  NVIDIA_ACTIONS["WORKFLOW_NVLINK_ERR"].action)


@dataclass(frozen=True)
class Xid74Decode:
    """One Xid 74 line's register words, read with NVIDIA's bit lists."""

    classes: tuple[str, ...]  # rule names whose bits are set, in XID74_RULES order, each once
    unknown_bits: tuple[tuple[int, int], ...]  # (register, bit) set but not in NVIDIA's lists
    undecoded_words: tuple[int, ...]  # registers NVIDIA does not describe that are non-zero
    severity: Severity
    action: Action
    basis: str  # in words, for the finding

    @property
    def ecc_parity(self) -> bool:
        return "ecc_parity" in self.classes


def decode_xid74(words: Sequence[int]) -> Xid74Decode | None:
    """Verdict for one Xid 74 line from its register words; None when the line carried none."""
    if not words:
        return None
    regs = [w & 0xFFFFFFFF for w in words]
    classes: list[str] = []
    verdicts: list[tuple[Severity, Action]] = []
    named: dict[int, set[int]] = {}
    for rule in XID74_RULES:
        if rule.register >= len(regs):
            continue
        hit = {b for b in rule.bits if regs[rule.register] >> b & 1}
        if hit:
            named.setdefault(rule.register, set()).update(hit)
            verdicts.append(rule.once)
            if rule.name not in classes:
                classes.append(rule.name)
    unknown = tuple((r, b) for r, w in enumerate(regs) if r in _XID74_DESCRIBED
                    for b in range(32) if w >> b & 1 and b not in named.get(r, set()))
    undecoded = tuple(r for r, w in enumerate(regs) if r not in _XID74_DESCRIBED and w)
    parts = [f"{', '.join(classes)}" if classes else "no bit NVIDIA's workflow lists"]
    if unknown or undecoded or not classes:
        verdicts.append(_XID74_DEFAULT)  # NVIDIA: "report a bug"; the line is a fatal link error
        extra = [f"register {r + 1} bit {b}" for r, b in unknown] + [f"register {r + 1}" for r in undecoded]
        if extra:
            parts.append("not in NVIDIA's lists: " + ", ".join(extra) + " (NVIDIA: report it)")
    severity = max(v[0] for v in verdicts)
    action = max(v[1] for v in verdicts)
    return Xid74Decode(tuple(classes), unknown, undecoded, severity, action,
                       "register bits: " + "; ".join(parts))


def xid74_repeats(lines_by_class: Mapping[str, int]) -> tuple[Severity, Action, str] | None:
    """The escalated verdict for a link whose lines carried these classes this many times, if any."""
    worst: tuple[Severity, Action, str] | None = None
    for rule in XID74_RULES:
        n = lines_by_class.get(rule.name, 0)
        if rule.repeated is None or n <= XID74_REPEAT_LIMIT:
            continue
        why = f"{rule.name} bits on {n} lines of this link (NVIDIA: {rule.nvidia})"
        if worst is None or (rule.repeated[0], rule.repeated[1]) > (worst[0], worst[1]):
            worst = (rule.repeated[0], rule.repeated[1], why)
    return worst


# -- WORKFLOW_NVLINK5_ERR (Xids 144-150, Blackwell NVLink5) -------------------------------
#
# NVIDIA's "XID 144-150 Decode" sheet (catalog_data.NVL5_DECODE): the line prints
# "<unit> <Fatal|Nonfatal> XC<n> i<n> Link <n> (<intrInfo> <errorStatus> <debug words>...)"; a rule
# applies when the Xid and the printed unit match it and the IntrInfo word matches its V1 (drivers
# before R575) or V2 pattern (IntrInfo bits 25..20 are the sub-code of NETIR_LINK_EVT: 38 and 40
# are IGNORE), and the error status is the rule's (several status bits: each must have a rule, the
# worst wins). Its resolution decides: IGNORE -> ok, RESET_GPU -> fail / reset_gpu, XID_154_EVAL ->
# follow the Xid 154 that accompanies it, else restart_app (the check does the following). A line
# no rule matches falls back to the Fatal/Nonfatal word the driver printed: fail / reset_gpu or
# warn / none. A line without words is decided by the unit's name alone where all its rules agree.

_NVL5_RESOLUTIONS: Mapping[str, tuple[Severity, Action]] = MappingProxyType({
    "IGNORE": (Severity.OK, Action.NONE),
    "XID_154_EVAL": (Severity.WARN, Action.RESTART_APP),  # no Xid 154 with it: RESTART_APP
    "RESET_GPU": (Severity.FAIL, Action.RESET_GPU),
})


def _pattern(p: str) -> tuple[int, int]:
    """'------000000----------0000100001' (bit 31 first) -> (mask, value)."""
    if len(p) != 32 or set(p) - set("01-"):
        raise ValueError(f"bad IntrInfo pattern {p!r}")
    mask = value = 0
    for i, ch in enumerate(p):
        bit = 31 - i
        if ch != "-":
            mask |= 1 << bit
            value |= int(ch) << bit
    return mask, value


def _statuses(s: str) -> frozenset[int] | None:
    return None if not s.strip() else frozenset(int(x, 16) for x in s.split("/"))


def _names(unit: str) -> frozenset[str]:
    names = {n.strip() for n in unit.split("/") if n.strip()}
    return frozenset(names | {n.replace(" ", "_").upper() for n in names} | {unit.strip()})


@dataclass(frozen=True)
class Nvl5Rule:
    code: int
    unit: str  # NVIDIA's name, e.g. "NETIR_LINK_EVT/NETIR_LINK_DOWN"
    names: frozenset[str]  # what a line may print for it
    v1: tuple[int, int]  # IntrInfo (mask, value), drivers before R575
    v2: tuple[int, int]  # IntrInfo (mask, value), R575 and later
    statuses: frozenset[int] | None  # None: any status
    resolution: str  # IGNORE, RESET_GPU, XID_154_EVAL
    level: str  # "Fatal", "Link Fatal" or "Non-fatal" (NVIDIA's *, ** and ? marks dropped)
    investigatory: str

    def matches(self, intrinfo: int) -> bool:
        return any(intrinfo & mask == value for mask, value in (self.v1, self.v2))

    @property
    def subcode(self) -> int | None:
        """The IntrInfo sub-code (bits 25..20) of a NETIR_LINK_EVT rule; the other units require 0."""
        return (self.v1[1] >> 20) & 0x3F if "NETIR_LINK_EVT" in self.names else None


def _level(sheet: str) -> str:
    s = sheet.rstrip("*?").strip()
    return {"fatal": "Fatal", "link fatal": "Link Fatal", "non-fatal": "Non-fatal"}.get(s.lower(), s)


NVL5_RULES: tuple[Nvl5Rule, ...] = tuple(
    Nvl5Rule(code, unit, _names(unit), _pattern(v1), _pattern(v2), _statuses(status), resolution,
             _level(severity), investigatory)
    for code, unit, v1, v2, status, resolution, severity, investigatory in _data.NVL5_DECODE
)


@dataclass(frozen=True)
class Nvlink5Decode:
    level: str  # "Fatal", "Link Fatal" or "Non-fatal"
    basis: str  # how it was decided, for the finding's message and evidence
    severity: Severity
    action: Action
    status: int | None  # the error-status word, when the line had one
    resolution: str = ""  # NVIDIA's resolution; "" when decided by the printed word
    investigatory: str = ""  # NVIDIA's investigatory action for the matched rule(s)
    subcode: int | None = None  # IntrInfo bits 25..20 of a NETIR_LINK_EVT rule

    @property
    def follows_xid154(self) -> bool:
        return self.resolution == "XID_154_EVAL"


_RES_ORDER = ("IGNORE", "XID_154_EVAL", "RESET_GPU")


def _worst(rules: Sequence[Nvl5Rule]) -> Nvl5Rule:
    return max(rules, key=lambda r: _RES_ORDER.index(r.resolution) if r.resolution in _RES_ORDER else 99)


def _decided(rule: Nvl5Rule, basis: str, status: int | None, more: Sequence[Nvl5Rule] = ()) -> Nvlink5Decode:
    severity, action = _NVL5_RESOLUTIONS.get(rule.resolution, _RESET)
    inv = ", ".join(dict.fromkeys(r.investigatory for r in (rule, *more) if r.investigatory))
    return Nvlink5Decode(rule.level, basis, severity, action, status, rule.resolution, inv, rule.subcode)


def _by_rules(code: int, printed: frozenset[str], words: Sequence[int]) -> Nvlink5Decode | None:
    named = [r for r in NVL5_RULES if r.code == code and r.names & printed]
    if not named:
        return None
    if not words:
        if len({(r.resolution, r.level) for r in named}) == 1:
            return _decided(named[0], f"NVIDIA decode: {named[0].unit} is {named[0].level}, "
                                      f"{named[0].resolution} (every rule of the unit)", None)
        return None
    intrinfo = words[0] & 0xFFFFFFFF
    status = words[1] & 0xFFFFFFFF if len(words) > 1 else None
    fitting = [r for r in named if r.matches(intrinfo)]
    if not fitting:
        return None
    any_status = [r for r in fitting if r.statuses is None]
    exact = [r for r in fitting if r.statuses is not None and status in r.statuses]
    chosen = any_status + exact
    if not chosen and status:
        bits = [1 << b for b in range(32) if status >> b & 1]
        per_bit = [[r for r in fitting if r.statuses is not None and bit in r.statuses] for bit in bits]
        if len(bits) > 1 and all(per_bit):
            chosen = [r for rules in per_bit for r in rules]
    if not chosen:
        return None
    rule = _worst(chosen)
    sub = f" sub-code {rule.subcode}" if rule.subcode is not None else ""
    st = f" status {status:#x}" if status is not None and rule.statuses is not None else ""
    basis = (f"NVIDIA decode: {rule.unit}{sub}{st} (IntrInfo {intrinfo:#010x}) is {rule.level}, "
             f"{rule.resolution}")
    if rule.investigatory:
        basis += f"; investigate: {rule.investigatory}"
    return _decided(rule, basis, status, chosen)


def decode_nvlink5(code: int, unit: str | None, fatal_word: bool | None,
                   words: Sequence[int]) -> Nvlink5Decode | None:
    """Verdict of one Xid 144-150 line: NVIDIA's decode rules first, else the Fatal/Nonfatal word.

    None when neither is available (a damaged line, or an NVML event without the line).
    """
    printed = frozenset({unit, *unit.split("/")}) if unit else frozenset()
    decoded = _by_rules(code, printed, words) if printed else None
    if decoded is not None:
        return decoded
    if fatal_word is None:
        return None
    status = words[1] & 0xFFFFFFFF if len(words) > 1 else None
    level = "Fatal" if fatal_word else "Non-fatal"
    basis = f"{unit or 'unit'} printed {'Fatal' if fatal_word else 'Nonfatal'}"
    if words:
        basis += f" (IntrInfo {words[0] & 0xFFFFFFFF:#x}"
        basis += f" status {status:#x}" if status is not None else ""
        basis += " not in NVIDIA's decode rules)"
    severity, action = _RESET if fatal_word else _NOTE
    return Nvlink5Decode(level, basis, severity, action, status)
