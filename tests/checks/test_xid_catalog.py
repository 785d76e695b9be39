"""XID_CATALOG against the team's Xid research note (a byte-for-byte copy of
shared/reference/xid-catalog.md in tests/data, so the test runs on a fresh clone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from gpumon.model import Action, Severity
from gpumon_checks.xid_catalog import CATALOG_SOURCE, XID_CATALOG, XidInfo, lookup

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
