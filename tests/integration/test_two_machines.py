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
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.netns import ip, kill_namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

#: `up` on a fresh data dir in a namespace: PostgreSQL's initdb, Temporal, four Python
#: components, on two shared cores.
UP_READY_TIMEOUT_S = 240.0
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
#: Killing what runs in the namespaces at the end: ten seconds of SIGKILL rounds.
KILL_TIMEOUT_S = 10.0
#: Ports in the stack's namespace: a fresh namespace has no listeners, so fixed ones do.
PORTS = {"api": 18400, "gateway": 18401, "postgres": 18432, "temporal": 17233,
         "temporal-ui": 18233, "temporal-http": 17243, "temporal-metrics": 17244,
         "temporal-mtls": 17235}

#: Run inside a namespace: one HTTP request, its answer printed as JSON. The test's own
#: process stays in the root namespace, which reaches neither end of the link.
REQUEST_SCRIPT = """
import json, sys, httpx
method, url, body, token = json.loads(sys.argv[1])
headers = {"Authorization": "Bearer " + token} if token else {}
try:
    resp = httpx.request(method, url, json=body, headers=headers, timeout=60)
    print(json.dumps({"status": resp.status_code, "text": resp.text}))
except httpx.HTTPError as exc:
    print(json.dumps({"status": None, "text": repr(exc)}))
"""


def _must(*args: str) -> None:
    done = ip(*args)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"


@dataclass
class Link:
    """Two namespaces joined by a veth pair, and what runs in them."""

    stack_ns: str
    agent_ns: str
    stack_ip: str
    agent_ip: str
    veth: str
    logs: list[Path] = field(default_factory=list)

    def spawn(self, ns: str, argv: list[str], log: Path | None = None,
              ) -> subprocess.Popen[str]:
        """Start ``argv`` in ``ns``, in a process group of its own (killed in cleanup with
        everything else in the namespace); stdout to ``log``, or a pipe when None."""
        out: int | IO[str]
        if log is None:
            out = subprocess.PIPE
        else:
            self.logs.append(log)
            out = open(log, "w")  # noqa: SIM115 - the child holds it; closed below
        try:
            return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out,
                                    stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        finally:
            if log is not None:
                assert not isinstance(out, int)
                out.close()

    def request(self, method: str, url: str, *, body: Any = None,
                token: str | None = None) -> tuple[int | None, str]:
        """One HTTP request sent from the stack's namespace."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.stack_ns, sys.executable, "-c", REQUEST_SCRIPT,
             json.dumps([method, url, body, token])],
            capture_output=True, text=True, timeout=90, check=False)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        return answer["status"], answer["text"]

    def kill_everything(self) -> None:
        """SIGKILL every process group with a process in either namespace: all of them
        are this test's (up, its children, the agent, and engines in groups of their
        own), and a namespace with a process in it outlives its deletion."""
        kill_namespaces((self.stack_ns, self.agent_ns), timeout_s=KILL_TIMEOUT_S)

    def delete(self) -> None:
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        for ns in (self.stack_ns, self.agent_ns):
            ip("netns", "del", ns)
        ip("link", "del", self.veth)  # only if it never made it into a namespace

    def log_tails(self) -> str:
        return "".join(f"\n--- {p}\n{p.read_text(errors='replace')[-4000:]}"
                       for p in self.logs if p.exists())


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the slow tier as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


@pytest.fixture
def link() -> Iterator[Link]:
    why = _skip_reason()
    if why is not None:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    subnet = random.randrange(1, 254)
    made = Link(stack_ns=f"mk2m-a-{tag}", agent_ns=f"mk2m-b-{tag}",
                stack_ip=f"10.200.{subnet}.1", agent_ip=f"10.200.{subnet}.2",
                veth=f"mk2m{tag}"[:13])
    try:
        added = ip("netns", "add", made.stack_ns)
        if added.returncode != 0:
            pytest.skip(f"cannot create a network namespace here: {added.stderr.strip()}")
        _must("netns", "add", made.agent_ns)
        peer = made.veth + "b"
        _must("link", "add", made.veth, "type", "veth", "peer", "name", peer)
        _must("link", "set", made.veth, "netns", made.stack_ns)
        _must("link", "set", peer, "netns", made.agent_ns)
        for ns, dev, address in ((made.stack_ns, made.veth, made.stack_ip),
                                 (made.agent_ns, peer, made.agent_ip)):
            _must("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _must("-n", ns, "link", "set", dev, "up")
            # `up` talks to its own servers on loopback, which a new namespace has down.
            _must("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        made.kill_everything()
        made.delete()


def _wait_for_banner(proc: subprocess.Popen[str], link: Link) -> str:
    """`up`'s output up to its last banner line."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + UP_READY_TIMEOUT_S
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Press Ctrl-C"):
            return "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
    pytest.fail(f"up exited ({proc.wait()}):\n{''.join(lines)}{link.log_tails()}")


