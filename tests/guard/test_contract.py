"""The guard's contract held together: the verdict file's JSON Schema the package ships, the
dataclasses that write and read it (``Verdict``, ``Identity``), the reader, and the tables of the
docs page "The guard's contract" (``docs/guard/contract.md``). Any of them changed without the others
fails here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import types
import typing
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from gpumon.guard import verdict as vf

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = vf.schema()
SUBJECT = SCHEMA["properties"]["subject"]
EVIDENCE = SCHEMA["properties"]["evidence"]
# In the file only: the dataclass is the verdict, these say how to read it.
ENVELOPE = {"format", "version"}
# Written by the node daemon's intake only, on the file it puts into the spool (never by a job).
DAEMON = {"attestation"}
# Defaulted in the dataclass only so that a Verdict can be built before it is stamped; every file
# has them (write() names the file after the id) and the reader refuses a file without them.
STAMPED = {"id", "time"}


def _required(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def _json_types(annotation: Any) -> set[str]:
    """The JSON Schema types a dataclass field's annotation is written as."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_json_types(a) for a in typing.get_args(annotation)))
    origin = typing.get_origin(annotation) or annotation
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
             dict: "object", list: "array", vf.Identity: "object"}
    return {names[origin]}


def _schema_types(prop: dict[str, Any]) -> set[str]:
    kind = prop["type"]
    return {kind} if isinstance(kind, str) else set(kind)


def _identity(gpu: bool = True, rank: int = 2) -> vf.Identity:
    return vf.Identity(rank=rank, world_size=3, host="trn-a07", node_name="a07" if gpu else None,
                       node_name_source="SLURMD_NODENAME" if gpu else None, local_rank=1 if gpu else None,
                       device="cuda:1" if gpu else "cpu",
                       gpu_uuid="GPU-5c1f0d2e-8a3b-4c6d-9e0f-112233445566" if gpu else None,
                       gpu_pci_bus_id="00000000:BB:00.0" if gpu else None, gpu_index=5 if gpu else None,
                       gpu_note="resolved through NVML by UUID" if gpu else "device cpu: no GPU")


_COMPUTATION = {"role": "own", "rank": 2, "node": "a07", "loss": 2.25, "loss_bits": "4002000000000000",
                "grads_fingerprint": "9f" * 16,
                "rerun_same_gpu": {"loss": 2.25, "loss_bits": "4002000000000000",
                                   "grads_fingerprint": "9e" * 16, "same_as_first": False}}
_PLACE = {"replica": 1, "shard": 0, "replicas": 3, "shards": 2,
          "strategy": "FSDP2 2-D mesh (replicate, shard)"}
_KEPT = {"bundle": "/var/lib/gpumon/guard/bundles/x", "bundle_kind": "replay",
         "bundle_replay": "gpumon canary replay /var/lib/gpumon/guard/bundles/x", "bundle_micro_batch_of": 2,
         "bundle_seed": 77}
# evidence as the guard writes it for each check (step_verdict.py, weights.py, stragglers.py, sharded.py,
# audit.py, pace.py, keep.py)
EVIDENCE_OF = {
    "nonfinite_grad": {
        "ranks_nonfinite_local": [2], "ranks_nonfinite_reduced": [0, 1, 2], "parameters": ["0.weight"],
        "reruns": [{"role": "rerun_same_gpu", "rank": 2, "node": "a07", "nonfinite": True,
                    "loss": float("nan"), "loss_bits": "7ff8000000000000", "grads_fingerprint": "ab" * 16},
                   {"role": "other_node", "rank": 0, "node": "a01", "nonfinite": False, "loss": 2.5,
                    "loss_bits": "4004000000000000", "grads_fingerprint": "cd" * 16}],
        "rerun_judgement": "it reproduced on its GPU and not on another node's", **_KEPT},
    "nonfinite_reduce": {"ranks_nonfinite_shards": [1], "reduce_on_every_rank": False,
                         "parameters": ["layers.0.weight"], **_PLACE},
    "weights": {"first_parameter": "0.weight", "parameter_index": 0, "parameters_differing": 1,
                "fingerprint": "0f" * 16, "groups": [[0, 1], [2]], "other_rank": 0,
                "other": "rank 0 on trn-a01", "found_before": "the audit", "not_judged_step": 9},
    "straggler": {"pace": 0.61, "pace_per_work": 0.6, "compute_ms": 31.5, "group_median_ms": 19.2,
                  "slow_windows": 3, "windows": 5, "window_steps": 100,
                  "scores": [{"rank": 2, "compute_ms": 31.5, "work": 4096.0, "pace": 0.61,
                              "pace_per_work": 0.6}]},
    "audit": {"disputes": [{"step": 10, "micro_batch_of": 2, "audited_by": 1, "referee": None,
                            "loss_compared": True, "computations": [_COMPUTATION],
                            "majority_ranks": [0, 1], "judgement": "...", "parameters_differing": 1,
                            "differing_parameters": [{"parameter": "0.weight", "own": "1" * 32,
                                                      "audit": "2" * 32}],
                            "role_of_named": "own micro-batch"}],
              "audits": 0, "audited_by": [1], "ring_note": "every rank is on one node", **_KEPT},
}


