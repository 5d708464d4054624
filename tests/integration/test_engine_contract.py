"""Every vLLM and SGLang command line the adapters can build parses with the real
package's parser (bench/engine_contract.py), where the engine is installed in its cached
environment. Installing one takes several GB (torch and CUDA's libraries), so this never
installs: `python -m bench.engine_contract` does, once. And it runs only when asked
(MODELKEEPER_ENGINE_CONTRACT=1): importing torch twice costs two minutes of two cores,
which the suite's ten-minute budget has no room for on a machine that happens to hold the
environments."""

from __future__ import annotations

import os

import pytest

from bench.engine_contract import ENGINES, PINNED, check, is_installed, venv_dir
from modelkeeper.domain.shards import EngineKind

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]

#: The switch that runs this check.
OPT_IN = "MODELKEEPER_ENGINE_CONTRACT"


@pytest.mark.parametrize("engine", ENGINES)
def test_every_command_line_parses_with_the_engines_own_parser(engine: EngineKind) -> None:
    version = PINNED[engine]
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"set {OPT_IN}=1 to check the command lines against {engine.value}'s "
                    "own parser (bench/results/engine_contract.md has the last run)")
    if not is_installed(engine, version):
        pytest.skip(f"{engine.value} {version} is not installed in {venv_dir(engine, version)}:"
                    " run `python -m bench.engine_contract` once to install it (several GB)")
    result = check(engine, version)
    assert "parser_error" not in result, result.get("parser_error")
    assert result["versions"][engine.value] == version
    failed = [(row["case"], row["error"]) for row in result["rows"] if not row["passed"]]
    assert failed == []
    # The controls were refused: the check can fail.
    assert any(not row["should_parse"] and not row["parsed"] for row in result["rows"])
