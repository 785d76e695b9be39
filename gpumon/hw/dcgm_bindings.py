"""A DCGM diagnostic through DCGM's own Python bindings, printed as DCGM 4's ``dcgmi diag -j`` JSON.

Run by path in a child process (``gpumon.hw.dcgm.run_diag_bindings``), never imported by gpumon: a
DCGM call that hangs in the agent's own process could never be interrupted, and a child is bounded
and killed by the tool runner. It imports nothing from gpumon (its directory is swapped for the
bindings directory on ``sys.path``), so that no module of gpumon's shadows one of DCGM's.

Usage: ``python dcgm_bindings.py <bindings dir> <level> <gpu,gpu,...>``. Exit 0 with the JSON on
stdout (a DCGM runtime error is JSON too, ``runtime_error``); 3: the bindings cannot be imported; 4:
this DCGM's response has no tests/results (older than DCGM 4). On 3 and 4 the caller falls back to
``dcgmi``.

Response layout: ``dcgm_structs.c_dcgmDiagResponse_v12`` (tests[].name/resultIndices/errorIndices,
results[].entity/result, errors[].entity/msg/code), as DCGM's testing/python3/DcgmDiag.py helpers
read it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

EXIT_NO_BINDINGS = 3
EXIT_TOO_OLD = 4


def diag_json(dcgm_structs: Any, dcgm_fields: Any, resp: Any) -> dict[str, Any]:
    """DCGM 4's diag JSON for a bindings response (``gpumon.hw.dcgm.parse_diag_json`` reads it)."""
    words = {dcgm_structs.DCGM_DIAG_RESULT_PASS: "Pass", dcgm_structs.DCGM_DIAG_RESULT_FAIL: "Fail",
             dcgm_structs.DCGM_DIAG_RESULT_WARN: "Warn", dcgm_structs.DCGM_DIAG_RESULT_SKIP: "Skip",
             dcgm_structs.DCGM_DIAG_RESULT_NOT_RUN: "Not Run"}
    tests = []
    for test in resp.tests[:resp.numTests]:
        results = []
        errors = [resp.errors[i] for i in test.errorIndices[:test.numErrors]]
        for idx in test.resultIndices[:test.numResults]:
            r = resp.results[idx]
            if r.entity.entityGroupId != dcgm_fields.DCGM_FE_GPU:
                continue
            mine = [e for e in errors if e.entity.entityGroupId == r.entity.entityGroupId
                    and e.entity.entityId == r.entity.entityId]
            results.append({"entity_group": "GPU", "entity_id": int(r.entity.entityId),
                            "status": words.get(r.result, "Not Run"),
                            "warnings": [{"warning": str(e.msg), "error_id": int(e.code)} for e in mine]})
        tests.append({"name": str(test.name), "results": results,
                      "test_summary": {"status": words.get(test.result, "Not Run")}})
    return {"DCGM Diagnostic": {"test_categories": [{"category": "", "tests": tests}]},
            "metadata": {"version": "bindings"}}


def main(argv: Sequence[str]) -> int:
    bindings, level, gpu_list = argv
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [bindings, *(p for p in sys.path if os.path.abspath(p or ".") != here)]
    gpus = [int(g) for g in gpu_list.split(",") if g]
    try:
        dcgm_structs, dcgm_fields, pydcgm, dcgm_diag = (
            importlib.import_module(m) for m in ("dcgm_structs", "dcgm_fields", "pydcgm", "DcgmDiag"))
    except Exception as exc:
        print(f"gpumon-dcgm: cannot import DCGM's bindings: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NO_BINDINGS
    try:
        try:
            handle = pydcgm.DcgmHandle(ipAddress="127.0.0.1")
        except Exception:
            handle = pydcgm.DcgmHandle()  # no nv-hostengine running: DCGM embedded in this process
        diag = dcgm_diag.DcgmDiag(gpuIds=gpus or None, testNamesStr=level)
        resp = diag.Execute(handle.handle)
    except Exception as exc:
        print(json.dumps({"DCGM Diagnostic": {"runtime_error": f"{type(exc).__name__}: {exc}"}}))
        return 0
    if not hasattr(resp, "tests") or not hasattr(resp, "results"):
        print("gpumon-dcgm: this DCGM's diag response has no tests/results (older than DCGM 4)",
              file=sys.stderr)
        return EXIT_TOO_OLD
    print(json.dumps(diag_json(dcgm_structs, dcgm_fields, resp)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