def _verdict(check: str, **changes: Any) -> vf.Verdict:
    who = _identity()
    when = time.time()
    v = vf.Verdict(check=check, fault="unknown", step=10, message=f"{check}: rank 2 named", subject=who,
                   evidence=EVIDENCE_OF.get(check, {}), job="slurm:991", time=when, id=vf.new_id(who, when))
    return dataclasses.replace(v, **changes)


def _contract() -> str:
    """The docs page of the guard's contract (the whole page: every table below is on it)."""
    text = (ROOT / "docs" / "guard" / "contract.md").read_text()
    assert text.startswith("# The guard's contract\n")
    return text


def _table(head: str) -> list[list[str]]:
    """The rows (cells, stripped) of the contract page's table whose header row starts with
    ``head``."""
    lines = _contract().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"| {head}"))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# -- the schema itself -------------------------------------------------------------------------------

def test_the_schema_is_shipped_in_the_package_valid_and_named_by_format_and_version() -> None:
    shipped = files("gpumon.guard.schema") / "verdict-v1.schema.json"
    assert json.loads(shipped.read_text(encoding="utf-8")) == SCHEMA
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["$id"] == vf.SCHEMA_ID == f"urn:gpumon:{vf.FORMAT}:{vf.VERSION}"
    assert shipped.name == vf.SCHEMA_FILE == f"verdict-v{vf.VERSION}.schema.json"
    assert SCHEMA["title"] and SCHEMA["description"]
    assert SCHEMA["properties"]["format"]["const"] == vf.FORMAT
    assert SCHEMA["properties"]["version"]["const"] == vf.VERSION


def _properties(node: dict[str, Any], where: str = "$") -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, prop in node.get("properties", {}).items():
        out.append((f"{where}.{name}", prop))
        out += _properties(prop, f"{where}.{name}")
        if isinstance(prop.get("items"), dict):
            out += _properties(prop["items"], f"{where}.{name}[]")
    return out


def test_every_property_is_described_with_its_type_first() -> None:
    everything = _properties(SCHEMA)
    assert len(everything) > 80
    wrong = []
    for where, prop in everything:
        head = prop.get("description", "").partition(":")[0]
        # "string or null: ...", "array of integers (audit): ...": the head names every type
        if not prop.get("description") or not all(t in head for t in _schema_types(prop)):
            wrong.append(f"{where}: {prop.get('description')!r}")
    assert not wrong, wrong


# -- the schema and the dataclasses ------------------------------------------------------------------

def test_the_schema_has_exactly_the_fields_of_verdict_and_identity() -> None:
    verdict_fields = {f.name for f in dataclasses.fields(vf.Verdict)}
    identity_fields = {f.name for f in dataclasses.fields(vf.Identity)}
    assert set(SCHEMA["properties"]) == verdict_fields | ENVELOPE | DAEMON
    assert set(SUBJECT["properties"]) == identity_fields
    # what the writer writes is every property, no more
    v = _verdict("weights")
    assert set(v.to_json()) == set(SCHEMA["properties"]) - DAEMON
    assert set(v.to_json()["subject"]) == set(SUBJECT["properties"])


