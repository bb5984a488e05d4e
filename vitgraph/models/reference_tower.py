"""What the families with a plain-PyTorch forward only share: the 2-D rotary (fp32), the
contract's widths, and the refusal of a fused path they do not have."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.attention import attend


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_attention(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, backend: str,
                     segments) -> torch.Tensor:
    """A block's attention from its qkv rows ``[T, 3E]``: q and k rotated in fp32 (the reference's
    ``rotate_half`` form, cast back), then attention within each segment: ``[T, E]``."""
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)  # [T, H, D] each
    dtype = q.dtype
    q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(dtype) for t in (q, k))
    return attend(backend, q, k, v.contiguous(), segments).reshape(qkv.shape[0], -1)


class ReferenceTower(nn.Module):
    """A base for towers whose forward is the reference one (``config``: a ``TowerShape``)."""

    supports_fused = False

    def _init_rotary(self) -> None:
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.fused = False
        self.gemm_backend = "cublas"

    def _inv_freq(self) -> torch.Tensor:
        half = self.config.head_dim // 2  # h and w each rotate half of the head
        exponent = torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half
        return (1.0 / (self.config.rope_theta ** exponent)).to(torch.get_default_device())

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after loading weights with ``assign=True``)."""
        self.inv_freq = self._inv_freq().to(self.patch_embed.proj.weight.device)

    @property
    def input_width(self) -> int:
        return self.config.patch_width

    @property
    def merge_unit(self) -> int:
        return self.config.merge_unit

    def set_gemm_backend(self, backend: str) -> None:
        if backend != "cublas":
            raise ValueError(f"gemm={backend!r}: the {type(self).__name__} has no fused GEMM path yet")

    def fuse(self, enabled: bool = True) -> None:
        if enabled:
            raise ValueError(f"fuse=True: the {type(self).__name__} has no fused forward yet")

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin ``[T, 1, head_dim]`` of the angles ``[h*f | w*f | h*f | w*f]``."""
        angles = (positions.float()[..., None] * self.inv_freq.float()).flatten(1)  # [T, head_dim/2]
        emb = torch.cat([angles, angles], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def warm_up(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        return self(pixels, batch)
