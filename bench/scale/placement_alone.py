"""One placement's transaction at N nodes, alone: ``PlacementStore.place_replica`` and
``PlacementStore.dry_run_placement`` called one after another on an otherwise idle database.

Run it from the repository root::

    .venv/bin/python -m bench.scale.placement_alone --nodes 1000 --placements 200

What it does, on an embedded PostgreSQL of its own (started and stopped here, as the tests'
``pg_server`` does, in a temporary folder removed at the end):

1. registers N nodes through :meth:`NodeStore.register_node`, with inventories of the shapes a
   real fleet has: mostly CPU nodes of 64 to 512 GiB, a quarter GPU nodes (8 x H100 or
   4 x A100, one GPU in 16 reported unhealthy), a few that do not report memory (agents
   older than the field), some with labels; then marks 5 % silent
   (:meth:`NodeStore.mark_node_silent`) and cordons 2 % (:meth:`NodeStore.update_node`), so that
   placement meets every node state it meets in a fleet;
2. adds M models and M one-replica deployments (:meth:`CatalogStore.create_model`,
   :meth:`DeploymentStore.create_deployment`): 2 to 16 GiB each, every fourth asking for one GPU;
3. times M calls of :meth:`PlacementStore.place_replica`, one after another, one replica of each
   deployment (what the worker's place_replica activity calls);
4. times M calls of :meth:`PlacementStore.dry_run_placement` for a second replica of each
   deployment (it fits), and M for a replica that fits nowhere (4 TiB and 16 GPUs, so
   the nodes that do not report memory are refused too): the room watch
   runs for deployments that could not be placed, so a CantPlace, which names the nodes,
   is its common answer.

Each call is timed from the caller's side (``perf_counter`` around the await), the
database's round trips included. Before timing, a few dry runs warm the connections
(prepared statements, the type codecs' introspection); they are not counted.

With ``--pure``, no database: :func:`~modelkeeper.domain.placement.place` alone on the same
fleet shapes as :class:`NodeView` values, timed side by side with the facility rules off
and on (``--out`` writes the table, as bench/results/placement_alone.md and .json hold it).
"On" is every rule issue 22 adds to the pure function: each node carries
``topology.zone``, ``topology.rack`` (40 nodes a rack) and ``topology.pdu`` (two a rack),
one in ten is held for a class or an owner scope, every node draws some watts; each
request runs as a class for an owner, declares its watts under PDU and facility caps, and
spreads its deployment's shards (three siblings already placed) over racks with max skew 1.
With the rules on, every model also declares two hardware profiles, the first asking
for more GPUs than any node has, so each placement judges the fleet twice
(:func:`~modelkeeper.domain.profiles.place_profiles`: the first refused, the second placed),
as a vLLM-on-GPU profile falling back to llama.cpp on CPU does.

The nodes heartbeat nobody here, so the calls pass node timeouts long enough that they stay
ready throughout, as a live fleet's nodes would: what is measured is the cost of reading
and judging N nodes, not of a fleet going quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from bench.stats import percentile
from cli.postgres import dsn, start_postgres
from modelkeeper.domain.capacity import CapacityClass
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, HardwareProfile
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import AgentRegistration, GpuInfo, Inventory, NodeState, NodeUpdate
from modelkeeper.domain.placement import CantPlace, GpuView, NodeView, PlacementRequest
from modelkeeper.domain.profiles import ProfileCandidate, place_profiles, profile_candidates
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.topology import (
    PDU_LABEL,
    RACK_LABEL,
    ZONE_LABEL,
    Spread,
    TopologyKey,
)
from modelkeeper.infra.processes import free_port
from modelkeeper.store import Store

GIB = 1024**3
#: Long enough that no node goes quiet while the benchmark runs (see the docstring).
UNREACHABLE_AFTER_S = 3600.0
LOST_AFTER_S = 7200.0
START_TIMEOUT_S = 300.0
#: Dry runs before timing starts, not counted.
WARMUP_CALLS = 5
#: Shares of the fleet in each state other than ready.
SILENT_SHARE = 0.05
CORDONED_SHARE = 0.02
#: What the fits-nowhere dry run asks for: more memory than any node has, and more GPUs (a
#: node that does not report its memory fits any memory).
UNPLACEABLE_BYTES = 4096 * GIB
UNPLACEABLE_GPUS = 16
DATABASE = "placement_alone"


def _inventory(rng: random.Random, i: int) -> tuple[Inventory, dict[str, str]]:
    """A node's inventory and agent labels: a quarter GPU nodes, one in 25 without memory
    figures, the rest CPU nodes of varied size."""
    zone = {"zone": f"z{i % 3}"}
    if i % 4 == 0:
        h100 = rng.random() < 0.7
        count, name, gpu_mem = (8, "H100", 80 * GIB) if h100 else (4, "A100", 40 * GIB)
        gpus = [GpuInfo(index=g, name=name, memory_bytes=gpu_mem,
                        healthy=rng.random() >= 1 / 16) for g in range(count)]
        memory = rng.choice([1024, 2048]) * GIB
        return (Inventory(memory_total_bytes=memory, memory_available_bytes=memory,
                          cpu_count=rng.choice([96, 128]), gpus=gpus),
                {**zone, "gpu": name.lower()})
    if i % 25 == 1:
        return Inventory(cpu_count=rng.choice([16, 32])), zone
    memory = rng.choice([64, 128, 256, 512]) * GIB
    return (Inventory(memory_total_bytes=memory, memory_available_bytes=memory,
                      cpu_count=rng.choice([16, 32, 64, 128])), zone)


def _model(i: int) -> CatalogModel:
    return CatalogModel(model_id=ModelId(f"bench-model-{i:05d}"), engine=EngineKind.SIM,
                        source="bench/sim", memory_bytes=(2 + i % 15) * GIB,
                        cpu_cores=2.0, gpus=1 if i % 4 == 0 else None)


def _deployment(i: int) -> DeploymentId:
    return DeploymentId(f"bench-dep-{i:05d}")


def _request(model: CatalogModel, *, nowhere: bool = False) -> PlacementRequest:
    # As activities.store._placement_request builds it (deployment_id and siblings are the
    # store's to fill in).
    return PlacementRequest(model_id=model.model_id,
                            memory_bytes=UNPLACEABLE_BYTES if nowhere else model.memory_bytes,
                            cpu_cores=model.cpu_cores,
                            gpus=UNPLACEABLE_GPUS if nowhere else model.gpus,
                            min_nodes=model.min_nodes)


async def _populate(store: Store, *, nodes: int, placements: int, seed: int
                    ) -> list[CatalogModel]:
    rng = random.Random(seed)
    for i in range(nodes):
        inv, labels = _inventory(rng, i)
        node_id = f"node-{i:05d}"
        await store.nodes.register_node(AgentRegistration(node_id=NodeId(node_id), name=node_id,
                                                           labels=labels, inventory=inv))
    ids = [f"node-{i:05d}" for i in range(nodes)]
    rng.shuffle(ids)
    silent = int(nodes * SILENT_SHARE)
    cordoned = int(nodes * CORDONED_SHARE)
    now = datetime.now(UTC)
    for node_id in ids[:silent]:
        await store.nodes.mark_node_silent(node_id, since=now)
    for node_id in ids[silent:silent + cordoned]:
        await store.nodes.update_node(node_id, NodeUpdate(cordoned=True,
                                                          cordon_reason="bench: maintenance"))
    models = [_model(i) for i in range(placements)]
    for i, model in enumerate(models):
        await store.catalog.create_model(model)
        await store.deployments.create_deployment(_deployment(i),
                                                  DeploymentRequest(model_id=model.model_id),
                                                  f"wf-{_deployment(i)}")
    return models


async def _analyze(url: str) -> None:
    """Fresh statistics for the planner, as autovacuum's analyze would have written them on
    a stack that had been up a while (the tables were empty a moment ago)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def _timed(calls: list[Callable[[], Awaitable[object]]]) -> tuple[list[float], int]:
    """Each call's seconds, and how many answered CantPlace. The answers are not kept: 200
    CantPlaces of 1,000 rejections each are 200,000 live objects, and the garbage
    collector's full passes over them took up to 0.3 s, inside whichever call they fell
    in (a cost of this harness, not of the store)."""
    times, refused = [], 0
    for call in calls:
        began = time.perf_counter()
        result = await call()
        times.append(time.perf_counter() - began)
        refused += isinstance(result, CantPlace)
    return times, refused


