"""pcie_topology: GPU <-> NIC <-> PCIe switch affinity, link generation and width, and PCIe AER counters
compared from before the bootstrap suite's load to after it.

- **Affinity** (sysfs ``sys/bus/pci/devices``, resolved into the PCI tree by gpumon/hw/pci.py, and the
  RDMA devices of ``sys/class/infiniband``): for every GPU, the RDMA NICs that sit below the same PCIe
  switch. On an HGX board each GPU has its NIC beside it: the real HGX H100 ``lspci -vvv`` in
  tests/data/pcie-aer shows GPU 19:00.0 and ConnectX-7 1a:00.0 on two downstream ports (17:01.0,
  17:02.0) of one Broadcom PEX890xx switch (upstream port 16:00.0), and so for 3b/3c, 4c/4d, ...
  GPUDirect RDMA then moves data switch-locally; a GPU without a NIC under its switch sends it
  through the CPU's root complex. Expected when ``expect_nic_per_gpu`` says so, or by default when
  the profile has at least as many IB ports as GPUs (8 and 8 on HGX H100/H200/B200). A GPU with no
  such NIC -> fail, inspect_hardware (a NIC that did not enumerate, or a card in the wrong slot).
  When no PCIe switch is visible above any GPU (a VM's flattened topology) affinity is ``skipped``.
- **Links** of every GPU and of the NICs paired with them (``current/max_link_speed``,
  ``current/max_link_width``), each judged against the lower of its own and its link partner's
  maximum, as the continuous ``pcie`` check does: narrower than that -> fail, inspect_hardware
  (width does not change with load); a maximum below the profile's ``pcie.generation`` /
  ``pcie.width`` -> warn, inspect_hardware (wrong slot or riser); a speed below the maximum while
  the GPU is busy (utilization above ``load_utilization_pct``) -> warn. **Load caveat**: GPUs lower
  the link speed when idle (NVIDIA: "may be reduced when the GPU is not in use"), and this check runs
  early in the suite, before the compute checks load the GPUs, so an idle downshift is recorded and
  not judged. Speed under load is the continuous ``pcie`` check's (it judges it whenever a job keeps
  the GPU busy); host<->device bandwidth needs CUDA and belongs to the compute checks.
- **AER over the suite**: ``run`` records the AER totals (correctable, non-fatal, fatal) of every GPU,
  paired NIC and PCIe port above them in the check's state; ``after_suite`` (called by the suite once
  every other check has run, see gpumon/bootstrap.py) reads them again. A new fatal or non-fatal
  error -> fail, inspect_hardware; new correctable errors beyond DCGM's replay limit (8 per minute,
  at least one minute's worth) -> warn, inspect_hardware. Counts since boot are the ``pcie`` check's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import HwCondition
from gpumon.hw import pci as pcihw
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Action, Finding, Phase, Severity, gpu, pci

from .pcie import PcieConfig

_SWITCH_ROLES = ("switch_upstream", "switch_downstream")


@dataclass(frozen=True)
class PcieTopologyConfig:
    expect_nic_per_gpu: bool | None = field(default=None, metadata={
        "source": "default (null): expected when the profile's network.ib_ports >= gpu.count, as on HGX "
                  "boards: the real HGX H100 lspci in tests/data/pcie-aer has one ConnectX-7 per GPU on "
                  "the same PEX890xx switch (GPU 19:00.0 / NIC 1a:00.0 below upstream port 16:00.0)"})
    load_utilization_pct: int = field(default=PcieConfig.load_utilization_pct, metadata={
        "min": 0, "max": 100,
        "source": "the pcie check's load_utilization_pct (checks/pcie/options.py, sources there)"})
    correctable_per_minute: float = field(default=8.0, metadata={
        "min": 0,
        "source": "NVIDIA/DCGM common/DcgmGPUHardwareLimits.h @ 28bfbd4c97413d4aec249cdd9543a67d24f95b78: "
                  "DCGM_LIMIT_MAX_PCIREPLAY_RATE 8 per minute (the pcie check's 480/h is the same limit)"})


@dataclass(frozen=True)
class GpuNicPair:
    gpu_index: int
    gpu_bdf: str
    device: str  # RDMA device name (mlx5_3)
    nic_bdf: str
    switch: str  # bus id of the deepest PCIe switch port above both


def shared_switch(tree: pcihw.PciScan, a: str, b: str) -> str | None:
    """The deepest PCIe switch port above both functions, or None when only the root complex is shared."""
    fa, fb = tree.functions.get(a), tree.functions.get(b)
    if fa is None or fb is None:
        return None
    common = [x for x in fa.ancestors if x in fb.ancestors and x in tree.functions]
    for bdf in reversed(common):
        if tree.role(bdf) in _SWITCH_ROLES:
            return bdf
    return None


def has_switch_above(tree: pcihw.PciScan, bdf: str) -> bool:
    fn = tree.functions.get(bdf)
    return fn is not None and any(a in tree.functions and tree.role(a) in _SWITCH_ROLES for a in fn.ancestors)


def gpu_nic_pairs(tree: pcihw.PciScan, gpus: Mapping[str, int],
                  nics: Mapping[str, str]) -> dict[int, list[GpuNicPair]]:
    """GPU index -> the RDMA NICs below the same PCIe switch (SR-IOV virtual functions left out).

    ``gpus``: bus id -> GPU index; ``nics``: RDMA device -> bus id (gpumon.hw.pci.infiniband_devices).
    """
    out: dict[int, list[GpuNicPair]] = {index: [] for index in gpus.values()}
    for gpu_bdf, index in gpus.items():
        for dev, nic_bdf in sorted(nics.items()):
            fn = tree.functions.get(nic_bdf)
            if fn is None or fn.virtual:
                continue
            switch = shared_switch(tree, gpu_bdf, nic_bdf)
            if switch is not None:
                out[index].append(GpuNicPair(index, gpu_bdf, dev, nic_bdf, switch))
    return out


@dataclass
class _Verdicts:
    items: list[tuple[Severity, Action, str]] = field(default_factory=list)

    def add(self, severity: Severity, action: Action, text: str) -> None:
        self.items.append((severity, action, text))

    def worst(self) -> tuple[Severity, Action]:
        if not self.items:
            return Severity.OK, Action.NONE
        return max(s for s, _, _ in self.items), max(a for _, a, _ in self.items)

    def text(self) -> str:
        bad = [t for s, _, t in self.items if s > Severity.OK]
        return "; ".join(bad)


class PcieTopologyCheck(Check):
    name = "pcie_topology"
    phase = Phase.BOOTSTRAP
    description = ("GPU/NIC/PCIe-switch affinity, GPU and NIC link generation and width, PCIe AER counters "
                   "compared before and after the bootstrap suite")
    timeout = 60.0
    cost = 2.0
    Config = PcieTopologyConfig

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.gpus:
            return "no GPUs visible to NVML"
        if not inventory.pci_devices:
            return "no PCI devices under the host root (sys/bus/pci/devices is empty or missing)"
        return None

    # -- before the load --------------------------------------------------------

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(PcieTopologyConfig)
        try:
            nics, nic_errors = pcihw.infiniband_devices(ctx.hw.fs)
            tree = pcihw.scan(ctx.hw.fs, extra=set(nics.values()))
        except HwCondition as cond:
            ctx.state.pop("aer_baseline", None)
            return [self.from_condition(cond, NODE)]
        gpus = {g.pci_bus_id: g.index for g in ctx.inventory.gpus if g.pci_bus_id in tree.functions}
        out: list[Finding] = []
        for g in ctx.inventory.gpus:
            if g.pci_bus_id not in tree.functions:
                out.append(self.finding(gpu(g.index), Severity.UNKNOWN,
                                        f"GPU {g.index}: NVML's bus id {g.pci_bus_id} is not under "
                                        "sys/bus/pci/devices: topology not judged", Action.NONE,
                                        error=tree.errors.get(g.pci_bus_id)))
        pairs = gpu_nic_pairs(tree, gpus, nics)
        expected, why = self._expectation(ctx, options)
        flattened = bool(gpus) and not any(has_switch_above(tree, b) for b in gpus)
        node_ev: dict[str, Any] = {"nics": dict(nics), "expect_nic_per_gpu": expected, "expectation": why}
        if nic_errors:
            node_ev["nic_errors"] = nic_errors
        if flattened:
            out.append(self.finding(NODE, Severity.SKIPPED,
                                    "no PCIe switch visible above any GPU (a VM or a flattened topology): "
                                    "GPU/NIC affinity not judged", Action.NONE, **node_ev))
        for bdf, index in sorted(gpus.items(), key=lambda item: item[1]):
            out.append(self._gpu(ctx, options, tree, index, bdf, pairs[index], expected and not flattened))
        paired_nics = {p.nic_bdf: p for ps in pairs.values() for p in ps}
        for pair in sorted(paired_nics.values(), key=lambda p: p.device):
            out.extend(self._nic(ctx, tree, pair))
        baseline = self._aer_snapshot(ctx, tree, gpus, pairs)
        ctx.state["aer_baseline"] = baseline
        ctx.state["aer_at"] = ctx.clock()
        read = sum(1 for v in baseline.values() if isinstance(v, dict))
        out.append(self.ok(NODE, f"PCIe AER counters of {read} function(s) recorded before the suite's load",
                           aer_functions=read, **node_ev))
        return out

    def _expectation(self, ctx: CheckContext, options: PcieTopologyConfig) -> tuple[bool, str]:
        if options.expect_nic_per_gpu is not None:
            return options.expect_nic_per_gpu, "checks.pcie_topology.expect_nic_per_gpu"
        ports, count = ctx.profile.network.ib_ports, ctx.profile.gpu.count
        if ports is None or count is None:
            return False, f"profile {ctx.profile.name} states no IB port or GPU count: affinity not required"
        return ports >= count, (f"profile {ctx.profile.name}: {ports} IB ports for {count} GPUs "
                                f"({'one NIC per GPU' if ports >= count else 'fewer NICs than GPUs'})")

    def _gpu(self, ctx: CheckContext, options: PcieTopologyConfig, tree: pcihw.PciScan, index: int, bdf: str,
             pairs: list[GpuNicPair], expected: bool) -> Finding:
        v = _Verdicts()
        ev: dict[str, Any] = {"pci_bus_id": bdf, "nics": [p.device for p in pairs],
                              "switch": pairs[0].switch if pairs else None}
        if not pairs:
            above = [a for a in tree.functions[bdf].ancestors if a in tree.functions
                     and tree.role(a) in _SWITCH_ROLES]
            where = f"PCIe switch {above[0]}" if above else "its root port"
            if expected:
                v.add(Severity.FAIL, Action.INSPECT_HARDWARE,
                      f"no RDMA NIC below the same {where}: this GPU's GPUDirect RDMA traffic would cross "
                      "the CPU root complex (a NIC that did not enumerate, or a card in the wrong slot)")
            else:
                ev["affinity"] = f"no RDMA NIC below the same {where} (not required here)"
        self._link(ctx, options, tree, tree.functions[bdf], v, ev, gpu_index=index)
        severity, action = v.worst()
        pair_text = ", ".join(f"{p.device} ({p.nic_bdf})" for p in pairs) or "no NIC"
        if severity is Severity.OK:
            link = ev.get("link", {})
            return self.ok(gpu(index), f"GPU {index}: NIC {pair_text} on the same PCIe switch; link "
                                       f"{link.get('current', '?')} of {link.get('expected', '?')}", **ev)
        return self.finding(gpu(index), severity, f"GPU {index}: {v.text()}", action, **ev)

    def _nic(self, ctx: CheckContext, tree: pcihw.PciScan, pair: GpuNicPair) -> list[Finding]:
        v = _Verdicts()
        ev: dict[str, Any] = {"device": pair.device, "gpu": pair.gpu_index, "switch": pair.switch}
        self._link(ctx, None, tree, tree.functions[pair.nic_bdf], v, ev, gpu_index=None)
        severity, action = v.worst()
        if severity is Severity.OK:
            return []  # a healthy NIC link is evidence on its GPU's finding; no line of its own
        return [self.finding(pci(pair.nic_bdf), severity, f"NIC {pair.device} ({pair.nic_bdf}): {v.text()}",
                             action, **ev)]

    def _link(self, ctx: CheckContext, options: PcieTopologyConfig | None, tree: pcihw.PciScan,
              fn: pcihw.PciFunction, v: _Verdicts, ev: dict[str, Any], *, gpu_index: int | None) -> None:
        try:
            link = pcihw.read_link(ctx.hw.fs, fn)
        except HwCondition as cond:
            v.add(Severity.UNKNOWN, Action.NONE, f"link state unreadable ({cond.call}: {cond})")
            return
        if link is None or link.max_width is None or link.max_gts is None or link.current_width is None:
            v.add(Severity.UNKNOWN, Action.NONE, "no link attributes in sysfs: link not judged")
            return
        best_width, best_gts = link.max_width, link.max_gts
        partner = tree.link_partner(fn.bdf)
        if partner is not None:
            with contextlib.suppress(HwCondition):
                other = pcihw.read_link(ctx.hw.fs, tree.functions[partner])
                if other is not None:
                    best_width = min(best_width, other.max_width or best_width)
                    best_gts = min(best_gts, other.max_gts or best_gts)
        best_gen = pcihw.generation(best_gts)
        info: dict[str, Any] = {"current": link.describe(), "max": link.describe(current=False),
                                "expected": f"Gen{best_gen} x{best_width}", "partner": partner}
        ev["link"] = info
        width = link.current_width
        if width == 0:
            v.add(Severity.FAIL, Action.INSPECT_HARDWARE, "PCIe link down (width 0)")
        elif width < best_width:
            v.add(Severity.FAIL, Action.INSPECT_HARDWARE,
                  f"PCIe link trained at x{width}, both ends can do x{best_width} "
                  f"({width / best_width:.0%} of the bandwidth): reseat or inspect the card or riser")
        if gpu_index is not None and options is not None:
            spec = ctx.profile.pcie
            if spec.generation is not None and best_gen is not None and best_gen < spec.generation:
                v.add(Severity.WARN, Action.INSPECT_HARDWARE, f"link can reach only Gen{best_gen}; "
                      f"profile {ctx.profile.name} expects Gen{spec.generation}")
            if spec.width is not None and best_width < spec.width:
                v.add(Severity.WARN, Action.INSPECT_HARDWARE,
                      f"link can reach only x{best_width}; profile {ctx.profile.name} expects x{spec.width}")
        if link.current_gts is None or not width or link.current_gts >= best_gts:
            return
        below = f"link at Gen{link.current_gen} while it can do Gen{best_gen}"
        if gpu_index is None:
            v.add(Severity.WARN, Action.INSPECT_HARDWARE, below)
            return
        try:
            util = ctx.hw.nvml.utilization_pct(gpu_index)
        except HwCondition as cond:
            info["idle_downshift"] = f"{below}; load unreadable ({cond.call}): not judged"
            return
        info["gpu_utilization_pct"] = util
        threshold = options.load_utilization_pct if options is not None else PcieConfig.load_utilization_pct
        if util > threshold:
            v.add(Severity.WARN, Action.INSPECT_HARDWARE,
                  f"{below} while the GPU is busy ({util} % utilization)")
        else:
            info["idle_downshift"] = (f"{below} at {util} % utilization: GPUs lower the link speed when "
                                      "idle; not judged before the suite's load")

    # -- AER before and after ----------------------------------------------------

    def _aer_snapshot(self, ctx: CheckContext, tree: pcihw.PciScan, gpus: Mapping[str, int],
                      pairs: Mapping[int, list[GpuNicPair]]) -> dict[str, Any]:
        watched: dict[str, str] = {}
        for bdf, index in gpus.items():
            watched[bdf] = f"gpu/{index}"
        for ps in pairs.values():
            for p in ps:
                watched[p.nic_bdf] = p.device
        for bdf, what in list(watched.items()):
            for anc in tree.functions[bdf].ancestors:
                if anc in tree.functions and anc not in watched:
                    watched[anc] = f"port above {what}"
        snap: dict[str, Any] = {}
        for bdf, what in sorted(watched.items()):
            try:
                aer = pcihw.read_aer(ctx.hw.fs, tree.functions[bdf])
            except HwCondition as cond:
                snap[bdf] = f"unreadable: {cond}"
                continue
            if aer is None:
                continue  # not AER-capable: nothing to compare
            snap[bdf] = {"what": what, "path": tree.functions[bdf].path,
                         **{kind: aer.of(kind).total for kind in pcihw.AER_FILES}}
        return snap

    def after_suite(self, ctx: CheckContext) -> list[Finding]:
        """Compare AER counters with the reading ``run`` took before the suite's load."""
        baseline = ctx.state.get("aer_baseline")
        if not isinstance(baseline, dict):
            return [self.finding(NODE, Severity.UNKNOWN, "no AER reading from before the suite: errors "
                                 "during the suite not judged", Action.NONE)]
        options = ctx.options_as(PcieTopologyConfig)
        minutes = max(1.0, (ctx.clock() - float(ctx.state.get("aer_at", ctx.clock()))) / 60.0)
        allowance = options.correctable_per_minute * minutes
        out: list[Finding] = []
        compared = 0
        for bdf, before in sorted(baseline.items()):
            if not isinstance(before, dict):
                continue
            fn = pcihw.PciFunction(bdf, before["path"], "", "", "")
            try:
                aer = pcihw.read_aer(ctx.hw.fs, fn)
            except HwCondition as cond:
                out.append(self.finding(pci(bdf), Severity.UNKNOWN,
                                        f"AER counters unreadable after the suite: {cond}", Action.NONE,
                                        what=before["what"]))
                continue
            if aer is None:
                out.append(self.finding(pci(bdf), Severity.UNKNOWN, "AER counters gone after the suite "
                                        "(the device was removed?)", Action.NONE, what=before["what"]))
                continue
            compared += 1
            delta = {kind: aer.of(kind).total - int(before[kind]) for kind in pcihw.AER_FILES}
            if any(d < 0 for d in delta.values()):
                out.append(self.finding(pci(bdf), Severity.UNKNOWN, "AER counters went backwards during the "
                                        "suite (the device was removed and re-added)", Action.NONE,
                                        what=before["what"], delta=delta))
                continue
            ev = {"what": before["what"], "delta": delta, "minutes": round(minutes, 2)}
            if delta["fatal"] or delta["nonfatal"]:
                out.append(self.finding(pci(bdf), Severity.FAIL,
                                        f"{before['what']}: {delta['fatal']} fatal and {delta['nonfatal']} "
                                        "non-fatal PCIe AER error(s) during the bootstrap suite",
                                        Action.INSPECT_HARDWARE, **ev))
            elif delta["correctable"] > allowance:
                out.append(self.finding(pci(bdf), Severity.WARN,
                                        f"{before['what']}: {delta['correctable']} correctable PCIe AER "
                                        f"errors during the suite (more than {allowance:g}: DCGM's 8 replays "
                                        "per minute)",
                                        Action.INSPECT_HARDWARE, **ev))
        new = sum(1 for f in out if f.severity > Severity.OK)
        out.append(self.ok(NODE, f"PCIe AER compared on {compared} function(s) over the suite "
                                 f"({minutes:.1f} min counted): {new} with new errors or unreadable",
                           aer_compared=compared))
        return out
