"""Replay bundles: a training step captured from a real model, or the failing run of a canary.

A bundle is a directory: ``manifest.json`` (what to run, under which key, the expected
fingerprints) and ``torch.save`` files. Two kinds:

- ``capture``: one real training step of a user's model (``capture(...)``): module state, optimizer
  state, one batch, the seed, which module outputs to fingerprint, and references to the code that
  rebuilds the model and computes the loss. ``gpumon canary run --bundle DIR`` runs it on every GPU;
  its own reference run (made at capture time) is the golden for the capturing device's key.
- ``failure``: kept by ``gpumon canary run`` when a GPU disagreed: the workload, iteration, key,
  the expected and the observed fingerprints, the failing worker's tensors (``observed.pt``) and an
  agreeing worker's (``reference.pt``), so that the run can be replayed on this or another GPU
  (``gpumon canary replay DIR``) and the differing elements looked at bit by bit. A run under the
  fault harness records its spec (``injected_fault``): a replay runs without it unless asked
  (``--with-injection``, ``replay_fault``).

Bundles are loaded with ``torch.load(weights_only=True)``: tensors and plain containers only. A
capture bundle names code to import (the model factory and loss function), which runs with the
privileges of whoever replays it: ``workload_from_bundle`` refuses a bundle that anyone but root and
the replaying user could have written (``gpumon.sdc.trust``) unless the caller trusts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpumon.atomic import write_atomic
from gpumon.hw import local_cpu_model
from gpumon.sdc.fingerprint import words
from gpumon.sdc.golden import Golden, GoldenKey, device_key, first_difference
from gpumon.sdc.inject import FaultSpec, FaultSpecError
from gpumon.sdc.trust import CODE_REFS, check_bundle
from gpumon.sdc.trust import MANIFEST as MANIFEST
from gpumon.sdc.trust import BundleError as BundleError
from gpumon.sdc.workloads import (
    Point,
    Recorder,
    Workload,
    builtin_workloads,
    deterministic,
    run_workload,
    training_step,
)

FORMAT = "gpumon-sdc-bundle/1"
STATE = "state.pt"
# BundleError and MANIFEST are gpumon.sdc.trust's (a module without torch), imported from here too


# -- code references -------------------------------------------------------------------------------

def callable_ref(obj: Any) -> dict[str, str]:
    """How to find a module-level function or class again in another process."""
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not qualname or not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise BundleError(f"{obj!r} is not a module-level function or class: replay could not find it")
    source = getattr(sys.modules.get(module), "__file__", None)
    if module == "__main__":
        if not source:
            raise BundleError(f"{qualname} is defined in an interactive session: put it in a file")
        return {"file": str(Path(source).resolve()), "qualname": qualname}
    ref = {"module": module, "qualname": qualname}
    if source:
        # a module imported from a script's folder may not be importable elsewhere: keep its file too
        ref["file"] = str(Path(source).resolve())
    return ref


def resolve_ref(ref: Mapping[str, str], file: Path | None = None) -> Any:
    """The function or class ``ref`` names: imported by its module name, else from its file
    (``file``: the file as a trust check resolved it, instead of the one the ref names)."""
    try:
        target: Any = None
        if "module" in ref and file is None:
            try:
                target = importlib.import_module(ref["module"])
            except ImportError:
                if "file" not in ref:
                    raise
        if target is None:
            path = file if file is not None else Path(ref["file"])
            name = "gpumon_sdc_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
            target = sys.modules.get(name)
            if target is None:
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise BundleError(f"cannot import {path}")
                target = importlib.util.module_from_spec(spec)
                sys.modules[name] = target
                spec.loader.exec_module(target)
        for part in ref["qualname"].split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, OSError, KeyError) as exc:
        raise BundleError(f"cannot find {ref}: {exc}") from None
    return target


# -- reading and writing -------------------------------------------------------------------------

def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{file}: not a readable bundle manifest: {exc}") from None
    return _valid(data, file)


def _valid(data: Any, file: Path) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{file}: not a gpumon replay bundle (want format {FORMAT!r})")
    return data


def _write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def _points(rows: Any) -> list[Point]:
    return [Point.from_json(r) for r in rows or []]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


# -- capture ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def deterministic_scope(threads: int = 1) -> Iterator[None]:
    """``deterministic()`` for the duration, then the caller's settings back."""
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.get_num_threads())
    deterministic(threads, interop=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2], saved[3]
        torch.set_num_threads(saved[4])


