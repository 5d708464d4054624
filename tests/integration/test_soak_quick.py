"""The soak's quick mode (bench/soak): chat and streamed completions through the gateway
while the three demand faults (scale to zero and back, sleep and wake under load,
eviction) are injected on the whole stack, back to back. No request
may go unanswered (the demand faults' own included) and no claim may leak; the committed
long run is bench/results/soak.md."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Set-up (about a minute on two busy cores), the load and its faults (three minutes at
#: most), the last fault's settling and the report; the test's own timeout is a little
#: longer still.
SOAK_TIMEOUT_S = 390
#: A soak asked to stop (SIGTERM) stops every process it started, namespaces included.
CLEANUP_TIMEOUT_S = 60

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.mark.timeout(SOAK_TIMEOUT_S + CLEANUP_TIMEOUT_S - 30)
def test_quick_soak_answers_every_request_and_leaks_no_claim(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    log = tmp_path / "soak.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "bench.soak.run", "--quick",
                                 "--out", str(out)], cwd=ROOT, stdout=sink,
                                stderr=subprocess.STDOUT)
        try:
            code = proc.wait(SOAK_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                # Not SIGKILL: the soak's servers are in process groups of their own, and
                # only the soak itself knows them (it stops them on SIGTERM).
                proc.send_signal(signal.SIGTERM)
                proc.wait(CLEANUP_TIMEOUT_S)
    tail = log.read_text(errors="replace")[-4000:]
    assert code == 0, f"the soak failed:\n{tail}"
    result = json.loads(out.with_suffix(".json").read_text())
    seed = result["meta"]["seed"]
    requests, claims = result["requests"], result["claims"]
    assert requests["sent"] > 0 and result["faults"], tail
    demand = {"scale to zero and back", "sleep and wake under load", "eviction"}
    injected = {f["kind"] for f in result["faults"] if not f.get("refused")}
    assert demand <= injected, (seed, result["faults"])
    assert requests["unanswered"] == 0, (seed, requests["unanswered_list"])
    assert claims["leaked_claims"] == 0, (seed, claims["mismatches"])
    assert result["claim_episodes"]["leaks"] == 0, (seed, result["claim_episodes"])
    assert result["end"]["settled"], (seed, result["end"])
    assert out.with_suffix(".png").stat().st_size > 0