def test_required_is_what_the_dataclasses_do_not_default() -> None:
    assert set(SUBJECT["required"]) == _required(vf.Identity)
    assert set(SCHEMA["required"]) == _required(vf.Verdict) | ENVELOPE | STAMPED
    assert not (ENVELOPE | STAMPED) & _required(vf.Verdict)


@pytest.mark.parametrize(("cls", "node"), [(vf.Verdict, SCHEMA), (vf.Identity, SUBJECT)])
def test_each_fields_type_is_the_schemas(cls: type, node: dict[str, Any]) -> None:
    hints = typing.get_type_hints(cls)
    wrong = {f.name: (hints[f.name], node["properties"][f.name]["type"]) for f in dataclasses.fields(cls)
             if _json_types(hints[f.name]) != _schema_types(node["properties"][f.name])}
    assert not wrong, wrong


def test_the_checks_and_faults_are_the_schemas_enums() -> None:
    assert SCHEMA["properties"]["check"]["enum"] == list(vf.CHECKS)
    assert SCHEMA["properties"]["fault"]["enum"] == list(vf.FAULTS)


@pytest.mark.parametrize("key", sorted(set(SCHEMA["properties"]) - DAEMON))
def test_the_dataclass_reader_requires_what_the_schema_requires(key: str) -> None:
    """Without the schema (``Verdict.from_json`` alone): a key the schema requires is refused when
    missing, one it does not is not. A reader tightened or loosened alone fails here."""
    data = _verdict("weights").to_json()
    del data[key]
    if key in SCHEMA["required"]:
        with pytest.raises(vf.VerdictError):
            vf.Verdict.from_json(data)
    else:
        vf.Verdict.from_json(data)
        vf.validate(data)


# -- verdicts written, verdicts refused ---------------------------------------------------------------

@pytest.mark.parametrize("check", vf.CHECKS)
def test_a_verdict_of_every_check_written_by_write_validates_and_reads_back(tmp_path: Path,
                                                                           check: str) -> None:
    assert check in EVIDENCE_OF, f"no evidence sample for check {check}: add the keys it writes"
    for v in (_verdict(check), _verdict(check, subject=_identity(gpu=False), job=None, evidence={},
                                        fault="persistent", step=-1)):
        path = vf.write(v, tmp_path)
        Draft202012Validator(SCHEMA).validate(json.loads(path.read_text()))
        got = vf.read(path)
        assert (got.id, got.check, got.subject, got.job) == (v.id, v.check, v.subject, v.job)
        assert got.evidence.keys() == v.evidence.keys()


def test_the_evidence_samples_name_only_keys_the_schema_describes() -> None:
    # the samples above are the guard's keys: one the schema does not describe is undocumented
    keys = {k for sample in EVIDENCE_OF.values() for k in sample}
    assert keys <= set(EVIDENCE["properties"]), keys - set(EVIDENCE["properties"])
    assert EVIDENCE["additionalProperties"] is True


