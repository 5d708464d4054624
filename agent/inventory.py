"""What a node has: memory, CPUs and GPUs, read from the machine and capped by declarations.

A node may declare less than it has (``--memory 16GiB``): that is how operators keep room
for other work, and how tests run several differently sized nodes on one machine.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

from modelkeeper import __version__
from modelkeeper.domain.nodes import GpuInfo, Inventory
from modelkeeper.domain.shards import EngineKind

MEMINFO = Path("/proc/meminfo")


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo's text; None where absent."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            # /proc/meminfo says "kB" but means KiB.
            factor = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
            values[key.strip()] = int(parts[0]) * factor
    return values.get("MemTotal"), values.get("MemAvailable")


def parse_nvidia_smi(csv_text: str) -> list[GpuInfo]:
    """GPUs from nvidia-smi's ``--query-gpu`` CSV (noheader, nounits)."""
    gpus = []
    for line in csv_text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        index, name, memory_mib = fields[0], fields[1], fields[2]
        ecc_errors = fields[3] if len(fields) > 3 else ""
        gpus.append(GpuInfo(index=int(index), name=name,
                            memory_bytes=int(float(memory_mib)) * 1024 * 1024,
                            # Uncorrected ECC errors mean the GPU returns wrong results;
                            # "[N/A]" (ECC off or unsupported) is no evidence of a fault.
                            healthy=not (ecc_errors.isdigit() and int(ecc_errors) > 0)))
    return gpus


def read_gpus() -> list[GpuInfo]:
    """GPUs via nvidia-smi when it is installed; none otherwise."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,ecc.errors.uncorrected.volatile.total",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi(out)


def _read_memory(declared_memory: int | None, meminfo: Path) -> tuple[int | None, int | None]:
    """(total, available) bytes, capped by the declaration; None where unreadable."""
    try:
        total, available = parse_meminfo(meminfo.read_text())
    except OSError:
        total, available = None, None
    if declared_memory is not None:
        # Available memory is the machine's, but a node declaring less may not use more
        # than it declared.
        total = declared_memory
        available = declared_memory if available is None else min(available, declared_memory)
    return total, available


def read_available_memory(*, declared_memory: int | None = None,
                          meminfo: Path = MEMINFO) -> int | None:
    """The memory available now, capped by the declaration; None where unreadable.

    Cheap (no GPU query), for the start-up gate's fit check before each launch.
    """
    return _read_memory(declared_memory, meminfo)[1]


def read_inventory(*, declared_memory: int | None = None, declared_cpus: int | None = None,
                   meminfo: Path = MEMINFO, gpus: list[GpuInfo] | None = None) -> Inventory:
    """The machine's capacity, with declarations capping what it reports."""
    total, available = _read_memory(declared_memory, meminfo)
    cpus = declared_cpus if declared_cpus is not None else os.cpu_count()
    return Inventory(memory_total_bytes=total, memory_available_bytes=available,
                     cpu_count=cpus, gpus=read_gpus() if gpus is None else gpus)


# -- engines ---------------------------------------------------------------------------------

#: ``llama-server --version`` answers at once; a binary that does not is not one to run.
LLAMA_SERVER_VERSION_TIMEOUT_S = 10.0
#: Its line: "version: 4567 (abcdef0)"; reported as llama.cpp's own tag, "b4567".
_LLAMA_SERVER_VERSION = re.compile(r"version:\s*(\d+)")
#: The engines that run as a package of the agent's own interpreter (each adapter starts
#: ``sys.executable -m ...``), and that package's name.
_PACKAGED_ENGINES = {EngineKind.LLAMACPP: "xllamacpp", EngineKind.VLLM: "vllm",
                     EngineKind.SGLANG: "sglang"}


def read_engine_versions(llama_server_path: Path | None = None) -> dict[EngineKind, str]:
    """The engines this agent can start, with their versions: the sim always (it is part
    of the agent), each engine package installed in the agent's own environment (the
    adapters run them with its interpreter), and llama.cpp's native ``llama-server`` when
    the node is configured with one (its build number, "b4567"), in place of the wheel's.
    Read from package metadata, without importing the engines (vLLM's import alone takes
    seconds and a GPU check)."""
    found: dict[EngineKind, str] = {EngineKind.SIM: __version__}
    for kind, package in _PACKAGED_ENGINES.items():
        try:
            found[kind] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    if llama_server_path is not None:
        found.pop(EngineKind.LLAMACPP, None)
        build = llama_server_build(llama_server_path)
        if build is not None:
            found[EngineKind.LLAMACPP] = build
    return found


def llama_server_build(path: Path) -> str | None:
    """``b<build>`` from ``path --version``; None when it does not run or say one."""
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                              timeout=LLAMA_SERVER_VERSION_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _LLAMA_SERVER_VERSION.search(done.stdout + done.stderr)
    return None if match is None else f"b{match.group(1)}"
