"""Every vLLM and SGLang command line our adapters can build, parsed by the real packages.

Run it as::

    python -m bench.engine_contract            # install (once, cached), check, write results
    python -m bench.engine_contract --engine vllm --no-install

Each engine is installed, pinned, into a virtual environment of its own under
``~/.cache/modelkeeper/engine-contract/<engine>-<version>`` (``$MODELKEEPER_ENGINE_CONTRACT_CACHE``
moves it), never into the project's test install: each pulls torch and CUDA's libraries,
several GB. The first run downloads them (minutes); later runs reuse the folder. pip is
run as ``./dev`` runs it: with this machine's own pip configuration, no index of ours.

The command lines come from the adapters themselves (:class:`agent.engines.vllm.VllmAdapter`,
:class:`agent.engines.sglang.SglangAdapter`) for shard specs that cover every
``engine_args`` name the catalog allows for the engine (each alone, and all together),
every value of each flag argument, multi-node ranks and leader addresses, GPU sets and
parallel layouts, and memory shares. Each is handed to
:mod:`bench.engine_contract_parse`, which runs in the engine's environment and parses it
with the engine's own parser, the way the engine's entry point does. The results go to
``bench/results/engine_contract.{md,json}``.

No GPU is needed: both parsers build without one. What needs a GPU (loading a model,
sleeping it) is not checked here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.engines.base import LaunchPlan
from agent.engines.sglang import SglangAdapter
from agent.engines.vllm import VllmAdapter
from bench.common import ROOT
from bench.report import run_meta, write_results
from modelkeeper.domain.engine_args import ENGINE_ARG_RULES, FlagArg, IntArg, NumberArg, WordArg
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec

#: The versions checked: the newest of each in the package index when this was written
#: (vLLM 0.33 is the release the adapter's multi-node flags target; see agent/engines/vllm.py).
PINNED: dict[EngineKind, str] = {EngineKind.VLLM: "0.33.0", EngineKind.SGLANG: "0.5.23"}
#: The distribution each engine is installed as.
PACKAGE: dict[EngineKind, str] = {EngineKind.VLLM: "vllm", EngineKind.SGLANG: "sglang"}
ENGINES = tuple(PINNED)

CACHE_ENV = "MODELKEEPER_ENGINE_CONTRACT_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "modelkeeper" / "engine-contract"
#: Written into a venv once its install has succeeded: a half-finished install (a killed
#: run) is not taken for a cached one.
INSTALLED_MARK = ".modelkeeper-installed"
#: One install may take this long: about 4 GB of wheels (torch and CUDA's libraries).
INSTALL_TIMEOUT_S = 3600.0
#: One parse run, all of an engine's command lines: importing vLLM or SGLang takes tens of
#: seconds on two cores; parsing a line takes milliseconds.
PARSE_TIMEOUT_S = 600.0

PARSE_SCRIPT = Path(__file__).with_name("engine_contract_parse.py")
OUT = ROOT / "bench" / "results" / "engine_contract"


def cache_root() -> Path:
    """Where the engines' environments live."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def venv_dir(engine: EngineKind, version: str) -> Path:
    """The environment ``engine`` at ``version`` is installed in."""
    return cache_root() / f"{engine.value}-{version}"


def venv_python(engine: EngineKind, version: str) -> Path:
    return venv_dir(engine, version) / "bin" / "python"


def is_installed(engine: EngineKind, version: str) -> bool:
    """Whether ``engine`` at ``version`` has a finished install in the cache."""
    return (venv_dir(engine, version) / INSTALLED_MARK).is_file()


def install(engine: EngineKind, version: str) -> Path:
    """Install ``engine`` at ``version`` into its cached environment (once); its python."""
    folder = venv_dir(engine, version)
    python = venv_python(engine, version)
    if is_installed(engine, version):
        return python
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    began = time.monotonic()
    print(f"engine_contract: installing {PACKAGE[engine]}=={version} into {folder} "
          "(once; several GB)...", file=sys.stderr, flush=True)
    # --no-compile as ./dev: byte-compiling torch would take minutes of two cores, and
    # Python compiles what the parse imports, once.
    subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
                    "--progress-bar", "off", "--no-compile",
                    f"{PACKAGE[engine]}=={version}"],
                   check=True, timeout=INSTALL_TIMEOUT_S)
    (folder / INSTALLED_MARK).write_text(f"{PACKAGE[engine]}=={version}\n")
    print(f"engine_contract: installed in {time.monotonic() - began:.0f} s", file=sys.stderr,
          flush=True)
    return python


