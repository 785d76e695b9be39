"""pcie: PCIe errors and link state of every GPU, RDMA NIC and NVSwitch, and the ports above them.

Watched functions: NVIDIA GPUs (class 0x0300/0x0302), NVSwitches (NVIDIA 0x0680),
RDMA NICs (the function behind ``sys/class/infiniband/<dev>/device``, or any
Mellanox network function), and every bridge between them and the root
complex. AER counters can rise at either end of a link (the kernel's ABI note:
errors are counted "as seen/reported by the device", often by the link
partner), so a fault on the GPU's link may only show at its switch port.

- **AER counters** (sysfs, since boot). The first reading of a boot is the
  baseline. Any rise of the fatal or non-fatal total afterwards fails. Fatal
  and non-fatal totals already non-zero at the first reading: fatal fails
  (a fatal error means "the link is unreliable" and the kernel had to reset
  it; the NVIDIA driver has no AER recovery callback, so the GPU is not
  brought back either), non-fatal warns (it cannot be dated, and firmware
  probing at boot leaves Unsupported Request errors on healthy ports: the
  real HGX H100 capture in tests/data/pcie-aer has UnsupReq latched on six
  switch ports). A correctable rate above ``correctable_per_hour`` warns.
  Counters going backwards (the function was removed and re-added) restart
  the baseline; there is never a negative rate.
- **Kernel log**: "PCIe Bus Error: severity=Uncorrected/Uncorrectable ..." on a
  watched function fails it; corrected reports are counted as evidence (the
  kernel rate-limits these messages, the counters are exact). The AER summary
  line ("AER: [Multiple] Uncorrected|Uncorrectable (Fatal|Non-Fatal) error
  [message] received[: | from] <source>") fails its source (else the port that
  printed it) when no detail line came with it (gcm's test lines have none);
  "AER: can't recover (no error_detected callback)" (a driver without AER
  recovery, such as nvidia's) and "AER: device recovery failed" fail the
  function that printed them: it stays unusable until a reset or a reboot.
- **Link**: each physical link is judged at its upstream-facing end (endpoint
  or switch upstream port) against the lower of the two ends' maxima. Width
  below that fails. Speed below it warns only while the GPU on the link is
  busy: NVIDIA documents that the current link generation "may be reduced when
  the GPU is not in use". On other links a lower speed warns. A GPU link whose
  maximum is below the SKU profile's generation or width warns (wrong slot or
  riser).

Remedy: PCIe errors and a narrow link are faults of the path — card seating,
riser, retimer, baseboard — so every problem here points at inspect_hardware,
for NICs too: AER counts errors on the NIC's PCIe link, not on its network
cable (check_cables would send someone to the wrong cable; network-side errors
are the ib check's).

Uncorrectable errors and the "before gpumon watched" counts stay reported for
the boot (the counters themselves only reset at boot).

The state is the check's declared ``State`` (``PcieState``), loaded, checked, saved and reset at a
reboot by the framework: saved state of another shape (a hand edit, another release) is refused,
with its reason logged, and the check starts afresh instead of raising on every run.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumon.check import Check, CheckContext, KernelLogFold, KernelLogNeeds
from gpumon.errors import HwCondition
from gpumon.hw import pci as pcihw
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, pci, reading

from .state import PcieState

_MAX_LOG_DEVICES = 256
_MAX_SAMPLES = 5
_MAX_NAMES = 32
_UNCORRECTABLE: tuple[pcihw.AerKind, ...] = ("fatal", "nonfatal")
_WORDS = {"fatal": "fatal", "nonfatal": "non-fatal", "correctable": "correctable"}
# AER summary lines (drivers/pci/pcie/aer.c, err.c): 4.x "AER: Multiple Corrected error received:
# 0000:00:1c.0", 3.x "... received: id=00e0", 6.x "AER: Correctable error message received from
# 0000:07:00.0", gcm's test "AER: Uncorrectable (Fatal) error received" (no source)
_AER_BDF = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
_AER_SUMMARY_RE = re.compile(
    rf"(?P<bdf>{_AER_BDF}):\s+AER:\s+(?:Multiple\s+)?(?P<kind>Correct(?:ed|able)|Uncorrect(?:ed|able))"
    r"(?:\s+\((?P<sev>Fatal|Non-Fatal)\))?\s+error(?:\s+message)?\s+received"
    rf"(?:(?::\s*|\s+from\s+)(?:(?P<src>{_AER_BDF})|id=(?P<id>[0-9a-fA-F]{{4}})))?", re.IGNORECASE)
_AER_LOST_RE = re.compile(
    rf"(?P<bdf>{_AER_BDF}):\s+AER:\s+(?P<what>can't recover \(no error_detected callback\)|"
    r"device recovery failed)", re.IGNORECASE)


@dataclass(frozen=True)
class PcieConfig:
    correctable_per_hour: float = field(default=480.0, metadata={
        "min": 0,
        "source": "NVIDIA/DCGM common/DcgmGPUHardwareLimits.h @ 28bfbd4c97413d4aec249cdd9543a67d24f95b78: "
                  "DCGM_LIMIT_MAX_PCIREPLAY_RATE 8, '8 replays per minute is the maximum recommended by RM'; "
                  "a replay is the link-level retry that follows a correctable error (bad TLP/DLLP, replay "
                  "timeout), so 8/min = 480/h correctable errors is the same limit in AER terms"})
    correctable_window_s: float = field(default=3600.0, metadata={
        "min": 60,
        "source": "design: the rate is per hour; judged over the last hour so that one burst averages out "
                  "while a sustained rate at DCGM's limit still shows"})
    correctable_min_span_s: float = field(default=60.0, metadata={
        "min": 1,
        "source": "DCGM's replay limit is per minute (DcgmGPUHardwareLimits.h, as above): no rate is "
                  "judged over less than one minute of readings"})
    load_utilization_pct: int = field(default=50, metadata={
        "min": 0, "max": 100,
        "source": "nvidia-smi --help-query-gpu, pcie.link.gen.current: 'These may be reduced when the GPU "
                  "is not in use'; measurement: 8x RTX 4090 and a Titan V at 0 % utilization report link "
                  "generation Current 1 with Max 4 / 3 "
                  "(shared/realdata/nvidia-smi-q/rtx4090x8_535.154.05.txt, titanv_x1_560.35.03.txt). "
                  "Utilization is the share of the sample period with a kernel "
                  "running (nvmlUtilization_t.gpu); above half of it the GPU is unambiguously in use"})


@dataclass(frozen=True)
class _Problem:
    severity: Severity
    action: Action
    text: str


def _fail(text: str) -> _Problem:
    return _Problem(Severity.FAIL, Action.INSPECT_HARDWARE, text)


def _warn(text: str) -> _Problem:
    return _Problem(Severity.WARN, Action.INSPECT_HARDWARE, text)


def _unknown(text: str) -> _Problem:
    return _Problem(Severity.UNKNOWN, Action.NONE, text)


class PcieCheck(Check):
    name = "pcie"
    phase = Phase.CONTINUOUS
    description = ("PCIe AER errors (sysfs counters, kernel log) and link width/speed of GPUs, RDMA NICs, "
                   "NVSwitches and the ports above them")
    readings = (
        ReadingSpec(
            "pcie_aer_errors_total", "counter",
            "PCIe AER errors reported by this PCI function (a GPU, RDMA NIC, NVSwitch, or a bridge or "
            "switch port above them) since boot (label aer_severity: correctable, nonfatal, fatal).",
            unit="errors",
            source="sysfs /sys/bus/pci/devices/<bdf>/aer_dev_correctable, aer_dev_nonfatal, aer_dev_fatal "
                   "(TOTAL_ERR_*), which the kernel resets only at boot",
            labels=("aer_severity",)),
    )
    interval = 60.0
    timeout = 30.0
    Config = PcieConfig
    State = PcieState
    # AER lines are folded as they arrive (AerFold); only an uncorrectable report runs the check
    # at once, corrected ones are counted and reach it at its regular run
    kernel_log = KernelLogNeeds(events=(), fold=lambda: AerFold())

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.pci_devices:
            return "no PCI devices under the host root (sys/bus/pci/devices is empty or missing)"
        if not inventory.ib_devices and not any(
                d.is_gpu or d.is_nvswitch or (d.vendor == pcihw.MELLANOX and d.pci_class.startswith("0x02"))
                for d in inventory.pci_devices):
            return "no NVIDIA GPU, NVSwitch or RDMA NIC on the PCI bus"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(PcieConfig)
        state = ctx.state_as(PcieState)
        now = ctx.clock()
        out = self._read_kernel_log(ctx, state, now)
        try:
            nics, nic_errors = pcihw.infiniband_devices(ctx.hw.fs)
            tree = pcihw.scan(ctx.hw.fs, extra=set(nics.values()))
        except HwCondition as cond:
            return [*out, self.from_condition(cond, NODE)]
        if not tree.listed:
            return [*out, self.finding(NODE, Severity.SKIPPED,
                                       "no PCI devices under the host root (sys/bus/pci/devices is empty or "
                                       "missing): no PCIe tree to watch")]
        watched = _watched(tree, nics, ctx.inventory)
        devices = state.devices
        for bdf in sorted(watched):
            out.append(self._device(ctx, options, tree, bdf, watched[bdf],
                                    devices.setdefault(bdf, {}), state.kmsg, now))
        for bdf in sorted(tree.errors):
            out.append(self.finding(pci(bdf), Severity.UNKNOWN,
                                    f"PCI function {bdf} cannot be identified, so whether it is a GPU, NIC "
                                    f"or port to watch is unknown: {tree.errors[bdf]}"))
        for bdf in sorted(set(devices) - set(tree.functions) - set(tree.errors)):
            out.append(self.finding(pci(bdf), Severity.UNKNOWN,
                                    f"{bdf} ({devices[bdf].get('is', 'watched')}) is no longer listed in "
                                    "sys/bus/pci/devices: removed from the bus or hot-unplugged",
                                    was=devices[bdf].get("is")))
        for dev in sorted(nic_errors):
            out.append(self.finding(NODE, Severity.UNKNOWN,
                                    f"RDMA device {dev}: its PCI function cannot be found: "
                                    f"{nic_errors[dev]}"))
        if not any(f.component != NODE for f in out):
            out.append(self.finding(NODE, Severity.SKIPPED,
                                    "no NVIDIA GPU, NVSwitch or RDMA NIC on the PCI bus",
                                    pci_functions=tree.listed))
        return out

    # -- one watched function ---------------------------------------------------

    def _device(self, ctx: CheckContext, options: PcieConfig, tree: pcihw.PciScan, bdf: str,
                labels: list[str], ds: dict[str, Any], kmsg: Mapping[str, Any], now: float) -> Finding:
        fn = tree.functions[bdf]
        what = ", ".join(labels)
        ds["is"] = what
        evidence: dict[str, Any] = {"is": what, "vendor": fn.vendor, "device": fn.device,
                                    "class": fn.pci_class, "port": tree.role(bdf)}
        upstream = [a for a in fn.ancestors if a in tree.functions]
        if upstream:
            evidence["upstream"] = upstream
        problems: list[_Problem] = []
        readings = 0
        try:
            aer = pcihw.read_aer(ctx.hw.fs, fn)
        except HwCondition as cond:
            problems.append(_unknown(f"AER counters unreadable: {cond}"))
        else:
            if aer is None:
                evidence["aer"] = "not exposed (no AER capability, or a kernel without AER statistics)"
            else:
                readings += 1
                problems += _aer(options, ds, aer, now, evidence)
        try:
            link = pcihw.read_link(ctx.hw.fs, fn)
        except HwCondition as cond:
            problems.append(_unknown(f"link attributes unreadable: {cond}"))
        else:
            if link is None:
                evidence["link"] = "not exposed (not a PCIe function)"
            else:
                readings += 1
                problems += self._link(ctx, options, tree, fn, link, evidence)
        log = kmsg.get(bdf)
        if log:
            problems += _logged(log, evidence)
        return self._verdict(pci(bdf), what, problems, readings, evidence)

    def _verdict(self, comp: str, what: str, problems: list[_Problem], readings: int,
                 evidence: dict[str, Any]) -> Finding:
        if not problems and not readings:
            return self.finding(comp, Severity.SKIPPED,
                                f"{what}: no AER counters and no link attributes in sysfs", **evidence)
        if not problems:
            return self.ok(comp, f"{what}: {_summary(evidence)}", **evidence)
        problems.sort(key=lambda p: p.severity, reverse=True)
        severity = problems[0].severity
        action = max((p.action for p in problems), default=Action.NONE)
        return self.finding(comp, severity, f"{what}: " + "; ".join(p.text for p in problems), action,
                            **evidence)

    # -- link -------------------------------------------------------------------

    def _link(self, ctx: CheckContext, options: PcieConfig, tree: pcihw.PciScan, fn: pcihw.PciFunction,
              link: pcihw.LinkState, evidence: dict[str, Any]) -> list[_Problem]:
        info: dict[str, Any] = {"current": link.describe(), "max": link.describe(current=False)}
        evidence["link"] = info
        role = tree.role(fn.bdf)
        if role in ("root_port", "switch_downstream"):
            info["judged"] = "at the function below (this port's link faces down)"
            return []
        if role == "bridge":
            info["judged"] = "no: the port above is not listed, so which way this link faces is unknown"
            return []
        function0 = fn.bdf[:-1] + "0"
        if fn.bdf != function0 and function0 in tree.functions:
            # one link per device, owned by function 0; the others' link registers need not agree
            # (HGX H100 capture in tests/data/pcie-aer: 81:00.1 claims x16 and runs x2, while 81:00.0,
            # the port that owns the link, is x2 of x2)
            info["judged"] = f"at function 0 ({function0}): one link per device"
            return []
        width, max_width, max_gts = link.current_width, link.max_width, link.max_gts
        if width is None or max_width is None or max_gts is None:
            return [_unknown(f"link attributes incomplete (current {link.describe()}, max "
                             f"{link.describe(current=False)})")]
        best_width, best_gts = max_width, max_gts
        partner = tree.link_partner(fn.bdf)
        if partner is not None:
            info["partner"] = partner
            try:
                other = pcihw.read_link(ctx.hw.fs, tree.functions[partner])
            except HwCondition as cond:
                info["partner_error"] = str(cond)
                other = None
            if other is not None:
                info["partner_max"] = other.describe(current=False)
                best_width = min(best_width, other.max_width or best_width)
                best_gts = min(best_gts, other.max_gts or best_gts)
        best_gen = pcihw.generation(best_gts)
        info["expected"] = f"Gen{best_gen} x{best_width}"
        out: list[_Problem] = []
        if width == 0:
            out.append(_fail("link down (width 0)"))
        elif width > max_width:
            out.append(_unknown(f"current link width x{width} above the maximum x{max_width}: "
                                "the device's registers read back invalid (not responding?)"))
        elif width < best_width:
            out.append(_fail(f"link trained at x{width}, both ends can do x{best_width} "
                             f"(x{width} carries {width / best_width:.0%} of the host-device bandwidth): "
                             "reseat or inspect the card, riser or cable"))
        if width:
            out += self._speed(ctx, options, fn, link, best_gts, info)
        if fn.is_nvidia_gpu:
            out += _against_profile(ctx, best_gen, best_width, info)
        return out

    def _speed(self, ctx: CheckContext, options: PcieConfig, fn: pcihw.PciFunction, link: pcihw.LinkState,
               best_gts: float, info: dict[str, Any]) -> list[_Problem]:
        if link.current_gts is None:
            return [_unknown("current link speed reads 'Unknown'")]
        if link.current_gts >= best_gts:
            return []
        below = (f"link at Gen{link.current_gen} ({link.current_gts:g} GT/s), both ends can do "
                 f"Gen{pcihw.generation(best_gts)}")
        if not fn.is_nvidia_gpu:
            return [_warn(below)]
        gpu = ctx.inventory.gpu_by_pci(fn.bdf)
        if gpu is None:
            return [_unknown(f"{below}; the GPU is not in NVML, so whether it is idle (a normal downshift) "
                             "is unknown")]
        try:
            util = ctx.hw.nvml.utilization_pct(gpu.index)
        except HwCondition as cond:
            return [_unknown(f"{below}; GPU load unreadable ({cond.call}: {cond}), so an idle downshift "
                             "cannot be ruled out")]
        info["gpu_utilization_pct"] = util
        if util > options.load_utilization_pct:
            return [_warn(f"{below} while the GPU is busy ({util} % utilization)")]
        info["idle_downshift"] = (f"Gen{link.current_gen} at {util} % utilization (not above "
                                  f"{options.load_utilization_pct} %): GPUs lower the link speed when idle")
        return []

    # -- kernel log -------------------------------------------------------------

    def _read_kernel_log(self, ctx: CheckContext, state: PcieState, now: float) -> list[Finding]:
        log = ctx.kernel_log
        if not log.available:
            return [self.finding(NODE, Severity.UNKNOWN,
                                 f"kernel log unreadable ({log.error or 'unknown reason'}): AER messages not "
                                 "checked; the sysfs AER counters still are", source=log.source)]
        if isinstance(log.folded, AerDelta):  # the daemon's pump folded the lines as they came
            log.folded.merge(state.kmsg, state.kmsg_source)
        if log.records:
            fold = AerFold(state.kmsg_source)
            for rec in log.records:
                fold.add(rec, log.time_of(rec, now))
            delta = fold.take()
            if delta is not None:
                delta.merge(state.kmsg, state.kmsg_source)
        return []


class AerDelta:
    """AER lines folded since the pcie check's last run (:class:`AerFold`): what they add to the
    check's ``state["kmsg"]``, which :meth:`merge` adds. Merging deltas one after another
    gives the state that ingesting their lines one by one gives (tests/checks/test_pcie_fold.py)."""

    __slots__ = ("kmsg", "orphans", "sources")

    def __init__(self) -> None:
        # bus id -> entry, as in state["kmsg"], for the reports whose header is in this delta
        # (and the summary / not-recovered lines)
        self.kmsg: dict[str, dict[str, Any]] = {}
        # reporter -> the function its latest header named ("": a header of no known severity)
        self.sources: dict[str, str] = {}
        # detail lines (status, error bits) of reports whose header came in an earlier delta, in
        # order, a run of lines for one function as one item: (("bdf", function), what they say)
        # for that function's current report, or (("reporter", prefix), ...) for the function
        # that the state's kmsg_source names (a reporter whose header this fold never saw)
        self.orphans: list[tuple[tuple[str, str], dict[str, Any]]] = []

    def __bool__(self) -> bool:
        return bool(self.kmsg or self.sources or self.orphans)

    def merge(self, kmsg: dict[str, Any], sources: dict[str, str]) -> None:
        """Add this delta to the state's ``kmsg`` (bus id -> entry) and ``kmsg_source``."""
        for (by, key), said in self.orphans:  # they came before anything of this delta's
            entry = kmsg.get(sources.get(key, key) if by == "reporter" else key)
            if entry is not None and "current" in entry:
                _details(entry[entry["current"]], said)
        for bdf, new in self.kmsg.items():
            entry = kmsg.get(bdf)
            if entry is None:
                if len(kmsg) < _MAX_LOG_DEVICES:
                    kmsg[bdf] = new
                continue
            for key, value in new.items():
                if key in _WORDS:  # a report group: count, first, last, errors, status
                    group = entry.get(key)
                    if group is None:
                        entry[key] = value
                        continue
                    group["count"] += value["count"]
                    group["first"] = min(group["first"], value["first"])
                    group["last"] = max(group["last"], value["last"])
                    _details(group, value)
                elif key in ("summary", "not_recovered"):
                    groups = entry.setdefault(key, {})
                    for kind, counted in value.items():
                        have = groups.get(kind)
                        if have is None:
                            groups[kind] = counted
                        else:
                            have["count"] += counted["count"]
                            have["first"] = min(have["first"], counted["first"])
                            have["last"] = max(have["last"], counted["last"])
                elif key == "samples":
                    samples: list[str] = entry.setdefault("samples", [])
                    samples.extend(value[: max(0, _MAX_SAMPLES - len(samples))])
                else:  # current, reported_by: the latest says
                    entry[key] = value
        sources.update(self.sources)


