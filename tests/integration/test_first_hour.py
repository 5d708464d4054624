"""docs/first-hour.md runs as written: every block of the page, in page order, against a
real stack, each followed by a check of what that step should show (``CHECKS``), so the
test fails when the page goes wrong.

The comment above each block (``<!-- first-hour: ID [how] -->``) says how it runs:

- ``ID``: typed in "terminal C": ``bash -e -o pipefail -c BLOCK``; it must exit 0, and then
  its check must pass.
- ``ID repeat``: the page says to run it again until it shows something; run a second
  apart until its check passes, within REPEAT_TIMEOUT_S.
- ``ID background until "TEXT"``: a terminal of its own (a process group); read until a
  line contains TEXT. Its check sees what it printed so far.
- ``ID ctrl-c OTHER``: Ctrl-C in background block OTHER's terminal: SIGINT to its process
  group. It must exit 0, and each line of the text block below the comment, if any, must be
  among the last lines it printed.
- ``ID not-run: REASON``: for the reader only.

Only two things differ from a reader's root shell:

- "This machine" is a network namespace of the test's own, so the stack's default ports,
  which the page names, are free whatever else runs here. Blocks enter it with
  ``nsenter --net``, which switches only the network. ``ip netns exec`` would also give the
  block a mount namespace of its own, and the page's ``ip netns add`` made there would be
  invisible to every later block.
- The data dir: root's default, ``/var/lib/modelkeeper``, which the page names, is a
  folder of tmp_path. Blocks get it as MODELKEEPER_DATA_DIR and in their text.

Needs root, iproute2's ``ip``, ``nsenter``, ``curl`` and ``jq``; skipped, naming what is
missing, elsewhere. Whatever happens, every process group with a process in either
namespace is killed, and both namespaces (and with them the veth pair) are deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

from tests.support.doc_blocks import Fence, fences, marked_blocks
from tests.support.netns import ip, kill_namespaces, netns_pids

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "first-hour.md"
MARKER = "first-hour"
#: The data dir the page names (root's default), and the second node's beside it.
DOC_DATA_DIR = "/var/lib/modelkeeper"
#: The page's second "machine": a global name, so the test refuses to run while one
#: exists that it did not make.
NODE_NS = "mk-node2"
NETNS_DIR = Path("/var/run/netns")

#: `up` on a fresh data dir: maybe `./dev`'s one-time install (a minute), then initdb,
#: Temporal, four Python components and the demo's llama.cpp load, on two shared cores.
UP_READY_TIMEOUT_S = 400.0
#: An agent's start and registration on loaded cores.
AGENT_READY_TIMEOUT_S = 120.0
#: One CLI call answers in about a second; a loaded machine gets thirty times that.
COMMAND_TIMEOUT_S = 60.0
#: Placement, a sim engine's start, a drain's surge and stop, a delete's engine stops.
REPEAT_TIMEOUT_S = 150.0
#: Between two tries of a repeat block: about as often as a person runs a command again.
REPEAT_INTERVAL_S = 1.0
#: `up` stops six components, each with a 15 s grace, and the engines after the agent.
STOP_TIMEOUT_S = 120.0
#: How long a killed background block may take to be reaped.
EXIT_TIMEOUT_S = 30.0

pytestmark = [pytest.mark.long, pytest.mark.timeout(900)]


# -- the page ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One marked block of the page and how to run it."""

    id: str
    kind: str  # run, repeat, background, ctrl-c, not-run
    body: str
    line: int
    ready: str = ""  # background: the text that says it is up
    target: str = ""  # ctrl-c: the background step whose terminal gets it

    @property
    def where(self) -> str:
        return f"{DOC.name}:{self.line} ({self.id})"


_WORDS = re.compile(r'^(?P<id>[\w-]+)(?:\s+(?:(?P<repeat>repeat)'
                    r'|background until "(?P<ready>[^"]+)"'
                    r'|ctrl-c (?P<target>[\w-]+)'
                    r'|not-run: (?P<reason>.+)))?$')


def doc_steps() -> list[Step]:
    """The page's marked blocks as steps, in page order."""
    steps = []
    for block in marked_blocks(DOC.read_text(), MARKER):
        match = _WORDS.match(block.words)
        assert match is not None, f"{DOC.name}:{block.line}: cannot read {block.words!r}"
        if match["repeat"]:
            kind = "repeat"
        elif match["ready"]:
            kind = "background"
        elif match["target"]:
            kind = "ctrl-c"
        elif match["reason"]:
            kind = "not-run"
        else:
            kind = "run"
        steps.append(Step(id=match["id"], kind=kind, body=block.body, line=block.line,
                          ready=match["ready"] or "", target=match["target"] or ""))
    return steps


