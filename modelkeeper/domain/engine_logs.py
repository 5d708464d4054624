"""Fatal lines in an engine's log: what killed it, named with the line that says so.

An engine that exits non-zero leaves its reason in its last log lines (the agent sends
them up as :attr:`~modelkeeper.domain.shards.ShardExit.log_tail`), but "exited with code 1"
names none. :func:`classify_log` reads the tail for the lines below and returns the
first cause found, in the order listed, with the line itself as evidence; the agent puts
it in the exit's detail. A cause is claimed only on its line: nothing is inferred.

The rules, in order (the first that matches wins; each has its test in
tests/unit/test_engine_logs.py). Each line's text is taken from the engine that prints it,
read in the installed packages (vllm 0.33.0, sglang 0.5.23, torch 2.14):

1. ``cuda_oom``: torch's allocator ran out of GPU memory: "torch.OutOfMemoryError: CUDA out
   of memory" (torch/cuda/__init__.py: ``OutOfMemoryError = torch._C.OutOfMemoryError``;
   the message is c10's CUDACachingAllocator: "CUDA out of memory. Tried to allocate"),
   or the CUDA runtime's own "CUDA error: out of memory".
2. ``kv_cache_memory``: the model loaded, and no memory was left for the KV cache. vLLM:
   "No available memory for the cache blocks", or the max model length's cache "is larger
   than the available KV cache memory" (vllm/v1/core/kv_cache_planning.py). SGLang: "Not
   enough memory. Please try to increase --mem-fraction-static"
   (sglang/srt/model_executor/pool_configurator.py).
3. ``nccl``: the collective library failed (a lost peer, a broken link): torch's "NCCL
   error in:" (c10d), or vLLM's and SGLang's own "NCCL error:" (their
   device_communicators/pynccl_wrapper.py), or NCCL's "ncclSystemError" and kin.
4. ``no_gpu``: CUDA found no GPU: torch's "No CUDA GPUs are available", or vLLM's
   "Failed to infer device type" (vllm/config/device.py).
5. ``engine_failed``: the engine's own words that it failed, no cause named above: vLLM's
   "Engine core initialization failed" (vllm/v1/engine/utils.py) or "EngineCore
   encountered a fatal error" (vllm/v1/engine/core.py); SGLang's "Scheduler hit an
   exception" (sglang/srt/managers/scheduler.py) or "Received sigquit from a child
   process" (sglang/srt/entrypoints/engine.py). Last, because each is printed after the
   traceback that names the cause.

Pure: no I/O. Lines are matched as they are; secrets were scrubbed before the tail left
the engine's node.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

#: How much of the evidence line a reason quotes: enough to recognise it, short enough
#: for an event and a status line.
EVIDENCE_CHARS = 240


@dataclass(frozen=True, slots=True)
class FatalPattern:
    """One known fatal line."""

    #: A short name, for matching in code and tests.
    cause: str
    #: What it means, for a person: the first words of the exit's reason.
    summary: str
    pattern: re.Pattern[str]


@dataclass(frozen=True, slots=True)
class LogFinding:
    """A fatal line found in a log tail."""

    cause: str
    summary: str
    #: The line, stripped and clipped to :data:`EVIDENCE_CHARS`.
    evidence: str
    #: Its index in the tail it was found in.
    line: int

    def reason(self) -> str:
        """The finding as the words an exit's detail ends with."""
        return f"{self.summary} (log: {self.evidence!r})"


#: The rules of the module docstring, in order.
FATAL_PATTERNS: tuple[FatalPattern, ...] = (
    FatalPattern("cuda_oom", "the GPU ran out of memory (CUDA out of memory)",
                 re.compile(r"CUDA out of memory|CUDA error: out of memory|"
                            r"torch\.(?:cuda\.)?OutOfMemoryError")),
    FatalPattern("kv_cache_memory",
                 "no GPU memory was left for the KV cache after the model loaded",
                 re.compile(r"No available memory for the cache blocks|"
                            r"larger than the available KV cache memory|"
                            r"Not enough memory\. Please try to increase --mem-fraction-static")),
    FatalPattern("nccl", "NCCL (the GPUs' collective communication) failed",
                 re.compile(r"NCCL error|nccl(?:System|Internal|UnhandledCuda|Remote|"
                            r"InvalidUsage|InvalidArgument)Error")),
    FatalPattern("no_gpu", "the engine found no usable GPU",
                 re.compile(r"No CUDA GPUs are available|Failed to infer device type")),
    FatalPattern("engine_failed", "the engine reported a fatal error",
                 re.compile(r"Engine core initialization failed|"
                            r"EngineCore encountered a fatal error|"
                            r"Scheduler hit an exception|"
                            r"Received sigquit from a child process")),
)


def _clip(line: str) -> str:
    text = " ".join(line.split())
    return text if len(text) <= EVIDENCE_CHARS else text[:EVIDENCE_CHARS] + "..."


def classify_log(tail: Sequence[str],
                 patterns: Sequence[FatalPattern] = FATAL_PATTERNS) -> LogFinding | None:
    """The first rule of ``patterns`` (in their order) that a line of ``tail`` matches,
    with its last matching line as evidence; None when no line matches any."""
    for rule in patterns:
        for index in range(len(tail) - 1, -1, -1):
            if rule.pattern.search(tail[index]):
                return LogFinding(cause=rule.cause, summary=rule.summary,
                                  evidence=_clip(tail[index]), line=index)
    return None


def exit_detail(detail: str, tail: Sequence[str]) -> str:
    """``detail`` (how the process ended) with the cause its log names, if any."""
    finding = classify_log(tail)
    return detail if finding is None else f"{detail}: {finding.reason()}"


def last_line(tail: Sequence[str]) -> str | None:
    """The last line of ``tail`` that says something, clipped; None when there is none."""
    lines = [line for line in tail if line.strip()]
    return _clip(lines[-1]) if lines else None


def log_location(log_path: str, *, node: str, replica_id: str) -> str:
    """Where an engine's full log is: the file on its node, and the command that reads it
    from anywhere."""
    return f"full log: {log_path} on node {node}, or `modelkeeper logs {replica_id}`"


def failure_detail(detail: str, tail: Sequence[str], *, log_path: str, node: str,
                         replica_id: str) -> str:
    """An engine's failure as its reason says it (a failed start, or an engine that exited
    with an error): how it ended (``detail``, which names a known cause when its log has
    one), else the engine's last log line, and where the full log is."""
    parts = [detail]
    line = last_line(tail)
    if classify_log(tail) is None and line is not None:
        parts.append(f"last log line: {line!r}")
    parts.append(log_location(log_path, node=node, replica_id=replica_id))
    return "; ".join(parts)
