"""``gpumon canary record|run|replay``: the SDC canaries from the command line.

Exit codes follow gpumon's (NHC): 0 every GPU bit-exact, 1 warnings only (``unknown``: no golden
and no majority, a GPU that did not run), 2 at least one GPU computed wrong bits (or, for
``record``, the hardware disagreed with itself), 3 could not run (bad golden file, bad bundle, a
bundle someone other than root and you could have written without ``--trust`` or ``--as-owner``
(``gpumon.sdc.trust``), bad ``--inject``, no device).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumon.distribution import install_hint
from gpumon.errors import ConfigError, GpumonError
from gpumon.model import Finding, Severity, Status, overall_status
from gpumon.usage import EXIT_USAGE, UsageParser

if TYPE_CHECKING:
    from gpumon.agent import Agent
    from gpumon.sdc.runner import Report

EXIT_CANNOT_RUN = EXIT_USAGE

TRUST_HELP = ("run a bundle even if someone other than root and you could have written it (its code "
              "runs with your privileges): only after looking at it")


def add_parser(subparsers: Any,
               common_parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """Add ``canary`` with its three subcommands to gpumon's subparsers; returns the new parser."""
    parents = list(common_parents)
    canary: argparse.ArgumentParser = subparsers.add_parser("canary", parents=parents,
                                   help="SDC canaries: bit-exact workloads vs a golden run and across GPUs")
    sub = canary.add_subparsers(dest="canary_command", required=True, metavar="SUBCOMMAND")

    def shared(p: argparse.ArgumentParser) -> None:
        p.add_argument("--workers", type=int, metavar="N",
                       help="devices to run on at once (default: every GPU; 4 CPU workers without GPUs)")
        p.add_argument("--gpus", metavar="I,J,..",
                       help="run on these GPU indices (one worker each; default: 0..workers-1)")
        p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="where workers compute (default: cuda when torch sees GPUs, else cpu)")
        p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                       help="per-iteration limit; a worker over it is reported hung (600)")
        p.add_argument("--json", action="store_true", help="print the JSON report")
        p.add_argument("-v", "--verbose", action="store_true", help="show ok findings too")

    p = sub.add_parser("record", parents=parents, help="run on known-good hardware, write the golden file")
    p.add_argument("--out", type=Path, required=True, metavar="FILE",
                   help="golden file (entries for other keys already in it are kept)")
    p.add_argument("--iterations", type=int, default=2, metavar="N",
                   help="runs per worker that must all agree before anything is recorded (2)")
    p.add_argument("--workload", action="append", default=[], metavar="NAME",
                   help="only this built-in workload (repeatable; default all)")
    p.add_argument("--bundle", action="append", default=[], type=Path, metavar="PATH",
                   help="also record this captured step (repeatable)")
    p.add_argument("--trust", action="store_true", help=TRUST_HELP)
    shared(p)

    p = sub.add_parser("run", parents=parents,
                       help="run on every GPU, compare with the golden and each other")
    p.add_argument("--golden", type=Path, metavar="FILE", help="golden file (default: majority only)")
    p.add_argument("--iterations", type=int, default=1, metavar="N", help="iterations per GPU (1)")
    p.add_argument("--workload", action="append", default=[], metavar="NAME",
                   help="only this built-in workload (repeatable; default all, or none with --bundle)")
    p.add_argument("--bundle", action="append", default=[], type=Path, metavar="PATH",
                   help="replay this captured training step on every GPU (repeatable)")
    p.add_argument("--trust", action="store_true", help=TRUST_HELP)
    p.add_argument("--inject", metavar="SPEC",
                   help="fault harness: make one worker flip bits, e.g. worker=2,dtype=fp32,rate=1 "
                        "(worker N: the N-th worker, i.e. the N-th of --gpus; dtype: fp64, fp32, bf16, "
                        "fp16 or torch's names; see gpumon.sdc.inject)")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="keep replay bundles of failing runs under DIR/sdc/bundles (default: state_dir)")
    shared(p)

    p = sub.add_parser("replay", parents=parents,
                       help="replay a bundle (a failing run: on its GPU unless --gpus/--workers; or a "
                            "captured step)")
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    p.add_argument("--iterations", type=int, default=1, metavar="N", help="iterations per GPU (1)")
    p.add_argument("--with-injection", action="store_true",
                   help="a bundle of an --inject run: inject the same fault again, on the same GPU "
                        "(without it the replay runs fault-free, so it shows whether the GPU itself "
                        "computes right)")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="keep replay bundles of failing runs under DIR/sdc/bundles (default: state_dir)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--trust", action="store_true", help=TRUST_HELP)
    who.add_argument("--as-owner", action="store_true",
                     help="replay a bundle of another user as that user (the owner of its folder), in "
                          "a gpumon process without your privileges; needs root")
    shared(p)
    canary.set_defaults(handler=main)
    return canary


