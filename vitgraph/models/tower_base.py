"""What every family's tower shares beyond its math: the contract's one setter and its defaults
(:class:`vitgraph.engine.contract.VisionTower`)."""

from __future__ import annotations

from dataclasses import asdict, replace

from ..engine.contract import TowerDims
from .rotary import RotaryFrequencies


def tower_dims(config) -> TowerDims:
    """The widths the runtime reads of a tower of ``config`` (its contract's ``shape``)."""
    return TowerDims(config.embed_dim, config.num_heads, config.head_dim,
                     getattr(config, "mlp_dim", None) or config.intermediate_size, config.patch_width,
                     config.spatial_merge_size)


def one_block_recipe(config) -> dict:
    """How a kernel-compiling worker builds a one-block tower of ``config``'s family and widths
    (:meth:`vitgraph.engine.contract.Precompiled.one_block_recipe`, built by
    :func:`vitgraph.models.one_block_tower`). Only Qwen2-VL precompiles: a family with block-index
    fields (Qwen2.5-VL's full-attention blocks) must map them first."""
    return {"builder": "vitgraph.models:one_block_tower",
            "kwargs": {"family": config.FAMILY, "config": asdict(replace(config, depth=1))}}


class TowerBase(RotaryFrequencies):
    """A mixin (before ``nn.Module``) for a family's tower. The tower defines
    ``set_attention_backend``, ``fuse`` and ``set_tuning``; the runtime calls :meth:`configure`."""

    gemm_backends: tuple[str, ...] = ("cublas",)  # the GEMM backends its fused forward has
    # The kernel settings its forwards read (a group, or "group.field"); the others cannot be set.
    tuning_reads: frozenset[str] = frozenset({"norms", "attention"})
    output_parts: int = 1  # outputs side by side in each row

    @property
    def input_width(self) -> int:
        return self.config.patch_width

    @property
    def merge_unit(self) -> int:
        return self.config.merge_unit

    @property
    def name(self) -> str:
        return self.config.FAMILY

    @property
    def shape(self) -> TowerDims:
        return tower_dims(self.config)

    @property
    def processor(self):
        return self.config.PROCESSOR

    @property
    def video_processor(self):
        return self.config.VIDEO_PROCESSOR


    def configure(self, attention: str, fused: bool, tuning) -> None:
        """The attention backend, whether the fused forward runs, and the kernels' tuning
        (:class:`vitgraph.ops.tuning.KernelTuning`): everything the runtime sets."""
        self.set_attention_backend(attention)
        self.fuse(fused)
        self.set_tuning(tuning)
