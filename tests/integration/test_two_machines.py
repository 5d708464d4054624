"""A second machine for real: `up --bind-host 0.0.0.0` in one network namespace, an agent
in another, joined by a veth pair, with nothing shared but the API's URL, the join token
file and the three files of `up`'s Temporal mTLS front (docs/second-machine.md).

A model pinned to the remote node is deployed and served through the gateway: that takes
the API handing the agent a Temporal address it can reach (not ``0.0.0.0``, and the mTLS
front's, not the dev server's on loopback), the agent's worker getting through that front
with the agent certificate `up` made, the agent
advertising its own address on the link (not 127.0.0.1), its engine listening there, and
the gateway in the first namespace reaching it.

Needs root and iproute2's ``ip netns``; skipped, saying which is missing, elsewhere.
Every process started in either namespace is killed by process group, and the namespaces
and the veth pair are deleted, whatever happens.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.netns import Machines, machines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

#: Registration, placement (the settling window `up` sets is 2 s) and a sim engine start.
SERVING_TIMEOUT_S = 150.0
#: The agent says it polls once its worker runs, which is after the API counts its node
#: ready: it first connects to Temporal through the mTLS front (seconds, on busy cores).
POLLING_TIMEOUT_S = 60.0
#: Claims and holds: the node declares far more than one replica claims, and the sim engine
#: holds only engine_args.memory_bytes, so the test costs 64 MiB of real memory.
NODE_MEMORY = "2GiB"
MODEL = {"model_id": "sim-remote", "engine": "sim", "source": "sim",
         "memory_bytes": 256 * 1024**2, "engine_args": {"memory_bytes": 64 * 1024**2}}
#: Ports in the stack's namespace: a fresh namespace has no listeners, so fixed ones do.
PORTS = {"api": 18400, "gateway": 18401, "postgres": 18432, "temporal": 17233,
         "temporal-ui": 18233, "temporal-http": 17243, "temporal-metrics": 17244,
         "temporal-mtls": 17235}


@pytest.fixture
def net() -> Iterator[Machines]:
    with machines("mk2m", agents=1) as made:
        yield made


def test_an_agent_in_another_namespace_serves_through_the_gateway(
        net: Machines, tmp_path: Path) -> None:
    stack_dir, agent_dir = tmp_path / "a", tmp_path / "b"
    # The remote agent polls A's Temporal, which stays on loopback, through the mTLS front.
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
    operator = (stack_dir / "operator-token").read_text().strip()
    api = f"http://{net.stack_ip}:{PORTS['api']}"

    # Machine B gets the API's URL, the token file and copies of the three Temporal files
    # the banner names, and nothing else.
    mtls = stack_dir / "temporal-mtls"
    copies = tmp_path / "b-temporal"
    copies.mkdir(mode=0o700)
    for name in ("ca.pem", "agent.pem", "agent.key"):
        assert str(mtls / name) in banner, banner
        shutil.copy(mtls / name, copies / name)
    assert f"Temporal mTLS  {net.stack_ip}:{PORTS['temporal-mtls']}" in banner, banner
    agent_log = tmp_path / "agent-b.log"
    net.spawn(net.agent_ns[0], [
        "env", f"MODELKEEPER_TEMPORAL_TLS_CA_FILE={copies / 'ca.pem'}",
        f"MODELKEEPER_TEMPORAL_TLS_CERT_FILE={copies / 'agent.pem'}",
        f"MODELKEEPER_TEMPORAL_TLS_KEY_FILE={copies / 'agent.key'}",
        sys.executable, "-m", "modelkeeper", "agent", "--data-dir", str(agent_dir),
        "--api-url", api, "--join-token-file", str(token_file), "--name", "b",
        "--memory", NODE_MEMORY], log=agent_log)

    def node_b() -> dict[str, Any] | None:
        status, text = net.request("GET", f"{api}/nodes", token=operator)
        assert status == 200, text
        return next((n for n in json.loads(text)
                     if n["name"] == "b" and n["state"] == "ready"), None)

    node = net.until("node b registered and ready", node_b, 90)
    net.until("agent b saying it polls", lambda: "registered; polling" in agent_log.read_text(),
           POLLING_TIMEOUT_S)
    # Its worker polls through the mTLS front: the API sent it the front's address.
    assert f"on Temporal at {net.stack_ip}:{PORTS['temporal-mtls']}" in \
        agent_log.read_text(), net.log_tails()

    status, text = net.request("POST", f"{api}/models", body=MODEL, token=operator)
    assert status == 201, text
    status, text = net.request("POST", f"{api}/deployments", token=operator, body={
        "model_id": MODEL["model_id"], "node_ids": [node["node_id"]]})
    assert status == 201, text
    deployment_id = json.loads(text)["deployment_id"]

    def serving() -> dict[str, Any] | None:
        status, text = net.request("GET", f"{api}/deployments/{deployment_id}",
                                    token=operator)
        assert status == 200, text
        view: dict[str, Any] = json.loads(text)
        return view if view["status"] == "serving" else None

    view = net.until("the deployment serving on node b", serving, SERVING_TIMEOUT_S)
    [replica] = view["replicas"]
    assert replica["nodes"] == [node["node_id"]]
    # The engine listens on machine B's own address, which the API checked it against.
    assert replica["endpoint"].startswith(f"http://{net.agent_ips[0]}:"), replica

    status, text = net.request(
        "POST", f"http://127.0.0.1:{PORTS['gateway']}/v1/chat/completions",
        body={"model": MODEL["model_id"], "max_tokens": 8,
              "messages": [{"role": "user", "content": "hello from machine A"}]})
    assert status == 200, text + net.log_tails()
    assert json.loads(text)["choices"][0]["message"]["content"]
    assert "\x1b[" not in agent_log.read_text()  # a log file, not a terminal

    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=90)
    assert up.returncode == 0, out
    assert "no process of modelkeeper up is left" in out, out