# AerFold's memo of parsed lines, at most (the text comes from the kernel log): emptied when full
_FOLD_MEMO_MAX = 4096


class AerFold(KernelLogFold):
    """pcie's kernel-log lines folded into an :class:`AerDelta` as they arrive (the daemon's
    kernel-log pump calls :meth:`add` per record, see gpumon.check.KernelLogFold; the check's own
    run does the same with the records it is handed). A storm of corrected-error reports then
    costs a dictionary update per line, and runs the check only at its interval: ``add`` returns
    a key, which runs it at once, only for an uncorrectable report (header or summary line) and a
    device that was not recovered.

    ``sources``: the state's kmsg_source (reporter -> the function of its latest header), so that
    a detail line whose header was folded before is attributed as the state would. The daemon's
    fold starts without it and learns it from the headers it folds; after a daemon restart, a
    detail line whose header was handed over before the restart is attributed at the merge, to
    that function's report as it stood before the delta (the same, unless another header for the
    same function came between them)."""

    def __init__(self, sources: Mapping[str, str] | None = None) -> None:
        self._delta = AerDelta()
        self._source: dict[str, str] = dict(sources) if isinstance(sources, Mapping) else {}
        # what each line's text parses to (parse_aer_message, else the summary line): a storm
        # repeats the same few report lines, and parsing them was most of what a line cost
        self._memo: dict[str, pcihw.AerLogLine | tuple[str, str, str] | None] = {}
        # a record's whole text -> what its lines parse to (those that parse), the same for the
        # records that repeat it: one lookup for a record of the storm, AER or not
        self._texts: dict[str, tuple[tuple[str, pcihw.AerLogLine | tuple[str, str, str]], ...]] = {}

    def take(self) -> AerDelta | None:
        delta, self._delta = self._delta, AerDelta()
        return delta if delta else None

    def add_many(self, records: Iterable[Any], time_of: Callable[[Any], float]) -> list[tuple[str, str]]:
        """:meth:`add` for each record, dated by ``time_of`` only when it is an AER line (the
        pump's call, once per read of the log: see gpumon.check.KernelLogFold)."""
        keys: list[tuple[str, str]] = []
        texts = self._texts
        for record in records:
            text = getattr(record, "text", "")
            if not isinstance(text, str):
                continue
            lines = texts.get(text)
            if lines is None:
                lines = self._parsed(text)
            if lines:
                keys.extend(self._fold(lines, time_of(record)))
        return keys

    def add(self, record: Any, when: float) -> list[tuple[str, str]]:
        text = getattr(record, "text", "")
        if not isinstance(text, str):
            return []
        return self._add(text, when)

    def _add(self, text: str, when: float) -> list[tuple[str, str]]:
        lines = self._texts.get(text)
        if lines is None:
            lines = self._parsed(text)
        return self._fold(lines, when) if lines else []

    def _parsed(self, text: str) -> tuple[tuple[str, pcihw.AerLogLine | tuple[str, str, str]], ...]:
        """What the lines of a record's text parse to (parse_aer_message, else the summary line),
        those that parse, in order; kept for the records that repeat the text (bounded)."""
        out: list[tuple[str, pcihw.AerLogLine | tuple[str, str, str]]] = []
        # what parse_aer_message and the summary line need (most lines of a storm have none)
        if "[" in text or "AER:" in text or "PCIe Bus Error" in text or "error status/mask=" in text:
            memo = self._memo
            for line in text.splitlines():
                try:
                    parsed = memo[line]
                except KeyError:
                    parsed = _fold_parse(line)
                    if len(memo) >= _FOLD_MEMO_MAX:
                        memo.clear()
                    memo[line] = parsed
                if parsed is not None:
                    out.append((line, parsed))
        lines = tuple(out)
        if len(self._texts) >= _FOLD_MEMO_MAX:
            self._texts.clear()
        self._texts[text] = lines
        return lines

    def _fold(self, lines: tuple[tuple[str, pcihw.AerLogLine | tuple[str, str, str]], ...],
              when: float) -> list[tuple[str, str]]:
        keys: list[tuple[str, str]] = []
        for line, parsed in lines:
            if isinstance(parsed, pcihw.AerLogLine):
                if self._line(parsed, line, when):
                    keys.append((parsed.bdf, str(parsed.severity)))
            else:
                said = _count_summary(self._delta.kmsg, parsed, line, when)
                if said[1] != "correctable":
                    keys.append(said)
        return keys

    def _line(self, msg: pcihw.AerLogLine, line: str, when: float) -> bool:
        """Fold one line of a report; True for the header of an uncorrectable one."""
        delta = self._delta
        if msg.kind == "header":
            _ingest(delta.kmsg, delta.sources, msg, line, when)
            if len(self._source) >= 4 * _MAX_LOG_DEVICES and msg.reporter not in self._source:
                del self._source[next(iter(self._source))]
            self._source[msg.reporter] = delta.sources[msg.reporter]
            return msg.severity in _UNCORRECTABLE
        if msg.reporter in delta.sources:  # its header is in this delta
            _ingest(delta.kmsg, delta.sources, msg, line, when)
            return False
        target = self._source.get(msg.reporter)
        if target == "":
            return False  # its header had no severity: a report not counted
        # no header from this reporter yet: the function it prints (as _ingest does)
        entry = delta.kmsg.get(msg.reporter if target is None else target)
        if entry is not None and "current" in entry:  # a header in this delta named it
            _detail(entry[entry["current"]], msg)
            return False
        key = ("reporter", msg.reporter) if target is None else ("bdf", target)
        if delta.orphans and delta.orphans[-1][0] == key:
            said = delta.orphans[-1][1]
        elif len(delta.orphans) < _MAX_LOG_DEVICES:
            said = {"errors": []}
            delta.orphans.append((key, said))
        else:
            return False  # the tails of 256 reports split from their headers in one delta
        _detail(said, msg)
        return False


