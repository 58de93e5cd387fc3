"""What EarlStrategy reads from its arguments: layouts per stage or candidate lists, and the
selector protocol it asks for a stage's layout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, Union, runtime_checkable

from earl_lightning.parallel.layout import STAGES, Layout, check_stage

LayoutArg = Union[Layout, dict, str]  # noqa: UP007 - an alias jsonargparse reads at run time


@runtime_checkable
class LayoutSelector(Protocol):
    def select(self, stage: str, stats: Mapping[str, Any] | None, current: Layout) -> Layout: ...


def to_layout(value: LayoutArg, arg: str) -> Layout | None:
    """A Layout from a Layout, a dict of its fields, or ``"auto"`` (returned as None)."""
    return Layout.coerce(dict(value) if isinstance(value, Mapping) else value, arg, allow_auto=True)


def parse_layouts(layouts: Any) -> tuple[dict[str, Layout], list[Layout] | None, bool]:
    """(fixed per-stage layouts, candidate list or None, candidates are 'auto')."""
    if layouts is None:
        return {}, None, False
    if layouts == "auto":
        return {}, None, True
    if isinstance(layouts, Mapping):
        fixed = {}
        for stage, value in layouts.items():
            check_stage(stage, arg="layouts")
            fixed[stage] = to_layout(value, f"layouts.{stage}")
            if fixed[stage] is None:
                raise ValueError(
                    f"`layouts.{stage}` must be a Layout or a dict; 'auto' is only valid for all of "
                    "`layouts` (every factorization of the world size)"
                )
        return fixed, None, False
    if isinstance(layouts, Sequence) and not isinstance(layouts, str) and layouts:
        cands = [to_layout(v, f"layouts[{i}]") for i, v in enumerate(layouts)]
        if any(c is None for c in cands):
            raise ValueError(
                "`layouts` entries must be Layouts or dicts; use `layouts: auto` for all factorizations"
            )
        return {}, cands, False
    raise ValueError(
        f"`layouts` must be a dict stage -> layout (stages {list(STAGES)}), a non-empty list of "
        f"candidate layouts, 'auto' or None; got {layouts!r}"
    )


def same_placement(a: Layout, b: Layout) -> bool:
    return (a.dp, a.tp) == (b.dp, b.tp)


def check_stage_models(
    stage_models: dict[str, list[str]] | None, model_attrs: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """Which models each stage syncs on entry (default: rollout the policy, experience the policy
    and the reference model, train none); names must be among ``model_attrs``."""
    default = {"rollout": ("policy",), "experience": ("policy", "ref_policy"), "train": ()}
    if stage_models is None:
        return default
    for stage, attrs in stage_models.items():
        check_stage(stage, arg="stage_models")
        bad = [a for a in attrs if a not in model_attrs]
        if bad:
            raise ValueError(
                f"`stage_models.{stage}` names {bad}, which are not in `model_attrs` {list(model_attrs)}"
            )
    return {**default, **{k: tuple(v) for k, v in stage_models.items()}}
