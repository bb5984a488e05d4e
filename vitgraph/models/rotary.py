"""The 2-D rotary's frequencies every family's tower holds: fp32, whatever the weights are cast to."""

from __future__ import annotations

import torch


class RotaryFrequencies:
    """A mixin (before ``nn.Module``) for a tower with ``config.head_dim``, ``config.rope_theta`` and
    ``patch_embed.proj``: the non-persistent fp32 buffer ``inv_freq`` and the angles it gives."""

    def _init_rotary(self) -> None:
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        half = self.config.head_dim // 2  # h and w each rotate half of the head
        # On the CPU, then to the default device: a meta-device arange (the checkpoint loader
        # builds the tower on meta) runs through torch._refs, which imports torch._dynamo (seconds).
        exponent = torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half
        return (1.0 / (self.config.rope_theta ** exponent)).to(torch.get_default_device())

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after loading weights with ``assign=True``)."""
        self.inv_freq = self._inv_freq().to(self.patch_embed.proj.weight.device)
        self._rope_columns = None  # Qwen2-VL's epilogue columns, derived from inv_freq

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)
        return self

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin ``[T, head_dim/2]`` of the angles ``[h*f | w*f]``, one per rotated pair
        (the reference repeats them twice to span the head)."""
        angles = (positions.float()[..., None] * self.inv_freq.float()).flatten(1)
        return angles.cos(), angles.sin()