# --------------------------------------------------------------------------- helpers


def _watched(tree: pcihw.PciScan, nics: Mapping[str, str], inventory: Inventory) -> dict[str, list[str]]:
    """Bus id -> what it is ("gpu/3", "mlx5_2", "upstream of gpu/3, mlx5_3") for every function watched."""
    gpus = {g.pci_bus_id: g.index for g in inventory.gpus}
    names: dict[str, list[str]] = {}
    for dev, bdf in nics.items():
        names.setdefault(bdf, []).append(dev)
    endpoints: dict[str, str] = {}
    for bdf, fn in tree.functions.items():
        if fn.virtual:
            continue  # SR-IOV VFs share the physical function's link and report no AER of their own
        if fn.is_nvidia_gpu:
            endpoints[bdf] = f"gpu/{gpus[bdf]}" if bdf in gpus else "NVIDIA GPU not in NVML"
        elif fn.is_nvswitch:
            endpoints[bdf] = "NVSwitch"
        elif bdf in names:
            endpoints[bdf] = ", ".join(sorted(names[bdf]))
        elif fn.is_mellanox_nic:
            endpoints[bdf] = "Mellanox NIC"
    above: dict[str, list[str]] = {}
    for bdf in sorted(endpoints):
        for anc in tree.functions[bdf].ancestors:
            if anc in tree.functions and anc not in endpoints:
                above.setdefault(anc, []).append(endpoints[bdf])
    watched = {bdf: [label] for bdf, label in endpoints.items()}
    for bdf, labels in above.items():
        watched[bdf] = ["upstream of " + ", ".join(labels)]
    return watched