# ------------------------------------------------------------------------ the lines

#: What the command lines are built for: a 7B model on 80 GB GPUs, half of each.
GIB = 1 << 30
KEY = "contract-check-key"
HOST = "10.1.2.3"
PORT = 8200
#: The interpreter on a plan's command line is the engine's; the report shows this.
PYTHON_SHOWN = "python"

#: Values for each word argument: the catalog takes any word, the engines a few. These are
#: ones a catalog entry would hold; the parser's own choices are in the report beside them.
WORD_SAMPLES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", "bfloat16", "float16", "half"),
    "quantization": ("fp8", "awq", "gptq"),
}
#: Integer values: each rule's bounds and a typical value between them.
TYPICAL_INT = 4096


@dataclass(frozen=True)
class Case:
    """One shard spec the adapters are asked to plan, and whether its line must parse."""

    name: str
    spec: ShardSpec
    #: False for a control: a line the parser must refuse, or the check proves nothing.
    should_parse: bool = True
    #: Appended to the plan's argv (controls only).
    extra: tuple[str, ...] = ()


def _spec(engine: EngineKind, **fields: Any) -> ShardSpec:
    base: dict[str, Any] = {
        "replica_id": ReplicaId("rep-contract"), "model_id": ModelId("qwen-7b"),
        "node_id": NodeId("gpu-a"), "engine": engine, "source": "Qwen/Qwen2.5-7B-Instruct",
        "memory_bytes": 40 * GIB, "gpu_memory_bytes": 80 * GIB, "gpu_indices": [0],
    }
    base.update(fields)
    return ShardSpec(**base)


def arg_samples(engine: EngineKind) -> dict[str, list[Any]]:
    """Values to try for each ``engine_args`` name the catalog allows for ``engine``
    (:data:`~modelkeeper.domain.engine_args.ENGINE_ARG_RULES`), the parallel layout aside
    (the layout cases cover it: its values must fit the GPUs)."""
    samples: dict[str, list[Any]] = {}
    for name, rule in ENGINE_ARG_RULES[engine].items():
        if name in ("tensor_parallel_size", "pipeline_parallel_size"):
            continue
        match rule:
            case IntArg(low=low, high=high):
                samples[name] = sorted({low, min(max(TYPICAL_INT, low), high), high})
            case NumberArg(low=low, high=high):
                samples[name] = sorted({low, high})
            case FlagArg():
                samples[name] = [True, False]
            case WordArg():
                samples[name] = list(WORD_SAMPLES.get(name, ("auto",)))
    return samples