def test_every_block_of_the_page_is_a_step_with_a_check() -> None:
    steps = doc_steps()
    ids = [s.id for s in steps]
    assert len(ids) == len(set(ids)), ids
    # Nothing a reader types escapes the test: each shell block is marked.
    unmarked = [f for f in fences(DOC.read_text()) if f.lang == "sh" and not _ours(f)]
    assert unmarked == [], [f"{DOC.name}:{f.line}" for f in unmarked]
    # And each step that runs has a check, and each check a step.
    checked = {s.id for s in steps if s.kind != "not-run"}
    assert checked == set(CHECKS), (checked ^ set(CHECKS))
    started: set[str] = set()
    for step in steps:
        assert step.kind in ("ctrl-c", "not-run") or step.body.strip(), step.where
        if step.kind == "background":
            started.add(step.id)
        if step.kind == "ctrl-c":
            assert step.target in started, f"{step.where}: no earlier {step.target!r} runs"
            started.remove(step.target)
    assert DOC_DATA_DIR in DOC.read_text()


def _ours(fence: Fence) -> bool:
    return fence.marker is not None and fence.marker.startswith(f"<!-- {MARKER}:")


# -- reading what the CLI prints -------------------------------------------------------------


_HEADER = re.compile(r"^[A-Z]+(?: [A-Z]+)*(?:  +[A-Z]+(?: [A-Z]+)*)+$")
_COLUMN = re.compile(r"\S+(?: \S+)*")


def tables(out: str) -> list[list[dict[str, str]]]:
    """Every table in ``out`` (``operator_cli.table``: upper-case headers, left-aligned
    columns two spaces apart), each as rows keyed by header."""
    found: list[list[dict[str, str]]] = []
    rows: list[dict[str, str]] | None = None
    columns: list[tuple[str, int]] = []
    for line in out.splitlines():
        if _HEADER.match(line):
            columns = [(m.group(), m.start()) for m in _COLUMN.finditer(line)]
            rows = []
            found.append(rows)
        elif rows is not None and _in_columns(line, columns):
            ends = [start for _, start in columns[1:]] + [len(line)]
            rows.append({name: line[start:end].strip()
                         for (name, start), end in zip(columns, ends, strict=True)})
        else:
            rows = None
    return found


def _in_columns(line: str, columns: list[tuple[str, int]]) -> bool:
    """Whether ``line`` is a row under ``columns``: blank in the two spaces before each
    column but the first. What follows a table (a legend, the next command's sentence)
    is not."""
    return bool(line.strip()) and all(not line[start - 2:start].strip()
                                      for _, start in columns[1:])


def row(out: str, column: str, value: str) -> dict[str, str]:
    """The row whose ``column`` is ``value``, in the last table of ``out`` that has that
    column (the newest look, when a block prints the same table twice)."""
    for table in reversed(tables(out)):
        if table and column in table[0]:
            for found in table:
                if found[column] == value:
                    return found
            raise AssertionError(f"no row with {column} {value!r} in:\n{out}")
    raise AssertionError(f"no table with a {column} column in:\n{out}")


def has_row(out: str, column: str, value: str) -> bool:
    return any(r.get(column) == value for t in tables(out) for r in t)


def test_tables_are_read_by_column() -> None:
    out = ("ID            MODEL   STATUS   READY  FAILURES  REASON\n"
           "d-1           sim-a   serving  1/1    0\n"
           "d-2           sim-b   serving  1/1    0         (last failure: x unreachable)\n"
           "NAME   STATE  MEMORY   LAST SEEN\n"
           "node2  ready  2.0 GiB  2026-12-01\n"
           "! promises more than it has\n"
           "NODE   FITS  WHY\n"
           "node2  no    unreachable\n"
           "deployment d-3 of sim-c: placing\n")
    assert row(out, "MODEL", "sim-b")["REASON"] == "(last failure: x unreachable)"
    assert row(out, "MODEL", "sim-a")["REASON"] == ""
    assert row(out, "NAME", "node2") == {"NAME": "node2", "STATE": "ready",
                                         "MEMORY": "2.0 GiB", "LAST SEEN": "2026-12-01"}
    assert not has_row(out, "NAME", "!")
    assert [len(t) for t in tables(out)] == [2, 1, 1]


# -- the checks: what each step must show ----------------------------------------------------