def _aer(options: PcieConfig, ds: dict[str, Any], aer: pcihw.AerStats, now: float,
         evidence: dict[str, Any]) -> list[_Problem]:
    totals = {kind: aer.of(kind).total for kind in pcihw.AER_FILES}
    evidence["aer_since_boot"] = dict(totals)
    # AER counters count since boot in the kernel: counters in Prometheus terms
    # label aer_severity, not severity: that is the alert-routing label of alerting rules
    evidence["readings"] = [reading("pcie_aer_errors_total", n, aer_severity=kind)
                            for kind, n in totals.items()]
    if "totals" not in ds:
        ds["totals"] = dict(totals)
        ds["names"] = {kind: dict(aer.of(kind).errors) for kind in _UNCORRECTABLE}
        ds["before_watch"] = {kind: totals[kind] for kind in _UNCORRECTABLE if totals[kind]}
        ds["events"] = {}
        ds["resets"] = 0
        ds["cor"] = [[now, totals["correctable"]]]
    else:
        for kind in _UNCORRECTABLE:
            _compare(ds, kind, aer.of(kind), now)
        _correctable(options, ds, aer.correctable.total, now)
    if ds["resets"]:
        evidence["counter_resets"] = ds["resets"]
    out: list[_Problem] = []
    for kind in _UNCORRECTABLE:
        ev = ds["events"].get(kind)
        if ev:
            evidence[f"{kind}_errors"] = copy.deepcopy(ev)
            names = ", ".join(f"{n} +{c}" for n, c in sorted(ev["errors"].items())) or "no named bit"
            out.append(_fail(f"{ev['count']} new uncorrectable ({_WORDS[kind]}) AER error(s) since gpumon "
                             f"started watching ({names})"))
    before = ds["before_watch"]
    if before.get("fatal"):
        out.append(_fail(f"{before['fatal']} fatal AER error(s) since boot, before gpumon watched: a fatal "
                         "error makes the link unreliable and the kernel reset it"))
    if before.get("nonfatal"):
        out.append(_warn(f"{before['nonfatal']} non-fatal AER error(s) since boot, before gpumon watched "
                         f"({_nonzero(ds['names'].get('nonfatal', {}))}): cannot be dated; firmware probing "
                         "at boot leaves some on healthy ports"))
    rate = ds.get("cor_rate")
    if rate is not None:
        evidence["correctable_per_hour"] = round(rate, 1)
        if rate > options.correctable_per_hour:
            out.append(_warn(f"{rate:.0f} correctable AER errors/hour (limit "
                             f"{options.correctable_per_hour:g}; {_nonzero(aer.correctable.errors)}): "
                             "a marginal link, reseat at the next maintenance"))
    return out