def cases(engine: EngineKind) -> list[Case]:
    """Every kind of command line the adapter builds for ``engine`` (see the module
    docstring), and two controls the parser must refuse."""
    made = [Case("one GPU", _spec(engine)),
            Case("GPUs 2,5: tensor parallel 2", _spec(engine, gpu_indices=[2, 5])),
            Case("4 GPUs: tensor 4", _spec(engine, gpu_indices=[0, 1, 2, 3])),
            Case("4 GPUs: tensor 2 x pipeline 2", _spec(
                engine, gpu_indices=[0, 1, 2, 3],
                engine_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})),
            Case("4 GPUs: pipeline 4", _spec(
                engine, gpu_indices=[0, 1, 2, 3],
                engine_args={"tensor_parallel_size": 1, "pipeline_parallel_size": 4})),
            Case("memory share 0.01", _spec(engine, memory_bytes=1, gpu_memory_bytes=100)),
            Case("memory share capped at 0.95", _spec(engine, memory_bytes=200 * GIB))]
    samples = arg_samples(engine)
    for name, values in samples.items():
        made += [Case(f"{name}={value!r}", _spec(engine, engine_args={name: value}))
                 for value in values]
    everything = {name: values[0] if not isinstance(values[0], bool) else True
                  for name, values in samples.items()}
    made.append(Case("every argument at once", _spec(engine, engine_args=everything)))
    leaders = {2: "10.0.0.1:29501", 3: "gpu-a.internal:5000"}
    for world, leader in leaders.items():
        made += [Case(f"{world} nodes, rank {rank}, leader {leader}", _spec(
            engine, gpu_indices=[0, 1], world_size=world, rank=rank, leader_address=leader))
            for rank in range(world)]
    made += [Case(f"2 nodes, rank {rank}, IPv6 leader", _spec(
        engine, world_size=2, rank=rank, leader_address="[fd00::1]:5000"))
        for rank in range(2)]
    made.append(Case("2 nodes, rank 1, tensor 16 across nodes, every argument", _spec(
        engine, gpu_indices=list(range(8)), world_size=2, rank=1,
        leader_address="10.0.0.1:29501",
        engine_args={**everything, "tensor_parallel_size": 16, "pipeline_parallel_size": 1})))
    made += [Case("control: an unknown flag", _spec(engine), should_parse=False,
                  extra=("--no-such-flag-modelkeeper",)),
             Case("control: a second port without a value", _spec(engine), should_parse=False,
                  extra=("--port",))]
    return made


def adapter_for_contract(engine: EngineKind) -> VllmAdapter | SglangAdapter:
    return VllmAdapter(python=PYTHON_SHOWN) if engine is EngineKind.VLLM \
        else SglangAdapter(python=PYTHON_SHOWN)


def plan_of(engine: EngineKind, case: Case) -> LaunchPlan:
    """The adapter's own plan for ``case``."""
    return adapter_for_contract(engine).launch_plan(case.spec, host=HOST, port=PORT,
                                                    api_key=KEY)


def flags_used(engine: EngineKind) -> list[str]:
    """Every flag any case's plan holds, for the report's list of choices."""
    used: set[str] = set()
    for case in cases(engine):
        used.update(arg for arg in plan_of(engine, case).argv[1:] if arg.startswith("--"))
    return sorted(used)


# -------------------------------------------------------------------- the check


def check(engine: EngineKind, version: str) -> dict[str, Any]:
    """Parse every case's line with the engine installed at ``version``; the verdicts."""
    made = cases(engine)
    lines = []
    for index, case in enumerate(made):
        plan = plan_of(engine, case)
        if plan.argv[0] != PYTHON_SHOWN or KEY in " ".join(plan.argv):
            raise RuntimeError(f"{case.name}: unexpected plan {plan.argv[:2]}")
        lines.append({"id": str(index), "argv": [*plan.argv[1:], *case.extra]})
    request = {"engine": engine.value, "lines": lines, "describe": flags_used(engine)}
    began = time.monotonic()
    answer = subprocess.run([str(venv_python(engine, version)), str(PARSE_SCRIPT)],
                            input=json.dumps(request), capture_output=True, text=True,
                            timeout=PARSE_TIMEOUT_S, check=False)
    try:
        parsed: dict[str, Any] = json.loads(answer.stdout)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"the {engine.value} probe exited {answer.returncode} without "
                           f"a verdict: {answer.stderr[-2000:]}") from exc
    parsed["seconds"] = round(time.monotonic() - began, 1)
    verdicts = {result["id"]: result for result in parsed.get("results", [])}
    rows = []
    for index, case in enumerate(made):
        verdict = verdicts.get(str(index), {"ok": False, "error": "no verdict",
                                            "warnings": []})
        plan = plan_of(engine, case)
        rows.append({
            "case": case.name, "should_parse": case.should_parse,
            "parsed": verdict["ok"], "passed": verdict["ok"] is case.should_parse,
            "error": verdict["error"], "warnings": verdict["warnings"],
            "argv": [_shown(arg) for arg in (*plan.argv, *case.extra)],
            # Names only: the values hold the key.
            "env": sorted(plan.env),
        })
    parsed["rows"] = rows
    parsed.pop("results", None)
    return parsed


