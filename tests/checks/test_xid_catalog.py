"""XID_CATALOG against NVIDIA's catalog (tests/data/peer-fixtures/peer-catalogs.json, a byte-for-byte
copy of shared/realdata/peer-fixtures with provenance in SOURCES.md there, so the test runs on a
fresh clone), code by code; the generated data module against its generator; the decode rules of
the two NVLink workflows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumon.model import Action, Severity
from gpumon_checks.xid.catalog import (
    CATALOG_SOURCE,
    NVIDIA_ACTIONS,
    NVL5_RULES,
    OVERRIDES,
    UNKNOWN,
    WORKFLOW_TEXT,
    XID74_REPEAT_LIMIT,
    XID74_RULES,
    XID_CATALOG,
    XidInfo,
    decode_nvlink5,
    decode_xid74,
    lookup,
    xid74_repeats,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
PEER_CATALOGS = DATA / "peer-fixtures" / "peer-catalogs.json"
CATALOG_MD = DATA / "xid-catalog.md"
_CODES = json.loads(PEER_CATALOGS.read_text(encoding="utf-8"))["codes"]
NVIDIA: dict[int, dict[str, str]] = {int(c): row["nvidia"] for c, row in _CODES.items() if "nvidia" in row}


# -- the whole catalog, code by code -----------------------------------------------------------


def test_catalog_covers_every_code_nvidia_lists_1_to_172() -> None:
    assert sorted(NVIDIA) == list(range(1, 173))
    assert sorted(XID_CATALOG) == list(range(1, 173))


@pytest.mark.parametrize("code", sorted(NVIDIA))
def test_code_matches_nvidias_columns_and_the_one_mapping(code: int) -> None:
    info, nv = XID_CATALOG[code], NVIDIA[code]
    assert (info.code, info.mnemonic, info.nvidia_action, info.nvidia_investigatory) == (
        code, nv["mnemonic"], nv["immediate"], nv["investigatory"])
    assert info.description and "\n" not in info.description
    mapped = NVIDIA_ACTIONS[nv["immediate"]]
    if code in OVERRIDES:  # the only departures, each with its reason
        o = OVERRIDES[code]
        assert (info.severity, info.action, info.override) == (o.severity, o.action, o.reason)
        assert (info.severity, info.action) != (mapped.severity, mapped.action)
    else:
        assert (info.severity, info.action, info.advice, info.override) == (
            mapped.severity, mapped.action, mapped.advice, None)


def test_the_override_table_is_the_documented_one() -> None:
    assert sorted(OVERRIDES) == [63, 64, 171, 172]
    assert all(len(o.reason) > 60 for o in OVERRIDES.values())


def test_the_mapping_is_the_issues() -> None:
    want = {
        "RESTART_APP": (Severity.WARN, Action.RESTART_APP),
        "IGNORE": (Severity.OK, Action.NONE),
        "RESET_GPU": (Severity.FAIL, Action.RESET_GPU),
        "RESTART_BM": (Severity.FAIL, Action.REBOOT_NODE),
        "CONTACT_SUPPORT": (Severity.FAIL, Action.INSPECT_HARDWARE),
        "UPDATE_SWFW": (Severity.WARN, Action.NONE),
    }
    for token, verdict in want.items():
        assert (NVIDIA_ACTIONS[token].severity, NVIDIA_ACTIONS[token].action) == verdict, token
    assert "update" in NVIDIA_ACTIONS["UPDATE_SWFW"].advice
    # every token NVIDIA uses has exactly one rule (the module would not import otherwise)
    assert {nv["immediate"] for nv in NVIDIA.values()} <= set(NVIDIA_ACTIONS)


def test_unknown_codes_take_contact_supports_action_as_a_warning() -> None:
    assert lookup(173) is None  # in gpud only, not in NVIDIA's catalog
    assert lookup(0) is None and lookup(-1) is None and lookup(99999) is None
    assert (UNKNOWN.severity, UNKNOWN.action) == (Severity.WARN, NVIDIA_ACTIONS["CONTACT_SUPPORT"].action)
    # listed without an action (162-170) is the same as unknown
    assert (NVIDIA_ACTIONS[""].severity, NVIDIA_ACTIONS[""].action) == (UNKNOWN.severity, UNKNOWN.action)
    assert {c for c, i in XID_CATALOG.items() if not i.nvidia_action} == set(range(162, 173))


@pytest.mark.parametrize(
    ("code", "severity", "action", "nvidia_action", "workflow"),
    [
        (1, Severity.FAIL, Action.INSPECT_HARDWARE, "CONTACT_SUPPORT", None),
        (13, Severity.WARN, Action.RESTART_APP, "RESTART_APP", "XID_13"),
        (31, Severity.WARN, Action.RESTART_APP, "RESTART_APP", "XID_31"),
        (43, Severity.OK, Action.NONE, "IGNORE", None),
        (45, Severity.OK, Action.NONE, "WORKFLOW_XID_45", "XID_45"),
        (48, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_XID_48", "XID_48"),
        (54, Severity.FAIL, Action.INSPECT_HARDWARE, "CHECK_MECHANICALS", None),
        (63, Severity.WARN, Action.RESET_GPU, "IGNORE", None),
        (64, Severity.FAIL, Action.INSPECT_HARDWARE, "RESET_GPU", None),
        (74, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_NVLINK_ERR", "NVLINK_ERR"),
        (78, Severity.WARN, Action.NONE, "UPDATE_SWFW", None),
        (79, Severity.FAIL, Action.REBOOT_NODE, "RESTART_BM", None),
        (94, Severity.WARN, Action.RESTART_APP, "RESTART_APP", None),
        (95, Severity.FAIL, Action.RESET_GPU, "RESET_GPU", None),
        (100, Severity.WARN, Action.RESTART_APP, "RESTART_APP", None),
        (119, Severity.FAIL, Action.RESET_GPU, "RESET_GPU", None),
        (145, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR"),
        (149, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR"),
        (151, Severity.FAIL, Action.REBOOT_NODE, "RESTART_VM", None),
        (154, Severity.OK, Action.NONE, "XID_154", "XID_154"),
        (159, Severity.WARN, Action.RESET_GPU, "CHECK_UVM", None),
        (167, Severity.WARN, Action.INSPECT_HARDWARE, "", None),
        (172, Severity.FAIL, Action.RESET_GPU, "", None),
    ],
)
def test_spot_check_actions(
    code: int, severity: Severity, action: Action, nvidia_action: str, workflow: str | None
) -> None:
    info = XID_CATALOG[code]
    assert (info.severity, info.action, info.nvidia_action, info.workflow) == (
        severity, action, nvidia_action, workflow)


def test_descriptions_are_ours_or_say_they_are_nvidias_names() -> None:
    assert XID_CATALOG[79].description == "The GPU fell off the bus: the driver lost PCIe access to it."
    assert XID_CATALOG[77].description == "Exception in copy engine 8 (CE8) while running work."
    assert XID_CATALOG[165].description.startswith("As NVIDIA names it: PSHC_ZERO_LIFETIME")


def test_catalog_is_read_only() -> None:
    with pytest.raises(TypeError):
        cast(Any, XID_CATALOG)[999] = XID_CATALOG[79]
    with pytest.raises(TypeError):
        cast(Any, OVERRIDES)[13] = OVERRIDES[64]


def test_source_cites_nvidia_and_the_xlsx() -> None:
    assert "docs.nvidia.com/deploy/xid-errors" in CATALOG_SOURCE
    assert "7f70ce9684be0c9d98a367770341ccc1d8bca4465cebe42dab7e23d57df5d5a5" in CATALOG_SOURCE
    assert "XID_154_EVAL" in WORKFLOW_TEXT and "RESTART_APP" in WORKFLOW_TEXT["XID_154_EVAL"]


# -- the generated module and its generator ------------------------------------------------------


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_xid_catalog", ROOT / "tools" / "gen_xid_catalog.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_module_is_in_step_with_nvidias_data() -> None:
    """A new NVIDIA release is one regeneration: the module is exactly what the script makes."""
    gen = _generator()
    module = ROOT / "checks" / "xid" / "catalog_data.py"
    assert gen.generate(PEER_CATALOGS) == module.read_text(encoding="utf-8")


def test_generator_check_mode_spots_a_stale_module(tmp_path: Path) -> None:
    gen = _generator()
    out = tmp_path / "data.py"
    assert gen.main(["--input", str(PEER_CATALOGS), "--output", str(out), "--check"]) == 1
    assert gen.main(["--input", str(PEER_CATALOGS), "--output", str(out)]) == 0
    assert gen.main(["--input", str(PEER_CATALOGS), "--output", str(out), "--check"]) == 0


def test_generator_keeps_long_texts_whole() -> None:
    from gpumon_checks.xid import catalog_data as xid_catalog_data

    doc = json.loads(PEER_CATALOGS.read_text(encoding="utf-8"))
    assert dict(xid_catalog_data.WORKFLOWS) == doc["resolution_buckets"]
    assert [r[:2] for r in xid_catalog_data.NVL5_DECODE] == [
        (int(r["xid"]), r["unit"]) for r in doc["nvl5_decode_rules"]]


# -- the team's research note agrees where it overlaps ----------------------------------------------


def _note_rows() -> dict[int, list[str]]:
    rows: dict[int, list[str]] = {}
    in_table = False
    for line in CATALOG_MD.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            in_table = line.startswith("## XID table")
            continue
        if in_table and line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells[0].isdigit():
                rows[int(cells[0])] = cells
    return rows


def test_research_note_agrees_with_the_catalog_where_it_overlaps() -> None:
    rows = _note_rows()
    assert len(rows) == 59
    for code, cells in rows.items():
        immediate = cells[4].split(" / ")[0].strip()
        assert XID_CATALOG[code].mnemonic == cells[1], code
        assert XID_CATALOG[code].nvidia_action == ("" if immediate == "(not given)" else immediate), code


# -- WORKFLOW_NVLINK_ERR (Xid 74): every register NVIDIA describes ------------------------------------


def _regs(**by_register: int) -> tuple[int, ...]:
    words = [0] * 7
    for name, value in by_register.items():
        words[int(name[1:]) - 1] = value
    return tuple(words)


@pytest.mark.parametrize(
    ("words", "classes", "severity", "action"),
    [
        (_regs(r1=0x1), ("ignorable",), Severity.OK, Action.NONE),
        ((0x40800001,), ("ignorable",), Severity.OK, Action.NONE),  # bits 0, 23, 30
        (_regs(r1=0x2), ("sympathetic",), Severity.WARN, Action.NONE),
        (_regs(r1=0x10), ("ecc_parity",), Severity.FAIL, Action.RESET_GPU),
        (_regs(r1=0x10000), ("mechanical",), Severity.FAIL, Action.CHECK_CABLES),
        (_regs(r1=0x200000), ("marginal_si",), Severity.FAIL, Action.CHECK_CABLES),
        (_regs(r1=1 << 27), ("repeat_report",), Severity.WARN, Action.NONE),
        (_regs(r1=0x10010), ("ecc_parity", "mechanical"), Severity.FAIL, Action.RESET_GPU),  # worst wins
        # third register
        (_regs(r3=0x41), ("ecc_parity",), Severity.FAIL, Action.RESET_GPU),
        (_regs(r3=1 << 13), ("unexpected",), Severity.FAIL, Action.RESET_GPU),
        (_regs(r3=0x10000), ("repeat_field_diag",), Severity.WARN, Action.NONE),  # NVSentinel's line
        (_regs(r3=1 << 18), ("repeat_report",), Severity.WARN, Action.NONE),
        # fourth register
        (_regs(r4=1 << 17), ("sympathetic",), Severity.WARN, Action.NONE),
        (_regs(r4=1 << 18), ("fabric_reset",), Severity.FAIL, Action.RESET_GPU),
        # fifth register
        (_regs(r5=1 << 24), ("ecc_parity",), Severity.FAIL, Action.RESET_GPU),
        (_regs(r5=1 << 26), ("ecc_threshold",), Severity.OK, Action.NONE),
        (_regs(r1=0x1, r5=1 << 20), ("ignorable", "ecc_threshold"), Severity.OK, Action.NONE),
    ],
)
def test_xid74_register_bit_classes(words: tuple[int, ...], classes: tuple[str, ...], severity: Severity,
                                    action: Action) -> None:
    d = decode_xid74(words)
    assert d is not None and (d.classes, d.severity, d.action) == (classes, severity, action), d
    assert not d.unknown_bits and not d.undecoded_words


def test_xid74_what_nvidia_does_not_list_keeps_the_catalog_default() -> None:
    assert decode_xid74(()) is None
    default = (Severity.FAIL, Action.RESET_GPU)
    d = decode_xid74((0x1 | 1 << 2,))  # bit 2 is not in NVIDIA's list: "report a bug"
    assert d is not None and d.unknown_bits == ((0, 2),) and (d.severity, d.action) == default
    assert "register 1 bit 2" in d.basis
    d = decode_xid74(_regs(r2=0x5))  # the second register is not described (not valid on Hopper)
    assert d is not None and d.undecoded_words == (1,) and (d.severity, d.action) == default
    d = decode_xid74(_regs())  # seven zero words: nothing to go by
    assert d is not None and d.classes == () and (d.severity, d.action) == default


def test_xid74_repeats_escalate_past_nvidias_count() -> None:
    assert XID74_REPEAT_LIMIT == 2
    assert xid74_repeats({"ecc_parity": 2, "mechanical": 2}) is None
    esc = xid74_repeats({"ecc_parity": 3})
    assert esc is not None and esc[:2] == (Severity.FAIL, Action.INSPECT_HARDWARE) and "3 lines" in esc[2]
    esc = xid74_repeats({"repeat_field_diag": 3, "sympathetic": 9, "ignorable": 9})
    assert esc is not None and esc[:2] == (Severity.FAIL, Action.INSPECT_HARDWARE) and "field diags" in esc[2]
    assert xid74_repeats({"sympathetic": 9, "ignorable": 9, "ecc_threshold": 9, "fabric_reset": 9}) is None


def test_xid74_rules_cover_nvidias_text() -> None:
    text = WORKFLOW_TEXT["WORKFLOW_NVLINK_ERR"]
    for rule in XID74_RULES:
        for bit in rule.bits:
            assert str(bit) in text
    assert {r.register for r in XID74_RULES} == {0, 2, 3, 4}  # first, third, fourth, fifth


# -- WORKFLOW_NVLINK5_ERR (Xid 144-150): NVIDIA's decode sheet in full ---------------------------------


def _rule_line(rule: Any, version: int) -> tuple[int, int]:
    intrinfo = (rule.v1 if version == 1 else rule.v2)[1]  # every bit the pattern leaves open is 0
    status = min(rule.statuses) if rule.statuses else 0
    return intrinfo, status


@pytest.mark.parametrize("index", range(len(NVL5_RULES)))
@pytest.mark.parametrize("version", [1, 2])
def test_every_decode_rule_decides_its_own_line(index: int, version: int) -> None:
    rule = NVL5_RULES[index]
    intrinfo, status = _rule_line(rule, version)
    unit = sorted(rule.names)[0]
    d = decode_nvlink5(rule.code, unit, None, (intrinfo, status, 0, 0))
    assert d is not None and d.resolution == rule.resolution, (rule, d)
    want = {"IGNORE": (Severity.OK, Action.NONE), "RESET_GPU": (Severity.FAIL, Action.RESET_GPU),
            "XID_154_EVAL": (Severity.WARN, Action.RESTART_APP)}[rule.resolution]
    assert (d.severity, d.action) == want
    assert d.level in ("Fatal", "Link Fatal", "Non-fatal")


def test_decode_sheet_has_only_known_resolutions() -> None:
    assert {r.resolution for r in NVL5_RULES} == {"IGNORE", "RESET_GPU", "XID_154_EVAL"}
    assert len(NVL5_RULES) == 95


@pytest.mark.parametrize(
    ("code", "unit", "fatal", "words", "resolution", "severity", "action"),
    [
        # real GB200 lines (tests/data/kmsg-xid/gb200_*)
        (149, "NETIR_LINK_EVT", True, (0x021425C6, 0), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        (149, "NETIR_LINK_EVT", True, (0x004505C6, 0), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        (149, "NETIR", True, (0x000FE406, 0), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        (149, "NETIR_BER_EVENT", False, (0x00082226, 0x1), "IGNORE", Severity.OK, Action.NONE),
        (145, "RLW_SRC_TRACK", False, (0x040988E2, 0x8), "XID_154_EVAL", Severity.WARN, Action.RESTART_APP),
        (145, "RLW_RXPIPE", False, (0x0409A0C2, 0x8, 0x1, 0, 0x100000, 0x4), "IGNORE", Severity.OK,
         Action.NONE),
        # NVIDIA: NETIR_LINK_EVT sub-codes 38 and 40 are IGNORE although the line says Fatal
        (149, "NETIR_LINK_EVT", True, (0x026001C6, 0), "IGNORE", Severity.OK, Action.NONE),
        (149, "NETIR_LINK_EVT", True, (0x028001C6, 0), "IGNORE", Severity.OK, Action.NONE),
        (149, "NETIR_LINK_EVT/NETIR_LINK_DOWN", True, (0x02600011, 0), "IGNORE", Severity.OK, Action.NONE),
        # RLW_REMAP: fatal statuses whatever the printed word; others follow a Xid 154
        (145, "RLW_REMAP", False, (0x4, 0x40), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        (145, "RLW_REMAP", True, (0x82, 0x1), "XID_154_EVAL", Severity.WARN, Action.RESTART_APP),
        (145, "RLW_REMAP", False, (0x4, 0x100), "IGNORE", Severity.OK, Action.NONE),
        # several status bits: each must have a rule, the worst wins
        (145, "RLW_REMAP", False, (0x4, 0x41), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        (145, "RLW_REMAP", False, (0x4, 0x101), "XID_154_EVAL", Severity.WARN, Action.RESTART_APP),
        (146, "TLW_RX/TLW_RX_PIPE1", True, (0xB, 0x4), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        (146, "TLW_RX", False, (0xA, 0x1), "IGNORE", Severity.OK, Action.NONE),  # the pattern picks PIPE0
        (150, "MSE_WATCHDOG", True, (0x0, 0x0), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        # no words (an NVML event, a redacted line): the unit's name where all its rules agree
        (149, "NETIR_BER_EVENT", False, (), "IGNORE", Severity.OK, Action.NONE),
        (145, "RLW_RXPIPE", False, (), "IGNORE", Severity.OK, Action.NONE),
        (150, "MSE_WATCHDOG", False, (), "RESET_GPU", Severity.FAIL, Action.RESET_GPU),
        # outside the sheet: the printed word
        (144, "SAW_MVB", False, (0x3, 0x80000000), "", Severity.WARN, Action.NONE),  # 0x3 is RLW_CTRL's
        (144, "SAW_EGR", False, (0x4, 0x1), "", Severity.WARN, Action.NONE),  # a unit the sheet lacks
        (145, "RLW_REMAP", True, (0x4, 0x400), "", Severity.FAIL, Action.RESET_GPU),  # status not listed
        (149, "NETIR_LINK_EVT", True, (0x005001C6, 0), "", Severity.FAIL, Action.RESET_GPU),  # sub-code 5
        (149, "NETIR_LINK_EVT", True, (), "", Severity.FAIL, Action.RESET_GPU),  # sub-codes disagree
        (146, "TLW_RX", False, (), "", Severity.WARN, Action.NONE),
    ],
)
def test_nvlink5_decode(code: int, unit: str, fatal: bool, words: tuple[int, ...], resolution: str,
                        severity: Severity, action: Action) -> None:
    d = decode_nvlink5(code, unit, fatal, words)
    assert d is not None and (d.resolution, d.severity, d.action) == (resolution, severity, action), d


def test_nvlink5_decode_names_subcode_and_investigatory_action() -> None:
    d = decode_nvlink5(149, "NETIR_LINK_EVT", True, (0x021425C6, 0))
    assert d is not None and d.subcode == 33 and d.investigatory == "INVESTIGATE_PEER_DEVICE"
    assert "sub-code 33" in d.basis and "INVESTIGATE_PEER_DEVICE" in d.basis
    d = decode_nvlink5(145, "RLW_SRC_TRACK", False, (0x040988E2, 0x8))
    assert d is not None and d.follows_xid154 and d.subcode is None


def test_nvlink5_without_a_word_or_a_rule_is_not_decoded() -> None:
    assert decode_nvlink5(146, None, None, ()) is None  # an NVML event, or a damaged line


_words = st.lists(st.integers(min_value=0, max_value=(1 << 64) - 1), max_size=8)


@given(_words)
def test_xid74_decode_never_raises(words: list[int]) -> None:
    d = decode_xid74(words)
    if not words:
        assert d is None
        return
    assert d is not None and d.severity in (Severity.OK, Severity.WARN, Severity.FAIL)
    if d.unknown_bits or d.undecoded_words:
        assert (d.severity, d.action) >= (Severity.FAIL, Action.RESET_GPU)


@given(st.integers(min_value=144, max_value=150),
       st.sampled_from(["SAW_MVB", "RLW_REMAP", "RLW_RXPIPE", "NETIR_LINK_EVT", "NETIR_BER_EVENT",
                        "MSE_WATCHDOG", "TLW_RX", "TLW_RX/TLW_RX_PIPE0", ""])
       | st.none() | st.text(max_size=20),
       st.booleans() | st.none(), _words)
def test_nvlink5_decode_never_raises(code: int, unit: str | None, fatal: bool | None,
                                    words: list[int]) -> None:
    d = decode_nvlink5(code, unit, fatal, words)
    if d is None:
        return
    assert d.level in ("Fatal", "Link Fatal", "Non-fatal")
    if not d.resolution:  # decided by the printed word
        assert (d.severity is Severity.FAIL) == (d.level != "Non-fatal")
    if (code, unit) == (145, "RLW_REMAP") and len(words) > 1 and words[1] & 0xFFFFFFFF in (0x40, 0x80) \
            and words[0] & 0x3FF in (0x82, 0x4) and not words[0] >> 20 & 0x3F:
        assert (d.level, d.action) == ("Fatal", Action.RESET_GPU)


def test_xid_info_is_frozen() -> None:
    info = XID_CATALOG[79]
    with pytest.raises(AttributeError):
        cast(Any, info).severity = Severity.OK
    assert isinstance(info, XidInfo)