def _compare(ds: dict[str, Any], kind: pcihw.AerKind, counts: pcihw.AerCounts, now: float) -> None:
    last_total: int = ds["totals"][kind]
    last_names: dict[str, int] = ds["names"].get(kind, {})
    went_back = counts.total < last_total or any(counts.errors.get(n, 0) < c for n, c in last_names.items())
    if went_back:
        # the function was removed and re-added (its statistics restart):
        # a new baseline, never a negative rate
        ds["resets"] += 1
    elif counts.total > last_total:
        ev = ds["events"].setdefault(kind, {"count": 0, "first": now, "last": now, "errors": {}})
        ev["count"] += counts.total - last_total
        ev["last"] = now
        for name, count in counts.errors.items():
            delta = count - last_names.get(name, 0)
            if delta > 0 and (name in ev["errors"] or len(ev["errors"]) < _MAX_NAMES):
                ev["errors"][name] = ev["errors"].get(name, 0) + delta
    ds["totals"][kind] = counts.total
    ds["names"][kind] = dict(counts.errors)


def _correctable(options: PcieConfig, ds: dict[str, Any], total: int, now: float) -> None:
    samples: list[list[float]] = ds["cor"]
    ds["totals"]["correctable"] = total
    if samples and total < samples[-1][1]:
        ds["resets"] += 1
        samples[:] = []
    # keep about 120 samples per window however often the kernel log wakes the check
    if not samples or now - samples[-1][0] >= options.correctable_window_s / 120:
        samples.append([now, total])
    samples[:] = [s for s in samples if now - s[0] <= options.correctable_window_s] or [[now, total]]
    t0, c0 = samples[0]
    span = now - t0
    ds["cor_rate"] = (total - c0) / span * 3600.0 if span >= options.correctable_min_span_s else None


