"""A network namespace per agent, so that one node can be cut from the control plane.

Each agent runs in a namespace of its own (``ip netns exec``), with two roads out:

* **to its engines' clients:** a veth pair, the host end ``10.X.Y.(4k+1)``, the namespace
  end ``.(4k+2)``. The agent's engines bind the namespace end
  (``MODELKEEPER_ENGINE_HOST``) and advertise it, so the gateway reaches them straight
  through the kernel: a refused connection is a real one.
* **to the control plane:** :mod:`bench.soak.forward`, listening on ``127.0.0.1`` inside
  the namespace on the API's and Temporal's ports. It reaches the API over the veth pair
  (the API sees the node's address, as from a machine of its own) and Temporal on the
  host's loopback. A partition is a SIGSTOP of it.

The subnet is derived from our pid, so two soaks on one machine (a developer's and the
slow test tier) do not share addresses, and every name carries the pid, so a run killed
without clean-up leaves names that :func:`sweep_stale` recognises and removes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from modelkeeper.infra.processes import ManagedProcess

from .forward import NETNS_DIR

#: Prefix of every namespace and interface we create (interface names: 15 bytes at most).
PREFIX = "mks"
#: ``mks<pid>n<k>``: the namespace of agent k of soak <pid>.
NAME_PATTERN = re.compile(rf"^{PREFIX}(\d+)n(\d+)$")
#: Agents one soak can give a /30 each within one /24.
MAX_NODES = 63
#: How long the forwarder may take to bind its ports (a Python start on loaded cores).
FORWARDER_READY_S = 30.0
#: How often its ready file is looked for.
FORWARDER_POLL_S = 0.05


class NetnsError(RuntimeError):
    """A namespace could not be set up: says which command and what it printed."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _subnet_base() -> tuple[int, int]:
    """Second and third octets for this soak's /24 inside 10.0.0.0/8, from our pid."""
    pid = os.getpid()
    return 100 + (pid >> 8) % 100, pid % 256


@dataclass
class NodeNetwork:
    """One agent's namespace: its name, the veth addresses and its control-plane road."""

    name: str
    host_if: str
    host_ip: str
    node_ip: str
    forwarder: ManagedProcess | None = None

    @classmethod
    def create(cls, index: int) -> NodeNetwork:
        """Make namespace ``index`` of this soak, with its veth pair up and loopback on."""
        if index >= MAX_NODES:
            raise NetnsError(f"at most {MAX_NODES} namespaced agents per soak, not {index + 1}")
        b, c = _subnet_base()
        pid = os.getpid()
        net = cls(name=f"{PREFIX}{pid}n{index}", host_if=f"{PREFIX}{pid}h{index}",
                  host_ip=f"10.{b}.{c}.{4 * index + 1}", node_ip=f"10.{b}.{c}.{4 * index + 2}")
        inner = f"{PREFIX}{pid}i{index}"
        try:
            _ip("netns", "add", net.name)
            _ip("link", "add", net.host_if, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", net.name)
            _ip("addr", "add", f"{net.host_ip}/30", "dev", net.host_if)
            _ip("link", "set", net.host_if, "up")
            _ip("-n", net.name, "addr", "add", f"{net.node_ip}/30", "dev", inner)
            _ip("-n", net.name, "link", "set", inner, "up")
            _ip("-n", net.name, "link", "set", "lo", "up")
        except NetnsError:
            net.destroy()
            raise
        return net

    def exec_prefix(self) -> list[str]:
        """What a command is put behind to run inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def start_forwarder(self, relays: list[str], log_dir: Path) -> ManagedProcess:
        """Start the control-plane road (``--relay`` values of :mod:`bench.soak.forward`)
        and wait until it listens inside."""
        ready = log_dir / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        proc = ManagedProcess(
            f"forwarder {self.name}",
            [sys.executable, "-m", "bench.soak.forward", "--netns", self.name,
             *(f"--relay={r}" for r in relays), "--ready", str(ready)],
            log_dir / f"forwarder-{self.name}.log",
            cwd=Path(__file__).resolve().parents[2])
        proc.start()
        self.forwarder = proc
        deadline = time.monotonic() + FORWARDER_READY_S
        while not ready.exists():
            if proc.poll() is not None:
                raise NetnsError(f"the forwarder of {self.name} exited; log {proc.log_path}:\n"
                                 f"{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise NetnsError(f"the forwarder of {self.name} did not listen within "
                                 f"{FORWARDER_READY_S:.0f}s; log {proc.log_path}")
            time.sleep(FORWARDER_POLL_S)
        return proc

    def destroy(self) -> None:
        """Stop the forwarder and delete the namespace (its veth pair goes with it)."""
        if self.forwarder is not None:
            self.forwarder.stop(grace=0)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of soaks whose process is gone; returns their names."""
    removed = []
    for path in NETNS_DIR.glob(f"{PREFIX}*") if NETNS_DIR.exists() else []:
        match = NAME_PATTERN.match(path.name)
        if match is None or Path(f"/proc/{match[1]}").exists():
            continue
        subprocess.run(["ip", "netns", "del", path.name], capture_output=True, check=False)
        removed.append(path.name)
    return removed


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a test one is made and removed); None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root, and this run is not root"
    try:
        NodeNetwork.create(MAX_NODES - 1).destroy()
    except (NetnsError, OSError) as exc:
        return f"could not make a network namespace with a veth pair: {exc}"
    return None
