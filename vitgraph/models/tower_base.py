"""What every family's tower shares beyond its math: the contract's one setter and its defaults
(:class:`vitgraph.engine.contract.VisionTower`)."""

from __future__ import annotations

from .rotary import RotaryFrequencies


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

    def configure(self, attention: str, fused: bool, tuning) -> None:
        """The attention backend, whether the fused forward runs, and the kernels' tuning
        (:class:`vitgraph.ops.tuning.KernelTuning`): everything the runtime sets."""
        self.set_attention_backend(attention)
        self.fuse(fused)
        self.set_tuning(tuning)