def _shown(arg: str) -> str:
    """An argument as the report shows it: our entry script relative to the repository."""
    return arg.replace(str(ROOT) + os.sep, "") if arg.startswith(str(ROOT)) else arg


def engine_summary(result: dict[str, Any]) -> tuple[int, int]:
    """(cases passed, cases)."""
    rows = result.get("rows", [])
    return sum(1 for row in rows if row["passed"]), len(rows)


def markdown(document: dict[str, Any]) -> str:
    """The report: versions, what was run, each line and its verdict."""
    meta = document["meta"]
    out = ["# Engine contract: our command lines against vLLM's and SGLang's parsers", "",
           f"`{meta['command']}` on {meta['date']}, {meta['cores']} cores, Python "
           f"{meta['python']}, code {meta['code']}. No GPU: nothing here loaded a model.",
           ""]
    for name, result in document["engines"].items():
        versions = result.get("versions", {})
        passed, total = engine_summary(result)
        out += [f"## {name} {versions.get(name, '?')} (torch {versions.get('torch', '?')})", ""]
        if "parser_error" in result:
            out += ["The parser could not be built:", "", "```", result["parser_error"],
                    "```", ""]
            continue
        out += [f"**{passed} of {total} cases passed** (each line parsed, and each control "
                f"refused) in {result['seconds']} s.", ""]
        for fact, value in result.get("facts", {}).items():
            out.append(f"- {fact}: {json.dumps(value)}")
        choices = result.get("choices", {})
        free = [flag for flag, offered in choices.items() if offered is None]
        out += ["", f"Flags our lines use: {len(choices)}. Each takes any value of its type "
                f"except these, whose values the parser limits:", ""]
        for flag, offered in choices.items():
            if offered is not None:
                out.append(f"- `{flag}`: {json.dumps(offered)}")
        out += ["", f"Free: {', '.join(f'`{flag}`' for flag in free)}."]
        out += ["", "| case | expected | verdict | parser's words |", "|---|---|---|---|"]
        for row in result["rows"]:
            verdict = "pass" if row["passed"] else "**FAIL**"
            said = row["error"] or "; ".join(row["warnings"])
            out.append(f"| {row['case']} | {'parses' if row['should_parse'] else 'refused'} "
                       f"| {verdict} | {said.replace('|', '/')} |")
        out += ["", "<details><summary>The command lines</summary>", ""]
        for row in result["rows"]:
            out += [f"- {row['case']} (env: {', '.join(row['env'])}):",
                    f"  `{' '.join(row['argv'])}`"]
        out += ["", "</details>", ""]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_contract",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=[e.value for e in ENGINES], action="append",
                        help="check only this engine (repeatable); default: both")
    parser.add_argument("--no-install", action="store_true",
                        help="use the cached environments only; fail where one is missing")
    parser.add_argument("--out", type=Path, default=OUT,
                        help="where the results go (OUT.md and OUT.json)")
    parser.add_argument("--from-json", action="store_true",
                        help="write OUT.md again from OUT.json, checking nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        document = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(markdown(document))
        return 0
    chosen = [EngineKind(name) for name in args.engine] if args.engine else list(ENGINES)
    engines: dict[str, Any] = {}
    for engine in chosen:
        version = PINNED[engine]
        if args.no_install and not is_installed(engine, version):
            parser.error(f"{engine.value} {version} is not installed in "
                         f"{venv_dir(engine, version)}; run without --no-install")
        install(engine, version)
        engines[engine.value] = check(engine, version)
        passed, total = engine_summary(engines[engine.value])
        print(f"engine_contract: {engine.value} {version}: {passed}/{total} cases passed",
              file=sys.stderr)
    document = {"meta": run_meta("bench.engine_contract", argv), "engines": engines}
    write_results(args.out, document, markdown(document))
    failed = any(engine_summary(result)[0] != engine_summary(result)[1]
                 or "parser_error" in result for result in engines.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
