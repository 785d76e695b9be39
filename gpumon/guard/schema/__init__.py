"""The guard's file formats as JSON Schemas (data only; nothing to import).

``verdict-v1.schema.json``: the verdict file, ``gpumon-guard-verdict`` version 1, which the node's
``guard`` check validates every spool file against. Load it with ``gpumon.guard.verdict.schema()``
or ``importlib.resources.files("gpumon.guard.schema") / "verdict-v1.schema.json"``.
"""
