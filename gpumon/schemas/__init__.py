"""gpumon's JSON documents as JSON Schemas (data only; nothing to import).

``report-v1.schema.json``: the JSON report, what ``gpumon check --json`` and ``gpumon run-bootstrap
--json`` print and what the daemon writes to ``<state_dir>/report.json``. Load it with
``gpumon.report.schema()`` or ``importlib.resources.files("gpumon.schemas") / "report-v1.schema.json"``.
The guard's verdict file has its own, beside the guard (``gpumon.guard.schema``).
"""