def _against_profile(ctx: CheckContext, best_gen: int | None, best_width: int,
                     info: dict[str, Any]) -> list[_Problem]:
    spec = ctx.profile.pcie
    out: list[_Problem] = []
    if spec.generation is None and spec.width is None:
        info["profile"] = f"profile {ctx.profile.name} states no PCIe generation or width"
        return out
    if spec.generation is not None and best_gen is not None and best_gen < spec.generation:
        out.append(_warn(f"this GPU's link can reach only Gen{best_gen}; profile {ctx.profile.name} expects "
                         f"Gen{spec.generation}: wrong slot or riser?"))
    if spec.width is not None and best_width < spec.width:
        out.append(_warn(f"this GPU's link can reach only x{best_width}; profile {ctx.profile.name} expects "
                         f"x{spec.width}: wrong slot or riser?"))
    return out


def _ingest(kmsg: dict[str, Any], last_header: dict[str, str], msg: pcihw.AerLogLine, line: str,
            when: float) -> None:
    if msg.kind == "header":
        if msg.severity is None:
            last_header[msg.reporter] = ""  # its detail lines belong to no counted report
            return
        last_header[msg.reporter] = msg.bdf
        entry = kmsg.get(msg.bdf)
        if entry is None:
            if len(kmsg) >= _MAX_LOG_DEVICES:
                return
            entry = kmsg[msg.bdf] = {"samples": []}
        group: dict[str, Any] | None = entry.get(msg.severity)
        if group is None:
            group = {"count": 0, "first": when, "last": when, "errors": []}
            entry[msg.severity] = group
        group["count"] += 1
        # min() and max() as comparisons: the same result (NaN included), per line of a storm
        if when < group["first"]:
            group["first"] = when
        if when > group["last"]:
            group["last"] = when
        entry["current"] = msg.severity
        if msg.reporter != msg.bdf:
            entry["reported_by"] = msg.reporter
        if msg.severity != "correctable" and len(entry["samples"]) < _MAX_SAMPLES:
            entry["samples"].append(line.strip()[:300])
        return
    # detail lines carry the reporter's prefix; old kernels name the source only in the header
    entry = kmsg.get(last_header.get(msg.reporter, msg.reporter))
    if entry is None or "current" not in entry:
        return
    _detail(entry[entry["current"]], msg)


