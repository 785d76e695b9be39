"""XID_CATALOG against the team's Xid research note (a byte-for-byte copy of
shared/reference/xid-catalog.md in tests/data, so the test runs on a fresh clone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumon.model import Action, Severity
from gpumon_checks.xid_catalog import (
    CATALOG_SOURCE,
    XID_CATALOG,
    XidInfo,
    decode_nvlink5,
    decode_xid74,
    lookup,
)

CATALOG_MD = Path(__file__).resolve().parent.parent / "data" / "xid-catalog.md"


def _xid_table_rows() -> dict[int, list[str]]:
    """Rows of the "## XID table" section: code -> cells (the SXid table further down is skipped)."""
    rows: dict[int, list[str]] = {}
    in_table = False
    for line in CATALOG_MD.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            in_table = line.startswith("## XID table")
            continue
        if not in_table or not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not cells[0].isdigit():
            continue  # header and separator rows
        assert len(cells) == 9, f"unexpected column count in: {line}"
        code = int(cells[0])
        assert code not in rows, f"Xid {code} twice in {CATALOG_MD.name}"
        rows[code] = cells
    return rows


ROWS = _xid_table_rows()


def test_note_table_has_the_59_codes() -> None:
    assert len(ROWS) == 59


def test_catalog_covers_exactly_the_note_table() -> None:
    assert set(XID_CATALOG) == set(ROWS)


@pytest.mark.parametrize("code", sorted(ROWS))
def test_mnemonic_and_nvidia_action_match_the_note(code: int) -> None:
    info = XID_CATALOG[code]
    _, mnemonic, _, _, nvidia_actions, *_ = ROWS[code]
    assert info.code == code
    assert info.mnemonic == mnemonic
    immediate = nvidia_actions.split(" / ")[0].strip()
    assert info.nvidia_action == ("" if immediate == "(not given)" else immediate)
    assert info.description and "\n" not in info.description


@pytest.mark.parametrize(
    ("code", "severity", "action", "nvidia_action", "workflow"),
    [
        (13, Severity.WARN, Action.RESTART_APP, "RESTART_APP", "XID_13"),
        (31, Severity.WARN, Action.RESTART_APP, "RESTART_APP", "XID_31"),
        (43, Severity.OK, Action.NONE, "IGNORE", None),
        (45, Severity.OK, Action.NONE, "WORKFLOW_XID_45", "XID_45"),
        (48, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_XID_48", "XID_48"),
        (63, Severity.WARN, Action.RESET_GPU, "IGNORE", None),
        (64, Severity.FAIL, Action.INSPECT_HARDWARE, "RESET_GPU", None),
        (74, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_NVLINK_ERR", "NVLINK_ERR"),
        (79, Severity.FAIL, Action.REBOOT_NODE, "RESTART_BM", None),
        (94, Severity.WARN, Action.RESTART_APP, "RESTART_APP", None),
        (95, Severity.FAIL, Action.RESET_GPU, "RESET_GPU", None),
        (119, Severity.FAIL, Action.RESET_GPU, "RESET_GPU", None),
        (145, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR"),
        (149, Severity.FAIL, Action.RESET_GPU, "WORKFLOW_NVLINK5_ERR", "NVLINK5_ERR"),
        (154, Severity.OK, Action.NONE, "XID_154", "XID_154"),
    ],
)
def test_spot_check_actions(
    code: int, severity: Severity, action: Action, nvidia_action: str, workflow: str | None
) -> None:
    assert XID_CATALOG[code] == XidInfo(
        code=code,
        mnemonic=ROWS[code][1],
        description=XID_CATALOG[code].description,
        severity=severity,
        action=action,
        nvidia_action=nvidia_action,
        workflow=workflow,
    )


def test_lookup() -> None:
    assert lookup(79) is XID_CATALOG[79]
    assert lookup(173) is None  # in gpud only, not in NVIDIA's catalog
    assert lookup(-1) is None


def test_catalog_is_read_only() -> None:
    with pytest.raises(TypeError):
        cast(Any, XID_CATALOG)[999] = XID_CATALOG[79]


def test_source_cites_nvidia_and_the_mirror_commit() -> None:
    assert "docs.nvidia.com/deploy/xid-errors" in CATALOG_SOURCE
    assert "4a8de33a3f02e207f39e9023d67125592d599731" in CATALOG_SOURCE


# -- decode rules of the NVLink workflows (xid-catalog.md, WORKFLOW_NVLINK_ERR / NVLINK5_ERR) ------


@pytest.mark.parametrize(
    ("words", "classes", "severity", "action"),
    [
        ((0x1, 0, 0, 0, 0, 0, 0), ("ignorable",), Severity.WARN, Action.NONE),
        ((0x40800001,), ("ignorable",), Severity.WARN, Action.NONE),  # bits 0, 23, 30
        ((0x2,), ("sympathetic",), Severity.WARN, Action.NONE),
        ((0x10,), ("ecc_parity",), Severity.FAIL, Action.RESET_GPU),
        ((0x10000, 0, 0), ("mechanical",), Severity.FAIL, Action.CHECK_CABLES),
        ((0x200000,), ("marginal_si",), Severity.FAIL, Action.CHECK_CABLES),
        ((0x10010,), ("ecc_parity", "mechanical"), Severity.FAIL, Action.RESET_GPU),  # worst action wins
    ],
)
def test_xid74_first_word_bit_classes(words: tuple[int, ...], classes: tuple[str, ...], severity: Severity,
                                      action: Action) -> None:
    d = decode_xid74(words)
    assert d is not None and (d.classes, d.severity, d.action) == (classes, severity, action)
    assert not d.unknown_bits and not d.undecoded_words


def test_xid74_what_the_notes_do_not_decode_keeps_the_catalog_default() -> None:
    assert decode_xid74(()) is None
    # NVSentinel's quoted Hopper line: only the third word is set, and our notes decode the first
    d = decode_xid74((0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0))
    assert d is not None and d.undecoded_words == (2,) and (d.severity, d.action) == (Severity.FAIL,
                                                                                     Action.RESET_GPU)
    d = decode_xid74((0x1 | 1 << 2,))  # bit 2 is not in NVIDIA's list: "report a bug"
    assert d is not None and d.unknown_bits == (2,) and d.severity is Severity.FAIL


@pytest.mark.parametrize(
    ("code", "unit", "fatal", "words", "level", "severity", "action"),
    [
        (144, "SAW_MVB", False, (0x1, 0x2), "Fatal", Severity.FAIL, Action.RESET_GPU),
        (144, "SAW_MVB", True, (0x1, 0x8), "Non-fatal", Severity.WARN, Action.NONE),
        (145, "RLW_REMAP", False, (0x4, 0x40), "Fatal", Severity.FAIL, Action.RESET_GPU),
        (145, "RLW_REMAP", False, (0x4, 0x1), "Non-fatal", Severity.WARN, Action.NONE),
        (149, "NETIR_LINK_EVT", True, (0x025001C6, 0), "Link Fatal", Severity.FAIL, Action.RESET_GPU),
        (149, "NETIR_BER_EVENT", False, (), "Non-fatal", Severity.WARN, Action.CHECK_CABLES),
        (150, "MSE_WATCHDOG", False, (), "Fatal", Severity.FAIL, Action.RESET_GPU),
        # outside the rules: the printed word
        (145, "RLW_SRC_TRACK", False, (0x1, 0x4), "Non-fatal", Severity.WARN, Action.NONE),
        (145, "RLW_REMAP", True, (0x4, 0x100), "Fatal", Severity.FAIL, Action.RESET_GPU),  # status not listed
        (149, "NETIR", True, (0x000FE406, 0), "Fatal", Severity.FAIL, Action.RESET_GPU),
    ],
)
def test_nvlink5_decode(code: int, unit: str, fatal: bool, words: tuple[int, ...], level: str,
                        severity: Severity, action: Action) -> None:
    d = decode_nvlink5(code, unit, fatal, words)
    assert d is not None and (d.level, d.severity, d.action) == (level, severity, action), d


def test_nvlink5_without_a_word_or_a_rule_is_not_decoded() -> None:
    assert decode_nvlink5(146, None, None, ()) is None  # an NVML event, or a damaged line


_words = st.lists(st.integers(min_value=0, max_value=(1 << 64) - 1), max_size=8)


@given(_words)
def test_xid74_decode_never_raises_and_is_never_milder_than_warn(words: list[int]) -> None:
    d = decode_xid74(words)
    if not words:
        assert d is None
        return
    assert d is not None and d.severity in (Severity.WARN, Severity.FAIL)
    first = words[0] & 0xFFFFFFFF
    if first and not first & ~((1 << 0) | (1 << 23) | (1 << 30)) and not any(words[1:]):
        assert (d.severity, d.action) == (Severity.WARN, Action.NONE)  # only ignorable bits


@given(st.integers(min_value=144, max_value=150),
       st.sampled_from(["SAW_MVB", "RLW_REMAP", "RLW_RXPIPE", "NETIR_LINK_EVT", "NETIR_BER_EVENT",
                        "MSE_WATCHDOG", "TLW_RX", ""]) | st.none() | st.text(max_size=20),
       st.booleans() | st.none(), _words)
def test_nvlink5_decode_never_raises(code: int, unit: str | None, fatal: bool | None,
                                    words: list[int]) -> None:
    d = decode_nvlink5(code, unit, fatal, words)
    if d is None:
        return
    assert d.level in ("Fatal", "Link Fatal", "Non-fatal")
    assert (d.severity is Severity.FAIL) == (d.level != "Non-fatal")
    if (code, unit) == (145, "RLW_REMAP") and len(words) > 1 and words[1] & 0xC0:
        assert d.level == "Fatal"  # a fatal status bit is fatal whatever else is set
