"""Rerun disambiguation: is a rejected result the GPU's transient fault, its persistent fault, or the
data's / application's doing? (The idea of Megatron-LM's RerunStateMachine, without a restart.)

A rejected result is computed again on the **same** GPU: a different result there means the GPU
does not compute that micro-batch the same way twice: ``transient``. When it reproduces, the same
micro-batch is computed on a GPU of **another node**: a different result there means the first GPU
computes it wrongly every time: ``persistent``; the same result there means the inputs or the
program produce it on any GPU: ``application`` (not hardware; the node side holds it against no
GPU). The guard runs the same-GPU rerun and the other-node computation in one round (both at once:
one collective instead of two; the other node's result is only read when the rerun reproduced).

Pure functions of the results' keys (bytes: the fingerprints, equal keys = equal bits), and of who
computes whose micro-batch (``ring``); no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpumon.guard.verdict import Identity

TRANSIENT = "transient"
PERSISTENT = "persistent"
APPLICATION = "application"
UNKNOWN = "unknown"


def node_of(identity: Identity) -> str:
    """The node a rank runs on: the scheduler's name for it, else the host name."""
    return identity.node_name or identity.host


def ring(identities: Sequence[Identity]) -> tuple[list[int], str | None]:
    """Whom each rank audits (a ring over nodes: the i-th rank of a node audits the i-th rank of the
    next node, so that with equal nodes every rank is audited once), and a note when the audit
    cannot cross nodes (every rank on one node: rank r audits rank r + 1)."""
    world = len(identities)
    nodes: dict[str, list[int]] = {}
    for ident in identities:
        nodes.setdefault(node_of(ident), []).append(ident.rank)
    order = list(nodes.values())
    if len(order) == 1:
        note = (f"every rank is on one node ({next(iter(nodes))}): each rank audits the next rank, a GPU "
                "of the same node (a fault common to the node is not seen)")
        return [(r + 1) % world for r in range(world)], note
    targets = [0] * world
    for n, members in enumerate(order):
        following = order[(n + 1) % len(order)]
        for i, r in enumerate(members):
            targets[r] = following[i % len(following)]
    return targets, None


def nonfinite_fault(again_bad: bool, elsewhere_bad: bool | None) -> tuple[str, str]:
    """Check 1: a rank's local gradients were NaN/Inf. ``again_bad``: the same GPU's rerun of its
    micro-batch is non-finite again; ``elsewhere_bad``: another node's GPU's computation of it is
    (None: no other GPU computed it). (fault, why in words)."""
    if not again_bad:
        return TRANSIENT, "the same GPU computed the micro-batch again and got finite gradients"
    if elsewhere_bad is None:
        return UNKNOWN, ("the same GPU computed NaN/Inf again; no GPU of another node was there to "
                         "compute it")
    if elsewhere_bad:
        return APPLICATION, ("NaN/Inf again on the same GPU and on a GPU of another node: the data or "
                             "the model produce it, not the hardware")
    return PERSISTENT, ("NaN/Inf again on the same GPU, finite gradients on a GPU of another node: "
                        "this GPU computes the micro-batch wrongly every time")


@dataclass(frozen=True)
class Computation:
    """One computation of a micro-batch: who ran it, in which role, and its result's key."""

    rank: int
    role: str  # "own" (the rank's training step), "audit", "referee"
    key: bytes
    again: bytes | None = None  # the same GPU's rerun (own and audit computations only)


@dataclass
class Dispute:
    """The judgement of one micro-batch whose audit disagreed."""

    owner: int  # whose micro-batch
    majority: list[int] = field(default_factory=list)  # ranks whose first results agree (>= 2)
    # rank -> fault, for each GPU whose result is rejected: transient / persistent / unknown
    culprits: dict[int, str] = field(default_factory=dict)
    application: bool = False  # not a GPU's fault: the computation is not reproducible
    why: str = ""


def judge(owner: int, runs: list[Computation]) -> Dispute:
    """A disputed micro-batch: ``runs`` holds its owner's own computation, its auditor's and, with a
    third node, a referee's (each first result; own and audit with the same GPU's rerun).

    - A strict majority of the first results (2 of 3) rejects the odd one out; its GPU's rerun says
      transient (a different result) or persistent (the same wrong result again; the majority's
      GPUs are on other nodes). If a majority GPU's own rerun differs from its first result, the
      computation is not reproducible even there: application, no GPU named.
    - No majority with 3 results (three different answers): application (not deterministic).
    - 2 results (two nodes): a GPU whose rerun changed to the other's result was transient; both
      reproducing their own different results: unknown (two GPUs cannot outvote each other); both
      changing: application.
    """
    out = Dispute(owner)
    counts = Counter(r.key for r in runs)
    key, n = counts.most_common(1)[0]
    if len(runs) >= 3 and n * 2 > len(runs):
        out.majority = sorted(r.rank for r in runs if r.key == key)
        unstable = [r.rank for r in runs if r.key == key and r.again is not None and r.again != r.key]
        if unstable:
            out.application = True
            out.why = (f"rank(s) {', '.join(map(str, unstable))} agreed with the majority but computed a "
                       "different result when rerun on the same GPU: the computation is not "
                       "reproducible (not deterministic), no GPU can be blamed")
            return out
        for r in runs:
            if r.key == key:
                continue
            if r.again is None:
                out.culprits[r.rank] = UNKNOWN
            elif r.again != r.key:
                out.culprits[r.rank] = TRANSIENT
            else:
                out.culprits[r.rank] = PERSISTENT
        out.why = (f"{n} of {len(runs)} GPUs on different nodes agree (ranks "
                   f"{', '.join(map(str, out.majority))})")
        return out
    if len(runs) >= 3:
        out.application = True
        out.why = (f"{len(counts)} different results from {len(runs)} GPUs on different nodes: the "
                   "computation is not deterministic (dropout without guard.seed_step()? a "
                   "batch_for that is not a pure function of (rank, step)? different GPU models?)")
        return out
    a, b = runs
    a_moved = a.again is not None and a.again != a.key
    b_moved = b.again is not None and b.again != b.key
    if a_moved and not b_moved and a.again == b.key:
        out.culprits[a.rank] = TRANSIENT
        out.majority = [b.rank]
        out.why = f"rank {a.rank}'s rerun on the same GPU changed to rank {b.rank}'s result"
    elif b_moved and not a_moved and b.again == a.key:
        out.culprits[b.rank] = TRANSIENT
        out.majority = [a.rank]
        out.why = f"rank {b.rank}'s rerun on the same GPU changed to rank {a.rank}'s result"
    elif not a_moved and not b_moved:
        out.culprits = {a.rank: UNKNOWN, b.rank: UNKNOWN}
        out.why = ("each GPU reproduced its own result: with two nodes, two GPUs cannot outvote each "
                   "other (a third node settles it)")
    else:
        out.application = True
        out.why = "the reruns on the same GPUs changed too: the computation is not deterministic"
    return out


def combine(faults: list[str]) -> str:
    """One GPU named by several disputes (its own micro-batch and the one it audited): persistent
    if any reproduced, else transient, else unknown."""
    for fault in (PERSISTENT, TRANSIENT):
        if fault in faults:
            return fault
    return UNKNOWN
