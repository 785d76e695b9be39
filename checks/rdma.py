"""rdma: RDMA NIC bandwidth on this host with perftest's ``ib_write_bw``: host-memory loopback per
port, and GPUDirect RDMA (``--use_cuda``) for every GPU-NIC pair that shares a PCIe switch.

- **Which ports**: every InfiniBand port under ``<host-root>/sys/class/infiniband`` (the RDMA
  devices themselves, not ``ibstat``: ``ibstat`` with no HCA prints nothing and exits 0, and "no
  output" must never read as "no fault"). Ethernet (RoCE) ports only with ``include_ethernet``
  (they need a GID index, ``roce_gid_index``). A port that is not ACTIVE/LinkUp cannot be measured:
  fail, check_cables (the ib check says why).
- **Host loopback**: server and client of ``ib_write_bw`` on this host, both pinned to the device
  (``-d mlx5_N -i <port>``), ``message_size`` bytes (8 MiB, as Azure's GPUDirect check) for
  ``iterations`` (perftest's default, 5000), ``-F --report_gbits``, bound to the NIC's NUMA node when
  ``numactl`` is installed. One NIC after another (``parallel_host`` off): eight NICs at line rate
  would move some 800 GB/s through host memory at once and measure the memory, not the NICs; Azure's
  host-memory check also loops over the devices one by one.
- **GPUDirect RDMA**: the same with ``--use_cuda=<GPU>`` for each GPU-NIC pair below one PCIe switch
  (checks/pcie_topology.py ``gpu_nic_pairs``); the CUDA index is NVML's (``CUDA_DEVICE_ORDER=
  PCI_BUS_ID``). Pairs run at once (``parallel_gdr``, as Azure's GPUDirect check backgrounds one run
  per NIC), in waves that never use one NIC or one GPU twice at the same time (on a board with two
  GPUs and two NICs per switch each NIC pairs with both GPUs). Skipped with the reason when perftest
  was built without CUDA.
- **Verdict**: the average Gb/s of the largest message size against the profile's
  ``network.ib_rate_gbps`` (or, without one, the port's own negotiated rate) times ``host_efficiency``
  / ``gdr_efficiency``. Below -> fail, inspect_hardware: a loopback never leaves the HCA, so a slow one
  is the NIC or its PCIe path (the pcie and pcie_topology checks name the link), not a cable. Each
  bandwidth finding is **retryable** (evidence ``retryable: true``, ``retry_id`` ``host`` or
  ``gdr:<NIC>``): the suite measures it again before it fails, since bandwidth varies run to run; on
  that retry (``ctx.retry``) only the measurements named there are taken.
- A run that does not finish within ``run_timeout_s`` is a fail (hung); perftest's own errors
  (cannot open the device, cannot register CUDA memory: nvidia-peermem not loaded) are ``unknown``
  with perftest's words. No RDMA device or no perftest -> ``skipped`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.check import RETRY_ID, RETRYABLE, Check, CheckContext
from gpumon.errors import HwCondition, HwTimeout
from gpumon.hw import infiniband as ibhw
from gpumon.hw import pci as pcihw
from gpumon.hw import perftest
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, gpu, reading

from .pcie_topology import GpuNicPair, gpu_nic_pairs

GBIT_BYTES = 1e9 / 8  # bytes per second in 1 Gbit/s


@dataclass(frozen=True)
class RdmaConfig:
    host_efficiency: float = field(default=0.9, metadata={
        "min": 0.05, "max": 1.0,
        "source": "design, from Azure/azurehpc-health-checks: its GPUDirect loopback thresholds are 0.95 "
                  "of the link rate on NDR 400 (conf/nd96isr_h100_v5.conf @ "
                  "7e6ac7796e4398d2a6b0b29ca39f1060f0a993cb: "
                  "check_ib_bw_gdr 380) and 0.925 on HDR 200 (conf/nd96asr_v4.conf @ "
                  "120095246e74e58a4414650c77e6d851520a838f: check_ib_bw_gdr 185.0); host-memory loopback "
                  "crosses the host's memory twice and is allowed a little more"})
    gdr_efficiency: float = field(default=0.95, metadata={
        "min": 0.05, "max": 1.0,
        "source": "Azure/azurehpc-health-checks conf/nd96isr_h100_v5.conf @ "
                  "7e6ac7796e4398d2a6b0b29ca39f1060f0a993cb: check_ib_bw_gdr 380 on 400 Gb/s NDR ports "
                  "(issue 5: 'GPUDirect RDMA loopback >= 380 Gb/s per NDR NIC')"})
    message_size: int = field(default=8 << 20, metadata={
        "min": 1,
        "source": "Azure/azurehpc-health-checks customTests/azure_ib_write_bw_gdr.nhc @ "
                  "0078044d3a838a45a89649836d61ebd1b000e3ae: MESSAGE_SIZE=8388608"})
    iterations: int = field(default=5000, metadata={
        "min": 10,
        "source": "perftest's default iteration count for bandwidth tests (DEF_ITERS 5000): 40 GiB at 8 MiB, "
                  "under a second at 400 Gb/s"})
    gdr: bool = True
    parallel_host: bool = False
    parallel_gdr: bool = True
    include_ethernet: bool = False
    roce_gid_index: int = field(default=3, metadata={
        "min": 0, "max": 255,
        "source": "design: RoCE v2 over IPv4 is GID index 3 on a default mlx5 port (show_gids); "
                  "set per site"})
    tcp_port_base: int = field(default=18515, metadata={
        "min": 1024, "max": 65000, "source": "perftest's default port (DEF_PORT 18515); one port per run"})
    run_timeout_s: float = field(default=60.0, metadata={
        "min": 1,
        "source": "design: a healthy run takes about a second; 60 s bounds a hung one well inside the "
                  "check's 180 s budget even when every NIC is retried"})


@dataclass(frozen=True)
class _Target:
    component: str
    retry_id: str
    spec: perftest.LoopbackSpec
    expected_gbps: float
    expected_from: str
    efficiency: float
    label: str
    extra: dict[str, Any]


def waves(targets: list[_Target]) -> list[list[_Target]]:
    """Groups to run at once, in which no NIC and no GPU appears twice (first fit, in order)."""
    out: list[list[_Target]] = []
    for t in targets:
        for group in out:
            if all(o.spec.device != t.spec.device and (t.spec.cuda is None or o.spec.cuda != t.spec.cuda)
                   for o in group):
                group.append(t)
                break
        else:
            out.append([t])
    return out


class RdmaCheck(Check):
    name = "rdma"
    phase = Phase.BOOTSTRAP
    description = ("RDMA NIC loopback bandwidth with perftest ib_write_bw: host memory per port, "
                   "GPUDirect RDMA per GPU-NIC pair on one PCIe switch")
    readings = (
        ReadingSpec(
            "rdma_loopback_bytes_per_second", "gauge",
            "RDMA write bandwidth of a loopback through one NIC port in the last rdma run, perftest's "
            "average at message_size (default 8 MiB) (label kind: host = host memory to host memory, on "
            "component ib/<dev>/<port>; gdr = GPUDirect RDMA to and from this GPU's memory through a NIC "
            "below its PCIe switch, on component gpu/<i>; labels device and port: the NIC's RDMA device and "
            "port, which tell apart the NICs that share a GPU's switch).",
            unit="bytes per second (the check's evidence and messages say Gbit/s, as perftest: 1 Gbit/s = "
                 "1.25e8 bytes per second)",
            source="perftest ib_write_bw --report_gbits",
            labels=("kind", "device", "port")),
    )
    timeout = 180.0
    cost = 30.0
    Config = RdmaConfig

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.ib_devices:
            return "no RDMA device under sys/class/infiniband"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(RdmaConfig)
        only = ctx.retry.retry_ids if ctx.retry is not None else None
        out: list[Finding] = []
        ports = self._ports(ctx, options, out)
        binary = "ib_write_bw"
        if ctx.hw.tools.which(binary) is None:
            return [*out, self.finding(NODE, Severity.SKIPPED, "perftest's ib_write_bw is not installed "
                                       "(not found on PATH): RDMA bandwidth not measured", Action.NONE)]
        targets = [self._host_target(ctx, options, dev, port, rate, is_ib, i)
                   for i, (dev, port, rate, is_ib) in enumerate(ports)]
        if options.gdr and ctx.inventory.gpus:
            targets += self._gdr_targets(ctx, options, ports, len(targets), out, binary, only)
        if only is not None:
            targets = [t for t in targets if (t.component, t.retry_id) in only]
        host = [t for t in targets if t.spec.cuda is None]
        runs = dict(zip(map(id, host), perftest.run_loopbacks(
            ctx.hw.tools, [t.spec for t in host], parallel=options.parallel_host,
            timeout=options.run_timeout_s), strict=True))
        for wave in waves([t for t in targets if t.spec.cuda is not None]):
            runs.update(zip(map(id, wave), perftest.run_loopbacks(
                ctx.hw.tools, [t.spec for t in wave], parallel=options.parallel_gdr,
                timeout=options.run_timeout_s), strict=True))
        for target in targets:
            out.append(self._judge(target, runs[id(target)]))
        if not out:
            out.append(self.finding(NODE, Severity.UNKNOWN, "no RDMA port to measure", Action.NONE))
        return out

    # -- what to measure -----------------------------------------------------------

    def _ports(self, ctx: CheckContext, options: RdmaConfig,
               out: list[Finding]) -> list[tuple[str, int, float | None, bool]]:
        """(device, port, link rate, InfiniBand?) of every port to measure; findings for the others."""
        ports: list[tuple[str, int, float | None, bool]] = []
        fs = ctx.hw.fs
        for dev in ibhw.list_devices(fs):
            try:
                numbers = ibhw.list_ports(fs, dev)
            except HwCondition as cond:
                out.append(self.from_condition(cond, NODE))
                continue
            for number in numbers:
                comp = ibhw.component_for(dev, number)
                if comp is None:
                    continue
                try:
                    p = ibhw.read_port(fs, dev, number, counters=())
                except HwCondition as cond:
                    out.append(self.from_condition(cond, comp))
                    continue
                if not p.is_infiniband and not options.include_ethernet:
                    out.append(self.finding(comp, Severity.SKIPPED, f"{dev} port {number}: {p.link_layer} "
                                            "(RoCE) port not measured (checks.rdma.include_ethernet is off)",
                                            Action.NONE))
                    continue
                if not p.up:
                    out.append(self.finding(comp, Severity.FAIL, f"{dev} port {number} is not up ({p.state}, "
                                            f"{p.phys_state}): bandwidth cannot be measured",
                                            Action.CHECK_CABLES, state=str(p.state),
                                            phys_state=str(p.phys_state)))
                    continue
                ports.append((dev, number, p.rate.gbps if p.rate else None, p.is_infiniband))
        return ports

    def _numa(self, ctx: CheckContext, dev: str) -> int | None:
        try:
            return ctx.hw.fs.read_int(f"{ibhw.CLASS_DIR}/{dev}/device/numa_node")
        except HwCondition:
            return None

    def _expected(self, ctx: CheckContext, rate: float | None) -> tuple[float | None, str]:
        profile_rate = ctx.profile.network.ib_rate_gbps
        if profile_rate is not None:
            note = ctx.profile.source_of("network.ib_rate_gbps") or ""
            said = f" ({note[:120]})" if note else ""
            return profile_rate, f"profile {ctx.profile.name} network.ib_rate_gbps{said}"
        return rate, "the port's own negotiated rate (the profile states none)"

    def _host_target(self, ctx: CheckContext, options: RdmaConfig, dev: str, port: int, rate: float | None,
                     is_ib: bool, i: int) -> _Target:
        expected, why = self._expected(ctx, rate)
        spec = perftest.LoopbackSpec(dev, port, options.tcp_port_base + i, options.message_size,
                                     options.iterations, numa_node=self._numa(ctx, dev),
                                     gid_index=None if is_ib else options.roce_gid_index)
        return _Target(f"ib/{dev}/{port}", "host", spec, expected or 0.0, why, options.host_efficiency,
                       f"{dev} port {port} host-memory loopback", {"device": dev, "port": port})

    def _gdr_targets(self, ctx: CheckContext, options: RdmaConfig,
                     ports: list[tuple[str, int, float | None, bool]], first_port: int,
                     out: list[Finding], binary: str,
                     only: frozenset[tuple[str, str]] | None) -> list[_Target]:
        try:
            nics, _ = pcihw.infiniband_devices(ctx.hw.fs)
            tree = pcihw.scan(ctx.hw.fs, extra=set(nics.values()))
        except HwCondition as cond:
            out.append(self.from_condition(cond, NODE))
            return []
        gpus = {g.pci_bus_id: g.index for g in ctx.inventory.gpus}
        measured = {dev: (port, rate) for dev, port, rate, _ in ports}
        pairs: list[GpuNicPair] = [p for ps in gpu_nic_pairs(tree, gpus, nics).values() for p in ps
                                   if p.device in measured]
        if not pairs:
            out.append(self.finding(NODE, Severity.SKIPPED, "no GPU shares a PCIe switch with a measured "
                                    "RDMA NIC: GPUDirect RDMA loopback not measured", Action.NONE))
            return []
        wanted = only is None or any(p.startswith("gdr:") for _, p in only)
        if wanted and not perftest.supports_cuda(ctx.hw.tools, binary):
            out.append(self.finding(NODE, Severity.SKIPPED, "this ib_write_bw was built without CUDA (its "
                                    "usage text lists no --use_cuda): GPUDirect RDMA loopback not measured",
                                    Action.NONE))
            return []
        targets: list[_Target] = []
        for i, pair in enumerate(pairs):
            port, rate = measured[pair.device]
            expected, why = self._expected(ctx, rate)
            spec = perftest.LoopbackSpec(pair.device, port, options.tcp_port_base + first_port + i,
                                         options.message_size, options.iterations, cuda=pair.gpu_index,
                                         numa_node=self._numa(ctx, pair.device))
            targets.append(_Target(gpu(pair.gpu_index), f"gdr:{pair.device}", spec, expected or 0.0, why,
                                   options.gdr_efficiency,
                                   f"GPUDirect RDMA gpu/{pair.gpu_index} <-> {pair.device} port {port}",
                                   {"device": pair.device, "port": port, "gpu": pair.gpu_index,
                                    "switch": pair.switch}))
        return targets

    # -- verdicts --------------------------------------------------------------------

    def _judge(self, t: _Target, run: perftest.LoopbackRun) -> Finding:
        ev: dict[str, Any] = {**t.extra, RETRY_ID: t.retry_id, "argv": run.argv}
        if isinstance(run.condition, HwTimeout):
            return self.finding(t.component, Severity.FAIL, f"{t.label}: ib_write_bw did not finish within "
                                f"{run.condition.seconds:g} s (killed)", Action.NONE, call=run.condition.call,
                                **ev)
        if run.condition is not None:
            return self.from_condition(run.condition, t.component)
        if run.report is None:
            return self.finding(t.component, Severity.UNKNOWN,
                                f"{t.label}: no bandwidth result ({run.error})", Action.NONE, **ev)
        row = run.report.at_size(t.spec.size) or run.report.largest
        measured = row.average_gbps
        threshold = t.expected_gbps * t.efficiency
        ev.update({RETRYABLE: True, "measured_gbps": round(measured, 2),
                   "threshold_gbps": round(threshold, 2), "expected_gbps": t.expected_gbps,
                   "efficiency": t.efficiency,
                   "threshold_from": t.expected_from,
                   "message_size": row.size, "link_type": run.report.link_type,
                   # perftest's Gbit/s in bytes per second; device and port tell apart the NICs that
                   # share one GPU's switch (their gdr readings are all on that GPU's component)
                   "readings": [reading("rdma_loopback_bytes_per_second", measured * GBIT_BYTES,
                                        kind=t.retry_id.split(":")[0], device=t.spec.device,
                                        port=t.spec.ib_port)]})
        if row.size != t.spec.size:
            ev["size_note"] = (f"no {t.spec.size}-byte row in the output; judged the largest "
                               f"({row.size} bytes)")
        if not t.expected_gbps:
            return self.finding(t.component, Severity.UNKNOWN, f"{t.label}: {measured:.1f} Gb/s; no "
                                "expected rate (no profile rate and the port's rate is unreadable)",
                                Action.NONE, **ev)
        if measured < threshold:
            return self.finding(t.component, Severity.FAIL,
                                f"{t.label}: {measured:.1f} Gb/s, below {threshold:.0f} Gb/s "
                                f"({t.efficiency:.0%} of {t.expected_gbps:g}): the NIC or its PCIe path is "
                                "slow",
                                Action.INSPECT_HARDWARE, **ev)
        return self.ok(t.component, f"{t.label}: {measured:.1f} Gb/s (threshold {threshold:.0f})", **ev)