def main(args: argparse.Namespace, agent: Agent) -> int:
    """Run ``gpumon canary ...`` on the node ``agent`` was started on; returns the exit code. Errors
    are reported here, never raised."""
    try:
        import torch  # noqa: F401  (the canaries need it; say so plainly when it is missing)
    except ImportError:
        print(f"gpumon: canary: torch is not installed ({install_hint('compute')})", file=sys.stderr)
        return EXIT_CANNOT_RUN
    from gpumon.sdc.bundle import BundleError
    from gpumon.sdc.inject import FaultSpecError
    from gpumon.sdc.runner import CanaryError
    from gpumon.sdc.trust import UntrustedBundle

    try:
        node = _open_node(args, agent)
        if args.canary_command == "record":
            return _record(args, node, agent)
        if args.canary_command == "run":
            return _run(args, node, agent)
        if args.canary_command == "replay":
            return _replay(args, node, agent)
    except (ConfigError, FaultSpecError) as exc:
        print(f"gpumon: canary: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except UntrustedBundle as exc:
        print(f"gpumon: canary: {exc}: {_trust_advice(args, exc)}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except (CanaryError, BundleError, GpumonError) as exc:
        print(f"gpumon: canary: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    print(f"gpumon: canary: unknown subcommand {args.canary_command}", file=sys.stderr)
    return EXIT_CANNOT_RUN


# -- the node ------------------------------------------------------------------------------------

@dataclass
class _Node:
    """The GPUs the canary names, as the agent's hardware layer reads them from NVML (index ->
    GpuInfo), and how its workers compute. No GPUs on a CPU run: its workers are no GPU's. Where CPU
    workers stand in for the GPUs (``Hardware.devices``), each computes as its GPU's stand-in says."""

    gpus: dict[int, Any] = field(default_factory=dict)
    driver: str | None = None
    only_device: str | None = None  # the device every worker uses, whatever --device says
    describe: str = ""  # what the node is, for messages ("" for a real node)
    sdc_of: dict[int, str] = field(default_factory=dict)  # GPU -> the fault its stand-in computes under
    cpu_model: str = "unknown CPU"  # the host's CPU, the "GPU model" of CPU workers

    @property
    def stood_in(self) -> bool:
        return self.only_device is not None

    def identity(self) -> dict[int, dict[str, Any]]:
        return {i: {"uuid": g.uuid, "serial": g.serial, "pci_bus_id": g.pci_bus_id, "name": g.name}
                for i, g in self.gpus.items()}


def _open_node(args: argparse.Namespace, agent: Agent) -> _Node:
    import torch

    from gpumon.errors import HwCondition
    from gpumon.hw import local_cpu_model
    from gpumon.sdc.golden import cpu_model_of

    devices = agent.hw.devices
    node = _Node(only_device=devices.only_device, describe=devices.describe())
    if node.only_device is not None:
        # the workers standing in for the GPUs compute on this machine's own CPU
        node.cpu_model = local_cpu_model()
    else:
        with contextlib.suppress(HwCondition):
            node.cpu_model = cpu_model_of(agent.hw.fs.read_text("proc/cpuinfo"))
    if node.only_device is not None:
        if args.device not in ("auto", node.only_device):
            raise ConfigError(f"a {node.describe}'s GPUs are CPU workers: not with --device {args.device}",
                              key="--device")
        stand_ins = devices.stand_ins(agent.inventory)
        node.sdc_of = {s.index: s.sdc for s in stand_ins if s.sdc}
        _read_gpus(node, agent)
    elif args.device != "cpu" and torch.cuda.is_available():
        _read_gpus(node, agent)
    return node


def _read_gpus(node: _Node, agent: Agent) -> None:
    """NVML's GPUs and driver, as the agent found them. Without NVML the canary still runs: the
    golden key then says driver "unknown" and bundles carry the GPU index alone."""
    if agent.inventory.nvml_error and not agent.inventory.gpus:
        return
    node.gpus = {g.index: g for g in agent.inventory.gpus}
    node.driver = agent.inventory.driver_version


# -- helpers ---------------------------------------------------------------------------------------

def _gpus(args: argparse.Namespace) -> tuple[int, ...]:
    if not args.gpus:
        return ()
    try:
        gpus = tuple(int(g) for g in args.gpus.split(",") if g.strip())
    except ValueError:
        raise ConfigError(f"not a list of GPU indices: {args.gpus!r}", key="--gpus") from None
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise ConfigError(f"GPU indices must be distinct and >= 0: {args.gpus!r}", key="--gpus")
    return gpus


def _workers(args: argparse.Namespace, node: _Node) -> int:
    import torch

    if _gpus(args):
        return len(_gpus(args))
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError("must be at least 1", key="--workers")
        return int(args.workers)
    if node.stood_in and node.gpus:
        return len(node.gpus)
    if args.device != "cpu" and torch.cuda.is_available():
        return int(torch.cuda.device_count())
    return 4


def _device_indices(args: argparse.Namespace, node: _Node) -> tuple[int, ...]:
    """The GPU of each worker, in worker order: --gpus, else the first N GPUs (NVML's, when known)."""
    gpus = _gpus(args)
    known = sorted(node.gpus)
    if gpus and known:
        absent = [g for g in gpus if g not in node.gpus]
        if absent:
            raise ConfigError(f"no GPU {', '.join(map(str, absent))} on this node (NVML: "
                              f"{', '.join(map(str, known))})", key="--gpus")
    if gpus or not node.stood_in:
        return gpus
    return tuple(known[:_workers(args, node)])


def _state_dir(args: argparse.Namespace, agent: Agent) -> Path:
    if getattr(args, "state_dir", None):
        return Path(args.state_dir)
    return agent.state_dir


def _options(args: argparse.Namespace, node: _Node, **extra: Any) -> Any:
    from gpumon.sdc.runner import Options

    if getattr(args, "iterations", 1) < 1:
        raise ConfigError("must be at least 1", key="--iterations")
    # CPU workers standing in for GPUs: never the machine's own GPUs under their names; the key's
    # CPU model is this machine's, whose CPU computes them
    return Options(workers=_workers(args, node), device_indices=_device_indices(args, node),
                   device=node.only_device or args.device, timeout_s=args.timeout,
                   cpu_model=node.cpu_model, driver=node.driver,
                   gpu_identity=node.identity(), **extra)


def _stand_in_fault(node: _Node, options: Any) -> Any:
    """The fault a stand-in for a GPU the run uses computes under, for its worker."""
    from gpumon.sdc.inject import stand_in_fault

    if not node.stood_in:
        return None
    return stand_in_fault(node.sdc_of, list(options.device_indices) or list(range(options.workers)))


def _bundle_dir(args: argparse.Namespace, agent: Agent) -> Path:
    return _state_dir(args, agent) / "sdc" / "bundles"


def _emit(args: argparse.Namespace, findings: list[Finding], summary: dict[str, Any],
          headline: str) -> int:
    status = overall_status(findings)
    if args.json:
        doc = {"status": status.value, "node": socket.gethostname(), "profile": None,
               "findings": [f.to_json() for f in findings if args.verbose or f.severity is not Severity.OK
                            or not any(g.severity is not Severity.OK for g in findings)],
               "canary": summary}
        print(json.dumps(doc, indent=2, default=str))
        return status.exit_code
    print(headline)
    for f in findings:
        if f.severity is Severity.OK and not args.verbose and status is not Status.OK:
            continue
        action = f" [{f.action.value}]" if f.action.value != "none" else ""
        print(f"  {f.severity.value.upper():8s} {f.component:8s} {f.message}{action}")
        if f.severity is not Severity.OK and args.verbose:
            for k in ("first_differing_tensor", "expected_fingerprint", "observed_fingerprint", "bundle"):
                if k in f.evidence:
                    print(f"           {k}: {f.evidence[k]}")
    for b in summary.get("bundles") or []:
        print(f"  replay bundle kept: {b}")
    return status.exit_code


# -- subcommands -----------------------------------------------------------------------------------

def _judge(agent: Agent) -> Callable[[Report], list[Finding]]:
    """The canary check's verdict (``Check.canary_verdict``), through the registry, so that a run
    is judged as the daemon's check judges it without importing any check module."""
    from gpumon.sdc.runner import CHECK

    check = agent.checks.get(CHECK)
    if check is None or not check.judges_canaries():
        raise GpumonError(f"the {CHECK} check is not installed (entry-point group gpumon.checks), "
                          "and it is what judges a canary run")
    return check().canary_verdict


def _record(args: argparse.Namespace, node: _Node, agent: Agent) -> int:
    from gpumon.sdc import runner
    from gpumon.sdc.golden import FORMAT, Golden, GoldenKey

    # entries of other keys (other SKUs, drivers) already in the file are kept
    golden = Golden.load(args.out) if args.out.exists() and args.out.stat().st_size else Golden()
    options = _options(args, node, iterations=args.iterations, workloads=tuple(args.workload),
                       bundles=_bundles(args), trust_bundles=args.trust, keep_tensors=False)
    report = runner.run(options)
    findings = _judge(agent)(report)
    problems = [f for f in findings if f.severity is not Severity.OK]
    # every run of every worker must agree, with itself across iterations and with the others
    disagree: list[str] = []
    recorded = 0
    for w in report.workers:
        for name in report.workloads:
            runs = [report.runs[(w.index, it, name)] for it in range(report.iterations.get(w.index, 0))]
            if not runs:
                continue
            if any(r.error for r in runs):
                error = next(r.error for r in runs if r.error)
                disagree.append(f"{name} raised on worker {w.index}: {error}")
                continue
            if len({r.signature() for r in runs}) > 1:
                disagree.append(f"{name} is not repeatable on worker {w.index}")
    keys: dict[GoldenKey, list[Any]] = {}
    for (i, _it, name), r in report.runs.items():
        info = next(w for w in report.workers if w.index == i)
        keys.setdefault(GoldenKey(name, r.params, info.key), []).append(r)
    for key, runs in keys.items():
        if len({r.signature() for r in runs}) > 1:
            disagree.append(f"{key.workload}: workers of one key disagree")
    if report.worker_failures:
        disagree.extend(f"worker {i}: {why}" for i, why in sorted(report.worker_failures.items()))
    if problems or disagree:
        summary = {**runner.summary_json(report), "recorded": 0, "refused": disagree}
        head = ("gpumon canary record: NOT recorded: the hardware disagrees with itself or a worker "
                "failed:\n  " + "\n  ".join(disagree or ["see below"]))
        _emit(args, findings, summary, head)
        return max(overall_status(findings).exit_code, 2)
    for key, runs in sorted(keys.items()):
        golden.put(key, runs[0].points, workers=len(report.workers),
                   iterations=max(report.iterations.values(), default=0))
        recorded += 1
    golden.save(args.out)
    summary = {**runner.summary_json(report), "recorded": recorded, "golden": str(args.out),
               "format": FORMAT}
    return _emit(args, findings, summary,
                 f"gpumon canary record: {recorded} golden entries written to {args.out} "
                 f"({len(report.workers)} workers x {args.iterations} iterations agreed)")


def _run(args: argparse.Namespace, node: _Node, agent: Agent) -> int:
    from gpumon.sdc import runner
    from gpumon.sdc.bundle import expected_golden
    from gpumon.sdc.golden import Golden
    from gpumon.sdc.inject import FaultSpec

    golden = Golden.load(args.golden) if args.golden else Golden()
    bundles = _bundles(args)
    for b in bundles:
        extra = expected_golden(b)
        for key, points in extra.entries.items():
            golden.entries.setdefault(key, points)
    options = _options(args, node, iterations=args.iterations, workloads=tuple(args.workload),
                       bundles=bundles, trust_bundles=args.trust, golden=golden,
                       bundle_dir=_bundle_dir(args, agent))
    # --inject wins over a simulated node's own sdc fault
    inject = FaultSpec.parse(args.inject) if args.inject else _stand_in_fault(node, options)
    options = dataclasses.replace(options, inject=inject,
                                  inject_origin="harness" if args.inject else "simulated")
    if inject is not None and inject.worker >= options.workers:
        raise ConfigError(f"worker {inject.worker} does not exist ({options.workers} workers)",
                          key="--inject")
    report = runner.run(options)
    findings = _judge(agent)(report)
    summary = runner.summary_json(report)
    if inject is not None:
        summary["injected_fault"] = inject.to_text()
    bad = [f for f in findings if f.severity is Severity.FAIL]
    head = (f"gpumon canary run: {len(report.workers)} workers, {args.iterations} iterations, "
            f"{len(report.workloads)} workloads: "
            + (f"{len(bad)} GPU(s) computed wrong bits" if bad else "no GPU computed wrong bits"))
    if inject is not None:
        head += (f" (fault harness on: {inject.to_text()}: GPU {report.gpu_of(inject.worker)})"
                 if args.inject else f" ({node.describe}: GPU {report.gpu_of(inject.worker)} computes "
                 "wrong bits)")
    return _emit(args, findings, summary, head)


def _replay(args: argparse.Namespace, node: _Node, agent: Agent) -> int:
    from gpumon.sdc import runner
    from gpumon.sdc.bundle import (
        OLD_BUNDLE_NOTE,
        BundleError,
        describe_gpu,
        expected_golden,
        failed_gpu,
        injected_fault,
        read_manifest,
        replay_fault,
        tensor_diff,
    )
    from gpumon.sdc.trust import bundle_owner, check_bundle, trusted_uids

    if args.as_owner:
        # decided on the folder's owner alone: nothing of the bundle is read before the drop
        owner = bundle_owner(args.bundle)
        if owner not in trusted_uids():
            return _replay_as_owner(args, owner)
    # what is read and imported from here on is the path that was checked, symlinks resolved
    bundle = args.bundle if args.trust else check_bundle(args.bundle).path
    manifest = read_manifest(bundle)
    failure = manifest.get("kind") == "failure"
    gpu = failed_gpu(manifest) if failure else None
    fault = injected_fault(manifest)
    if args.with_injection and fault is None:
        raise BundleError(f"{args.bundle}: --with-injection: the bundle's run had no fault injected")
    if args.with_injection and fault is not None and fault.by == "simulated":
        raise BundleError(f"{args.bundle}: --with-injection: the fault was the simulated node's own (its "
                          f"scenario's sdc fault on GPU {fault.gpu}): replayed on that simulated node, "
                          "its GPU computes it again without --with-injection")
    where = _replay_on(args, node, gpu)
    golden = expected_golden(bundle)
    options = _options(args, node, iterations=args.iterations, bundles=(bundle,), golden=golden,
                       trust_bundles=args.trust, bundle_dir=_bundle_dir(args, agent))
    replayed = None
    if args.with_injection and fault is not None:
        replayed = replay_fault(fault, options.device_indices, options.workers)
        options = dataclasses.replace(options, inject=replayed)
    else:
        stand_in = _stand_in_fault(node, options)
        options = dataclasses.replace(options, inject=stand_in, inject_origin="simulated")
    who = (describe_gpu(gpu) if gpu is not None else f"worker {manifest.get('worker')}") if failure else ""
    # what is replayed comes first: the verdict below reads differently for an injected fault
    if failure:
        head = (f"gpumon canary replay {args.bundle} (failure): {manifest.get('workload')} iteration "
                f"{manifest.get('iteration')} as {who} computed it (first differing tensor "
                f"{manifest.get('first_differing_tensor')!r}, vs {manifest.get('compared_with')})")
    else:
        head = (f"gpumon canary replay {args.bundle} ({manifest.get('kind')}): "
                f"{manifest.get('name') or manifest.get('workload')}")
    if fault is not None:
        head += "\n  " + _fault_words(fault, replayed)
    if where:
        head += f"\n  {where}"
    report = runner.run(options)
    findings = _judge(agent)(report)
    summary = runner.summary_json(report)
    summary["bundle"] = {"path": str(args.bundle), "kind": manifest.get("kind"),
                         "workload": manifest.get("workload") or manifest.get("name")}
    if failure:
        summary["bundle"].update({
            "failed_on_gpu": gpu, "failed_on_worker": manifest.get("worker"),
            "iteration": manifest.get("iteration"),
            "first_differing_tensor": manifest.get("first_differing_tensor"),
            "compared_with": manifest.get("compared_with"),
            "expected_is_golden": manifest.get("expected_is_golden")})
        if fault is not None:
            summary["bundle"]["injected_fault"] = {
                "spec": fault.text, "by": fault.by, "gpu": fault.gpu, "on_failing_gpu": fault.on_failing_gpu,
                "replayed": replayed is not None or fault.by == "simulated",
                "replayed_as": replayed.to_text() if replayed is not None else None}
        if gpu is None:
            summary["bundle"]["note"] = OLD_BUNDLE_NOTE
        if where:
            summary["bundle"]["replayed_on"] = where
        diff = tensor_diff(bundle)
        if diff is not None:
            summary["bundle"]["kept_tensors_diff"] = diff
    head += f"\n  replay: {len(report.workers)} workers, {args.iterations} iterations"
    if failure:
        failed = sorted({report.gpu_of(m.worker) for m in report.mismatches})
        if failed:
            head += f"\n  the failure of {who} reproduced on GPU(s) {', '.join(map(str, failed))}"
            if replayed is not None:
                head += " (with the injected fault)"
        else:
            head += f"\n  the failure of {who} did not reproduce here"
            if fault is not None and fault.on_failing_gpu and fault.by != "simulated" and replayed is None:
                head += " (as expected: the injected fault was not replayed)"
        if golden.entries and not manifest.get("expected_is_golden"):
            head += ("\n  the run had no golden: \"golden\" below is the bits the agreeing GPUs "
                     "computed in that run, kept in the bundle")
        if gpu is None:
            head += f"\n  note: {OLD_BUNDLE_NOTE}"
        elif gpu.get("identity_note"):
            head += f"\n  note: {gpu['identity_note']}"
    if not golden.entries:
        head += "\n  the bundle carries no golden: comparing the workers with each other only"
    elif report.no_golden:
        head += ("\n  the bundle's golden was made under another key: comparing the workers with each "
                 "other only")
    code = _emit(args, findings, summary, head)
    diff = summary["bundle"].get("kept_tensors_diff")
    if diff and not args.json:
        print(f"  kept tensors of the failing run vs an agreeing worker: {json.dumps(diff)}")
    return code


def _bundles(args: argparse.Namespace) -> tuple[Path, ...]:
    """``--bundle``s to run: as given with ``--trust``, else checked (``gpumon.sdc.trust``)."""
    from gpumon.sdc.trust import checked_paths

    return tuple(checked_paths(args.bundle, trust=args.trust))


def _trust_advice(args: argparse.Namespace, exc: Any) -> str:
    """What to do about a refused bundle (``UntrustedBundle``), for this command."""
    from gpumon.sdc.trust import describe_uid

    said = (f"a replay imports the code a bundle names and loads its files with your privileges "
            f"({describe_uid(os.geteuid())})")
    if args.canary_command != "replay":
        return (f"{said}: look at it, then run it with --trust (as it is), or replay it as its owner "
                "with `gpumon canary replay --as-owner BUNDLE`")
    if exc.owner is not None and exc.owner not in exc.uids:
        return (f"{said}: look at the bundle, then replay it with --trust (as it is, with your "
                f"privileges) or --as-owner (as its owner, {describe_uid(exc.owner)}, without them)")
    return (f"{said}: make root (or you) the only one who can change that, or look at the bundle and "
            "replay it with --trust (as it is)")


# What a replay as the bundle's owner keeps of the environment: root's may hold credentials
_OWNER_ENV = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH", "LD_LIBRARY_PATH"})
_OWNER_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "GPUMON_", "OMP_", "MKL_", "TORCH_", "PYTORCH_", "NCCL_")


def _replay_as_owner(args: argparse.Namespace, owner: int) -> int:
    """``replay --as-owner``: the replay runs as ``gpumon canary replay`` in a process of the
    bundle's owner (its uid, its primary group, no other group, none of root's environment beyond
    ``_OWNER_ENV``, no controlling terminal, so no TIOCSTI into root's), which checks the bundle as
    its own (every file the owner's or root's) and writes straight to this process's stdout and
    stderr. This process reads nothing of the bundle and nothing back but the exit code."""
    import pwd
    import signal
    import subprocess
    import tempfile

    from gpumon.sdc.trust import describe_uid

    who = describe_uid(owner)
    if os.geteuid() != 0:
        raise ConfigError(f"the bundle is {who}'s: only root can replay as another user (ask them to, or "
                          "look at it and replay it with --trust)", key="--as-owner")
    try:
        user = pwd.getpwuid(owner)
    except KeyError:
        # not the folder's group: a folder in a setgid folder carries that folder's group
        raise ConfigError(f"the bundle's owner, uid {owner}, has no passwd entry: no group to replay as",
                          key="--as-owner") from None
    made = None
    if args.state_dir:
        state = Path(args.state_dir).absolute()
    else:
        # the owner cannot write this node's state directory: its failing replays are kept here
        made = state = Path(tempfile.mkdtemp(prefix="gpumon-replay-"))
        os.chown(made, owner, user.pw_gid)
    argv = [sys.executable, "-m", "gpumon", *_global_argv(args), "canary", "replay",
            str(Path(args.bundle).absolute()), *_replay_argv(args), "--state-dir", str(state)]
    env = {k: v for k, v in os.environ.items() if k in _OWNER_ENV or k.startswith(_OWNER_ENV_PREFIXES)}
    env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    print(f"gpumon: canary: replaying {args.bundle} as its owner, {who}, in a process without your "
          f"privileges (replay bundles of failing runs under {state})", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        try:
            proc = subprocess.Popen(argv, user=owner, group=user.pw_gid, extra_groups=[], env=env, cwd="/",
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise GpumonError(f"cannot start the replay as {who} (it runs {sys.executable}): {exc}") from None
        try:
            code = proc.wait()
        except BaseException:
            # its own session: Ctrl-C reached this process only; the replay stops its workers on SIGINT
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    finally:
        if made is not None:
            with contextlib.suppress(OSError):
                os.rmdir(made)  # only if no failing replay was kept in it
    if code < 0:
        print(f"gpumon: canary: the replay as {who} was killed by signal {-code}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    return code


def _global_argv(args: argparse.Namespace) -> list[str]:
    """gpumon's global flags as given, paths made absolute (the owner's replay runs in /)."""
    out: list[str] = []
    for flag, dest, is_path in (("--config", "config", True), ("--host-root", "host_root", True),
                                ("--profile", "profile", False), ("--simulate", "simulate", False),
                                ("--sim-at", "sim_at", False), ("--sim-dir", "sim_dir", True)):
        value = getattr(args, dest, None)
        if value is None:
            continue
        if is_path or (dest == "simulate" and Path(value).exists()):  # a scenario file, not a name
            value = Path(value).absolute()
        out += [flag, str(value)]
    return out


def _replay_argv(args: argparse.Namespace) -> list[str]:
    """``canary replay``'s own flags as given, but for --as-owner and --state-dir."""
    out = ["--iterations", str(args.iterations), "--device", args.device, "--timeout", str(args.timeout)]
    if args.workers is not None:
        out += ["--workers", str(args.workers)]
    if args.gpus:
        out += ["--gpus", args.gpus]
    out += [flag for flag, on in (("--with-injection", args.with_injection), ("--json", args.json),
                                  ("--verbose", args.verbose)) if on]
    return out


def _fault_words(fault: Any, replayed: Any) -> str:
    """What the bundle says of the fault injected in its run, and whether this replay injects it."""
    if fault.by == "simulated":
        return (f"captured on a simulated node whose GPU {fault.gpu} computes wrong bits (its scenario's "
                f"sdc fault: {fault.text}): that simulated GPU computes them again in this replay")
    said = f"captured under the fault harness (--inject {fault.text}: GPU {fault.gpu})"
    if fault.by is None:
        said += (" [a bundle from before bundles said whose fault it was; if it was a simulated node's "
                 "own sdc fault, that simulated GPU computes it again]")
    if replayed is not None:
        return said + (f"\n  replaying WITH the injected fault (--with-injection) on GPU {fault.gpu}, "
                       f"worker {replayed.worker} of this replay: {replayed.to_text()}")
    if not fault.on_failing_gpu:
        return said + ("\n  the injected fault was on another GPU than the failing one: this failure is "
                       "not the injected fault's; it is not replayed (--with-injection replays it)")
    return said + ("\n  the injected fault is NOT replayed (--with-injection replays it): \"did not "
                   "reproduce\" is then what to expect, and means the wrong bits were the harness's, not "
                   "the hardware's")


def _replay_on(args: argparse.Namespace, node: _Node, gpu: dict[str, Any] | None) -> str | None:
    """Without --gpus/--workers, a failure is replayed on the GPU that failed: the one with the
    bundle's UUID when NVML knows it (GPUs renumber: a reboot, a replaced board), else its index.
    Sets ``args.gpus``; returns what was chosen, in words (None: the caller's choice stands)."""
    if gpu is None or args.gpus or args.workers is not None:
        return None
    index: int = gpu["index"]
    uuid = gpu.get("uuid")
    if node.gpus:
        by_uuid = [i for i, g in node.gpus.items() if uuid and g.uuid == uuid]
        if by_uuid:
            index = by_uuid[0]
        elif index not in node.gpus:
            return f"GPU {index} ({uuid or 'UUID not known'}) is not on this node: replaying on every GPU"
    args.gpus = str(index)
    said = f"replaying on GPU {index}, the GPU of the failure (--gpus or --workers to choose others)"
    if index != gpu["index"]:
        said += f"; it is GPU {index} now (UUID {uuid}), it was GPU {gpu['index']}"
    elif uuid and node.gpus and node.gpus[index].uuid != uuid:
        said += f"; NOTE: GPU {index} now has UUID {node.gpus[index].uuid}, not the bundle's {uuid}"
    return said


def _standalone(argv: Sequence[str] | None = None) -> int:
    """``python -m gpumon.sdc.cli SUBCOMMAND ...``: the same commands without gpumon's global flags."""
    parser = UsageParser(prog="gpumon-canary", description="gpumon SDC canaries")
    parser.add_argument("--config", type=Path, metavar="FILE", help="gpumon config (for state_dir)")
    parser.add_argument("--host-root", metavar="DIR", help="where the host's /proc is (default /)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    canary = add_parser(sub)
    # drop the "canary" level: its subcommands become this program's commands
    args = parser.parse_args(["canary", *(sys.argv[1:] if argv is None else argv)])
    del canary
    from gpumon.agent import Agent
    from gpumon.config import load_config
    from gpumon.registry import load_registry

    try:
        registry = load_registry()
        checks = registry.checks
        config = load_config(args.config, checks, overrides={"host_root": args.host_root},
                             not_loaded=registry.not_loaded)
        agent = Agent(config, checks, not_loaded=registry.not_loaded)
        agent.start(require_nvml=False)
    except GpumonError as exc:
        print(f"gpumon: canary: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    try:
        return main(args, agent)
    finally:
        agent.stop()


if __name__ == "__main__":
    sys.exit(_standalone())
