"""Hardware profiles: which of a catalog model's ways to run it a replica gets. Pure.

A model may declare profiles (:class:`~.catalog.HardwareProfile`: an engine with its
memory, GPUs, cores and engine arguments), for example vLLM on one GPU, else llama.cpp on
CPU. Placement tries them in turn with :func:`~.placement.place` and takes the first that
fits. The rules, each with its test in ``tests/unit/test_profiles.py``:

1. Order (:func:`order_profiles`): a higher ``priority`` first; among equal priorities,
   the profile with the most measured throughput first (``measured``: tokens per second
   per GPU, or per core for a profile without GPUs), a measured one before an unmeasured
   one, and otherwise the declared order. Nothing is measured yet, so callers pass an
   empty ``measured`` and the declared order decides ties.
2. A model that declares no profiles has one candidate, its own fields (``profile`` None),
   and its placement is exactly :func:`~.placement.place`'s, can't-place reason included.
3. A profile's request is the replica's request with the profile's memory (the model's
   when the profile gives none), cores, GPUs, engine and engine version (its own, never
   the model's: placement rule 11); where it may go (nodes, labels, avoided
   and sibling nodes, ``min_nodes``) does not change with the profile.
4. A profile runs its own engine arguments with the generation's laid over them; a profile
   whose engine refuses those is not tried, and says why.
5. The first candidate that fits wins. The placement's note names each profile passed over
   and why, so a replica on its second choice says what kept it off its first.
6. When none fits, the :class:`~.placement.CantPlace` names every profile with its reason
   ("profile gpu: node a: 0 of 0 GPUs free, needs 1; profile cpu: node a: 3.1 GiB free,
   needs 4.0 GiB"); its per-node rejections are those of the first profile tried, the one
   the model wants most.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .catalog import CatalogModel, HardwareProfile
from .engine_args import EngineConfigError, check_engine_arg_names
from .placement import (
    SUMMARY_LIMIT_BYTES,
    CantPlace,
    NodeView,
    Placement,
    PlacementRequest,
    place,
)

#: What ends a profile's reason cut short to fit the summary's bound.
_CUT_MARK = " ... (`modelkeeper explain` lists every node)"


def order_profiles(profiles: Sequence[HardwareProfile],
                   measured: Mapping[str, float]) -> list[HardwareProfile]:
    """The profiles in the order placement tries them (rule 1). ``measured``: by profile
    name, the tokens per second it sustains per GPU (per core without GPUs); empty until
    capacity is measured, when this is the declared order within each priority."""
    def key(indexed: tuple[int, HardwareProfile]) -> tuple[int, int, float, int]:
        declared, profile = indexed
        score = measured.get(profile.name)
        return (-profile.priority, score is None, -(score or 0.0), declared)

    return [p for _, p in sorted(enumerate(profiles), key=key)]


@dataclass(frozen=True, slots=True)
class ProfileCandidate:
    """One way to place a replica: the profile (None: the model's own fields), the model
    as that profile runs it, and what placement is asked; or why it is not tried."""

    profile: HardwareProfile | None
    model: CatalogModel
    request: PlacementRequest
    #: Why this profile is not tried at all (its engine refuses the engine arguments).
    refused: str | None = None

    @property
    def name(self) -> str | None:
        return None if self.profile is None else self.profile.name


@dataclass(frozen=True, slots=True)
class ProfilePlacement:
    """Where a replica goes, and under which candidate."""

    candidate: ProfileCandidate
    placement: Placement
    #: Each profile tried before it, with why it did not fit ("profile gpu: ...").
    passed_over: tuple[str, ...] = ()

    @property
    def note(self) -> str | None:
        """The placement's note (it shares a node), then the profiles passed over."""
        parts = [] if self.placement.note is None else [self.placement.note]
        if self.passed_over:
            parts.append(f"runs profile {self.candidate.name}, passed over "
                         + _bounded(list(self.passed_over)))
        return _bounded(parts) if parts else None


def profile_model(model: CatalogModel, profile: HardwareProfile | None, *,
                  overrides: Mapping[str, Any] | None = None) -> CatalogModel:
    """``model`` as ``profile`` runs it: the profile's engine, memory (the model's when it
    gives none), cores, GPUs and engine arguments, ``overrides`` (a generation's engine
    arguments) laid over those. ``profile`` None: ``model`` itself (its ``engine_args``
    already carry the overrides: the activity lays them over)."""
    if profile is None:
        return model
    return model.model_copy(update={
        "engine": profile.engine,
        "memory_bytes": profile.memory_bytes or model.memory_bytes,
        "memory_estimated": model.memory_estimated and profile.memory_bytes is None,
        "cpu_cores": profile.cpu_cores, "gpus": profile.gpus,
        "engine_version": profile.engine_version,
        "engine_args": {**profile.engine_args, **(overrides or {})}})


def profile_candidates(model: CatalogModel, request: PlacementRequest, *,
                       overrides: Mapping[str, Any] | None = None,
                       measured: Mapping[str, float] | None = None,
                       ) -> list[ProfileCandidate]:
    """The candidates for a replica of ``model``, in the order they are tried (rules 1-4).
    ``request`` is what the model's own fields ask (its memory, cores and GPUs, with the
    deployment's nodes and labels); ``overrides``: the generation's engine arguments."""
    if not model.profiles:
        return [ProfileCandidate(profile=None, model=model, request=request)]
    found = []
    for profile in order_profiles(model.profiles, measured or {}):
        runs = profile_model(model, profile, overrides=overrides)
        refused = None
        try:
            check_engine_arg_names(runs.engine, runs.engine_args,
                                   claim_bytes=runs.memory_bytes)
        except EngineConfigError as exc:
            refused = f"{runs.engine.value} refuses its engine arguments ({exc})"
        found.append(ProfileCandidate(
            profile=profile, model=runs, refused=refused,
            request=request.model_copy(update={
                "memory_bytes": runs.memory_bytes, "cpu_cores": runs.cpu_cores,
                "gpus": runs.gpus, "engine": runs.engine,
                "engine_version": runs.engine_version})))
    return found


def place_profiles(candidates: Sequence[ProfileCandidate], nodes: Sequence[NodeView],
                   ) -> ProfilePlacement | CantPlace:
    """The first candidate that fits on ``nodes``, placed; or why none does (rules 5, 6).
    One candidate without a profile: exactly :func:`place`'s answer."""
    if not candidates:
        raise ValueError("no candidates: a model has at least its own fields")
    passed_over: list[str] = []
    first: CantPlace | None = None
    for candidate in candidates:
        if candidate.refused is not None:
            passed_over.append(f"profile {candidate.name}: {candidate.refused}")
            continue
        result = place(candidate.request, nodes)
        if isinstance(result, Placement):
            return ProfilePlacement(candidate=candidate, placement=result,
                                    passed_over=tuple(passed_over))
        if candidate.profile is None:
            return result
        first = first or result
        passed_over.append(f"profile {candidate.name}: {result.summary}")
    summary = _bounded(passed_over)
    if first is None:
        return CantPlace(rejections=[], needed_nodes=candidates[0].request.min_nodes,
                         summary=summary)
    return first.model_copy(update={"summary": summary})


def _bounded(parts: list[str]) -> str:
    """``parts`` joined with "; ", each cut to an equal share of the summary's bound when
    together they pass it, so the last profile's reason is never the one dropped."""
    text = "; ".join(parts)
    if len(text.encode()) <= SUMMARY_LIMIT_BYTES:
        return text
    share = SUMMARY_LIMIT_BYTES // len(parts) - len("; ") - len(_CUT_MARK.encode())
    cut = []
    for part in parts:
        raw = part.encode()
        cut.append(part if len(raw) <= share
                   else raw[:share].decode(errors="ignore") + _CUT_MARK)
    return "; ".join(cut)