def _written(tmp_path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(vf.write(_verdict("audit"), tmp_path).read_text())
    return data


@pytest.mark.parametrize(("broken", "where", "said"), [
    (lambda d: d.update(step="41"), "$.step", "'41' is not of type 'integer'"),
    (lambda d: d["subject"].update(rank="seven"), "$.subject.rank", "'seven' is not of type 'integer'"),
    (lambda d: d["subject"].pop("host"), "$.subject", "required property missing: host"),
    (lambda d: d.pop("fault"), "$", "required property missing: fault"),
    (lambda d: d.update(check="gradients"), "$.check", "'gradients' is not one of"),
    (lambda d: d.update(id=""), "$.id", "'' should be non-empty"),
    (lambda d: d.update(evidence=[1, 2]), "$.evidence", "is not of type 'object'"),
    (lambda d: d["evidence"].update(audited_by="rank 1"), "$.evidence.audited_by", "is not of type"),
    (lambda d: d["evidence"]["disputes"][0]["computations"][0].update(role="judge"),
     "$.evidence.disputes[0].computations[0].role", "'judge' is not one of"),
])
def test_a_broken_file_is_refused_naming_the_field(tmp_path: Path, broken: Any, where: str,
                                                   said: str) -> None:
    data = _written(tmp_path)
    broken(data)
    assert list(Draft202012Validator(SCHEMA).iter_errors(data)), "the schema alone must refuse it"
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(vf.SchemaViolation) as refused:
        vf.read(path)
    assert refused.value.where == where and said in str(refused.value), str(refused.value)
    assert str(refused.value).startswith(f"{where}: ") and vf.SCHEMA_FILE in str(refused.value)
    node = SCHEMA
    for part in refused.value.rule.strip("/").split("/")[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    assert refused.value.rule.rsplit("/", 1)[1] in node  # the rule is a path into the schema


def test_a_newer_version_is_a_future_verdict_not_a_schema_violation(tmp_path: Path) -> None:
    data = _written(tmp_path)
    data["version"] = vf.VERSION + 1
    data["check"] = "something_new"
    with pytest.raises(vf.FutureVerdict):
        vf.validate(data)


def test_the_validator_is_built_once() -> None:
    assert vf.validator() is vf.validator()


# -- the docs page (docs/guard/contract.md) -----------------------------------------------------------

def test_the_contract_page_lists_every_field_of_the_file_with_its_type_and_whether_required() -> None:
    rows = _table("field | type | required")
    said = {_ticked(r[0])[0]: (r[1], r[2]) for r in rows}
    expected = {f"{prefix}{name}": (prop["description"].partition(":")[0],
                                    "yes" if name in node["required"] else "no")
                for prefix, node in (("", SCHEMA), ("subject.", SUBJECT))
                for name, prop in node["properties"].items()}
    assert said == expected


def test_the_contract_page_names_every_evidence_key_and_every_check() -> None:
    rows = _table("check | evidence keys")
    # the cells name the guards, their arguments and a key's values beside the keys
    words = {*vf.CHECKS, "Guard", "ShardedGuard", "batch_for", "loss_fn", "replay", "state"}
    keys = {k for r in rows for k in _ticked(r[1]) if k not in words}
    assert keys == set(EVIDENCE["properties"])
    named = {k for r in rows for k in _ticked(r[0])}
    assert set(vf.CHECKS) <= named


def test_the_contract_page_says_how_to_load_the_schema_and_the_spool_order() -> None:
    text = _contract()
    assert 'files("gpumon.guard.schema") / "verdict-v1.schema.json"' in text
    assert f"`gpumon/guard/schema/{vf.SCHEMA_FILE}`" in text and f"`{vf.SCHEMA_ID}`" in text
    assert vf.DEFAULT_DIR in text and f"${vf.DIR_ENV}" in text
    # the orders the guard reads the environment in, as the identity module has them
    from gpumon.guard import identity

    rows = {r[0]: r[1] for r in _table("field | read from")}
    assert _ticked(rows["`node_name`"]) == list(identity.NODE_NAME_ENVS)
    assert _ticked(rows["`local_rank`"]) == ["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"]


def test_the_contract_page_documents_every_field_of_the_reports_the_state_and_the_alarm() -> None:
    core = pytest.importorskip("gpumon.guard.core")  # torch
    sharded = pytest.importorskip("gpumon.guard.sharded")

    def members(cls: type) -> set[str]:
        props = {n for n, v in vars(cls).items() if isinstance(v, property)}
        return {f.name for f in dataclasses.fields(cls)} | props

    rows = _table("field | `WeightReport`")
    plain = {_ticked(r[0])[0] for r in rows if r[1] != "—"}
    shard = {_ticked(r[0])[0] for r in rows if r[2] != "—"}
    assert plain == members(core.WeightReport) and shard == members(sharded.ShardedWeightReport)

    state = {_ticked(r[0])[0] for r in _table("field | type | meaning")}
    assert state == {f.name for f in dataclasses.fields(core.GuardState)}

    alarm = core.GuardAlarm([_verdict("weights", fault="persistent")], skipped=False)
    documented = {_ticked(r[0])[0] for r in _table("attribute | type")}
    public = {n for n in (*vars(alarm), *vars(core.GuardAlarm)) if not n.startswith("_")}
    assert documented == public
    assert alarm.exit_code == vf.EXIT_FAILED_VALIDATION == 17 and vf.EXIT_RESUME_ELSEWHERE == 16
