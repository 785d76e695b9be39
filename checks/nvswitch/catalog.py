"""NVSwitch SXid codes as data: what each SXid is and what gpumon does about it.

An SXid is the NVSwitch driver's error report (``nvidia-nvswitchN: SXid (PCI:...): <code>, ...``);
nvidia-fabricmanager reports the same codes in its log ("detected NVSwitch non-fatal error 12028").
This module only says what one code means. Grouping the lines of one event, the Fatal/Non-fatal
word of a line, switches and repeats are the nvswitch check's business.

Sources (facts re-tabulated; the one-word descriptions are ours):

NVS   NVIDIA/NVSentinel ``distros/kubernetes/nvsentinel/charts/nvswitch-health-monitor/
      sxiderrorsmapping.csv`` @ 6f8b0fcfa8e502bdda78fabf96facef729a9285b (Apache-2.0): every code
      with NVIDIA's ``NVSWITCH_ERR_HW_*`` name (the prefix is dropped in the table below), the
      recommended action token and a FATAL/NONFATAL class. It is the "SXid mapping" of the team's
      research note (shared/reference/xid-catalog.md, copied to tests/data/xid-catalog.md), whose
      selected rows ``tests/checks/test_nvswitch.py`` keeps in step with this table. In NVS the
      class is NONFATAL exactly for the IGNORE rows.
FMG   NVIDIA Fabric Manager user guide, DU-09883-001 v1.3 (October 2023), appendix "NVSwitch SXid
      errors": the tables "Non-Fatal NVSwitch SXid Errors", "Fatal NVSwitch SXid Errors", "Always
      Fatal NVSwitch SXid Errors" and "Other Notable NVSwitch SXid Errors",
      https://docs.nvidia.com/datacenter/tesla/pdf/fabric-manager-user-guide.pdf (current guide:
      https://docs.nvidia.com/datacenter/tesla/fabric-manager-user-guide/index.html). We read those
      tables through leptonai/gpud ``components/accelerator/nvidia/sxid/sxid.go`` @
      09b59a5bced71a8ee3aa01c3ce23fe63b938be62, which transcribes them section by section with
      their impact and recovery text.

Class (fatal or not) when the line itself does not say: FMG's table where it lists the code, else
NVS's class. They disagree on 11004, 12028, 19084 and 20012 (NVS: FATAL; FMG: non-fatal table). FMG
is NVIDIA's own document, and the driver agrees with it where we have real lines: it prints
"12028, Non-fatal, Link 32 egress non-posted PRIV error" (leptonai/gpud test input, research note
section 6), fabric manager logs "detected NVSwitch non-fatal error 12028" (tests/data/fabricmanager),
and "19084, Non-fatal, Link 29 AN1 Heartbeat Timeout Error" appears in real NVSwitch logs
(LHRS-UM-FERI/MENTHOS-dataset-rootcause on Hugging Face). A line's own Fatal/Non-fatal word always
beats this column.

gpumon verdict (``SXidInfo.verdict(fatal)``), by NVS's action token:

    fatal, RESET_FABRIC / RESET_GPU /          FAIL / REBOOT_NODE
      WORKFLOW_NVLINK_POTENTIALY_FATAL_ERR /
      CHECK_FM_CONFIG / IGNORE
    fatal, UNEXPECTED_ERR_REPORT_ISSUE /       FAIL / INSPECT_HARDWARE
      REPORT_ISSUE / RUN_FIELDDIAG /
      INVESTIGATE_LINK_SI / CHECK_THERMALS /
      CHECK_LINK_MECHANICAL_CONNECTIONS
    non-fatal, CHECK_LINK_MECHANICAL_          WARN / CHECK_CABLES
      CONNECTIONS / INVESTIGATE_LINK_SI
    non-fatal, anything else                   WARN / NONE

Why a fatal SXid is ``reboot_node`` and not ``reset_gpu``: FMG's recovery for the always-fatal
codes is "Restart the host to reset the entire fabric/system", for others "Reset all GPUs and all
NVSwitches" (its section D.9) or, for 20034 on H100, a reset of the GPU behind the port. An SXid
names a switch port, not a GPU, so gpumon cannot say which GPU a reset should target, and on an
NVSwitch baseboard the GPUs and switches are reset together with fabric manager stopped; a node
reboot does all of it and satisfies every narrower remedy (the research note's action vocabulary:
"node reboot also satisfies" RESET_GPU). NVIDIA's own token is kept in the evidence
(``nvidia_action``). Tokens that ask for diagnostics, an issue report or a physical check of links
or cooling go to ``inspect_hardware``, which outranks a reboot.

Per-code exceptions (``_OVERRIDES``), from FMG's impact/recovery text:

    11004  non-fatal table, but "GPU NVLink traffic will be stalled, and the subsequent GPU access
           will hang"; it only comes from a wrong fabric partition configuration ->
           FAIL / REBOOT_NODE whatever the line says.
    12028  non-fatal table: "The GPU driver on the guest VM will abort CUDA jobs with Xid 45.
           Recovery: Restart Guest VM" -> a non-fatal 12028 is WARN / RESTART_APP (the job died,
           the fabric did not: the Dec 2024 capture shows fabric manager serving multicast team
           requests right after 18 of them).
    19084  non-fatal table, but its recovery is "Reset all GPUs and all NVSwitches" ->
           FAIL / REBOOT_NODE whatever the line says.

FMG also says of the fatal table: "If the same SXid is returned [after the reset], the NVSwitch
should be inspected and repaired" (as transcribed by gpud); the check applies that across boots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gpumon.model import Action, Severity

CATALOG_SOURCE = (
    "NVIDIA/NVSentinel charts/nvswitch-health-monitor/sxiderrorsmapping.csv @ "
    "6f8b0fcfa8e502bdda78fabf96facef729a9285b; NVIDIA Fabric Manager user guide DU-09883-001 v1.3, "
    "appendix 'NVSwitch SXid errors' (https://docs.nvidia.com/datacenter/tesla/pdf/"
    "fabric-manager-user-guide.pdf), as transcribed in leptonai/gpud components/accelerator/nvidia/"
    "sxid/sxid.go @ 09b59a5bced71a8ee3aa01c3ce23fe63b938be62"
)
NAME_PREFIX = "NVSWITCH_ERR_HW_"

# NVS action tokens
_IG = "IGNORE"
_RF = "RESET_FABRIC"
_RG = "RESET_GPU"
_WF = "WORKFLOW_NVLINK_POTENTIALY_FATAL_ERR"  # sic: NVIDIA's spelling
_UE = "UNEXPECTED_ERR_REPORT_ISSUE"
_SI = "INVESTIGATE_LINK_SI"
_FD = "RUN_FIELDDIAG"
_ME = "CHECK_LINK_MECHANICAL_CONNECTIONS"
_TH = "CHECK_THERMALS"
_FM = "CHECK_FM_CONFIG"
_RI = "REPORT_ISSUE"

_FATAL_INSPECT = frozenset({_UE, _RI, _FD, _SI, _TH, _ME})
_NONFATAL_LINK = frozenset({_ME, _SI})

# FMG's tables (see the module docstring). "notable" codes are classed one by one below.
FMG_NONFATAL = frozenset({
    11004, 11012, 11021, 11022, 11023, 12021, 12023, 12028, 15008, 15011, 19049, 19055, 19057,
    19059, 19062, 19065, 19068, 19071, 19084, 20001, 20012, 22013, 24001, 24002, 24003,
})
FMG_FATAL = frozenset({
    11001, 11009, 11013, 11018, 11019, 11020, 12001, 12002, 12022, 12024, 12025, 12026, 12027,
    12030, 12031, 12032, 14017, 15001, 15006, 15009, 15010, 15012, 15013, 19047, 19048, 19054,
    19056, 19058, 19060, 19061, 19063, 19064, 19066, 19067, 19069, 19070, 20034, 22012, 24004,
    24005, 24006, 24007,
})
FMG_ALWAYS_FATAL = frozenset({12020, 22003, 22011, *range(23001, 23018)})
# "Other Notable": 10001/10002 "not fatal ... might be followed by other fatal events", 10003
# "never expected to occur ... If it occurs, it is fatal", 10004/10005 thermal events "not
# directly fatal".
FMG_NOTABLE = MappingProxyType({10001: False, 10002: False, 10003: True, 10004: False, 10005: False})

_OVERRIDES: Mapping[int, Mapping[bool, tuple[Severity, Action]]] = MappingProxyType({
    11004: {True: (Severity.FAIL, Action.REBOOT_NODE), False: (Severity.FAIL, Action.REBOOT_NODE)},
    12028: {False: (Severity.WARN, Action.RESTART_APP)},
    19084: {True: (Severity.FAIL, Action.REBOOT_NODE), False: (Severity.FAIL, Action.REBOOT_NODE)},
})


@dataclass(frozen=True)
class SXidInfo:
    code: int
    name: str  # NVIDIA's NVSWITCH_ERR_HW_* enum name ("" where NVS gives none)
    nvidia_action: str  # NVS's action token
    nvs_fatal: bool  # NVS's class
    fmg_table: str | None  # "non-fatal", "fatal", "always fatal", "notable" or None (not in FMG)
    fatal: bool  # the class gpumon uses when a line does not say

    @property
    def class_source(self) -> str:
        return "FMG" if self.fmg_table is not None else "NVS"

    def verdict(self, fatal: bool) -> tuple[Severity, Action]:
        """gpumon's severity and action for one occurrence of this code, fatal or not."""
        override = _OVERRIDES.get(self.code, {}).get(fatal)
        if override is not None:
            return override
        return default_verdict(self.nvidia_action, fatal)

    @property
    def severity(self) -> Severity:
        return self.verdict(self.fatal)[0]

    @property
    def action(self) -> Action:
        return self.verdict(self.fatal)[1]