def _detail(group: dict[str, Any], msg: pcihw.AerLogLine) -> None:
    """A detail line (status, error bit) of the report counted in ``group``."""
    if msg.kind == "status":
        group["device_ids"] = msg.ids
        group["status_mask"] = f"{msg.status}/{msg.mask}"
    elif msg.name and msg.name not in group["errors"] and len(group["errors"]) < _MAX_NAMES:
        group["errors"].append(msg.name)


def _details(group: dict[str, Any], said: Mapping[str, Any]) -> None:
    """Detail lines folded apart (``_detail`` on another group) added to ``group``, as if they
    had come one by one: the status is the latest one, names are added in order, unseen ones
    only, up to _MAX_NAMES."""
    if "device_ids" in said:
        group["device_ids"] = said["device_ids"]
        group["status_mask"] = said["status_mask"]
    names: list[str] = group["errors"]
    for name in said["errors"]:
        if len(names) >= _MAX_NAMES:
            break
        if name not in names:
            names.append(name)


def _fold_parse(line: str) -> pcihw.AerLogLine | tuple[str, str, str] | None:
    """What :meth:`AerFold.add` makes of one line: an AER report's line, a summary line
    (:func:`_parse_summary`), or None."""
    msg = pcihw.parse_aer_message(line)
    if msg is not None:
        return msg
    return _parse_summary(line) if "AER:" in line else None


