"""The engine contract's command lines (bench/engine_contract.py) cover what the adapters
can build: every allow-listed engine argument, multi-node ranks, GPU sets, and controls
the real parser must refuse. The parsing itself needs the engines installed: see
tests/integration/test_engine_contract.py."""

from __future__ import annotations

import pytest

from bench.engine_contract import ENGINES, PYTHON_SHOWN, cases, plan_of
from modelkeeper.domain.engine_args import ALLOWED_ENGINE_ARGS, ENGINE_ARG_RULES, FlagArg
from modelkeeper.domain.shards import EngineKind

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_allowed_argument_and_every_flag_value_is_planned(engine: EngineKind) -> None:
    made = cases(engine)
    named = {name for case in made for name in case.spec.engine_args}
    assert named == set(ALLOWED_ENGINE_ARGS[engine])
    for name, rule in ENGINE_ARG_RULES[engine].items():
        if isinstance(rule, FlagArg):
            values = {case.spec.engine_args[name] for case in made
                      if name in case.spec.engine_args}
            assert values == {True, False}, name


@pytest.mark.parametrize("engine", ENGINES)
def test_ranks_layouts_and_controls(engine: EngineKind) -> None:
    made = cases(engine)
    ranks = {(c.spec.world_size, c.spec.rank) for c in made}
    assert {(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)} <= ranks
    assert {len(c.spec.gpu_indices) for c in made} >= {1, 2, 4, 8}
    controls = [c for c in made if not c.should_parse]
    assert len(controls) == 2 and all(c.extra for c in controls)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_lines_are_the_adapters_own(engine: EngineKind) -> None:
    for case in cases(engine):
        plan = plan_of(engine, case)
        assert plan.argv[0] == PYTHON_SHOWN
        # Rank > 0 of vLLM serves no HTTP, and says so with --headless.
        if engine is EngineKind.VLLM:
            assert ("--headless" in plan.argv) is (case.spec.rank > 0)