def capture(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
            batch: Mapping[str, torch.Tensor], loss_fn: Callable[[nn.Module, Mapping[str, torch.Tensor]],
                                                                 torch.Tensor],
            model_factory: Callable[..., nn.Module], model_kwargs: Mapping[str, Any] | None = None,
            seed: int = 0, watch: Sequence[str] = (), name: str | None = None,
            device: torch.device | str | None = None) -> Path:
    """Capture one training step of ``model`` into a replay bundle at ``path``; return the path.

    The bundle holds the module state, optimizer state and ``batch`` as they are now (before the
    step), the seed, and references to ``model_factory(**model_kwargs)`` (rebuilds the module) and
    ``loss_fn(model, batch)`` (computes the loss): both must be module-level. ``watch`` names
    submodules whose outputs are fingerprinted besides the loss, every gradient, the optimizer state
    and the updated parameters. ``model`` and ``optimizer`` are not changed.

    The step is then replayed twice from the bundle on ``device`` (default: the model's), under
    deterministic settings: if the two replays differ the step cannot serve as a canary and
    ``BundleError`` names the first differing tensor; else the fingerprints are stored as the
    expected result for this device's key.
    """
    folder = Path(path)
    params = list(model.parameters())
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    if [id(p) for p in opt_params] != [id(p) for p in params]:
        raise BundleError("the optimizer must hold exactly model.parameters(), in that order")
    if folder.exists() and any(folder.iterdir()):
        raise BundleError(f"{folder} exists and is not empty")
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = dict(model_kwargs or {})
    try:
        json.dumps(kwargs)
    except TypeError as exc:
        raise BundleError(f"model_kwargs must be JSON values: {exc}") from None
    torch.save({"model": _cpu(model.state_dict()), "optimizer": _cpu(optimizer.state_dict()),
                "batch": {k: _cpu(v) for k, v in batch.items()}}, folder / STATE)
    manifest: dict[str, Any] = {
        "format": FORMAT, "kind": "capture", "name": name or type(model).__name__,
        "created": time.time(),
        "model_factory": callable_ref(model_factory), "model_kwargs": kwargs,
        "loss_fn": callable_ref(loss_fn), "optimizer": callable_ref(type(optimizer)),
        "training": model.training, "seed": int(seed), "watch": list(watch),
        "state_file": STATE, "state_sha256": _sha256(folder / STATE),
    }
    _write_manifest(folder, manifest)
    default = params[0].device if params else torch.device("cpu")
    dev = torch.device(device) if device is not None else default
    # the code is the caller's own, already imported in this process: nothing to check it against
    workload = workload_from_bundle(folder, dev.type, trust=True)
    # the caller's random streams are theirs: the replays seed their own and leave them as they were
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), deterministic_scope():
        first, _ = run_workload(workload, dev)
        second, _ = run_workload(workload, dev)
    for run in (first, second):
        if run.error:
            raise BundleError(f"the captured step fails when replayed: {run.error}")
    diff = first_difference(first.points, second.points)
    if diff is not None:
        raise BundleError(f"the captured step is not deterministic: two replays differ at {diff.describe()}")
    key = GoldenKey(workload.name, workload.params, device_key(dev, cpu_model=local_cpu_model()))
    manifest["expected"] = {"key": key.to_json(), "points": [p.to_json() for p in first.points]}
    _write_manifest(folder, manifest)
    return folder


def _build_optimizer(cls: Any, params: Sequence[nn.Parameter],
                     state: Mapping[str, Any]) -> torch.optim.Optimizer:
    try:
        opt = cls(params)
    except TypeError:  # an optimizer whose lr has no default
        opt = cls(params, lr=state["param_groups"][0]["lr"])
    # load_state_dict restores every hyper-parameter of every group, then the state
    opt.load_state_dict(state)
    if not isinstance(opt, torch.optim.Optimizer):
        raise BundleError(f"{cls} is not a torch optimizer")
    return opt


