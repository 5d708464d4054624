"""Engine logs hold no key and are closed to other users (issue 19, finding 11).

SGLang logs its arguments, its API key among them, into the engine's log. The engine's
output now reaches its log through a log filter (:mod:`agent.log_filter`) that scrubs it,
the engine's own key by value included; logs are 0640 in a 0750 folder; and an engine
whose agent dies keeps running, its log still written.

The engine here is a Python one-liner started through the agent's own start path
(:mod:`tests.support.script_engine`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil
import pytest

from agent.shards import ShardManager
from modelkeeper.domain.engine_keys import derive_engine_key, derive_node_key
from modelkeeper.domain.shards import ExitKind, FetchProgress
from modelkeeper.infra.processes import ManagedProcess, free_port, signal_group
from tests.support.script_engine import SECRET, ScriptAdapter, manager, spec

pytestmark = pytest.mark.timeout(60)

NODE = "n-engine-logs"
#: An interpreter starting on a busy machine; the engine's first lines come in well under.
WAIT_S = 30.0

#: Prints the key in the forms an engine could: SGLang's argument repr, JSON, JSON with
#: escapes, JSON inside JSON, a Python repr of argv, every character escaped, the key
#: without its prefix on stderr, and the key cut across two writes. Then says it is done
#: (the file named by its first argument) and waits to be stopped.
LEAKY_ENGINE = r"""
import json, os, pathlib, sys, time
k = os.environ["MODELKEEPER_ENGINE_API_KEY"]
print("engine starting", flush=True)
print(f"server_args=ServerArgs(model_path='m', api_key={k!r}, port=30000)")
print(json.dumps({"api_key": k}))
print(json.dumps({"api_key": k}).replace("-", "\\u002d"))
print(json.dumps(json.dumps({"args": {"api_key": k}})))
print(repr({"argv": ["--api-key", k]}))
print("".join("\\u%04x" % ord(c) for c in k))
print("key=" + k[3:], file=sys.stderr, flush=True)
sys.stdout.write("Authorization: Bearer " + k[:20]); sys.stdout.flush()
sys.stdout.write(k[20:] + "\n"); sys.stdout.flush()
print("engine ready", flush=True)
pathlib.Path(sys.argv[1]).write_text("printed")
time.sleep(3600)
"""

#: A line with the key every 20 ms, for as long as it runs.
CHATTY_ENGINE = r"""
import os, time
k = os.environ["MODELKEEPER_ENGINE_API_KEY"]
n = 0
while True:
    print(f"tick {n} key={k}", flush=True)
    n += 1
    time.sleep(0.02)
"""


def _progress(_: FetchProgress) -> None:
    pass


def _engine_key(replica: str) -> str:
    return derive_engine_key(derive_node_key(SECRET, NODE).encode(), replica)


def _traces(key: str) -> list[str]:
    """What of ``key`` must not show: the key, and every 16 characters of its secret part
    (a key cut short or split still leaks what shows of it)."""
    body = key[3:]
    return [key, *(body[i:i + 16] for i in range(len(body) - 15))]


def _assert_no_trace(key: str, text: str, where: str) -> None:
    leaked = [trace for trace in _traces(key) if trace in text]
    # Names the leak by position, never by value: the report must not hold the key.
    assert not leaked, f"{len(leaked)} traces of the engine key in {where}"


def _kill_engines() -> None:
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("MODELKEEPER_NODE_ID") == NODE:
                os.killpg(proc.pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue


async def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """No help from the umask: the modes must be the code's own."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
async def cleanup() -> AsyncIterator[None]:
    try:
        yield
    finally:
        _kill_engines()


async def test_a_key_printed_in_any_form_leaves_no_trace_in_the_engine_log(
        tmp_path: Path, cleanup: None) -> None:
    printed = tmp_path / "printed"
    shards = manager(str(tmp_path / "agent"), NODE, free_port(),
                     ScriptAdapter(LEAKY_ENGINE, str(printed)))
    try:
        await shards.start(spec("r-leaky", NODE), _progress)
        await _until(printed.exists, "the engine to print its key")
        ended = await shards.stop(spec("r-leaky", NODE).replica_id, grace_s=5)
    finally:
        await shards.close()
    key = _engine_key("r-leaky")
    log = (tmp_path / "agent" / "logs" / "r-leaky.log").read_text()
    # The log was written, to its last line, and says where the key was.
    assert "engine starting" in log and "engine ready" in log
    assert log.count("mk-<redacted>") >= 8, log
    _assert_no_trace(key, log, "the engine's log")
    _assert_no_trace(key, "\n".join(ended.log_tail), "the log tail sent to Temporal")
    assert "engine ready" in ended.log_tail


