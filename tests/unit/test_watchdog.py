"""The memory watchdog's rules (modelkeeper.domain.watchdog, one test per rule), the
agent's measurement of a real process, the metrics and the alert rule that reads them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from agent.engines.sim_server import MAX_GROW_BYTES, HttpError, grow_bytes
from agent.main import Node, NodeIdentity, _heartbeat_loop
from agent.shards import ShardManager
from agent.watchdog import Watchdog, node_sample, parse_gpu_free, tree_rss, trees_rss
from api.monitoring import node_memory_metrics
from modelkeeper.domain.capacity import CapacityClass
from modelkeeper.domain.catalog import CatalogModel
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import Inventory, NodeRecord, PortRange
from modelkeeper.domain.shards import EngineKind, ShardReport, ShardState
from modelkeeper.domain.tunables import WatchdogTunables
from modelkeeper.domain.watchdog import (
    Calibration,
    MemoryLevel,
    MemorySample,
    ProtectCandidate,
    WatchState,
    action_due,
    assess,
    calibrated_memory,
    calibration_view,
    choose_victim,
    margin_for,
    memory_level,
    raw_level,
    with_calibration,
)
from modelkeeper.settings import Settings

pytestmark = pytest.mark.timeout(30)

MIB = 1 << 20
GIB = 1 << 30
T = WatchdogTunables()
OK, WARN, CRITICAL = MemoryLevel.OK, MemoryLevel.WARN, MemoryLevel.CRITICAL
ALERTS = Path(__file__).parents[2] / "deploy" / "prometheus" / "alerts.yml"


# -- rule 1: the margin ------------------------------------------------------------------

def test_a_large_node_keeps_the_fixed_margin_and_a_small_one_a_fraction() -> None:
    assert margin_for(512 * GIB, T) == 8 * GIB
    assert margin_for(80 * GIB, T) == 8 * GIB  # exactly 10 margins
    assert margin_for(16 * GIB, T) == int(1.6 * GIB)
    assert margin_for(None, T) == 8 * GIB  # unknown size: the seed's margin


# -- rule 2: the level ---------------------------------------------------------------------

@pytest.mark.parametrize(("available_mib", "level"), [
    (99, CRITICAL), (100, WARN), (149, WARN), (150, OK), (10_000, OK), (0, CRITICAL)])
def test_levels_follow_the_margin_and_the_warn_factor(available_mib: int,
                                                      level: MemoryLevel) -> None:
    assert raw_level(available_mib * MIB, 100 * MIB, 1.5) is level


# -- rule 3: hysteresis ----------------------------------------------------------------------

def _level(available_mib: int, previous: MemoryLevel) -> MemoryLevel:
    return memory_level(available_mib * MIB, previous, margin_bytes=100 * MIB, tunables=T)


def test_a_worse_level_is_taken_at_once() -> None:
    assert _level(149, OK) is WARN
    assert _level(99, OK) is CRITICAL
    assert _level(99, WARN) is CRITICAL


def test_a_better_level_waits_until_the_line_is_cleared_by_the_band() -> None:
    # The band is 10 % of the margin: 10 MiB.
    assert _level(105, CRITICAL) is CRITICAL
    assert _level(110, CRITICAL) is WARN
    assert _level(155, WARN) is WARN
    assert _level(160, WARN) is OK
    # Far above every line: straight to ok.
    assert _level(500, CRITICAL) is OK
    # Cleared the critical line but not the warn line by the band: warn.
    assert _level(155, CRITICAL) is WARN


def test_a_node_hovering_at_a_line_changes_level_once() -> None:
    level, changes = OK, 0
    for available in [151, 149, 151, 149, 152, 148, 155, 149]:
        new = _level(available, level)
        changes += new is not level
        level = new
    assert (level, changes) == (WARN, 1)


def test_an_unreadable_sample_keeps_the_level() -> None:
    assert memory_level(None, CRITICAL, margin_bytes=100 * MIB, tunables=T) is CRITICAL
    assert memory_level(None, OK, margin_bytes=100 * MIB, tunables=T) is OK


def test_the_node_level_is_the_worse_of_system_and_gpu() -> None:
    sample = MemorySample(available_bytes=100 * GIB, total_bytes=200 * GIB,
                          gpu_free_bytes=512 * MIB)
    report, state = assess(sample, WatchState(), T)
    assert (report.level, state) == (CRITICAL, WatchState(system=OK, gpu=CRITICAL))
    assert "GPU" in report.reason and report.margin_bytes == 8 * GIB
    quiet, _ = assess(sample.model_copy(update={"gpu_free_bytes": None}), WatchState(), T)
    assert quiet.level is OK


# -- what the agent measures -------------------------------------------------------------------

def test_a_declared_node_has_its_declaration_less_its_engines_resident_memory() -> None:
    sample = node_sample(declared_memory=GIB, engines_rss=700 * MIB,
                         machine=(64 * GIB, 30 * GIB), gpu_free=None)
    assert (sample.available_bytes, sample.total_bytes) == (324 * MIB, GIB)
    # The machine's own MemAvailable still counts when it is the smaller.
    tight = node_sample(declared_memory=GIB, engines_rss=0, machine=(64 * GIB, 200 * MIB),
                        gpu_free=None)
    assert tight.available_bytes == 200 * MIB
    undeclared = node_sample(declared_memory=None, engines_rss=5 * GIB,
                             machine=(64 * GIB, 30 * GIB), gpu_free=None)
    assert (undeclared.available_bytes, undeclared.total_bytes) == (30 * GIB, 64 * GIB)


def test_nvidia_smi_free_memory_is_read_as_the_least_free_gpu() -> None:
    assert parse_gpu_free("80000\n512\n") == 512 * MIB
    assert parse_gpu_free("") is None
    assert parse_gpu_free("[N/A]\n") is None


def test_the_agent_measures_a_real_process_and_reports_its_peak_when_it_is_killed() -> None:
    """This test's own process stands for an engine: its resident memory is real."""
    pid = os.getpid()
    assert tree_rss(pid) > 10 * MIB
    dog = Watchdog(T, declared_memory=64 * GIB, gpu_free=lambda: None)
    shard = ShardReport(replica_id=ReplicaId("r-1"), model_id=ModelId("m"), rank=0,
                        state=ShardState.READY, port=1, pid=pid, url=None, adopted=False)
    report = dog.check([shard])
    assert report.engines_rss_bytes > 10 * MIB and report.level is OK
    assert report.available_bytes is not None
    assert report.available_bytes <= 64 * GIB - report.engines_rss_bytes
    dog.take_kills([(ReplicaId("r-1"), ModelId("m"), "SIGKILL: the kernel's OOM killer")])
    (kill,) = dog.pending_kills
    assert kill.peak_rss_bytes >= report.engines_rss_bytes
    dog.check([])  # the engine is gone: its peak is forgotten, the kill kept
    assert dog.peaks == {} and len(dog.pending_kills) == 1
    dog.kills_reported(1)
    assert dog.pending_kills == []


