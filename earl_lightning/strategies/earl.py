"""EarlStrategy: one parallel layout per RL stage, switched at stage boundaries.

Hook contract with the LightningModule (modules stay free of parallel code):

- The module holds plain HF causal LMs in the attributes named by ``model_attrs`` (default
  ``"policy"`` and the optional, frozen ``"ref_policy"``), created in ``__init__`` or
  ``configure_model()``. It must not shard them itself.
- In ``setup`` (after ``configure_model``, before ``configure_optimizers``) the strategy shards each
  of them for the train layout with :func:`parallelize_model` (TP, activation checkpointing, FSDP2),
  so the optimizer is built over the sharded parameters.
- ``with strategy.stage(name, stats) as ctx:`` (the :class:`StageStrategy` contract) picks the
  stage's layout (registered selector, else the fixed per-stage layout), and syncs the stage's
  models into it. ``ctx.model("policy")`` is the model placed for the stage's layout (the train
  copy itself when the layout's dp x tp equals the train layout's, else a cached replica:
  TP-sharded, dp-replicated, weights refreshed by a layout-aware reshard whenever the train copy
  changed); ``ctx.reduce`` reduces over the layout with TP replicas counted once. Ranks of one
  TP group process the same episodes with the same sampling seed.
- Losses are normalized by the GLOBAL token count (all dp ranks): FSDP sums dp gradients.
- Leaving ``stage("train")`` marks the trainable models as changed; call
  ``strategy.mark_weights_updated()`` if weights change elsewhere (e.g. an optimizer step outside
  a train stage).
- Metrics for ``self.log`` accumulate in ``strategy.stage_metrics``; ``pop_stage_metrics()``
  returns and clears them once per step.
- A peer lost in the strategy's collectives (checkpoint saves) ends the run in one line (faults.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn
from typing_extensions import override

from earl_lightning.checkpoints.io import DcpCheckpoints
from earl_lightning.core.checks import check_choice, check_number
from earl_lightning.core.lightning_internals import (
    configure_model_optional,
    join_processes,
    process_group_backend,
    process_group_timeout,
    set_module_device_mesh,
)
from earl_lightning.models.lora import has_lora
from earl_lightning.parallel.collectives import (
    Reducer,
    broadcast_object,
    init_elastic_process_group,
    set_collective_timeout,
)
from earl_lightning.parallel.layout import (
    Layout,
    LayoutArg,
    LayoutSelector,
    check_selected,
    check_stage,
    check_stage_models,
    parse_layouts,
    same_placement,
    to_layout,
    train_layout_arg,
)
from earl_lightning.parallel.parallelize import (
    build_replica,
    is_checkpoint_switchable,
    model_heads,
    parallelize_model,
    refuse_lora_tp,
    reject_fsdp1,
    reject_lora_tp,
    set_activation_checkpointing,
)
from earl_lightning.parallel.plans import reject_unplanned_tp, supports_tp
from earl_lightning.parallel.reshard import Resharder, ReshardStats, reshard_naive
from earl_lightning.stages import StageContext, StageStrategy
from earl_lightning.strategies.faults import OneLineCollectives


class EarlStrategy(OneLineCollectives, DcpCheckpoints, ModelParallelStrategy, StageStrategy):
    """FSDP2 x tensor parallel with a layout per RL stage.

    Args:
        train_layout: the layout the optimizer's copy lives in: a Layout, a dict of its fields, or
            ``"auto"`` (``layouts["train"]`` when given, else dp = world size, tp = 1).
        layouts: fixed layouts per stage (``{"rollout": {"dp": 1, "tp": 2}}``; missing stages use the
            train layout; one without ``micro_batch_tokens`` runs at the module's budget, one with it
            at the smaller of the two), or a list of candidate layouts for a selector, or ``"auto"``
            (every dp x tp factorization of the world size whose tp divides the attention and KV heads).
        memory_budget_gb: memory per device the selector may plan with (None: unknown).
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); None picks from the device.
        model_attrs: the LightningModule attributes holding the models to shard.
        stage_models: which of them each stage syncs on entry; others sync on first ``stage_model``.
        reshard_method: ``"layout_aware"`` (all-to-all of the needed slices) or ``"naive"`` (reference).
        bucket_mb: size of one all-to-all bucket of the layout-aware reshard.
        save_distributed_checkpoint: under several processes, every rank writes its shards into
            one DCP directory (true) or process 0 writes the whole tensors into one file (false),
            as Lightning's ModelParallelStrategy; one process always writes one file.
        timeout: how long joining the process group waits for every rank.
        collective_timeout_s: how long a collective may wait for a peer before the run stops (a
            dead or stuck rank), set on the process group once it is up (joining it keeps
            ``timeout``, Lightning's default 30 minutes: ranks that start slowly still join).

    Raises:
        ValueError: a setting out of range or an unknown choice, named as the setting; when the
            processes start, a layout whose dp x tp is not the world size, or whose tp does not
            divide the model's attention and KV heads (or a model that cannot be tensor-parallel:
            LoRA adapters, an architecture without a TP plan).
    """

    strategy_name = "earl"

    def __init__(
        self,
        train_layout: LayoutArg = "auto",
        layouts: dict[str, LayoutArg] | list[LayoutArg] | str | None = None,
        memory_budget_gb: float | None = None,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        model_attrs: Sequence[str] = ("policy", "ref_policy"),
        stage_models: dict[str, list[str]] | None = None,
        reshard_method: Literal["layout_aware", "naive"] = "layout_aware",
        bucket_mb: float = 64.0,
        save_distributed_checkpoint: bool = True,
        timeout: timedelta | None = default_pg_timeout,
        collective_timeout_s: float | None = None,
    ) -> None:
        seconds = collective_timeout_s
        check_number(
            "collective_timeout_s", seconds, low=0, strict=True, optional=True, unit=" of seconds"
        )
        self.collective_timeout = None if seconds is None else timedelta(seconds=seconds)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        check_choice("process_group_backend", process_group_backend, (None, "gloo", "nccl"))
        gib = memory_budget_gb
        check_number("memory_budget_gb", gib, low=0, strict=True, optional=True, unit=" of GiB")
        check_choice("reshard_method", reshard_method, ("layout_aware", "naive"))
        check_number("bucket_mb", bucket_mb, low=0, strict=True, unit=" of MiB")
        self._fixed, self._candidates, self._auto_candidates = parse_layouts(layouts)
        self._train = train_layout_arg(to_layout(train_layout, "train_layout"), self._fixed)
        self.memory_budget_gb = memory_budget_gb
        self.model_attrs = tuple(model_attrs)
        self.stage_models = check_stage_models(stage_models, self.model_attrs)
        self.reshard_method = reshard_method
        self.bucket_mb = float(bucket_mb)
        self.stage_metrics: dict[str, float] = {}
        self._selector: LayoutSelector | None = None
        self._meshes: dict[tuple[int, int], Any] = {}
        self._replicas: dict[tuple[str, int, int], nn.Module] = {}
        self._resharders: dict[tuple[str, int, int], Resharder] = {}
        self._version: dict[str, int] = {}
        self._synced: dict[tuple[str, int, int], int] = {}
        self._current: Layout | None = None
        self.current_stage: str | None = None
        # Set (before setup) by a selector that may switch the train stage's activation
        # checkpointing per step: the layers are then wrapped once and recompute only when asked.
        self.checkpoint_switchable = False

    # ---- layouts and meshes --------------------------------------------------------------------
    @property
    def train_layout(self) -> Layout:
        """The layout the optimizer's copy of the weights lives in (the train stage's placement).

        Raises:
            RuntimeError: read before the processes start (``auto`` is resolved then).
        """
        if self._train is None:
            raise RuntimeError(
                "the train layout is resolved when the processes start (Trainer.fit)"
            )
        return self._train

    @property
    def current_layout(self) -> Layout:
        """The layout of the running stage; the train layout outside any stage."""
        return self._current or self.train_layout

    @property
    def listed_layouts(self) -> list[Layout] | None:
        """The candidate layouts the recipe listed (``layouts: [...]``), None when it listed none."""
        return None if self._candidates is None else list(self._candidates)

    @property
    def candidate_layouts(self) -> list[Layout]:
        """Layouts a selector may choose from (fixed ones and the train layout when none were listed)."""
        if self._candidates is not None:
            return list(self._candidates)
        return [self.train_layout, *[v for v in self._fixed.values() if v != self.train_layout]]

    def layout_coords(self) -> tuple[int, int]:
        """(dp_rank, tp_rank) of this process in the current layout."""
        return self.current_layout.coords(self.global_rank)

    def mesh_for(self, layout: Layout):
        """The ("dp", "tp") DeviceMesh of a layout, built on first use (a collective) and cached."""
        from torch.distributed.device_mesh import init_device_mesh

        key = (layout.dp, layout.tp)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(
                self.root_device.type, key, mesh_dim_names=("dp", "tp")
            )
            set_collective_timeout(self.collective_timeout, self._meshes[key].get_all_groups())
        return self._meshes[key]

    def _resolve_layouts(self, world_size: int) -> None:
        self._train = self._train or Layout(dp=world_size, tp=1)
        for arg, layout in self.named_layouts():
            layout.check_world(world_size, arg=arg)

    def named_layouts(self) -> list[tuple[str, Layout]]:
        """Each layout this strategy was given, with the setting that gave it; the train layout once
        known (``auto`` is resolved when the processes start)."""
        train = [("train_layout", self._train)] if self._train is not None else []
        return [
            *train,
            *((f"layouts.{s}", lay) for s, lay in self._fixed.items()),
            *((f"layouts[{i}]", lay) for i, lay in enumerate(self._candidates or [])),
        ]

    def refuse_lora_tp(self, prefix: str = "") -> None:
        """The module carries LoRA adapters: a tensor-parallel layout given is refused now, in one
        line (the ``earl`` command asks before any process starts; ``setup`` would refuse it on
        every rank), each named as ``prefix`` + its setting."""
        for arg, layout in self.named_layouts():
            refuse_lora_tp(layout, prefix + arg)

    def _check_heads(self, model: nn.Module, attr: str) -> None:
        heads, kv_heads = model_heads(model)
        for arg, layout in self.named_layouts():
            layout.check_heads(heads, kv_heads, arg=arg)
            reject_lora_tp(model, layout, arg=arg)
            reject_unplanned_tp(model, layout, arg=arg)
        if self._auto_candidates and self._candidates is None:
            self._candidates = [
                c
                for c in Layout.factorizations(self.world_size, heads, kv_heads)
                if c.tp == 1 or (not has_lora(model) and supports_tp(model))
            ]

    # ---- Lightning hooks -----------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """Join the processes, then resolve the layouts and build the train layout's mesh.

        ModelParallelStrategy's own builds a ("data_parallel", "tensor_parallel") mesh sized by its
        arguments; every stage here and :func:`parallelize_model` use a ("dp", "tp") mesh per
        layout, so only its joining step is taken (:func:`join_processes`). Under torchrun the
        group is joined first under this restart round's store keys (:func:`init_elastic_process_group`;
        Lightning's join then finds it up), and the collective timeout is set once it is up."""
        self.accelerator.setup_device(self.root_device)  # before joining, as Lightning's own order
        init_elastic_process_group(
            process_group_backend(self), process_group_timeout(self), self.root_device
        )
        join_processes(self)
        set_collective_timeout(self.collective_timeout)
        self._resolve_layouts(self.world_size)
        set_module_device_mesh(self.lightning_module, self.mesh_for(self._train))

    @property
    @override
    def device_mesh(self):
        """The train layout's ("dp", "tp") mesh (the module's ``device_mesh`` too)."""
        if self._train is None or (key := (self._train.dp, self._train.tp)) not in self._meshes:
            return super().device_mesh  # Lightning's error: the processes have not started
        return self._meshes[key]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_rank = self.train_layout.coords(self.global_rank)[0]
        return {"num_replicas": self.train_layout.dp, "rank": dp_rank}

    @override
    def setup(self, trainer) -> None:
        """Shard the module's models for the train layout, then ModelParallelStrategy's set-up
        (materialize, precision, device; the optimizer over the sharded parameters). The parent
        asks the module to shard itself in ``configure_model`` and refuses one that does not
        override it; here the strategy shards, so that hook stays optional."""
        self.parallelize_module_models()
        with configure_model_optional(self.lightning_module):
            super().setup(trainer)

    def parallelize_module_models(self) -> None:
        """Shard each of the module's ``model_attrs`` for the train layout (FSDP2 over dp, tensor
        parallel over tp), after checking every given layout against the model's heads; with
        activation checkpointing wrapped switchably when a layout or a selector may change it."""
        module = self.lightning_module
        reject_fsdp1(module, arg="LightningModule")
        fixed = self._fixed.get("train")
        switchable = self.checkpoint_switchable or (
            fixed is not None
            and fixed.activation_checkpointing != self._train.activation_checkpointing
        )
        for attr in self.model_attrs:
            model = getattr(module, attr, None)
            if model is None:
                continue
            reject_fsdp1(model, arg=attr)
            self._check_heads(model, attr)
            mesh = self.mesh_for(self._train)
            parallelize_model(
                model, mesh=mesh, layout=self._train, checkpoint_switchable=switchable
            )
            self._version[attr] = 0

    # ---- stages --------------------------------------------------------------------------------
    def register_selector(self, selector: LayoutSelector) -> None:
        """Let ``selector.select(stage, stats, current) -> Layout`` choose every stage's layout.

        Raises:
            TypeError: ``selector`` has no ``select`` method.
        """
        if not isinstance(selector, LayoutSelector):
            raise TypeError(
                f"a layout selector needs a `select(stage, stats, current)` method; got {selector!r}"
            )
        self._selector = selector

    @contextmanager
    def stage(self, name: str, stats: Mapping[str, Any] | None = None) -> Iterator[StageContext]:
        """Run a stage under its layout; yields the :class:`StageContext` (layout, the stage's
        models, a reducer over the layout). The train layout is current again afterwards.

        Args:
            name: the stage (``rollout``, ``experience``, ``train``).
            stats: what the selector sizes the stage by (contexts, sequences); unused without one.

        Raises:
            ValueError: an unknown stage; a layout the selector chose that is not a candidate,
                does not fit the world size or moves the train stage off the train placement; a
                train layout whose activation checkpointing the models, sharded without
                ``checkpoint_switchable``, cannot switch to.
            TypeError: the selector returned something other than a Layout.
        """
        check_stage(name, arg="stage")
        layout = self._select(name, stats)
        self._current, self.current_stage = layout, name
        self.stage_metrics[f"layout/{name}/dp"] = float(layout.dp)
        self.stage_metrics[f"layout/{name}/tp"] = float(layout.tp)
        try:
            if name == "train":
                self._set_checkpointing(layout)
            for attr in self.stage_models.get(name, ()):
                if getattr(self.lightning_module, attr, None) is not None:
                    self.stage_model(attr)
            yield StageContext(
                name, layout, Reducer(layout), layout.micro_batch_tokens, self.stage_model
            )
        finally:
            self._current, self.current_stage = None, None
            if name == "train":
                self.mark_weights_updated()

    def _set_checkpointing(self, layout: Layout) -> None:
        for attr in self.model_attrs:
            model = getattr(self.lightning_module, attr, None)
            if model is None:
                continue
            if is_checkpoint_switchable(model):
                set_activation_checkpointing(model, layout.activation_checkpointing)
            elif layout.activation_checkpointing != self.train_layout.activation_checkpointing:
                raise ValueError(
                    f"stage 'train' asks for activation_checkpointing={layout.activation_checkpointing}, but `{attr}` "
                    f"was sharded with activation_checkpointing={self.train_layout.activation_checkpointing} and "
                    "cannot switch; set `strategy.checkpoint_switchable = True` before fit (AdaptiveParallelism "
                    "does when its `activation_checkpointing` lists both)"
                )

    def _select(self, name: str, stats: Mapping[str, Any] | None) -> Layout:
        if self._selector is None:
            return self._fixed.get(name, self.train_layout)
        layout = self._selector.select(name, stats, self.current_layout)
        # one decision for all ranks, even if the selector's inputs differ
        return check_selected(
            broadcast_object(layout), name, self.world_size, self._candidates, self.train_layout
        )

    def stage_model(self, attr: str = "policy") -> nn.Module:
        """The model ``attr`` placed for the current layout, with up-to-date weights: the train
        copy itself where its placement serves the stage, else a replica resharded from it once per
        weight update.

        Raises:
            ValueError: ``attr`` is not one of ``model_attrs``, or the module's ``attr`` is None.
        """
        if attr not in self.model_attrs:
            raise ValueError(f"unknown model `{attr}`; `model_attrs` are {list(self.model_attrs)}")
        model = getattr(self.lightning_module, attr, None)
        if model is None:
            raise ValueError(f"the LightningModule has no `{attr}` model (it is None or missing)")
        layout = self.current_layout
        # The train copy is FSDP-sharded over dp: every forward all-gathers, so it can serve a stage
        # only if all ranks run the same forwards. Rollout and experience ranks of different dp
        # groups process different episodes (different numbers of turns and micro-batches), so
        # with dp > 1 they get a replica that is whole over dp (sharded over tp only).
        if same_placement(layout, self.train_layout) and (
            self.train_layout.dp == 1 or self.current_stage == "train"
        ):
            return model
        key = (attr, layout.dp, layout.tp)
        if key not in self._replicas:
            # inference replica: no activation checkpointing
            placement = Layout(dp=layout.dp, tp=layout.tp)
            self._replicas[key] = build_replica(
                model, mesh=self.mesh_for(placement), layout=placement, device=self.root_device
            )
        if self._synced.get(key) != self._version.get(attr, 0):
            self._record(self._reshard(model, key))
            self._synced[key] = self._version.get(attr, 0)
        return self._replicas[key]

    def _reshard(self, model: nn.Module, key: tuple[str, int, int]) -> ReshardStats:
        if self.reshard_method == "naive":
            return reshard_naive(model, self._replicas[key])
        if key not in self._resharders:
            self._resharders[key] = Resharder(model, self._replicas[key], bucket_mb=self.bucket_mb)
        return self._resharders[key].run()

    def _record(self, stats: ReshardStats) -> None:
        metrics = self.stage_metrics
        metrics["reshard/bytes"] = metrics.get("reshard/bytes", 0.0) + stats.bytes_received
        metrics["reshard/seconds"] = metrics.get("reshard/seconds", 0.0) + stats.seconds

    def mark_weights_updated(
        self, attrs: Sequence[str] | None = None, all_models: bool = False
    ) -> None:
        """Invalidate replicas of the given models (default: every model with trainable parameters)."""
        module = self.lightning_module
        for attr in attrs or self.model_attrs:
            model = getattr(module, attr, None) if module is not None else None
            if model is None:
                continue
            if all_models or attrs or any(p.requires_grad for p in model.parameters()):
                self._version[attr] = self._version.get(attr, 0) + 1

    def pop_stage_metrics(self) -> dict[str, float]:
        """The metrics recorded since the last call (layout per stage, reshard bytes / seconds)."""
        out, self.stage_metrics = self.stage_metrics, {}
        return out

    @override
    def teardown(self) -> None:
        self._replicas.clear()
        self._resharders.clear()
        super().teardown()


if "earl" not in StrategyRegistry:
    StrategyRegistry.register(
        "earl", EarlStrategy, description="EARL: a parallel layout per RL stage (FSDP2 x TP)"
    )