class Background:
    """A block left running in a terminal of its own: a process group, read line by line
    on a thread (so it never blocks on a full pipe)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.ended = False
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def output(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> bool:
        """Whether a line containing ``text`` came within ``timeout`` (False at once if the
        process ended without one)."""
        def seen() -> bool:
            return any(text in line for line in self.lines)

        with self.changed:
            self.changed.wait_for(lambda: seen() or self.ended, timeout)
            return seen()

    def interrupt(self) -> int:
        """Ctrl-C in its terminal: SIGINT to its process group; its exit code."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        self.reader.join(timeout=EXIT_TIMEOUT_S)
        return code


@dataclass
class Hour:
    """The run of the page: its namespace, data dir, and what runs in the background."""

    tmp: Path
    ns: str
    background: dict[str, Background] = field(default_factory=dict)
    #: Each step's id and output, for a failure message.
    transcript: list[tuple[str, str]] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.tmp / "modelkeeper"

    def env(self) -> dict[str, str]:
        # A developer's shell may point the CLI at another stack; a reader's fresh one
        # does not. MODELKEEPER_VENV only says where ./dev keeps its environment.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MODELKEEPER_", "TEMPORAL_")) or k == "MODELKEEPER_VENV"}
        env["MODELKEEPER_DATA_DIR"] = str(self.data)
        return env

    def text(self, body: str) -> str:
        """``body`` with the page's data dir replaced by the test's."""
        text = body.replace(DOC_DATA_DIR, str(self.data))
        assert "/var/lib" not in text, text  # never a real folder: `rm -rf` is on the page
        return text

    def argv(self, script: str) -> list[str]:
        return ["nsenter", f"--net={NETNS_DIR / self.ns}", "bash", "-e", "-o", "pipefail",
                "-c", script]

    def run(self, step: Step) -> str:
        try:
            done = subprocess.run(self.argv(self.text(step.body)), env=self.env(), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", timeout=COMMAND_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            self.fail(step, f"still running after {COMMAND_TIMEOUT_S:.0f}s:\n{exc.output!r}")
        if done.returncode != 0:
            self.fail(step, f"exited {done.returncode}:\n{done.stdout}")
        return done.stdout

    def start(self, step: Step) -> Background:
        proc = subprocess.Popen(self.argv(self.text(step.body)), env=self.env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
        self.background[step.id] = Background(proc)
        return self.background[step.id]

    def do(self, step: Step) -> None:
        """Run one step as its marker says, then its check."""
        out = ""
        match step.kind:
            case "not-run":
                return
            case "run":
                out = self.run(step)
            case "repeat":
                out = self._repeat(step)
            case "background":
                started = self.start(step)
                timeout = UP_READY_TIMEOUT_S if step.id == "up" else AGENT_READY_TIMEOUT_S
                if not started.wait_for(step.ready, timeout):
                    self.fail(step, f"no line with {step.ready!r} within {timeout:.0f}s:\n"
                                    f"{started.output()}")
                out = started.output()
            case "ctrl-c":
                target = self.background[step.target]
                try:
                    code = target.interrupt()
                except subprocess.TimeoutExpired:
                    self.fail(step, f"{step.target} still runs {STOP_TIMEOUT_S:.0f}s after "
                                    f"Ctrl-C:\n{target.output()}")
                out = target.output()
                if code != 0:
                    self.fail(step, f"{step.target} exited {code} after Ctrl-C:\n{out}")
                last = [line.rstrip() for line in out.splitlines()[-10:]]
                for expected in self.text(step.body).splitlines():
                    if expected.strip() and expected.rstrip() not in last:
                        self.fail(step, f"{expected!r} is not among its last lines:\n{out}")
        self.transcript.append((step.id, out))
        if step.kind != "repeat":
            try:
                CHECKS[step.id](self, out)
            except AssertionError as exc:
                self.fail(step, str(exc))

    def _repeat(self, step: Step) -> str:
        deadline = time.monotonic() + REPEAT_TIMEOUT_S
        while True:
            out = self.run(step)
            try:
                CHECKS[step.id](self, out)
                return out
            except AssertionError as exc:
                if time.monotonic() > deadline:
                    self.fail(step, f"not shown within {REPEAT_TIMEOUT_S:.0f}s: {exc}")
            time.sleep(REPEAT_INTERVAL_S)

    def fail(self, step: Step, why: str) -> NoReturn:
        pytest.fail(f"{step.where}: {why}\n{self.context()}", pytrace=False)

    def context(self) -> str:
        """What a reader would look at: the last steps' output, each terminal, the logs."""
        parts = [f"--- step {name}\n{out[-2000:]}" for name, out in self.transcript[-4:]]
        parts += [f"--- terminal {name}\n{bg.output()[-3000:]}"
                  for name, bg in self.background.items()]
        logs = [*sorted((self.data / "logs").glob("*.log")),
                *sorted(self.tmp.glob("modelkeeper-node2/agent/logs/*.log"))]
        parts += [f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs]
        return "\n".join(parts)

    def exited(self, name: str) -> int:
        """The exit code of background block ``name``, which must end soon."""
        try:
            return self.background[name].proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs {EXIT_TIMEOUT_S:.0f}s on") from None


def _up(hour: Hour, out: str) -> None:
    for line in (f"data and logs  {hour.data}", f"join token     {hour.data}/join-token",
                 "demo model     smollm2-135m: serving",
                 f"operator token {hour.data}/operator-token", "AUTH OFF"):
        assert line in out, f"the banner lacks {line!r}:\n{out}"


def _serving(out: str, model: str, ready: str) -> dict[str, str]:
    found = row(out, "MODEL", model)
    assert (found["STATUS"], found["READY"]) == ("serving", ready), found
    return found


def _first_look(hour: Hour, out: str) -> None:
    _serving(out, "smollm2-135m", "1/1")
    [local] = [r for t in tables(out) if t and "NAME" in t[0] for r in t]
    assert local["STATE"] == "ready", local


def _answered(hour: Hour, out: str) -> None:
    # jq prints "null" for an error body, which has no choices.
    assert out.strip() and out.strip() != "null", repr(out)


def _added_and_deployed(model: str) -> Callable[[Hour, str], None]:
    def check(hour: Hour, out: str) -> None:
        assert f"model {model} added (1.0 GiB)" in out, out
        assert re.search(rf"deployment d-\w+ of {model}: ", out), out
    return check


def _sim_a_serving(hour: Hour, out: str) -> None:
    _serving(out, "sim-a", "1/1")


def _link_up(hour: Hour, out: str) -> None:
    assert '"status":"ok"' in out, out


def _registered(hour: Hour, out: str) -> None:
    assert re.search(r"node n-\w+ \(node2\): adopted 0 shard\(s\)", out), out
    assert "on Temporal at 10.77.0.1:7233" in out, out


def _two_nodes(hour: Hour, out: str) -> None:
    node2 = row(out, "NAME", "node2")
    assert (node2["STATE"], node2["MEMORY"], node2["CLAIMED"]) == (
        "ready", "2.0 GiB", "0.0 GiB"), node2
    [local] = [r for t in tables(out) for r in t if r.get("NAME") != "node2"]
    assert local["STATE"] == "ready", local


def _deploy_sim_b(hour: Hour, out: str) -> None:
    _added_and_deployed("sim-b")(hour, out)
    assert "sim-b: fits on node2\n" in out, out


def _sim_b_on_node2(hour: Hour, out: str) -> None:
    _serving(out, "sim-b", "1/1")
    assert row(out, "NAME", "node2")["CLAIMED"] == "1.0 GiB", out


def _crashed(hour: Hour, out: str) -> None:
    assert hour.exited("node2") in (-signal.SIGKILL, 128 + signal.SIGKILL)


def _re_served(hour: Hour, out: str) -> None:
    sim_b = _serving(out, "sim-b", "1/1")
    assert "unreachable" in sim_b["REASON"], sim_b
    node2 = row(out, "NAME", "node2")
    assert node2["STATE"] in ("unreachable", "lost"), node2
    assert "sim-b: fits on node2" not in out, out
    why = row(out, "NODE", "node2")
    assert (why["FITS"], why["WHY"]) == ("no", node2["STATE"]), why


def _events(hour: Hour, out: str) -> None:
    kinds = [line.split()[1] for line in out.splitlines() if len(line.split()) > 1]
    assert "node.silent" in kinds, out
    silent = kinds.index("node.silent")
    assert "replica.placed" in kinds[silent:], out
    assert "deployment.serving" in kinds[silent:], out


def _rejoined(hour: Hour, out: str) -> None:
    _registered(hour, out)


def _scaled(hour: Hour, out: str) -> None:
    assert re.search(r"deployment d-\w+ of sim-a: 2 wanted", out), out


def _spread(hour: Hour, out: str) -> None:
    _serving(out, "sim-a", "2/2")
    node2 = row(out, "NAME", "node2")
    assert (node2["STATE"], node2["CLAIMED"]) == ("ready", "1.0 GiB"), node2


def _drain_started(hour: Hour, out: str) -> None:
    assert re.search(r"^drain/\S+ started: ", out, re.M), out


def _drained(hour: Hour, out: str) -> None:
    [drain] = [r for t in tables(out) if t and "SUMMARY" in t[0] for r in t
               if r["ID"].startswith("drain/")]
    assert drain["STATE"] == "succeeded", drain
    _serving(out, "sim-a", "2/2")
    node2 = row(out, "NAME", "node2")
    assert (node2["STATE"], node2["CLAIMED"]) == ("cordoned", "0.0 GiB"), node2


def _node2_stopped(hour: Hour, out: str) -> None:
    assert netns_pids(NODE_NS) == [], "something still runs in node2"


def _left(hour: Hour, out: str) -> None:
    assert re.search(r"^node n-\w+: stopped 0 engine\(s\); none left running$", out,
                     re.M), out
    assert re.search(r"^node node2 \(n-\w+\): removed$", out, re.M), out


def _deleting(hour: Hour, out: str) -> None:
    assert len(re.findall(r"^deployment d-\w+: deleting$", out, re.M)) == 2, out


def _removed(hour: Hour, out: str) -> None:
    assert not has_row(out, "MODEL", "sim-a") and not has_row(out, "MODEL", "sim-b"), out
    _serving(out, "smollm2-135m", "1/1")


def _up_stopped(hour: Hour, out: str) -> None:
    pass  # the lines under the page's Ctrl-C, checked by Hour.do


def _all_gone(hour: Hour, out: str) -> None:
    assert not hour.data.exists(), hour.data
    assert not (hour.tmp / "modelkeeper-node2").exists()
    assert not (NETNS_DIR / NODE_NS).exists(), "the namespace is still there"


#: What each step must show, by the id in its marker.
CHECKS: dict[str, Callable[[Hour, str], None]] = {
    "up": _up,
    "first-look": _first_look,
    "chat-demo": _answered,
    "deploy-sim-a": _added_and_deployed("sim-a"),
    "sim-a-serving": _sim_a_serving,
    "chat-sim-a": _answered,
    "make-node2": _link_up,
    "node2": _registered,
    "two-nodes": _two_nodes,
    "deploy-sim-b": _deploy_sim_b,
    "sim-b-on-node2": _sim_b_on_node2,
    "chat-sim-b": _answered,
    "crash-node2": _crashed,
    "after-crash": _re_served,
    "events": _events,
    "node2-again": _rejoined,
    "scale": _scaled,
    "spread": _spread,
    "drain": _drain_started,
    "drained": _drained,
    "stop-node2": _node2_stopped,
    "leave": _left,
    "rm-deployments": _deleting,
    "removed": _removed,
    "stop-up": _up_stopped,
    "remove": _all_gone,
}


# -- the machine -----------------------------------------------------------------------------


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "the page runs as root (step 3 makes a network namespace)"
    for tool in ("ip", "nsenter", "curl", "jq"):
        if shutil.which(tool) is None:
            return f"the page uses {tool}, which is not installed"
    return None


@pytest.fixture
def hour(tmp_path: Path) -> Iterator[Hour]:
    why = _skip_reason()
    if why is not None:
        pytest.skip(why)
    if (NETNS_DIR / NODE_NS).exists():
        pytest.fail(f"a network namespace {NODE_NS} exists already (another run of the "
                    f"page?); this test makes and deletes its own: ip netns del {NODE_NS}")
    made = Hour(tmp=tmp_path, ns=f"mkfh{os.getpid()}")
    added = ip("netns", "add", made.ns)
    if added.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {added.stderr.strip()}")
    try:
        # `up` talks to its own servers on loopback, which a new namespace has down.
        assert ip("-n", made.ns, "link", "set", "lo", "up").returncode == 0
        yield made
    finally:
        for bg in made.background.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(bg.proc.pid, signal.SIGKILL)
        kill_namespaces([made.ns, NODE_NS], timeout_s=EXIT_TIMEOUT_S)
        for bg in made.background.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                bg.proc.wait(timeout=EXIT_TIMEOUT_S)
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        ip("netns", "del", NODE_NS)
        ip("netns", "del", made.ns)


@pytest.mark.slow
def test_the_first_hour_runs_as_written(hour: Hour) -> None:
    started = time.monotonic()
    for step in doc_steps():
        hour.do(step)
    # Every terminal has ended, and nothing the page started is left in the namespace.
    assert all(bg.proc.poll() is not None for bg in hour.background.values())
    assert netns_pids(hour.ns) == [], hour.context()
    print(f"the first hour ran in {time.monotonic() - started:.0f}s")