def test_a_process_that_is_gone_holds_nothing() -> None:
    assert tree_rss(2**22 + 12345) == 0


def test_an_engine_counts_what_its_children_hold() -> None:
    """A real child holding 64 MiB counts towards its parent (this process), as an
    engine's workers count towards the engine."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; x = bytearray(64 << 20); x[::4096] = "
         "b'1' * len(range(0, 64 << 20, 4096)); print('ok', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ok\n"
        mine = psutil.Process().memory_info().rss
        held = psutil.Process(child.pid).memory_info().rss
        total = trees_rss([os.getpid(), 2**22 + 12345])
        assert total[2**22 + 12345] == 0
        assert total[os.getpid()] >= mine + held - 8 * MIB  # both sampled a moment apart
        assert held >= 64 * MIB
    finally:
        child.kill()
        child.wait()


# -- rule 4: the victim ------------------------------------------------------------------------

ON_DEMAND = ScalingPolicy(min_replicas=0, max_replicas=2, idle_timeout_s=600)


def _candidate(replica: str, gib: int, *, cls: CapacityClass | None = None,
               policy: ScalingPolicy | None = None) -> ProtectCandidate:
    return ProtectCandidate(replica_id=ReplicaId(replica), deployment_id=DeploymentId(
        f"d-{replica}"), capacity_class=cls, policy=policy, memory_bytes=gib * GIB)


def test_the_lowest_class_goes_first_then_the_largest_within_it() -> None:
    critical = _candidate("crit", 40, cls=CapacityClass.CRITICAL)
    standard = _candidate("std", 30)  # no class, fixed: standard
    small_opp = _candidate("opp-small", 2, cls=CapacityClass.OPPORTUNISTIC)
    big_on_demand = _candidate("opp-big", 8, policy=ON_DEMAND)  # on demand: opportunistic
    assert choose_victim([critical, standard, small_opp, big_on_demand]) == big_on_demand
    assert choose_victim([critical, standard, small_opp]) == small_opp
    assert choose_victim([critical, standard]) == standard
    assert choose_victim([critical]) == critical
    assert choose_victim([]) is None


def test_equal_victims_are_chosen_by_replica_id_whatever_the_order() -> None:
    a, b = _candidate("a", 4), _candidate("b", 4)
    assert choose_victim([b, a]) == choose_victim([a, b]) == a


# -- rule 5: the pace --------------------------------------------------------------------------

def test_the_watchdog_acts_at_most_once_an_interval_per_node() -> None:
    now = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    assert action_due(None, now, 60)
    assert not action_due(now - timedelta(seconds=59), now, 60)
    assert action_due(now - timedelta(seconds=60), now, 60)


# -- rule 6: calibration -----------------------------------------------------------------------

def test_a_model_killed_for_memory_is_claimed_at_its_peak_with_the_margin() -> None:
    measured = Calibration(model_id=ModelId("m"), peak_rss_bytes=10 * GIB, oom_kills=1)
    assert calibrated_memory(8 * GIB, None, margin=1.2) == 8 * GIB
    assert calibrated_memory(8 * GIB, measured, margin=1.2) == 12 * GIB
    # A catalog figure above the measured peak stands.
    assert calibrated_memory(16 * GIB, measured, margin=1.2) == 16 * GIB
    model = CatalogModel(model_id=ModelId("m"), engine=EngineKind.SIM, source="sim",
                         memory_bytes=8 * GIB)
    assert with_calibration(model, measured, margin=1.2).memory_bytes == 12 * GIB
    assert with_calibration(model, None, margin=1.2) is model
    view = calibration_view(8 * GIB, measured, margin=1.2)
    assert view.claimed_bytes == 12 * GIB and "12.0 GiB" in view.note


# -- metrics and the alert rule ----------------------------------------------------------------

def _node(level: MemoryLevel, changes: int) -> NodeRecord:
    now = datetime.now(UTC)
    return NodeRecord(node_id=NodeId("n-1"), name="box", agent_labels={}, operator_labels={},
                      cordoned=False, cordon_reason=None, memory_total_bytes=GIB,
                      memory_available_bytes=GIB, cpu_count=2, gpus=[], last_seen=now,
                      registered_at=now, memory_level=level, memory_level_changes=changes)


def test_each_node_exports_its_level_and_its_changes() -> None:
    text = node_memory_metrics([_node(CRITICAL, 3)]).decode()
    assert 'modelkeeper_node_memory_level{node="box",node_id="n-1"} 2.0' in text
    assert 'modelkeeper_node_memory_level_changes_total{node="box",node_id="n-1"} 3.0' in text


def test_the_alert_rules_parse_and_read_series_the_api_exports() -> None:
    # The watchdog's own group (the quotas' is tests/unit/test_prometheus_rules.py's).
    rules = {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"]
             if g["name"] == "modelkeeper-memory" for r in g["rules"]}
    critical = rules["ModelkeeperNodeMemoryCritical"]
    assert critical["labels"]["severity"] == "critical"
    assert critical["expr"].split()[0] == "modelkeeper_node_memory_level"
    exported = node_memory_metrics([_node(CRITICAL, 1)]).decode()
    for rule in rules.values():
        assert rule["expr"].split()[0] + "{" in exported, rule["alert"]


# -- the sim's grow control --------------------------------------------------------------------

def test_the_sim_grows_by_a_bounded_whole_number_of_bytes() -> None:
    assert grow_bytes(b'{"bytes": 1048576}') == MIB
    for bad in (b'{"bytes": -1}', b'{"bytes": 1.5}', b'{"bytes": true}', b"[1]", b"{",
                b'{"bytes": ' + str(MAX_GROW_BYTES + 1).encode() + b"}"):
        with pytest.raises(HttpError):
            grow_bytes(bad)


# -- version skew: an API older than the watchdog --------------------------------------------

class _OldHeartbeat(BaseModel):
    """AgentHeartbeat as an API before the watchdog validates it: strict, two fields."""

    model_config = ConfigDict(extra="forbid")
    inventory: dict[str, Any]
    shards: list[dict[str, Any]]


async def test_an_api_older_than_the_watchdog_still_gets_heartbeats(tmp_path: Path) -> None:
    """It refuses the watchdog's fields (422); the agent sends the heartbeat again without
    them, at once, and every heartbeat tries with them first."""
    bodies: list[dict[str, Any]] = []
    stop = asyncio.Event()

    def old_api(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        try:
            _OldHeartbeat.model_validate(body)
        except ValidationError as err:
            return httpx.Response(422, json={"detail": str(err)})
        if sum("memory" not in b for b in bodies) == 2:
            stop.set()
        return httpx.Response(200, json={"claimed_replica_ids": []})

    settings = Settings(database_url="postgresql://unused", heartbeat_interval_s=0.01,
                        data_dir=tmp_path)
    manager = ShardManager(node_id=NodeId("n-old"), agent_dir=tmp_path / "agent",
                           engine_host="127.0.0.1", port_range=(20000, 20010))
    node = Node(node_id=NodeId("n-old"), name="old", labels={},
                identity=NodeIdentity(tmp_path / "agent", None), manager=manager,
                inventory=Inventory, engine_host="127.0.0.1",
                engine_ports=PortRange(low=20000, high=20010),
                watchdog=Watchdog(T, declared_memory=GIB, gpu_free=lambda: None))
    async with httpx.AsyncClient(transport=httpx.MockTransport(old_api),
                                 base_url="http://api") as http:
        await asyncio.wait_for(_heartbeat_loop(http, node, settings, stop), 10)
    await manager.close()
    assert ["memory" in b for b in bodies] == [True, False, True, False]
    assert bodies[0]["memory"]["level"] == "ok"
