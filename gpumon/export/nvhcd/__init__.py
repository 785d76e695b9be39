"""NVIDIA Resiliency Extension's node health check, answered from gpumon's health state.

NVRx's launcher (``ft_launcher --ft-node-health-check-endpoint /var/run/nvhcd.sock``) and its in-job
``NodeHealthCheck`` ask a node service ``nvhcd.HealthCheckService/RunHealthCheck`` over gRPC on a Unix
socket before they (re)start ranks on the node (``nvhcd.proto`` beside this file, NVRx's own). The
daemon serves it (``exporter.nvhcd_socket``) from the health state it already keeps: no check is run
for the question, no hardware is touched, the answer is as fresh as the last check runs.

The answer, as NVRx reads it (``shared_utils/health_check.py``: healthy is ``success`` and
``fail_count == 0`` in the JSON ``output``):

- ``success``: the node is neither unhealthy nor quarantined (degraded, i.e. warnings only, is
  healthy: a warning takes no node out of a job);
- ``exit_code``: gpumon's check codes, 0 healthy or degraded, 2 unhealthy or quarantined, 3 no
  health state to answer from (then ``error`` says why);
- ``output``: JSON ``{"fail_count", "failed_checks": [{component, state, action, checks, why}],
  "warn_count", "node", "state", "action", "source": "gpumon", "args_ignored"}``: the args NVRx
  sends (its defaults are another health tool's: ``--no-slurm --group prolog epilog logs gpu``) do
  not change the answer, and say so.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

from gpumon.distribution import install_hint
from gpumon.health.state import HealthView, Level

log = logging.getLogger("gpumon.nvhcd")

SERVICE = "nvhcd.HealthCheckService"
METHOD = "RunHealthCheck"
EXIT_OK, EXIT_FAIL, EXIT_UNKNOWN = 0, 2, 3
_FAILING = (Level.UNHEALTHY, Level.QUARANTINED)


class NvhcdUnavailable(RuntimeError):
    """grpcio/protobuf are not installed (gpumon-node[nvrx])."""


def messages() -> tuple[Any, Any]:
    """(HealthCheckRequest, HealthCheckResponse) classes of the contract."""
    try:
        from gpumon.export.nvhcd import nvhcd_pb2
    except ImportError as exc:
        raise NvhcdUnavailable(f"the NVRx health service needs grpcio and protobuf: {install_hint('nvrx')} "
                               f"({exc})") from None
    # protoc's classes are made at import (no stubs): looked up by name
    return getattr(nvhcd_pb2, "HealthCheckRequest"), getattr(nvhcd_pb2, "HealthCheckResponse")  # noqa: B009


def answer(view: HealthView | None, node: str, args: list[str]) -> dict[str, Any]:
    """The response's fields for the node's health state ``view``."""
    if view is None:
        return {"success": False, "exit_code": EXIT_UNKNOWN, "output": "",
                "error": f"gpumon on {node}: the health state is not open yet (the daemon is starting)"}
    failed, warned = [], 0
    for name, c in sorted(view.components.items()):
        if c.level in _FAILING:
            failed.append({"component": name, "state": c.level.value, "action": c.action.value,
                           "checks": sorted({f.check for f in c.why}),
                           "why": [f.message for f in c.why][:5]})
        elif c.level is Level.DEGRADED:
            warned += 1
    if view.node.level in _FAILING and not failed:  # a node-level fault with no component of its own
        failed.append({"component": "node", "state": view.node.level.value, "action": view.node.action.value,
                       "checks": sorted({f.check for f in view.node.why}),
                       "why": [f.message for f in view.node.why][:5]})
    output = {"source": "gpumon", "node": node, "state": view.node.level.value,
              "action": view.node.action.value, "fail_count": len(failed), "failed_checks": failed,
              "warn_count": warned, "args_ignored": list(args)}
    return {"success": not failed, "exit_code": EXIT_FAIL if failed else EXIT_OK,
            "output": json.dumps(output, sort_keys=True), "error": ""}


class NvhcdServer:
    """``RunHealthCheck`` on ``unix:<socket>``, answered from ``view()``."""

    def __init__(self, socket_path: str | Path, view: Callable[[], HealthView | None], node: str) -> None:
        try:
            import grpc
        except ImportError as exc:
            raise NvhcdUnavailable(f"the NVRx health service needs grpcio: {install_hint('nvrx')} ({exc})") \
                from None
        request_cls, response_cls = messages()
        self.path = Path(socket_path)
        self._view, self._node = view, node

        def run(request: Any, context: Any) -> Any:
            try:
                return response_cls(**answer(self._view(), self._node, list(request.args)))
            except Exception as exc:  # an answer always goes back; the daemon never fails on a question
                log.exception("nvhcd: answering RunHealthCheck")
                return response_cls(success=False, exit_code=EXIT_UNKNOWN, output="",
                                    error=f"gpumon: {type(exc).__name__}: {exc}")

        handler = grpc.method_handlers_generic_handler(SERVICE, {
            METHOD: grpc.unary_unary_rpc_method_handler(run, request_deserializer=request_cls.FromString,
                                                        response_serializer=response_cls.SerializeToString)})
        # a stale socket of an earlier daemon (it died) would refuse the bind
        if self.path.is_socket():
            self.path.unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpumon-nvhcd")
        self._server = grpc.server(pool, handlers=(handler,), maximum_concurrent_rpcs=16)
        if not self._server.add_insecure_port(f"unix:{self.path}"):
            raise OSError(f"cannot listen on unix:{self.path}")
        self._server.start()
        # the launcher runs as the job's user: anyone on the node may ask (the answer is read-only)
        os.chmod(self.path, 0o666)

    def stop(self) -> None:
        self._server.stop(grace=1.0).wait(5.0)
        if self.path.is_socket():
            self.path.unlink()
