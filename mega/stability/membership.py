"""Which nodes run next: diagnosis before a restart, eviction, spares, and shrinking DP.

When a node's ranks die (the driver's ``JobOutcome.failed_nodes``) and the run has a membership
policy (``restart.spare_nodes`` > 0 or ``restart.min_nodes`` set), the nodes of the failed attempt
run the self-check (mega/cluster/selfcheck.py: GEMM, the intra-node all-to-all, node-pair
exchanges) before the restart, as MegaScale does (NSDI'24, section 4.3). A node whose verdict is
unhealthy is evicted for the rest of the run:

* a spare takes its place (same node count, same layout): the run continues at full size;
* with no spare left the run continues on fewer nodes when ``restart.min_nodes`` allows: the
  model-parallel group (TP x PP) is unchanged, DP shrinks with the world, and the global batch
  stays the same through more microbatches per step. The data order depends on the step only, so
  the loss curve continues (to fp32 summation order), restored from ``latest`` through the
  reshardable checkpoint;
* otherwise ``CannotContinue`` says why, and the run fails instead of restarting onto a bad node.

Nodes here are physical: ``0 .. cluster.nodes-1`` start in the job, ``cluster.nodes ..
cluster.nodes+spare_nodes-1`` are the spares; the job's node rank ``i`` runs on ``nodes[i]``.
Under ``launcher=local-nodes`` a spare is one more agent slot on this machine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mega import faults
from mega.cluster.selfcheck import on_physical_nodes
from mega.config import ConfigError, validate

if TYPE_CHECKING:
    from mega.config import MegaConfig


class CannotContinue(RuntimeError):
    """Neither a spare nor ``restart.min_nodes`` lets the run go on without its evicted nodes."""


@dataclass
class Membership:
    nodes: list[int]  # physical nodes of the job, in node-rank order
    spares: list[int]  # idle spares, taken first to last
    evicted: list[int] = field(default_factory=list)

    @classmethod
    def initial(cls, cfg: MegaConfig) -> Membership:
        n = cfg.cluster.nodes
        return cls(list(range(n)), list(range(n, n + cfg.restart.spare_nodes)))

    def job_rank(self, physical: int) -> int | None:
        """The job's node rank of a physical node (None: not in the job)."""
        return self.nodes.index(physical) if physical in self.nodes else None


def diagnosis_enabled(cfg: MegaConfig) -> bool:
    """Whether a node failure is diagnosed: only where a verdict can change who runs next."""
    return cfg.restart.spare_nodes > 0 or cfg.restart.min_nodes is not None


def resize(cfg: MegaConfig, nodes: int) -> MegaConfig:
    """``cfg`` on ``nodes`` nodes of the same size: TP, PP and CP kept, DP = world / (TP x PP x CP), the
    global batch kept (more microbatches per step). Injected faults aimed at nodes or ranks end
    here (faults.disarm). CannotContinue names the setting that rules the size out."""
    c, p = cfg.cluster, cfg.parallelism
    world = nodes * c.procs_per_node
    mp = p.tp * p.pp * p.cp
    if world % mp:
        raise CannotContinue(
            f"{nodes} nodes x {c.procs_per_node} ranks = {world} is not a multiple of "
            f"tp*pp*cp={p.tp}*{p.pp}*{p.cp} (restart.min_nodes={cfg.restart.min_nodes})"
        )
    new = copy.deepcopy(cfg)
    new.cluster.nodes = nodes
    new.parallelism.dp = world // mp
    faults.disarm(new)
    try:
        return validate(new)
    except ConfigError as e:  # e.g. the global batch does not split over the smaller DP
        raise CannotContinue(f"on {nodes} nodes (dp={new.parallelism.dp}): {e}") from None


@dataclass
class Decision:
    membership: Membership
    cfg: MegaConfig
    evicted: list[int]  # physical nodes evicted now
    replaced: dict[int, int]  # evicted node -> the spare in its place
    note: str  # for people: what changed


def decide(cfg: MegaConfig, members: Membership, bad: list[int]) -> Decision:
    """Who runs next when the physical nodes ``bad`` failed their self-check (pure: no processes)."""
    bad = [k for k in members.nodes if k in bad]
    if not bad:
        return Decision(members, cfg, [], {}, "no node evicted")
    nodes, spares, replaced = list(members.nodes), list(members.spares), {}
    for k in bad:
        if spares:  # in the same place: node ranks, and so the layout, stay as they were
            replaced[k] = spares.pop(0)
            nodes[nodes.index(k)] = replaced[k]
        else:
            nodes.remove(k)
    floor = cfg.restart.min_nodes if cfg.restart.min_nodes is not None else cfg.cluster.nodes
    if len(nodes) < floor:
        floor_text = (
            f"restart.min_nodes={cfg.restart.min_nodes}"
            if cfg.restart.min_nodes is not None
            else "restart.min_nodes=null (never shrink)"
        )
        raise CannotContinue(
            f"node(s) {bad} failed the self-check; {len(nodes)} healthy node(s) left, no spare "
            f"(restart.spare_nodes={cfg.restart.spare_nodes}), and {floor_text} does not allow {len(nodes)}"
        )
    new_cfg = cfg if len(nodes) == len(members.nodes) else resize(cfg, len(nodes))
    if new_cfg is cfg:  # same layout on other nodes: the drills of the old nodes end too
        new_cfg = copy.deepcopy(cfg)
        faults.disarm(new_cfg)
    parts = [
        f"node {k} evicted" + (f", spare node {replaced[k]} in its place" if k in replaced else "")
        for k in bad
    ]
    if len(nodes) != len(members.nodes):
        p = new_cfg.parallelism
        parts.append(
            f"continuing on {len(nodes)} nodes: dp {cfg.parallelism.dp} -> {p.dp}, "
            f"{cfg.parallelism.num_microbatches} -> {p.num_microbatches} microbatches per step, "
            f"global batch {p.global_batch_size}"
        )
    return Decision(
        Membership(nodes, spares, members.evicted + bad), new_cfg, bad, replaced, "; ".join(parts)
    )


def swap(cfg: MegaConfig, members: Membership, suspects: list[int]) -> Decision | None:
    """Spares in the places of the physical nodes ``suspects`` before any verdict on them (pure):
    the suspects leave the job but are not evicted (a self-check beside the run decides: evicted,
    or a spare again). None when fewer spares than suspects are free."""
    suspects = [k for k in members.nodes if k in suspects]
    if not suspects or len(members.spares) < len(suspects):
        return None
    d = decide(cfg, members, suspects)
    note = "; ".join(
        f"spare node {d.replaced[k]} in node {k}'s place, node {k} set aside for a self-check"
        for k in suspects
    )
    return Decision(replace(d.membership, evicted=list(members.evicted)), d.cfg, [], d.replaced, note)


def selfcheck_verdicts(result: dict, members: Membership) -> dict[int, dict]:
    """The self-check's per-node verdicts keyed by physical node: healthy True/False/None (None:
    not judged, e.g. the job died before a verdict) and the reasons."""
    return {
        members.nodes[row["node"]]: {
            "healthy": row["healthy"],
            "reasons": on_physical_nodes(row["reasons"], members.nodes),
        }
        for row in result["nodes"]
        if row["node"] < len(members.nodes)
    }