def _ingest_summary(kmsg: dict[str, Any], line: str, when: float) -> tuple[str, str] | None:
    """An AER summary or "not recovered" line, counted on the function it names; returns
    (that function, the kind of report), None for another line."""
    parsed = _parse_summary(line)
    return None if parsed is None else _count_summary(kmsg, parsed, line, when)


def _parse_summary(line: str) -> tuple[str, str, str] | None:
    """An AER summary or "not recovered" line: (the function it names, the kind of report,
    "summary" or "not_recovered"); None for another line."""
    m = _AER_SUMMARY_RE.search(line)
    lost = None if m is not None else _AER_LOST_RE.search(line)
    if m is not None:
        reporter = m.group("bdf").lower()
        bdf = (m.group("src") or "").lower() or reporter
        if m.group("id"):
            value = int(m.group("id"), 16)
            bdf = f"{reporter[:4]}:{value >> 8:02x}:{(value & 0xFF) >> 3:02x}.{value & 7}"
        sev = (m.group("sev") or "").lower()
        kind = "correctable" if m.group("kind").lower().startswith("correct") else (
            "fatal" if sev == "fatal" else "nonfatal")
        key = "summary"
    elif lost is not None:
        bdf = lost.group("bdf").lower()
        kind = lost.group("what").lower()
        key = "not_recovered"
    else:
        return None
    return bdf, kind, key


def _count_summary(kmsg: dict[str, Any], parsed: tuple[str, str, str], line: str,
                   when: float) -> tuple[str, str]:
    """Count a summary line (:func:`_parse_summary`) on the function it names: (it, the kind)."""
    bdf, kind, key = parsed
    entry = kmsg.get(bdf)
    if entry is None:
        if len(kmsg) >= _MAX_LOG_DEVICES:
            return bdf, kind
        entry = kmsg[bdf] = {"samples": []}
    groups: dict[str, dict[str, Any]] | None = entry.get(key)
    if groups is None:
        groups = entry[key] = {}
    group: dict[str, Any] | None = groups.get(kind)
    if group is None:
        group = groups[kind] = {"count": 0, "first": when, "last": when}
    group["count"] += 1
    if when < group["first"]:  # min() and max(), as in _ingest
        group["first"] = when
    if when > group["last"]:
        group["last"] = when
    if kind != "correctable" and len(entry["samples"]) < _MAX_SAMPLES:
        entry["samples"].append(line.strip()[:300])
    return bdf, kind


def _logged(entry: Mapping[str, Any], evidence: dict[str, Any]) -> list[_Problem]:
    evidence["kernel_log"] = copy.deepcopy({k: v for k, v in entry.items() if k != "current"})
    out: list[_Problem] = []
    summary = entry.get("summary") or {}
    for kind in _UNCORRECTABLE:
        group = entry.get(kind)
        if group:
            errors = ", ".join(group["errors"]) or "no error bits logged"
            out.append(_fail(f"kernel log: {group['count']} uncorrectable ({_WORDS[kind]}) PCIe Bus Error "
                             f"report(s) ({errors})"))
        elif summary.get(kind):
            out.append(_fail(f"kernel log: {summary[kind]['count']} uncorrectable ({_WORDS[kind]}) AER error "
                             "report(s) (summary line only, no 'PCIe Bus Error' detail)"))
    for what, group in sorted((entry.get("not_recovered") or {}).items()):
        out.append(_fail(f"kernel log: not recovered after an AER error ('{what}', {group['count']} "
                         "report(s)): the device stays unusable until a reset or a reboot"))
    return out


def _nonzero(errors: Mapping[str, int]) -> str:
    named = [f"{n} {c}" for n, c in sorted(errors.items()) if c]
    return ", ".join(named) or "no named bit"


def _summary(evidence: Mapping[str, Any]) -> str:
    parts = []
    since = evidence.get("aer_since_boot")
    if since:
        parts.append(f"no new AER errors (since boot: {since['fatal']} fatal, {since['nonfatal']} non-fatal, "
                     f"{since['correctable']} correctable)")
    link = evidence.get("link")
    if isinstance(link, Mapping):
        parts.append(f"link {link['current']}" + (" (idle downshift)" if "idle_downshift" in link else ""))
    log = evidence.get("kernel_log")
    if log and "correctable" in log:
        parts.append(f"{log['correctable']['count']} corrected error report(s) in the kernel log")
    return "; ".join(parts) or "nothing to report"



