"""One object describes parallelism: a (dp, tp) factorization of the world plus stage knobs.

Rank order is dp-major, tp-minor (the same as ``init_device_mesh(..., ("dp", "tp"))``): global
rank ``r`` is ``dp_rank = r // tp``, ``tp_rank = r % tp``, so a tensor-parallel group is a run of
consecutive ranks (on GPUs: one node's NVLink domain).

Below :class:`Layout`, what a strategy reads from its arguments (layouts per stage or candidate
lists, :func:`parse_layouts`; the models each stage syncs, :func:`check_stage_models`) and the
selector protocol it asks for a stage's layout (:class:`LayoutSelector`). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union, runtime_checkable

from earl_lightning.core.checks import check_count

STAGES = ("rollout", "experience", "train")
# The micro-batch budget the memory model and the profile tables assume for a layout that names
# none (Layout's default before such a layout took the module's); AdaptiveParallelism's candidates
# always name theirs.
SIZING_MICRO_BATCH_TOKENS = 4096


@dataclass(frozen=True)
class Layout:
    """A stage's placement and knobs.

    ``micro_batch_tokens``: the padded-token budget of one forward/backward under this layout;
    None (default): the module's own (``optim.micro_batch_tokens``), so a fixed layout that does
    not name one never caps the recipe's (the memory model sizes it at :attr:`sizing_tokens`).
    ``activation_checkpointing``: recompute the decoder blocks in the backward.
    """

    dp: int = 1
    tp: int = 1
    micro_batch_tokens: int | None = None
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp"):
            check_count(f"Layout.{name}", getattr(self, name))
        check_count("Layout.micro_batch_tokens", self.micro_batch_tokens, optional=True)

    @property
    def sizing_tokens(self) -> int:
        """The micro-batch budget this layout's memory and throughput are sized with: its own,
        else :data:`SIZING_MICRO_BATCH_TOKENS`."""
        return self.micro_batch_tokens or SIZING_MICRO_BATCH_TOKENS

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def name(self) -> str:
        return f"dp{self.dp}xtp{self.tp}"

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank."""
        return rank // self.tp, rank % self.tp

    def rank_of(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        return [self.rank_of(dp_rank, t) for t in range(self.tp)]

    def check_world(self, world_size: int, arg: str = "layout") -> Layout:
        if self.world_size != world_size:
            raise ValueError(
                f"`{arg}` {self.name} has dp*tp = {self.world_size}, but the world size is {world_size}; "
                f"valid layouts: {[layout.name for layout in Layout.factorizations(world_size)]}"
            )
        return self

    def check_heads(self, num_heads: int, num_kv_heads: int, arg: str = "layout") -> Layout:
        if num_heads % self.tp or num_kv_heads % self.tp:
            raise ValueError(
                f"`{arg}` tp={self.tp} does not divide the model's attention heads ({num_heads}) and "
                f"KV heads ({num_kv_heads}); valid tp: "
                f"{[t for t in range(1, num_heads + 1) if num_heads % t == 0 and num_kv_heads % t == 0]}"
            )
        return self

    @staticmethod
    def coerce(value, arg: str, *, allow_auto: bool = False) -> Layout | None:
        """A Layout from a Layout or a dict of its fields (config files); ``"auto"`` gives None
        when ``allow_auto``. Errors name ``arg`` as the user wrote it."""
        if isinstance(value, Layout):
            return value
        if allow_auto and value == "auto":
            return None
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(Layout.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"`{arg}` has unknown keys {unknown}; valid keys: {list(Layout.__dataclass_fields__)}"
                )
            return Layout(**value)
        also = " or 'auto'" if allow_auto else ""
        raise ValueError(
            f"`{arg}` must be a Layout or a dict like {{'dp': 2, 'tp': 1}}{also}, got {value!r}"
        )

    @staticmethod
    def factorizations(
        world_size: int, num_heads: int | None = None, num_kv_heads: int | None = None, **knobs
    ) -> list[Layout]:
        """Every dp x tp == world_size whose tp divides the heads (when given)."""
        out = []
        for tp in range(1, world_size + 1):
            if world_size % tp:
                continue
            if num_heads is not None and (num_heads % tp or (num_kv_heads or num_heads) % tp):
                continue
            out.append(Layout(dp=world_size // tp, tp=tp, **knobs))
        return out


def check_stage(stage: str, arg: str = "stage") -> str:
    if stage not in STAGES:
        raise ValueError(f"unknown `{arg}` {stage!r}; valid stages: {list(STAGES)}")
    return stage


# ---- a strategy's layout arguments and the selector protocol -------------------------------
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


def train_layout_arg(train: Layout | None, fixed: dict[str, Layout]) -> Layout | None:
    """The train layout a strategy was given: ``train_layout``, else ``layouts.train``; both given
    must place the model the same way."""
    fixed_train = fixed.get("train")
    if train is not None and fixed_train is not None and not same_placement(train, fixed_train):
        raise ValueError(
            f"`train_layout` {train.name} and `layouts.train` {fixed_train.name} disagree; "
            "give one of them (the optimizer's copy lives in the train layout)"
        )
    return train or fixed_train


def check_selected(
    layout: Any, stage: str, world_size: int, candidates: list[Layout] | None, train: Layout
) -> Layout:
    """``layout``, which a selector chose for ``stage``, checked: a Layout of the world size, among
    the ``candidates`` when the recipe listed them, and placed as ``train`` for the train stage
    (the optimizer lives there: only its micro-batch and checkpointing knobs may change)."""
    if not isinstance(layout, Layout):
        raise TypeError(
            f"the layout selector returned {layout!r} for stage {stage!r}; expected a Layout"
        )
    layout.check_world(world_size, arg=f"selected layout for stage {stage!r}")
    if candidates is not None and not any(same_placement(layout, c) for c in candidates):
        raise ValueError(
            f"the layout selector chose {layout.name} for stage {stage!r}, which is not among the "
            f"candidate `layouts` {[c.name for c in candidates]}"
        )
    if stage == "train" and not same_placement(layout, train):
        raise ValueError(
            f"the layout selector chose {layout.name} for stage 'train', but the optimizer lives in "
            f"the train layout {train.name}; only its micro-batch and checkpointing "
            "knobs may change"
        )
    return layout