def default_verdict(nvidia_action: str, fatal: bool) -> tuple[Severity, Action]:
    """The rule of the module docstring (also used for codes the table does not know)."""
    if fatal:
        if nvidia_action in _FATAL_INSPECT:
            return Severity.FAIL, Action.INSPECT_HARDWARE
        return Severity.FAIL, Action.REBOOT_NODE
    if nvidia_action in _NONFATAL_LINK:
        return Severity.WARN, Action.CHECK_CABLES
    return Severity.WARN, Action.NONE


def _fmg_table(code: int) -> tuple[str | None, bool | None]:
    if code in FMG_NONFATAL:
        return "non-fatal", False
    if code in FMG_FATAL:
        return "fatal", True
    if code in FMG_ALWAYS_FATAL:
        return "always fatal", True
    if code in FMG_NOTABLE:
        return "notable", FMG_NOTABLE[code]
    return None, None


# (code, NVIDIA name without NVSWITCH_ERR_HW_, NVS action token), in NVS's order.
# fmt: off
_ROWS: tuple[tuple[int, str, str], ...] = (
    (10001, "HOST_PRIV_ERROR", _IG),
    (10002, "HOST_PRIV_TIMEOUT", _IG),
    (10003, "HOST_UNHANDLED_INTERRUPT", _RF),
    (10004, "HOST_THERMAL_EVENT_START", _TH),
    (10005, "HOST_THERMAL_EVENT_END", _IG),
    (10006, "HOST_THERMAL_SHUTDOWN", _RF),
    (10007, "HOST_IO_FAILURE", _RF),
    (10008, "HOST_FIRMWARE_INITIALIZATION_FAILURE", _RF),
    (11001, "NPORT_INGRESS_CMDDECODEERR", _WF),
    (11002, "NPORT_INGRESS_BDFMISMATCHERR", _IG),
    (11003, "NPORT_INGRESS_BUBBLEDETECT", _IG),
    (11004, "NPORT_INGRESS_ACLFAIL", _FM),
    (11005, "NPORT_INGRESS_PKTPOISONSET", _IG),
    (11006, "NPORT_INGRESS_ECCSOFTLIMITERR", _IG),
    (11007, "NPORT_INGRESS_ECCHDRDOUBLEBITERR", _WF),
    (11008, "NPORT_INGRESS_INVALIDCMD", _IG),
    (11009, "NPORT_INGRESS_INVALIDVCSET", _WF),
    (11010, "NPORT_INGRESS_ERRORINFO", _IG),
    (11011, "NPORT_INGRESS_REQCONTEXTMISMATCHERR", _IG),
    (11012, "NPORT_INGRESS_NCISOC_HDR_ECC_LIMIT_ERR", _IG),
    (11013, "NPORT_INGRESS_NCISOC_HDR_ECC_DBE_ERR", _WF),
    (11014, "NPORT_INGRESS_ADDRBOUNDSERR", _IG),
    (11015, "NPORT_INGRESS_RIDTABCFGERR", _IG),
    (11016, "NPORT_INGRESS_RLANTABCFGERR", _IG),
    (11017, "NPORT_INGRESS_REMAPTAB_ECC_DBE_ERR", _WF),
    (11018, "NPORT_INGRESS_RIDTAB_ECC_DBE_ERR", _WF),
    (11019, "NPORT_INGRESS_RLANTAB_ECC_DBE_ERR", _WF),
    (11020, "NPORT_INGRESS_NCISOC_PARITY_ERR", _WF),
    (11021, "NPORT_INGRESS_REMAPTAB_ECC_LIMIT_ERR", _IG),
    (11022, "NPORT_INGRESS_RIDTAB_ECC_LIMIT_ERR", _IG),
    (11023, "NPORT_INGRESS_RLANTAB_ECC_LIMIT_ERR", _IG),
    (11024, "NPORT_INGRESS_ADDRTYPEERR", _IG),
    (11025, "NPORT_INGRESS_EXTAREMAPTAB_INDEX_ERR", _IG),
    (11026, "NPORT_INGRESS_EXTBREMAPTAB_INDEX_ERR", _IG),
    (11027, "NPORT_INGRESS_MCREMAPTAB_INDEX_ERR", _IG),
    (11028, "NPORT_INGRESS_EXTAREMAPTAB_ECC_DBE_ERR", _WF),
    (11029, "NPORT_INGRESS_EXTBREMAPTAB_ECC_DBE_ERR", _WF),
    (11030, "NPORT_INGRESS_MCREMAPTAB_ECC_DBE_ERR", _WF),
    (11031, "NPORT_INGRESS_EXTAREMAPTAB_REQCONTEXTMISMATCHERR", _IG),
    (11032, "NPORT_INGRESS_EXTBREMAPTAB_REQCONTEXTMISMATCHERR", _IG),
    (11033, "NPORT_INGRESS_MCREMAPTAB_REQCONTEXTMISMATCHERR", _IG),
    (11034, "NPORT_INGRESS_EXTAREMAPTAB_ACLFAIL", _IG),
    (11035, "NPORT_INGRESS_EXTBREMAPTAB_ACLFAIL", _IG),
    (11036, "NPORT_INGRESS_MCREMAPTAB_ACLFAIL", _IG),
    (11037, "NPORT_INGRESS_EXTAREMAPTAB_ADDRBOUNDSERR", _IG),
    (11038, "NPORT_INGRESS_EXTBREMAPTAB_ADDRBOUNDSERR", _IG),
    (11039, "NPORT_INGRESS_MCREMAPTAB_ADDRBOUNDSERR", _IG),
    (11040, "NPORT_INGRESS_EXTAREMAPTAB_ECC_LIMIT_ERR", _IG),
    (11041, "NPORT_INGRESS_EXTBREMAPTAB_ECC_LIMIT_ERR", _IG),
    (11042, "NPORT_INGRESS_MCREMAPTAB_ECC_LIMIT_ERR", _IG),
    (11043, "NPORT_INGRESS_MCCMDTOUCADDRERR", _IG),
    (11044, "NPORT_INGRESS_READMCREFLECTMEMERR", _IG),
    (11045, "NPORT_INGRESS_EXTAREMAPTAB_ADDRTYPEERR", _IG),
    (11046, "NPORT_INGRESS_EXTBREMAPTAB_ADDRTYPEERR", _IG),
    (11047, "NPORT_INGRESS_MCREMAPTAB_ADDRTYPEERR", _IG),
    (12001, "NPORT_EGRESS_EGRESSBUFERR", _WF),
    (12002, "NPORT_EGRESS_PKTROUTEERR", _WF),
    (12003, "NPORT_EGRESS_ECCSINGLEBITLIMITERR0", _IG),
    (12004, "NPORT_EGRESS_ECCHDRDOUBLEBITERR0", _UE),
    (12005, "NPORT_EGRESS_ECCDATADOUBLEBITERR0", _UE),
    (12006, "NPORT_EGRESS_ECCSINGLEBITLIMITERR1", _IG),
    (12007, "NPORT_EGRESS_ECCHDRDOUBLEBITERR1", _UE),
    (12008, "NPORT_EGRESS_ECCDATADOUBLEBITERR1", _UE),
    (12009, "NPORT_EGRESS_NCISOCHDRCREDITOVFL", _IG),
    (12010, "NPORT_EGRESS_NCISOCDATACREDITOVFL", _IG),
    (12011, "NPORT_EGRESS_ADDRMATCHERR", _IG),
    (12012, "NPORT_EGRESS_TAGCOUNTERR", _IG),
    (12013, "NPORT_EGRESS_FLUSHRSPERR", _IG),
    (12014, "NPORT_EGRESS_DROPNPURRSPERR", _IG),
    (12015, "NPORT_EGRESS_POISONERR", _IG),
    (12016, "NPORT_EGRESS_PACKET_HEADER", _IG),
    (12017, "NPORT_EGRESS_BUFFER_DATA", _IG),
    (12018, "NPORT_EGRESS_NCISOC_CREDITS", _IG),
    (12019, "NPORT_EGRESS_TAG_DATA", _IG),
    (12020, "NPORT_EGRESS_SEQIDERR", _RF),
    (12021, "NPORT_EGRESS_NXBAR_HDR_ECC_LIMIT_ERR", _IG),
    (12022, "NPORT_EGRESS_NXBAR_HDR_ECC_DBE_ERR", _WF),
    (12023, "NPORT_EGRESS_RAM_OUT_HDR_ECC_LIMIT_ERR", _IG),
    (12024, "NPORT_EGRESS_RAM_OUT_HDR_ECC_DBE_ERR", _WF),
    (12025, "NPORT_EGRESS_NCISOCCREDITOVFL", _WF),
    (12026, "NPORT_EGRESS_REQTGTIDMISMATCHERR", _WF),
    (12027, "NPORT_EGRESS_RSPREQIDMISMATCHERR", _WF),
    (12028, "NPORT_EGRESS_PRIVRSPERR", _RF),
    (12029, "NPORT_EGRESS_HWRSPERR", _IG),
    (12030, "NPORT_EGRESS_NXBAR_HDR_PARITY_ERR", _WF),
    (12031, "NPORT_EGRESS_NCISOC_CREDIT_PARITY_ERR", _WF),
    (12032, "NPORT_EGRESS_NXBAR_FLITTYPE_MISMATCH_ERR", _RF),
    (12033, "NPORT_EGRESS_CREDIT_TIME_OUT_ERR", _IG),
    (12034, "NPORT_EGRESS_INVALIDVCSET_ERR", _IG),
    (12035, "NPORT_EGRESS_NXBAR_SIDEBAND_PD_PARITY_ERR", _WF),
    (12036, "NPORT_EGRESS_NXBAR_REDUCTION_HDR_ECC_LIMIT_ERR", _IG),
    (12037, "NPORT_EGRESS_NXBAR_REDUCTION_HDR_ECC_DBE_ERR", _WF),
    (12038, "NPORT_EGRESS_MCRSPCTRLSTORE_ECC_LIMIT_ERR", _IG),
    (12039, "NPORT_EGRESS_MCRSPCTRLSTORE_ECC_DBE_ERR", _WF),
    (12040, "NPORT_EGRESS_RBCTRLSTORE_ECC_LIMIT_ERR", _IG),
    (12041, "NPORT_EGRESS_RBCTRLSTORE_ECC_DBE_ERR", _WF),
    (12042, "NPORT_EGRESS_MCREDSGT_ECC_LIMIT_ERR", _IG),
    (12043, "NPORT_EGRESS_MCREDSGT_ECC_DBE_ERR", _WF),
    (12044, "NPORT_EGRESS_MCREDBUF_ECC_LIMIT_ERR", _IG),
    (12045, "NPORT_EGRESS_MCREDBUF_ECC_DBE_ERR", _WF),
    (12046, "NPORT_EGRESS_MCRSP_RAM_HDR_ECC_LIMIT_ERR", _IG),
    (12047, "NPORT_EGRESS_MCRSP_RAM_HDR_ECC_DBE_ERR", _WF),
    (12048, "NPORT_EGRESS_NXBAR_REDUCTION_HDR_PARITY_ERR", _WF),
    (12049, "NPORT_EGRESS_NXBAR_REDUCTION_FLITTYPE_MISMATCH_ERR", _IG),
    (12050, "NPORT_EGRESS_MCRSP_CNT_ERR", _IG),
    (12051, "NPORT_EGRESS_RBRSP_CNT_ERR", _IG),
    (13001, "NPORT_FSTATE_TAGPOOLBUFERR", _UE),
    (13002, "NPORT_FSTATE_CRUMBSTOREBUFERR", _UE),
    (13003, "NPORT_FSTATE_SINGLEBITECCLIMITERR_CRUMBSTORE", _UE),
    (13004, "NPORT_FSTATE_UNCORRECTABLEECCERR_CRUMBSTORE", _UE),
    (13005, "NPORT_FSTATE_SINGLEBITECCLIMITERR_TAGSTORE", _UE),
    (13006, "NPORT_FSTATE_UNCORRECTABLEECCERR_TAGSTORE", _UE),
    (13007, "NPORT_FSTATE_SINGLEBITECCLIMITERR_FLUSHREQSTORE", _UE),
    (13008, "NPORT_FSTATE_UNCORRECTABLEECCERR_FLUSHREQSTORE", _UE),
    (14001, "NPORT_TSTATE_TAGPOOLBUFERR", _RG),
    (14002, "NPORT_TSTATE_CRUMBSTOREBUFERR", _RG),
    (14003, "NPORT_TSTATE_SINGLEBITECCLIMITERR_CRUMBSTORE", _IG),
    (14004, "NPORT_TSTATE_UNCORRECTABLEECCERR_CRUMBSTORE", _WF),
    (14005, "NPORT_TSTATE_SINGLEBITECCLIMITERR_TAGSTORE", _IG),
    (14006, "NPORT_TSTATE_UNCORRECTABLEECCERR_TAGSTORE", _WF),
    (14007, "NPORT_TSTATE_TAGPOOL_ECC_LIMIT_ERR", _IG),
    (14008, "NPORT_TSTATE_TAGPOOL_ECC_DBE_ERR", _WF),
    (14009, "NPORT_TSTATE_CRUMBSTORE_ECC_LIMIT_ERR", _IG),
    (14010, "NPORT_TSTATE_CRUMBSTORE_ECC_DBE_ERR", _WF),
    (14011, "NPORT_TSTATE_COL_CRUMBSTOREBUFERR", _UE),
    (14012, "NPORT_TSTATE_COL_CRUMBSTORE_ECC_LIMIT_ERR", _UE),
    (14013, "NPORT_TSTATE_COL_CRUMBSTORE_ECC_DBE_ERR", _UE),
    (14014, "NPORT_TSTATE_TD_TID_RAMBUFERR", _RG),
    (14015, "NPORT_TSTATE_TD_TID_RAM_ECC_LIMIT_ERR", _IG),
    (14016, "NPORT_TSTATE_TD_TID_RAM_ECC_DBE_ERR", _WF),
    (14017, "NPORT_TSTATE_ATO_ERR", _RF),
    (14018, "NPORT_TSTATE_CAMRSP_ERR", _RG),
    (15001, "NPORT_ROUTE_ROUTEBUFERR", _WF),
    (15002, "NPORT_ROUTE_NOPORTDEFINEDERR", _IG),
    (15003, "NPORT_ROUTE_INVALIDROUTEPOLICYERR", _IG),
    (15004, "NPORT_ROUTE_ECCLIMITERR", _IG),
    (15005, "NPORT_ROUTE_UNCORRECTABLEECCERR", _WF),
    (15006, "NPORT_ROUTE_TRANSDONERESVERR", _WF),
    (15007, "NPORT_ROUTE_PACKET_HEADER", _IG),
    (15008, "NPORT_ROUTE_GLT_ECC_LIMIT_ERR", _IG),
    (15009, "NPORT_ROUTE_GLT_ECC_DBE_ERR", _WF),
    (15010, "NPORT_ROUTE_PDCTRLPARERR", _WF),
    (15011, "NPORT_ROUTE_NVS_ECC_LIMIT_ERR", _IG),
    (15012, "NPORT_ROUTE_NVS_ECC_DBE_ERR", _WF),
    (15013, "NPORT_ROUTE_CDTPARERR", _WF),
    (15014, "NPORT_ROUTE_MCRID_ECC_LIMIT_ERR", _IG),
    (15015, "NPORT_ROUTE_MCRID_ECC_DBE_ERR", _WF),
    (15016, "NPORT_ROUTE_EXTMCRID_ECC_LIMIT_ERR", _IG),
    (15017, "NPORT_ROUTE_EXTMCRID_ECC_DBE_ERR", _WF),
    (15018, "NPORT_ROUTE_RAM_ECC_LIMIT_ERR", _IG),
    (15019, "NPORT_ROUTE_RAM_ECC_DBE_ERR", _WF),
    (15020, "NPORT_ROUTE_INVALID_MCRID_ERR", _IG),
    (16001, "NPORT_DATAPOISONED", _IG),
    (16002, "NPORT_UCINTERNAL", _UE),
    (16003, "NPORT_CINTERNAL", _UE),
    (17001, "NVLCTRL_INGRESSECCSOFTLIMITERR", _IG),
    (17002, "NVLCTRL_INGRESSECCHDRDOUBLEBITERR", _WF),
    (17003, "NVLCTRL_INGRESSECCDATADOUBLEBITERR", _WF),
    (17004, "NVLCTRL_INGRESSBUFFERERR", _IG),
    (17005, "NVLCTRL_EGRESSECCSOFTLIMITERR", _IG),
    (17006, "NVLCTRL_EGRESSECCHDRDOUBLEBITERR", _WF),
    (17007, "NVLCTRL_EGRESSECCDATADOUBLEBITERR", _WF),
    (17008, "NVLCTRL_EGRESSBUFFERERR", _IG),
    (18001, "NVLIPT_DLPROTOCOL", _SI),
    (18002, "NVLIPT_DATAPOISONED", _SI),
    (18003, "NVLIPT_FLOWCONTROL", _SI),
    (18004, "NVLIPT_RESPONSETIMEOUT", _SI),
    (18005, "NVLIPT_TARGETERROR", _SI),
    (18006, "NVLIPT_UNEXPECTEDRESPONSE", _SI),
    (18007, "NVLIPT_RECEIVEROVERFLOW", _SI),
    (18008, "NVLIPT_MALFORMEDPACKET", _SI),
    (18009, "NVLIPT_STOMPEDPACKETRECEIVED", _SI),
    (18010, "NVLIPT_UNSUPPORTEDREQUEST", _SI),
    (18011, "NVLIPT_UCINTERNAL", _UE),
    (18012, "NVLIPT_PHYRECEIVER", _SI),
    (18013, "NVLIPT_BADAN0PKT", _SI),
    (18014, "NVLIPT_REPLAYTIMEOUT", _SI),
    (18015, "NVLIPT_ADVISORYERROR", _SI),
    (18016, "NVLIPT_CINTERNAL", _UE),
    (18017, "NVLIPT_HEADEROVERFLOW", _SI),
    (18018, "NVLIPT_RSTSEQ_PHYARB_TIMEOUT", _SI),
    (18019, "NVLIPT_RSTSEQ_PLL_TIMEOUT", _SI),
    (18020, "NVLIPT_CLKCTL_ILLEGAL_REQUEST", _SI),
    (19001, "NVLTLC_TXHDRCREDITOVFERR", _SI),
    (19002, "NVLTLC_TXDATACREDITOVFERR", _SI),
    (19003, "NVLTLC_TXDLCREDITOVFERR", _SI),
    (19004, "NVLTLC_TXDLCREDITPARITYERR", _WF),
    (19005, "NVLTLC_TXRAMHDRPARITYERR", _WF),
    (19006, "NVLTLC_TXRAMDATAPARITYERR", _WF),
    (19007, "NVLTLC_TXUNSUPVCOVFERR", _SI),
    (19008, "NVLTLC_TXSTOMPDET", _SI),
    (19009, "NVLTLC_TXPOISONDET", _IG),
    (19010, "NVLTLC_TARGETERR", _SI),
    (19011, "NVLTLC_TX_PACKET_HEADER", _SI),
    (19012, "NVLTLC_UNSUPPORTEDREQUESTERR", _SI),
    (19013, "NVLTLC_RXDLHDRPARITYERR", _WF),
    (19014, "NVLTLC_RXDLDATAPARITYERR", _WF),
    (19015, "NVLTLC_RXDLCTRLPARITYERR", _WF),
    (19016, "NVLTLC_RXRAMDATAPARITYERR", _WF),
    (19017, "NVLTLC_RXRAMHDRPARITYERR", _WF),
    (19018, "NVLTLC_RXINVALIDAEERR", _SI),
    (19019, "NVLTLC_RXINVALIDBEERR", _SI),
    (19020, "NVLTLC_RXINVALIDADDRALIGNERR", _SI),
    (19021, "NVLTLC_RXPKTLENERR", _SI),
    (19022, "NVLTLC_RSVCMDENCERR", _IG),
    (19023, "NVLTLC_RSVDATLENENCERR", _IG),
    (19024, "NVLTLC_RSVADDRTYPEERR", _IG),
    (19025, "NVLTLC_RSVRSPSTATUSERR", _IG),
    (19026, "NVLTLC_RSVPKTSTATUSERR", _IG),
    (19027, "NVLTLC_RSVCACHEATTRPROBEREQERR", _UE),
    (19028, "NVLTLC_RSVCACHEATTRPROBERSPERR", _UE),
    (19029, "NVLTLC_DATLENGTATOMICREQMAXERR", _UE),
    (19030, "NVLTLC_DATLENGTRMWREQMAXERR", _UE),
    (19031, "NVLTLC_DATLENLTATRRSPMINERR", _UE),
    (19032, "NVLTLC_INVALIDCACHEATTRPOERR", _UE),
    (19033, "NVLTLC_INVALIDCRERR", _IG),
    (19034, "NVLTLC_RXRESPSTATUSTARGETERR", _IG),
    (19035, "NVLTLC_RXRESPSTATUSUNSUPPORTEDREQUESTERR", _IG),
    (19036, "NVLTLC_RXHDROVFERR", _FD),
    (19037, "NVLTLC_RXDATAOVFERR", _FD),
    (19038, "NVLTLC_STOMPDETERR", _IG),
    (19039, "NVLTLC_RXPOISONERR", _IG),
    (19040, "NVLTLC_CORRECTABLEINTERNALERR", _IG),
    (19041, "NVLTLC_RXUNSUPVCOVFERR", _IG),
    (19042, "NVLTLC_RXUNSUPNVLINKCREDITRELERR", _IG),
    (19043, "NVLTLC_RXUNSUPNCISOCCREDITRELERR", _IG),
    (19044, "NVLTLC_RX_PACKET_HEADER", _IG),
    (19045, "NVLTLC_RX_ERR_HEADER", _IG),
    (19046, "NVLTLC_TX_SYS_NCISOC_PARITY_ERR", _WF),
    (19047, "NVLTLC_TX_SYS_NCISOC_HDR_ECC_DBE_ERR", _WF),
    (19048, "NVLTLC_TX_SYS_NCISOC_DAT_ECC_DBE_ERR", _WF),
    (19049, "NVLTLC_TX_SYS_NCISOC_ECC_LIMIT_ERR", _IG),
    (19050, "NVLTLC_TX_SYS_TXRSPSTATUS_HW_ERR", _IG),
    (19051, "NVLTLC_TX_SYS_TXRSPSTATUS_UR_ERR", _IG),
    (19052, "NVLTLC_TX_SYS_TXRSPSTATUS_PRIV_ERR", _IG),
    (19053, "NVLTLC_RX_SYS_NCISOC_PARITY_ERR", _WF),
    (19054, "NVLTLC_RX_SYS_HDR_RAM_ECC_DBE_ERR", _WF),
    (19055, "NVLTLC_RX_SYS_HDR_RAM_ECC_LIMIT_ERR", _IG),
    (19056, "NVLTLC_RX_SYS_DAT0_RAM_ECC_DBE_ERR", _WF),
    (19057, "NVLTLC_RX_SYS_DAT0_RAM_ECC_LIMIT_ERR", _IG),
    (19058, "NVLTLC_RX_SYS_DAT1_RAM_ECC_DBE_ERR", _WF),
    (19059, "NVLTLC_RX_SYS_DAT1_RAM_ECC_LIMIT_ERR", _IG),
    (19060, "NVLTLC_TX_LNK_CREQ_RAM_HDR_ECC_DBE_ERR", _WF),
    (19061, "NVLTLC_TX_LNK_CREQ_RAM_DAT_ECC_DBE_ERR", _WF),
    (19062, "NVLTLC_TX_LNK_CREQ_RAM_ECC_LIMIT_ERR", _IG),
    (19063, "NVLTLC_TX_LNK_RSP_RAM_HDR_ECC_DBE_ERR", _WF),
    (19064, "NVLTLC_TX_LNK_RSP_RAM_DAT_ECC_DBE_ERR", _WF),
    (19065, "NVLTLC_TX_LNK_RSP_RAM_ECC_LIMIT_ERR", _IG),
    (19066, "NVLTLC_TX_LNK_COM_RAM_HDR_ECC_DBE_ERR", _WF),
    (19067, "NVLTLC_TX_LNK_COM_RAM_DAT_ECC_DBE_ERR", _WF),
    (19068, "NVLTLC_TX_LNK_COM_RAM_ECC_LIMIT_ERR", _IG),
    (19069, "NVLTLC_TX_LNK_RSP1_RAM_HDR_ECC_DBE_ERR", _WF),
    (19070, "NVLTLC_TX_LNK_RSP1_RAM_DAT_ECC_DBE_ERR", _WF),
    (19071, "NVLTLC_TX_LNK_RSP1_RAM_ECC_LIMIT_ERR", _IG),
    (19072, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC0", _IG),
    (19073, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC1", _IG),
    (19074, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC2", _UE),
    (19075, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC3", _UE),
    (19076, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC4", _UE),
    (19077, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC5", _IG),
    (19078, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC6", _IG),
    (19079, "NVLTLC_TX_LNK_AN1_TIMEOUT_VC7", _UE),
    (19080, "NVLTLC_RX_LNK_RXRSPSTATUS_HW_ERR", _FD),
    (19081, "NVLTLC_RX_LNK_RXRSPSTATUS_UR_ERR", _IG),
    (19082, "NVLTLC_RX_LNK_RXRSPSTATUS_PRIV_ERR", _IG),
    (19083, "NVLTLC_RX_LNK_INVALID_COLLAPSED_RESPONSE_ERR", _FD),
    (19084, "NVLTLC_RX_LNK_AN1_HEARTBEAT_TIMEOUT_ERR", _RF),
    (20001, "DLPL_TX_REPLAY", _IG),
    (20002, "DLPL_TX_RECOVERY_SHORT", _IG),
    (20003, "DLPL_TX_RECOVERY_LONG", _IG),
    (20004, "DLPL_TX_FAULT_RAM", _SI),
    (20005, "DLPL_TX_FAULT_INTERFACE", _SI),
    (20006, "DLPL_TX_FAULT_SUBLINK_CHANGE", _FD),
    (20007, "DLPL_RX_FAULT_SUBLINK_CHANGE", _FD),
    (20008, "DLPL_RX_FAULT_DL_PROTOCOL", _IG),
    (20009, "DLPL_RX_SHORT_ERROR_RATE", _ME),
    (20010, "DLPL_RX_LONG_ERROR_RATE", _ME),
    (20011, "DLPL_RX_ILA_TRIGGER", _UE),
    (20012, "DLPL_RX_CRC_COUNTER", _ME),
    (20013, "DLPL_LTSSM_FAULT", _IG),
    (20014, "DLPL_LTSSM_PROTOCOL", _IG),
    (20015, "DLPL_MINION_REQUEST", _IG),
    (20016, "DLPL_FIFO_DRAIN_ERR", _UE),
    (20017, "DLPL_CONST_DET_ERR", _UE),
    (20018, "DLPL_OFF2SAFE_LINK_DET_ERR", _UE),
    (20019, "DLPL_SAFE2NO_LINK_DET_ERR", _UE),
    (20020, "DLPL_SCRAM_LOCK_ERR", _UE),
    (20021, "DLPL_SYM_LOCK_ERR", _UE),
    (20022, "DLPL_SYM_ALIGN_END_ERR", _UE),
    (20023, "DLPL_FIFO_SKEW_ERR", _UE),
    (20024, "DLPL_TRAIN2SAFE_LINK_DET_ERR", _UE),
    (20025, "DLPL_HS2SAFE_LINK_DET_ERR", _UE),
    (20026, "DLPL_FENCE_ERR", _UE),
    (20027, "DLPL_SAFE_NO_LD_ERR", _UE),
    (20028, "DLPL_E2SAFE_LD_ERR", _UE),
    (20029, "DLPL_RC_RXPWR_ERR", _UE),
    (20030, "DLPL_RC_TXPWR_ERR", _UE),
    (20031, "DLPL_RC_DEADLINE_ERR", _UE),
    (20032, "DLPL_TX_HS2LP_ERR", _UE),
    (20033, "DLPL_RX_HS2LP_ERR", _UE),
    (20034, "DLPL_LTSSM_FAULT_UP", _RG),
    (20035, "DLPL_LTSSM_FAULT_DOWN", _IG),
    (20036, "DLPL_PHY_A", _FD),
    (20037, "DLPL_TX_PL_ERROR", _FD),
    (20038, "DLPL_RX_PL_ERROR", _FD),
    (21001, "AFS_UC_INGRESS_CREDIT_OVERFLOW", _UE),
    (21002, "AFS_UC_INGRESS_CREDIT_UNDERFLOW", _UE),
    (21003, "AFS_UC_EGRESS_CREDIT_OVERFLOW", _UE),
    (21004, "AFS_UC_EGRESS_CREDIT_UNDERFLOW", _UE),
    (21005, "AFS_UC_INGRESS_NON_BURSTY_PKT_DETECTED", _UE),
    (21006, "AFS_UC_INGRESS_NON_STICKY_PKT_DETECTED", _UE),
    (21007, "AFS_UC_INGRESS_BURST_GT_17_DATA_VC_DETECTED", _UE),
    (21008, "AFS_UC_INGRESS_BURST_GT_1_NONDATA_VC_DETECTED", _UE),
    (21009, "AFS_UC_INVALID_DST", _UE),
    (21010, "AFS_UC_PKT_MISROUTE", _UE),
    (22001, "MINION_UCODE_IMEM", _IG),
    (22002, "MINION_UCODE_DMEM", _IG),
    (22003, "MINION_HALT", _RF),
    (22004, "MINION_BOOT_ERROR", _IG),
    (22005, "MINION_TIMEOUT", _IG),
    (22006, "MINION_DLCMD_FAULT", _IG),
    (22007, "MINION_DLCMD_TIMEOUT", _IG),
    (22008, "MINION_DLCMD_FAIL", _IG),
    (22009, "MINION_FATAL_INTR", _IG),
    (22010, "MINION_WATCHDOG", _IG),
    (22011, "MINION_EXTERR", _RF),
    (22012, "MINION_FATAL_LINK_INTR", _WF),
    (22013, "MINION_NONFATAL", _IG),
    (23001, "NXBAR_TILE_INGRESS_BUFFER_OVERFLOW", _RF),
    (23002, "NXBAR_TILE_INGRESS_BUFFER_UNDERFLOW", _RF),
    (23003, "NXBAR_TILE_EGRESS_CREDIT_OVERFLOW", _RF),
    (23004, "NXBAR_TILE_EGRESS_CREDIT_UNDERFLOW", _RF),
    (23005, "NXBAR_TILE_INGRESS_NON_BURSTY_PKT", _RF),
    (23006, "NXBAR_TILE_INGRESS_NON_STICKY_PKT", _RF),
    (23007, "NXBAR_TILE_INGRESS_BURST_GT_9_DATA_VC", _RF),
    (23008, "NXBAR_TILE_INGRESS_PKT_INVALID_DST", _RF),
    (23009, "NXBAR_TILE_INGRESS_PKT_PARITY_ERROR", _WF),
    (23010, "NXBAR_TILEOUT_INGRESS_BUFFER_OVERFLOW", _RF),
    (23011, "NXBAR_TILEOUT_INGRESS_BUFFER_UNDERFLOW", _RF),
    (23012, "NXBAR_TILEOUT_EGRESS_CREDIT_OVERFLOW", _RF),
    (23013, "NXBAR_TILEOUT_EGRESS_CREDIT_UNDERFLOW", _RF),
    (23014, "NXBAR_TILEOUT_INGRESS_NON_BURSTY_PKT", _RF),
    (23015, "NXBAR_TILEOUT_INGRESS_NON_STICKY_PKT", _RF),
    (23016, "NXBAR_TILEOUT_INGRESS_BURST_GT_9_DATA_VC", _RF),
    (23017, "NXBAR_TILEOUT_EGRESS_CDT_PARITY_ERROR", _WF),
    (24001, "NPORT_SOURCETRACK_CREQ_TCEN0_CRUMBSTORE_ECC_LIMIT_ERR", _IG),
    (24002, "NPORT_SOURCETRACK_CREQ_TCEN0_TD_CRUMBSTORE_ECC_LIMIT_ERR", _IG),
    (24003, "NPORT_SOURCETRACK_CREQ_TCEN1_CRUMBSTORE_ECC_LIMIT_ERR", _IG),
    (24004, "NPORT_SOURCETRACK_CREQ_TCEN0_CRUMBSTORE_ECC_DBE_ERR", _WF),
    (24005, "NPORT_SOURCETRACK_CREQ_TCEN0_TD_CRUMBSTORE_ECC_DBE_ERR", _WF),
    (24006, "NPORT_SOURCETRACK_CREQ_TCEN1_CRUMBSTORE_ECC_DBE_ERR", _WF),
    (24007, "NPORT_SOURCETRACK_SOURCETRACK_TIME_OUT_ERR", _RG),
    (24008, "NPORT_SOURCETRACK_DUP_CREQ_TCEN0_TAG_ERR", _RG),
    (24009, "NPORT_SOURCETRACK_INVALID_TCEN0_RSP_ERR", _RG),
    (24010, "NPORT_SOURCETRACK_INVALID_TCEN1_RSP_ERR", _RG),
    (25001, "NVLIPT_LNK_ILLEGALLINKSTATEREQUEST", _IG),
    (25002, "NVLIPT_LNK_FAILEDMINIONREQUEST", _IG),
    (25003, "NVLIPT_LNK_RESERVEDREQUESTVALUE", _IG),
    (25004, "NVLIPT_LNK_LINKSTATEWRITEWHILEBUSY", _IG),
    (25005, "NVLIPT_LNK_LINK_STATE_REQUEST_TIMEOUT", _IG),
    (25006, "NVLIPT_LNK_WRITE_TO_LOCKED_SYSTEM_REG_ERR", _IG),
    (25007, "NVLIPT_LNK_SLEEPWHILEACTIVELINK", _IG),
    (25008, "NVLIPT_LNK_RSTSEQ_PHYCTL_TIMEOUT", _SI),
    (25009, "NVLIPT_LNK_RSTSEQ_CLKCTL_TIMEOUT", _SI),
    (25010, "NVLIPT_LNK_ALI_TRAINING_FAIL", _SI),
    (26001, "SOE_RESET", _RF),
    (26002, "SOE_BOOTSTRAP", _RF),
    (26003, "SOE_COMMAND_QUEUE", _RF),
    (26004, "SOE_TIMEOUT", _RF),
    (26005, "SOE_SHUTDOWN", _RF),
    (26006, "SOE_HALT", _RF),
    (26007, "SOE_EXTERR", _RF),
    (26008, "SOE_WATCHDOG", _IG),
    (27001, "CCI_RESET", _ME),
    (27002, "CCI_INIT", _ME),
    (27003, "CCI_TIMEOUT", _ME),
    (27004, "CCI_SHUTDOWN", _ME),
    (27005, "CCI_MODULE", _ME),
    (27006, "CCI_MODULE_BOOT", _ME),
    (27007, "CCI_MODULE_RECOVERY", _ME),
    (28001, "OSFP_THERM_WARN_ACTIVATED", _TH),
    (28002, "OSFP_THERM_WARN_DEACTIVATED", _IG),
    (28003, "OSFP_THERM_OVERT_ACTIVATED", _TH),
    (28004, "OSFP_THERM_OVERT_DEACTIVATED", _IG),
    (28005, "OSFP_THERM_HEARTBEAT_SHUTDOWN", _TH),
    (28006, "", _RI),
    (29001, "NPORT_MULTICASTTSTATE_TAGPOOL_ECC_LIMIT_ERR", _IG),
    (29002, "NPORT_MULTICASTTSTATE_TAGPOOL_ECC_DBE_ERR", _WF),
    (29003, "NPORT_MULTICASTTSTATE_CRUMBSTORE_ECC_LIMIT_ERR", _IG),
    (29004, "NPORT_MULTICASTTSTATE_CRUMBSTORE_ECC_DBE_ERR", _WF),
    (29005, "NPORT_MULTICASTTSTATE_CRUMBSTORE_BUF_OVERWRITE_ERR", _IG),
    (29006, "NPORT_MULTICASTTSTATE_CRUMBSTORE_MCTO_ERR", _IG),
    (30001, "NPORT_REDUCTIONTSTATE_TAGPOOL_ECC_LIMIT_ERR", _IG),
    (30002, "NPORT_REDUCTIONTSTATE_TAGPOOL_ECC_DBE_ERR", _WF),
    (30003, "NPORT_REDUCTIONTSTATE_CRUMBSTORE_ECC_LIMIT_ERR", _IG),
    (30004, "NPORT_REDUCTIONTSTATE_CRUMBSTORE_ECC_DBE_ERR", _WF),
    (30005, "NPORT_REDUCTIONTSTATE_CRUMBSTORE_BUF_OVERWRITE_ERR", _IG),
    (30006, "NPORT_REDUCTIONTSTATE_CRUMBSTORE_RTO_ERR", _IG),
)
# fmt: on


def _build() -> Mapping[int, SXidInfo]:
    table: dict[int, SXidInfo] = {}
    for code, name, token in _ROWS:
        if code in table:
            raise ValueError(f"SXid {code} listed twice")
        fmg, fmg_fatal = _fmg_table(code)
        nvs_fatal = token != _IG
        table[code] = SXidInfo(code=code, name=NAME_PREFIX + name if name else "", nvidia_action=token,
                               nvs_fatal=nvs_fatal, fmg_table=fmg,
                               fatal=fmg_fatal if fmg_fatal is not None else nvs_fatal)
    for code in (*FMG_NONFATAL, *FMG_FATAL, *FMG_ALWAYS_FATAL, *FMG_NOTABLE):
        if code not in table:
            raise ValueError(f"SXid {code} is in FMG's tables but not in NVS's")
    return MappingProxyType(table)


SXID_CATALOG: Mapping[int, SXidInfo] = _build()


def lookup(code: int) -> SXidInfo | None:
    """The catalog entry for ``code``, or None for a code neither source lists."""
    return SXID_CATALOG.get(code)