async def test_engine_logs_are_closed_to_other_users(tmp_path: Path, open_umask: None,
                                                     cleanup: None) -> None:
    logs = tmp_path / "agent" / "logs"
    # A log an older agent left readable by all is tightened too.
    logs.mkdir(parents=True, mode=0o777)
    old = logs / "r-old.log"
    old.write_text("an old line\n")
    old.chmod(0o666)
    shards = manager(str(tmp_path / "agent"), NODE, free_port(),
                     ScriptAdapter("import time; print('hello', flush=True); time.sleep(3600)"))
    log = logs / "r-modes.log"
    try:
        await shards.start(spec("r-modes", NODE), _progress)
        await _until(lambda: "hello" in log.read_text(), "the engine's first line")
        await shards.stop(spec("r-modes", NODE).replica_id, grace_s=5)
    finally:
        await shards.close()
    assert stat.S_IMODE(logs.stat().st_mode) & ~0o750 == 0, oct(logs.stat().st_mode)
    for path in (log, old):
        assert stat.S_IMODE(path.stat().st_mode) & ~0o640 == 0, (path, oct(path.stat().st_mode))


def test_every_managed_process_log_is_closed_to_other_users(tmp_path: Path,
                                                           open_umask: None) -> None:
    # `up`'s components log through the same class.
    proc = ManagedProcess("true", ["true"], tmp_path / "component.log")
    proc.start()
    proc.stop(grace=5)
    mode = stat.S_IMODE((tmp_path / "component.log").stat().st_mode)
    assert mode & ~0o640 == 0, oct(mode)


async def test_an_engine_outlives_its_agent_and_its_log_is_still_written_and_scrubbed(
        tmp_path: Path, cleanup: None) -> None:
    agent_dir = tmp_path / "agent"
    low = free_port()
    agent = ManagedProcess(
        "agent", [sys.executable, "-m", "tests.support.script_engine", str(agent_dir), NODE,
                  str(low), CHATTY_ENGINE], tmp_path / "agent.log")
    agent.start()
    try:
        agent.wait_until(lambda: "started" in agent.log_tail(), timeout=WAIT_S)
        engine_pid = int(agent.log_tail().split("started ")[1].split()[0])
        signal_group(agent.pid, signal.SIGKILL)
        assert agent.popen is not None
        agent.popen.wait(WAIT_S)
    finally:
        agent.stop(grace=0)

    log = agent_dir / "logs" / "r-outlives.log"
    lines_at_death = log.read_text().count("\n")
    # The engine keeps writing, and its lines keep reaching the log, scrubbed.
    await _until(lambda: log.read_text().count("\n") >= lines_at_death + 20,
                 "the engine's log to grow after its agent died")
    engine = psutil.Process(engine_pid)
    assert engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE

    # The next agent adopts it; its end comes with its last lines.
    shards = ShardManager(node_id=spec("r-outlives", NODE).node_id, agent_dir=agent_dir,
                          engine_host="127.0.0.1", port_range=(low, low + 20),
                          node_key=derive_node_key(SECRET, NODE),
                          adapter_factory=lambda _spec: ScriptAdapter(CHATTY_ENGINE))
    try:
        adopted, killed = shards.recover()
        assert adopted == [spec("r-outlives", NODE).replica_id] and killed == []
        ended = await shards.stop(spec("r-outlives", NODE).replica_id, grace_s=5)
    finally:
        await shards.close()
    assert ended.kind is ExitKind.STOPPED
    assert any(line.startswith("tick ") for line in ended.log_tail)
    text = log.read_text()
    assert text.count("key=mk-<redacted>") >= lines_at_death + 20
    _assert_no_trace(_engine_key("r-outlives"), text, "the engine's log")