def workload_from_bundle(path: Path, device_type: str = "cpu", *, trust: bool = False) -> Workload:
    """The workload a bundle describes: its captured step, or the built-in workload that failed.

    Without ``trust``, ``UntrustedBundle`` for a bundle that anyone but root and this process's
    user could have written or could change (``gpumon.sdc.trust.check_bundle``); its code is then
    imported from where the check found it, after the check."""
    code: dict[str, Path] = {}
    if trust:
        manifest = read_manifest(path)
    else:
        checked = check_bundle(path)
        path, code = checked.path, checked.code
        manifest = _valid(checked.manifest, checked.folder / MANIFEST)
    folder = path if path.is_dir() else path.parent
    kind = manifest.get("kind")
    if kind == "failure":
        source = manifest.get("source") or {}
        if "capture" in source:
            return workload_from_bundle(Path(source["capture"]), device_type, trust=trust)
        builtin = builtin_workloads(device_type)
        name = str(manifest.get("workload"))
        if name not in builtin:
            raise BundleError(f"{folder}: workload {name!r} is not a built-in workload of this gpumon")
        if builtin[name].params != manifest.get("params"):
            raise BundleError(f"{folder}: {name} was run with {manifest.get('params')}; on {device_type} "
                              "this "
                              f"gpumon runs it with {builtin[name].params}")
        return builtin[name]
    if kind != "capture":
        raise BundleError(f"{folder}: unknown bundle kind {kind!r}")
    state_file = folder / str(manifest.get("state_file", STATE))
    factory, loss_fn, opt_cls = (resolve_ref(manifest[key], code.get(key)) for key in CODE_REFS)
    kwargs = dict(manifest.get("model_kwargs") or {})
    seed = int(manifest.get("seed", 0))
    watch = tuple(str(w) for w in manifest.get("watch") or ())
    training = bool(manifest.get("training", True))

    def run(rec: Recorder, device: torch.device) -> None:
        state = torch.load(state_file, map_location=device, weights_only=True)
        torch.manual_seed(seed)
        model: nn.Module = factory(**kwargs)
        model.to(device)
        model.load_state_dict(state["model"])
        model.train(training)
        opt = _build_optimizer(opt_cls, list(model.parameters()), state["optimizer"])
        batch = {k: v.to(device) for k, v in state["batch"].items()}
        torch.manual_seed(seed)  # the step's own randomness (dropout) starts from the captured seed
        training_step(rec, model, opt, batch, loss_fn, watch)

    digest = str(manifest.get("state_sha256", ""))[:16]
    return Workload(workload_name(folder), run, f"state_sha256={digest}",
                    f"captured training step from {folder}")


def workload_name(path: Path) -> str:
    """The name a capture bundle's workload runs under (``capture:<name>``)."""
    manifest = read_manifest(path)
    if manifest.get("kind") == "capture":
        return f"capture:{manifest.get('name', path.name)}"
    return str(manifest.get("workload"))


def expected_golden(path: Path) -> Golden:
    """The bundle's own expected fingerprints, as a golden under the key they were made on."""
    manifest = read_manifest(path)
    golden = Golden()
    if manifest.get("kind") == "capture" and manifest.get("expected"):
        exp = manifest["expected"]
        golden.put(GoldenKey.from_json(exp["key"]), _points(exp["points"]), source=str(path))
    elif manifest.get("kind") == "failure" and manifest.get("expected"):
        # the golden of the run, else the bits of an agreeing GPU of the run (same key): what the
        # failing GPU should have computed either way, so a replay on that GPU alone can tell
        golden.put(GoldenKey.from_json(manifest["key"]), _points(manifest["expected"]), source=str(path),
                   expected_from="golden" if manifest.get("expected_is_golden") else "agreeing GPU")
    return golden


