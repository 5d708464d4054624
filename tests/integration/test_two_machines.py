"""Other machines for real: `up --bind-host 0.0.0.0` in one network namespace and an agent
in each of two more, on one bridge, with nothing shared but the API's URL, the join token
file and the three files of `up`'s Temporal mTLS front (docs/second-machine.md). One test,
since each `up` costs a fresh PostgreSQL and Temporal on two shared cores:

- **A second machine** (docs/second-machine.md): the banner says where the join token and
  the mTLS files are; the API hands each agent a Temporal address it can reach (the mTLS
  front's, not ``0.0.0.0`` nor the dev server's on loopback); each agent's worker gets
  through the front with the agent certificate `up` made, and advertises its own address
  on the link (not 127.0.0.1), where its engine listens and the gateway reaches it.
- **A replica over two machines** (issue 23's acceptance, docs/engines.md): a 2-node sim
  replica in the sim's multi-rank mode, which rendezvouses as vLLM and SGLang do (rank 1
  connects to rank 0 at the address the control plane put in both shards' specs; rank 0
  serves only once rank 1 joined), so serving at all proves the leader address reached
  both agents and worked across the link. kill -9 of rank 1's engine: rank 0 exits as its
  group breaks, the replica is replaced whole and serves again, and the audit names the
  shard that failed.

Needs root and iproute2's ``ip netns``; skipped, saying which is missing, elsewhere.
Every process started in the namespaces is killed by process group, and the namespaces
deleted, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.netns import Machines, machines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

#: Registration, placement (the settling window `up` sets is 2 s) and two sim starts.
SERVING_TIMEOUT_S = 150.0
#: The agent says it polls once its worker runs, which is after the API counts its node
#: ready: it first connects to Temporal through the mTLS front (seconds, on busy cores).
POLLING_TIMEOUT_S = 60.0
#: The replica is replaced at once after an exit (no backoff; a multi-node replica is
#: never relaunched in place): a stop of both shards, a new placement, two starts.
REPLACED_TIMEOUT_S = 90.0
#: Claims and holds: each rank claims half the model, and holds 32 MiB of real memory.
NODE_MEMORY = "2GiB"
MODEL = {"model_id": "sim-two-nodes", "engine": "sim", "source": "sim",
         "memory_bytes": 256 * 1024**2, "min_nodes": 2,
         "engine_args": {"memory_bytes": 32 * 1024**2}}
#: Ports in the stack's namespace: a fresh namespace has no listeners, so fixed ones do.
PORTS = {"api": 18400, "gateway": 18401, "postgres": 18432, "temporal": 17233,
         "temporal-ui": 18233, "temporal-http": 17243, "temporal-metrics": 17244,
         "temporal-mtls": 17235}
AGENTS = ("b", "c")


@pytest.fixture
def net() -> Iterator[Machines]:
    with machines("mk2m", agents=len(AGENTS)) as made:
        yield made


def _chat(net: Machines) -> tuple[int | None, str]:
    return net.request("POST", f"http://127.0.0.1:{PORTS['gateway']}/v1/chat/completions",
                       body={"model": MODEL["model_id"], "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hello from A"}]})


def test_agents_on_other_machines_serve_a_replica_across_both(
        net: Machines, tmp_path: Path) -> None:
    stack_dir = tmp_path / "a"
    # The remote agents poll A's Temporal, which stays on loopback, through the mTLS front.
    up_argv = [sys.executable, "-m", "modelkeeper", "up", "--bind-host", "0.0.0.0",
               "--no-demo", "--data-dir", str(stack_dir)]
    for name, port in PORTS.items():
        up_argv += [f"--{name}-port", str(port)]
    up = net.spawn(net.stack_ns, up_argv)
    net.logs += [stack_dir / "logs" / f"{name}.log" for name in ("api", "worker", "gateway",
                                                                  "temporal-front")]
    banner = net.wait_for_banner(up)

    # `up` made the join token, and says where it is and how to join.
    token_file = stack_dir / "join-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert f"join token     {token_file}" in banner, banner
    assert net.stack_ip in banner, banner
    assert f"Temporal mTLS  {net.stack_ip}:{PORTS['temporal-mtls']}" in banner, banner
    operator = (stack_dir / "operator-token").read_text().strip()
    api = f"http://{net.stack_ip}:{PORTS['api']}"

    # Each machine gets the API's URL, the token file and copies of the three Temporal
    # files the banner names, and nothing else.
    mtls = stack_dir / "temporal-mtls"
    for name, ns in zip(AGENTS, net.agent_ns, strict=True):
        copies = tmp_path / f"{name}-temporal"
        copies.mkdir(mode=0o700)
        for file in ("ca.pem", "agent.pem", "agent.key"):
            assert str(mtls / file) in banner, banner
            shutil.copy(mtls / file, copies / file)
        net.spawn(ns, [
            "env", f"MODELKEEPER_TEMPORAL_TLS_CA_FILE={copies / 'ca.pem'}",
            f"MODELKEEPER_TEMPORAL_TLS_CERT_FILE={copies / 'agent.pem'}",
            f"MODELKEEPER_TEMPORAL_TLS_KEY_FILE={copies / 'agent.key'}",
            sys.executable, "-m", "modelkeeper", "agent", "--data-dir", str(tmp_path / name),
            "--api-url", api, "--join-token-file", str(token_file), "--name", name,
            "--memory", NODE_MEMORY], log=tmp_path / f"agent-{name}.log")

    def remote_nodes() -> dict[str, dict[str, Any]] | None:
        status, text = net.request("GET", f"{api}/nodes", token=operator)
        assert status == 200, text
        ready = {n["name"]: n for n in json.loads(text)
                 if n["name"] in AGENTS and n["state"] == "ready"}
        return ready if len(ready) == len(AGENTS) else None

    nodes = net.until("nodes b and c ready", remote_nodes, 90)
    # Each agent said which engines it can run (placement rule 11).
    assert all("sim" in n["engines"] for n in nodes.values()), nodes
    by_id = {n["node_id"]: name for name, n in nodes.items()}
    address = dict(zip(AGENTS, net.agent_ips, strict=True))
    for name in AGENTS:
        log = tmp_path / f"agent-{name}.log"
        net.until(f"agent {name} saying it polls",
                  lambda log=log: "registered; polling" in log.read_text(), POLLING_TIMEOUT_S)
        # Its worker polls through the mTLS front: the API sent it the front's address.
        assert f"on Temporal at {net.stack_ip}:{PORTS['temporal-mtls']}" in \
            log.read_text(), net.log_tails()

    status, text = net.request("POST", f"{api}/models", body=MODEL, token=operator)
    assert status == 201, text
    status, text = net.request("POST", f"{api}/deployments", token=operator, body={
        "model_id": MODEL["model_id"], "min_nodes": 2, "node_ids": sorted(by_id)})
    assert status == 201, text
    deployment_id = json.loads(text)["deployment_id"]

    def serving(not_replica: str | None = None) -> dict[str, Any] | None:
        status, text = net.request("GET", f"{api}/deployments/{deployment_id}",
                                   token=operator)
        assert status == 200, text
        view: dict[str, Any] = json.loads(text)
        replicas = view["replicas"]
        if view["status"] != "serving" or not replicas \
                or replicas[0]["replica_id"] == not_replica:
            return None
        return view

    view = net.until("the two-node replica serving", serving, SERVING_TIMEOUT_S)
    [replica] = view["replicas"]
    # Rank order: rank 0 first, and its engine is the endpoint, on its machine's own
    # address, which the API checked it against.
    rank0, rank1 = (by_id[n] for n in replica["nodes"])
    assert {rank0, rank1} == set(AGENTS)
    assert replica["endpoint"].startswith(f"http://{address[rank0]}:"), replica
    status, text = _chat(net)
    assert status == 200, text + net.log_tails()
    assert json.loads(text)["choices"][0]["message"]["content"]
    # Rank 0's engine log says rank 1 joined from rank 1's own address.
    rank0_log = next((tmp_path / rank0).rglob(f"{replica['replica_id']}.log"))
    assert f"rank 1 joined from ('{address[rank1]}'" in rank0_log.read_text()

    # kill -9 of rank 1's engine (its pid as its agent recorded it).
    record = next((tmp_path / rank1).rglob(f"shards/{replica['replica_id']}.json"))
    os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)

    view = net.until("a new replica serving",
                     lambda: serving(not_replica=replica["replica_id"]), REPLACED_TIMEOUT_S)
    assert len(view["replicas"]) == 1 and len(view["replicas"][0]["nodes"]) == 2
    status, text = _chat(net)
    assert status == 200, text + net.log_tails()

    # The audit names the shard that failed, first, and how rank 0 followed it.
    status, text = net.request("GET", f"{api}/events?deployment_id={deployment_id}",
                               token=operator)
    assert status == 200, text
    exited = [e for e in json.loads(text) if e["kind"] == "replica.exited"]
    assert exited, text
    assert exited[0]["message"].startswith(
        f"shard 1 on node {replica['nodes'][1]}: signalled: killed by SIGKILL"), exited[0]
    for name in AGENTS:
        assert "\x1b[" not in (tmp_path / f"agent-{name}.log").read_text()  # a file, not a tty

    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=90)
    assert up.returncode == 0, out
    assert "no process of modelkeeper up is left" in out, out
