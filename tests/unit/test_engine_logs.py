"""Fatal lines in an engine's log (modelkeeper/domain/engine_logs.py): each rule with the
line its engine prints, the order between them, and lines that must not match."""

from __future__ import annotations

import pytest

from modelkeeper.domain.engine_logs import (
    EVIDENCE_CHARS,
    FATAL_PATTERNS,
    classify_log,
    exit_detail,
)

pytestmark = pytest.mark.timeout(10)

#: A line each rule must recognise, as its engine prints it (the module docstring names
#: the source of each).
FATAL_LINES: list[tuple[str, str]] = [
    ("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                 "GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free."),
    ("cuda_oom", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"),
    ("cuda_oom", "RuntimeError: CUDA error: out of memory"),
    ("kv_cache_memory", "ValueError: No available memory for the cache blocks. Try increasing "
                        "`gpu_memory_utilization` when initializing the engine"),
    ("kv_cache_memory", "ValueError: To serve at least one request with the model's max seq "
                        "len (32768), (4.0 GiB KV cache is needed, which is larger than the "
                        "available KV cache memory (2.1 GiB)."),
    ("kv_cache_memory", "RuntimeError: Not enough memory. Please try to increase "
                        "--mem-fraction-static. Current value: mem_fraction_static=0.1"),
    ("nccl", "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/"
             "distributed/c10d/NCCLUtils.cpp:77, unhandled system error"),
    ("nccl", "RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO)"),
    ("nccl", "ncclSystemError: System call (e.g. socket, malloc) or external library call "
             "failed or device error."),
    ("no_gpu", "RuntimeError: No CUDA GPUs are available"),
    ("no_gpu", "RuntimeError: Failed to infer device type, please set the environment "
               "variable `VLLM_LOGGING_LEVEL=DEBUG`"),
    ("engine_failed", "RuntimeError: Engine core initialization failed. See root cause above. "
                      "Failed core proc(s): {}"),
    ("engine_failed", "ERROR 12-04 14:00:00 [core.py:1586] EngineCore encountered a fatal "
                      "error."),
    ("engine_failed", "[2026-12-04 14:00:00] Scheduler hit an exception: Traceback ..."),
    ("engine_failed", "[2026-12-04 14:00:00] Received sigquit from a child process. It "
                      "usually means the child failed."),
]

#: Lines that look near a fatal one and are not.
BENIGN_LINES = [
    "INFO 12-04 [parallel_state.py] NCCL version 2.27.3+cuda12.9",
    "INFO Memory profiling takes 3.2 seconds; the KV cache gets 40.1 GiB",
    "INFO [gpu_model_runner.py] Model loading took 14.2 GiB memory",
    "WARNING Not enough SMs to max out GEMM autotuning",
    "INFO Sleep mode freed 61.2 GiB memory, 2.1 GiB memory is still in use.",
    "[2026-12-04] max_total_num_tokens=412345, available_gpu_mem=7.45 GB",
]


@pytest.mark.parametrize(("cause", "line"), FATAL_LINES)
def test_each_rule_knows_its_line(cause: str, line: str) -> None:
    found = classify_log(["INFO loading", line, "INFO shutting down"])
    assert found is not None
    assert (found.cause, found.line, found.evidence) == (cause, 1, line[:EVIDENCE_CHARS]
                                                         + ("..." if len(line) >
                                                            EVIDENCE_CHARS else ""))


@pytest.mark.parametrize("line", BENIGN_LINES)
def test_benign_lines_name_no_cause(line: str) -> None:
    assert classify_log([line]) is None
    assert exit_detail("exited with code 1", [line]) == "exited with code 1"


def test_every_rule_has_a_line() -> None:
    assert {cause for cause, _ in FATAL_LINES} == {p.cause for p in FATAL_PATTERNS}


def test_the_cause_wins_over_the_engines_summary_whatever_comes_last() -> None:
    """vLLM prints the traceback that names the cause, then "Engine core initialization
    failed": the cause is what the reason names."""
    tail = ["Traceback (most recent call last):",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB",
            "RuntimeError: Engine core initialization failed. See root cause above."]
    found = classify_log(tail)
    assert found is not None and (found.cause, found.line) == ("cuda_oom", 1)


def test_the_last_matching_line_is_the_evidence() -> None:
    tail = ["RuntimeError: NCCL error: remote process exited", "INFO retrying",
            "RuntimeError: NCCL error: unhandled system error"]
    found = classify_log(tail)
    assert found is not None and found.line == 2


def test_an_exit_detail_names_the_cause_and_quotes_the_line() -> None:
    line = "ValueError: No available memory for the cache blocks. Try increasing it"
    assert exit_detail("exited with code 1", ["x", line]) == (
        "exited with code 1: no GPU memory was left for the KV cache after the model loaded "
        f"(log: {line!r})")


def test_a_long_line_is_clipped_and_an_empty_tail_names_nothing() -> None:
    found = classify_log(["torch.OutOfMemoryError: CUDA out of memory. " + "x" * 1000])
    assert found is not None and len(found.evidence) == EVIDENCE_CHARS + 3
    assert classify_log([]) is None