def failed_gpu(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The GPU a failure bundle's wrong bits came from (index, uuid, serial, ...), or None for a
    bundle written before bundles named the GPU (it has only ``worker``)."""
    gpu = manifest.get("gpu")
    if isinstance(gpu, dict) and isinstance(gpu.get("index"), int):
        return dict(gpu)
    return None


def describe_gpu(gpu: Mapping[str, Any]) -> str:
    """``GPU 6 (UUID GPU-..., serial 1655...)``: what an operator finds the GPU by."""
    words = [f"UUID {gpu['uuid']}" if gpu.get("uuid") else "UUID not known",
             f"serial {gpu['serial']}" if gpu.get("serial") else "serial not known"]
    if gpu.get("pci_bus_id"):
        words.append(f"PCI {gpu['pci_bus_id']}")
    return f"GPU {gpu['index']} ({', '.join(words)})"


OLD_BUNDLE_NOTE = ("this bundle predates GPU identities: it names only the worker, the N-th GPU the run "
                   "used (of --gpus, or of the idle GPUs in the daemon), which is GPU N only if the run "
                   "used every GPU; find the GPU from the run's finding (its component) or log")


# -- failures --------------------------------------------------------------------------------------

def write_failure_manifest(folder: Path, *, mismatch: Any, run: Any, expected: Sequence[Point] | None,
                           expected_is_golden: bool, reference_worker: int | None, key: GoldenKey,
                           capture_bundle: Path | None, inject: str | None,
                           dump_errors: Mapping[str, str], gpu: Mapping[str, Any] | None = None,
                           reference_gpu: int | None = None, inject_origin: str = "harness",
                           inject_gpu: int | None = None) -> None:
    """``gpu``: the GPU that computed the wrong bits (index, NVML's UUID and serial, ...: see
    ``Report.identity_of``); ``worker`` stays as the run's worker number, which is not the GPU's
    index when the run used some GPUs only (``--gpus``, the idle ones). ``inject``: the fault
    harness spec in force for the run, ``inject_origin`` whose fault it is (``INJECT_ORIGINS``),
    ``inject_gpu`` the GPU whose worker it was on."""
    manifest: dict[str, Any] = {
        "format": FORMAT, "kind": "failure", "created": time.time(),
        "workload": mismatch.workload, "params": run.params,
        "source": {"capture": str(capture_bundle)} if capture_bundle else {"builtin": True},
        "key": key.to_json(), "gpu": dict(gpu) if gpu is not None else None,
        "worker": mismatch.worker, "iteration": mismatch.iteration,
        "compared_with": mismatch.against, "first_differing_tensor": mismatch.first_tensor,
        "detail": mismatch.detail, "error": run.error,
        "observed": [p.to_json() for p in run.points],
        "expected": [p.to_json() for p in expected] if expected is not None else None,
        "expected_is_golden": expected_is_golden,
        "files": {"observed": "observed.pt" if (folder / "observed.pt").exists() else None,
                  "reference": "reference.pt" if (folder / "reference.pt").exists() else None},
        "reference_worker": reference_worker, "reference_gpu": reference_gpu,
    }
    if inject:
        if inject_origin not in INJECT_ORIGINS:
            raise BundleError(f"unknown injected fault origin {inject_origin!r}")
        manifest["injected_fault"] = {"spec": inject, "by": inject_origin, "gpu": inject_gpu,
                                      "flips": run.flips}
    if dump_errors:
        manifest["dump_errors"] = dict(dump_errors)
    _write_manifest(folder, manifest)


# "harness": ``canary run --inject``, a test's fault: replaying the bundle does not inject it again
# unless asked (``replay_fault``). "simulated": a simulated node's own ``sdc`` fault: the simulated
# GPU computes it again on every run, replays included, like a faulty GPU would.
INJECT_ORIGINS = ("harness", "simulated")


@dataclass(frozen=True)
class InjectedFault:
    """The fault the fault harness injected in a failure bundle's run (``injected_fault``)."""

    spec: FaultSpec  # as in force in the captured run (its worker: the run's worker number)
    by: str | None  # INJECT_ORIGINS; None: a bundle written before bundles said whose fault it was
    gpu: int  # the GPU whose worker it was on
    on_failing_gpu: bool  # the bundle's wrong bits came from that GPU

    @property
    def text(self) -> str:
        return self.spec.to_text()


def injected_fault(manifest: Mapping[str, Any]) -> InjectedFault | None:
    """The fault injected in the run a failure bundle captured, or None (none injected, or a
    bundle that is not a failure's). A bundle written before bundles recorded whose fault it was
    and on which GPU still loads: its worker numbers say where it was."""
    row = manifest.get("injected_fault")
    if manifest.get("kind") != "failure" or not isinstance(row, dict) or not row.get("spec"):
        return None
    try:
        spec = FaultSpec.parse(str(row["spec"]))
    except FaultSpecError as exc:
        raise BundleError(f"the bundle's injected fault {row['spec']!r} does not parse: {exc}") from None
    failing = failed_gpu(manifest)
    by = row.get("by") if row.get("by") in INJECT_ORIGINS else None
    if isinstance(row.get("gpu"), int):
        gpu = int(row["gpu"])
    elif spec.worker == manifest.get("worker") and failing is not None:
        gpu = int(failing["index"])
    else:
        gpu = spec.worker  # an old bundle of a run on every GPU: worker N was GPU N
    on_failing = (gpu == failing["index"]) if failing is not None else spec.worker == manifest.get("worker")
    return InjectedFault(spec, by, gpu, on_failing)


def replay_fault(fault: InjectedFault, gpus: Sequence[int], workers: int) -> FaultSpec:
    """The captured run's injected fault for a replay whose workers run on ``gpus`` (in worker
    order; empty: worker N stands for GPU N): on the replay's worker on the GPU it was injected on,
    drawing from the captured worker's random stream, so that a replay of iteration 0 flips the
    very bits the captured run flipped."""
    if fault.gpu in gpus:
        worker = list(gpus).index(fault.gpu)
    elif not gpus and fault.gpu < workers:
        worker = fault.gpu
    else:
        on = f"GPUs {', '.join(map(str, gpus))}" if gpus else f"workers 0..{workers - 1}"
        raise BundleError(f"the injected fault was on GPU {fault.gpu}, which this replay does not run on "
                          f"({on}): add it to --gpus")
    return dataclasses.replace(fault.spec, worker=worker, stream=fault.spec.random_stream)


def tensor_diff(folder: Path) -> dict[str, Any] | None:
    """Bit-level difference between a failure bundle's observed and reference tensors, if both exist.

    The first tensor (in recording order) whose bits differ, how many elements differ, and for the
    first differing element its flat index, both values and the XOR of the two bit patterns.
    """
    manifest = read_manifest(folder)
    files = manifest.get("files") or {}
    if not files.get("observed") or not files.get("reference"):
        return None
    observed = torch.load(folder / files["observed"], weights_only=True)
    reference = torch.load(folder / files["reference"], weights_only=True)
    for row in manifest.get("observed") or []:
        name = row[0]
        if name not in observed or name not in reference:
            continue
        o, r = observed[name], reference[name]
        if o.shape != r.shape or o.dtype != r.dtype:
            return {"tensor": name, "observed": f"{o.dtype}{list(o.shape)}",
                    "reference": f"{r.dtype}{list(r.shape)}"}
        ow, bits = words(o)
        rw, _ = words(r)
        differ = (ow != rw).nonzero().reshape(-1)
        if differ.numel() == 0:
            continue
        i = int(differ[0])
        mask = (1 << bits) - 1
        xor = (int(ow[i]) & mask) ^ (int(rw[i]) & mask)
        flat_o, flat_r = o.reshape(-1), r.reshape(-1)
        value = flat_o[i // 2 if o.is_complex() else i]
        ref_value = flat_r[i // 2 if r.is_complex() else i]
        return {"tensor": name, "elements_differing": int(differ.numel()), "elements": o.numel(),
                "first_element": i, "observed_value": repr(value.item()),
                "reference_value": repr(ref_value.item()),
                "xor_bits": f"{xor:0{bits // 4}x}", "bits_flipped": [b for b in range(bits) if xor >> b & 1]}
    return {"tensor": None, "note": "the kept tensors are bit-identical (fault not in a kept tensor)"}