def _until(what: str, check: Any, timeout: float, link: Link) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(1.0)
    pytest.fail(f"{what} not within {timeout:.0f}s{link.log_tails()}")


def test_an_agent_in_another_namespace_serves_through_the_gateway(
        link: Link, tmp_path: Path) -> None:
    stack_dir, agent_dir = tmp_path / "a", tmp_path / "b"
    # The remote agent polls A's Temporal, which stays on loopback, through the mTLS front.
    up_argv = [sys.executable, "-m", "modelkeeper", "up", "--bind-host", "0.0.0.0",
               "--no-demo", "--data-dir", str(stack_dir)]
    for name, port in PORTS.items():
        up_argv += [f"--{name}-port", str(port)]
    up = link.spawn(link.stack_ns, up_argv)
    link.logs += [stack_dir / "logs" / f"{name}.log" for name in ("api", "worker", "gateway",
                                                                  "temporal-front")]
    banner = _wait_for_banner(up, link)

    # `up` made the join token, and says where it is and how to join.
    token_file = stack_dir / "join-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert f"join token     {token_file}" in banner, banner
    assert link.stack_ip in banner, banner
    operator = (stack_dir / "operator-token").read_text().strip()
    api = f"http://{link.stack_ip}:{PORTS['api']}"

    # Machine B gets the API's URL, the token file and copies of the three Temporal files
    # the banner names, and nothing else.
    mtls = stack_dir / "temporal-mtls"
    copies = tmp_path / "b-temporal"
    copies.mkdir(mode=0o700)
    for name in ("ca.pem", "agent.pem", "agent.key"):
        assert str(mtls / name) in banner, banner
        shutil.copy(mtls / name, copies / name)
    assert f"Temporal mTLS  {link.stack_ip}:{PORTS['temporal-mtls']}" in banner, banner
    agent_log = tmp_path / "agent-b.log"
    link.spawn(link.agent_ns, [
        "env", f"MODELKEEPER_TEMPORAL_TLS_CA_FILE={copies / 'ca.pem'}",
        f"MODELKEEPER_TEMPORAL_TLS_CERT_FILE={copies / 'agent.pem'}",
        f"MODELKEEPER_TEMPORAL_TLS_KEY_FILE={copies / 'agent.key'}",
        sys.executable, "-m", "modelkeeper", "agent", "--data-dir", str(agent_dir),
        "--api-url", api, "--join-token-file", str(token_file), "--name", "b",
        "--memory", NODE_MEMORY], log=agent_log)

    def node_b() -> dict[str, Any] | None:
        status, text = link.request("GET", f"{api}/nodes", token=operator)
        assert status == 200, text
        return next((n for n in json.loads(text)
                     if n["name"] == "b" and n["state"] == "ready"), None)

    node = _until("node b registered and ready", node_b, 90, link)
    _until("agent b saying it polls", lambda: "registered; polling" in agent_log.read_text(),
           POLLING_TIMEOUT_S, link)
    # Its worker polls through the mTLS front: the API sent it the front's address.
    assert f"on Temporal at {link.stack_ip}:{PORTS['temporal-mtls']}" in \
        agent_log.read_text(), link.log_tails()

    status, text = link.request("POST", f"{api}/models", body=MODEL, token=operator)
    assert status == 201, text
    status, text = link.request("POST", f"{api}/deployments", token=operator, body={
        "model_id": MODEL["model_id"], "node_ids": [node["node_id"]]})
    assert status == 201, text
    deployment_id = json.loads(text)["deployment_id"]

    def serving() -> dict[str, Any] | None:
        status, text = link.request("GET", f"{api}/deployments/{deployment_id}",
                                    token=operator)
        assert status == 200, text
        view: dict[str, Any] = json.loads(text)
        return view if view["status"] == "serving" else None

    view = _until("the deployment serving on node b", serving, SERVING_TIMEOUT_S, link)
    [replica] = view["replicas"]
    assert replica["nodes"] == [node["node_id"]]
    # The engine listens on machine B's own address, which the API checked it against.
    assert replica["endpoint"].startswith(f"http://{link.agent_ip}:"), replica

    status, text = link.request(
        "POST", f"http://127.0.0.1:{PORTS['gateway']}/v1/chat/completions",
        body={"model": MODEL["model_id"], "max_tokens": 8,
              "messages": [{"role": "user", "content": "hello from machine A"}]})
    assert status == 200, text + link.log_tails()
    assert json.loads(text)["choices"][0]["message"]["content"]
    assert "\x1b[" not in agent_log.read_text()  # a log file, not a terminal

    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=90)
    assert up.returncode == 0, out
    assert "no process of modelkeeper up is left" in out, out
