"""Every check an alerting rule names is a check gpumon has.

A rule written for a check name that does not exist is valid PromQL that never fires: the SDC
canary rule once selected ``check=~"canary.*"`` while the check is ``sdc_canary`` (PromQL regexes
are anchored), so a GPU computing wrong bits paged nobody.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from gpumon.registry import load_checks

RULES = Path(__file__).resolve().parents[2] / "config" / "prometheus" / "gpumon-rules.yaml"


def test_every_check_a_rule_selects_exists() -> None:
    names = set(load_checks())
    doc = yaml.safe_load(RULES.read_text())
    seen = 0
    for group in doc["groups"]:
        for rule in group["rules"]:
            for op, value in re.findall(r'\bcheck\s*(=~|=|!=|!~)\s*"([^"]*)"', rule["expr"]):
                seen += 1
                if op == "=":
                    assert value in names, f"{rule['alert']}: no check named {value!r}"
                elif op == "=~":
                    matched = {n for n in names if re.fullmatch(value, n)}
                    assert matched, f"{rule['alert']}: check=~{value!r} matches no check"
    assert seen >= 3