def _stats(times: list[float]) -> str:
    ms = [t * 1e3 for t in times]
    return (f"p50 {percentile(ms, 0.50):7.1f} ms  p99 {percentile(ms, 0.99):7.1f} ms  "
            f"max {max(ms):7.1f} ms  mean {statistics.fmean(ms):7.1f} ms  (n={len(ms)})")


async def measure(url: str, *, nodes: int, placements: int, seed: int) -> None:
    async with await Store.connect(url) as store:
        t0 = time.perf_counter()
        models = await _populate(store, nodes=nodes, placements=placements, seed=seed)
        await _analyze(url)
        print(f"{nodes} nodes, {placements} deployments registered in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)

        def dry(i: int, model: CatalogModel, *, nowhere: bool = False
                ) -> Callable[[], Awaitable[object]]:
            return lambda: store.placement.dry_run_placement(
                deployment_id=_deployment(i), request=_request(model, nowhere=nowhere),
                now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
                lost_after_s=LOST_AFTER_S)

        def place(i: int, model: CatalogModel) -> Callable[[], Awaitable[object]]:
            return lambda: store.placement.place_replica(
                deployment_id=_deployment(i), replica_id=ReplicaId(f"{_deployment(i)}-r0"),
                request=_request(model), model=model, now=datetime.now(UTC),
                unreachable_after_s=UNREACHABLE_AFTER_S, lost_after_s=LOST_AFTER_S,
                start_timeout_s=START_TIMEOUT_S)

        await _timed([dry(i, models[i]) for i in range(min(WARMUP_CALLS, placements))])
        place_s, refused = await _timed([place(i, m) for i, m in enumerate(models)])
        fits_s, _ = await _timed([dry(i, m) for i, m in enumerate(models)])
        none_s, nowhere = await _timed([dry(i, m, nowhere=True)
                                        for i, m in enumerate(models)])
        assert nowhere == len(models), f"{len(models) - nowhere} unplaceable dry runs fit"
    print(f"nodes={nodes} placements={placements} seed={seed}")
    print(f"  place_replica            {_stats(place_s)}"
          + (f"  [{refused} CantPlace]" if refused else ""))
    print(f"  dry_run_placement fits   {_stats(fits_s)}")
    print(f"  dry_run_placement none   {_stats(none_s)}")


#: Pure mode's fleet: nodes per rack (a rack of 1U-2U servers), PDUs per rack (A and B
#: feeds), racks per zone; one node in HELD_EVERY held; what each node already draws.
NODES_PER_RACK = 40
PDUS_PER_RACK = 2
RACKS_PER_ZONE = 5
HELD_EVERY = 10
NODE_DRAW_WATTS = (300, 700, 1200)
#: A PDU's cap: room for about two more shards at the declared draw on every PDU, so the
#: rule is met, not idle.
PDU_CAP_WATTS = 20 * 700 + 2 * 450
SHARD_WATTS = 450
#: Shards of the deployment already placed, which the spread counts.
SIBLINGS = 3
#: What the pure mode's acceptance asks: issue 22, "Placement stays pure and fast".
TARGET_P50_MS = 25.0
OWNERS = ("acme/ml", "acme/web", "umbrella")


def _pure_nodes(nodes: int, seed: int, *, facility: bool) -> list[NodeView]:
    """The fleet of :func:`_populate` as views (claims empty, states as there), with
    topology labels, holds and draws when ``facility``."""
    rng = random.Random(seed)
    views = []
    for i in range(nodes):
        inv, labels = _inventory(rng, i)
        state = NodeState.READY
        roll = rng.random()
        if roll < SILENT_SHARE:
            state = NodeState.UNREACHABLE
        elif roll < SILENT_SHARE + CORDONED_SHARE:
            state = NodeState.CORDONED
        fields: dict[str, object] = {}
        if facility:
            rack = i // NODES_PER_RACK
            labels = {**labels, ZONE_LABEL: f"z{rack // RACKS_PER_ZONE}",
                      RACK_LABEL: f"r{rack}", PDU_LABEL: f"r{rack}-p{i % PDUS_PER_RACK}"}
            fields["watts_claimed"] = rng.choice(NODE_DRAW_WATTS)
            if i % HELD_EVERY == 3:
                fields["hold_class"] = CapacityClass.CRITICAL
            elif i % HELD_EVERY == 7:
                fields["hold_owner"] = rng.choice(OWNERS)
        views.append(NodeView(
            node_id=NodeId(f"node-{i:05d}"), name=f"node-{i:05d}", state=state, labels=labels,
            memory_total_bytes=inv.memory_total_bytes, cpu_count=inv.cpu_count,
            gpus=[GpuView(index=g.index, memory_bytes=g.memory_bytes, healthy=g.healthy)
                  for g in inv.gpus], **fields))
    return views


def _pure_requests(models: list[CatalogModel], nodes: list[NodeView], seed: int, *,
                   facility: bool) -> list[PlacementRequest]:
    """One request per model (hardware profiles would give one per profile, tried in
    order: the hook for them)."""
    rng = random.Random(seed)
    requests = []
    for i, model in enumerate(models):
        request = _request(model).model_copy(update={"deployment_id": _deployment(i)})
        if facility:
            siblings = [n.node_id for n in rng.sample(nodes, SIBLINGS)]
            racks = {n.labels[PDU_LABEL] for n in nodes}
            request = PlacementRequest.model_validate({
                **request.model_dump(), "sibling_node_ids": sorted(siblings),
                "sibling_shards": dict.fromkeys(siblings, 1),
                "capacity_class": list(CapacityClass)[i % 3], "owner": OWNERS[i % 3],
                "watts": SHARD_WATTS, "pdu_caps_watts": dict.fromkeys(racks, PDU_CAP_WATTS),
                "facility_cap_watts": len(nodes) * 2000,
                "spread": Spread(key=TopologyKey.RACK, max_skew=1)})
        requests.append(request)
    return requests


#: The rules-on models' profiles: one no node can take (more GPUs per shard than any node
#: has), then the model's own shape on CPU: each placement tries both.
UNFIT_PROFILE = HardwareProfile(name="gpu-16", engine=EngineKind.SIM, gpus=UNPLACEABLE_GPUS,
                                priority=10)
FALLBACK_PROFILE = HardwareProfile(name="cpu", engine=EngineKind.SIM)


def _pure_candidates(models: list[CatalogModel], requests: list[PlacementRequest], *,
                     profiles: bool) -> list[list[ProfileCandidate]]:
    """Each request's candidates: itself alone, or one per profile with ``profiles``."""
    return [profile_candidates(
        model.model_copy(update={"profiles": [UNFIT_PROFILE, FALLBACK_PROFILE]})
        if profiles else model, request) for model, request in zip(models, requests,
                                                                   strict=True)]


def _pure_times(candidates: list[list[ProfileCandidate]], nodes: list[NodeView]
                ) -> tuple[list[float], int]:
    times, refused = [], 0
    for each in candidates:
        began = time.perf_counter()
        result = place_profiles(each, nodes)
        times.append(time.perf_counter() - began)
        refused += isinstance(result, CantPlace)
    return times, refused


def measure_pure(*, nodes: int, placements: int, seed: int) -> dict[str, object]:
    """place() alone, issue 22's rules off and on (facility rules and profiles), on one
    fleet shape: p50, p95, p99 (ms)."""
    models = [_model(i) for i in range(placements)]
    rows: dict[str, object] = {}
    for facility in (False, True):
        views = _pure_nodes(nodes, seed, facility=facility)
        requests = _pure_requests(models, views, seed, facility=facility)
        candidates = _pure_candidates(models, requests, profiles=facility)
        _pure_times(candidates[:WARMUP_CALLS], views)
        times, refused = _pure_times(candidates, views)
        ms = [t * 1e3 for t in times]
        rows["on" if facility else "off"] = {
            "p50_ms": round(percentile(ms, 0.50), 3), "p95_ms": round(percentile(ms, 0.95), 3),
            "p99_ms": round(percentile(ms, 0.99), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "calls": len(ms), "cant_place": refused}
    off, on = rows["off"], rows["on"]
    assert isinstance(off, dict) and isinstance(on, dict)
    return {"nodes": nodes, "placements": placements, "seed": seed,
            "target_p50_ms": TARGET_P50_MS, **rows,
            "ratio_p50": round(on["p50_ms"] / off["p50_ms"], 2),
            "met": on["p50_ms"] <= TARGET_P50_MS}


def _pure_table(result: dict[str, object]) -> str:
    lines = ["| issue 22's rules (facility, holds, classes, owners, profiles) | p50 ms | "
             "p95 ms | p99 ms | mean ms | calls | CantPlace |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for key in ("off", "on"):
        row = result[key]
        assert isinstance(row, dict)
        lines.append(f"| {key} | {row['p50_ms']} | {row['p95_ms']} | {row['p99_ms']} | "
                     f"{row['mean_ms']} | {row['calls']} | {row['cant_place']} |")
    return "\n".join(lines)


def _pure_markdown(result: dict[str, object], table: str) -> str:
    return (f"# place() alone at {result['nodes']} nodes, issue 22's rules off and on\n\n"
            "`python -m bench.scale.placement_alone --pure --nodes "
            f"{result['nodes']} --placements {result['placements']} --seed {result['seed']}"
            " --out bench/results/placement_alone` (one run, both sides on one fleet shape;"
            " the module docstring says what \"on\" turns on).\n\n"
            f"{table}\n\n"
            f"On/off p50 ratio: {result['ratio_p50']}. Target (issue 22): p50 <= "
            f"{result['target_p50_ms']} ms with the rules on: "
            f"**{'met' if result['met'] else 'not met'}**.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.placement_alone",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--placements", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pure", action="store_true",
                        help="place() alone, no database: issue 22's rules off and on")
    parser.add_argument("--out", type=Path, default=None,
                        help="with --pure: write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if args.pure:
        result = measure_pure(nodes=args.nodes, placements=args.placements, seed=args.seed)
        table = _pure_table(result)
        print(table)
        print(f"on/off p50 ratio {result['ratio_p50']}, target p50 <= {TARGET_P50_MS} ms: "
              f"{'met' if result['met'] else 'NOT met'}")
        if args.out is not None:
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
            args.out.with_suffix(".md").write_text(_pure_markdown(result, table))
        return 0
    with tempfile.TemporaryDirectory(prefix="mk-placement-alone-") as tmp:
        root = Path(tmp)
        port = free_port()
        proc = start_postgres(root / "data", "127.0.0.1", port, root / "postgres.log")
        try:
            asyncio.run(_create_and_measure(dsn("127.0.0.1", port, "postgres", data_dir=root),
                                            dsn("127.0.0.1", port, DATABASE, data_dir=root),
                                            args))
        finally:
            proc.stop()
    return 0


async def _create_and_measure(admin_url: str, url: str, args: argparse.Namespace) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        await admin.close()
    await measure(url, nodes=args.nodes, placements=args.placements, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
