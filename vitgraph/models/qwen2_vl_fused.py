"""The Qwen2-VL tower's fused forward: the same math as the reference forward with vitgraph's
Triton kernels for the elementwise work, quack's GEMM epilogues and the attention kernel each
layout takes. A mixin of :class:`~vitgraph.models.qwen2_vl.Qwen2VisionTower`."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import cudnn_attention, kernels
from ..ops.activations import ACTIVATIONS
from .tower_base import one_block_recipe
from ..ops.backend_names import attention_backend
from ..ops.attention import (LANE_PAD, SegmentedBatch, attend, dense_masked, fa4_kernel,
                             finite_values_)
from ..ops.gemm import (bias_free_stream, fc1_kernel, linear_qkv, linear_qkv_rope, linear_quick_gelu, linear_split_k,
                        qkv_kernel, qkv_rope_kernel, rope_in_gemm)

# The batch is Qwen2-VL's VisionBatch; typed by what attention reads of it (no import back into qwen2_vl).
VisionBatch = SegmentedBatch


class FusedPaths(NamedTuple):
    """Which kernels the fused forward takes for a batch (see ``Qwen2VisionTower.fused_paths``)."""

    lane: int | None  # head-dim lanes of dense masked cuDNN attention (a padded one-segment layout)
    rope_epilogue: bool  # qkv's quack GEMM rotates q and k, zeroes padding rows and v's non-finite values
    ragged: bool  # cuDNN ragged attention (the cudnn backend's packed layouts)
    zero_padding: bool  # the rotary kernel zeroes padding rows (FlashAttention 4 reads them)
    # proj's and fc2's biases kept out of the residual stream, added by each LayerNorm (vitgraph.ops.gemm)
    bias_free: bool = False


JIT_OPS = ("qkv", "qkv_rope", "attention", "fc1")  # ops whose kernels compile on first use


class FusedForward:
    """The fused forward and what compiles or runs its kernels ahead of a capture."""

    def one_block_recipe(self) -> dict:
        """How a precompile worker builds a one-block tower of this one's widths."""
        return one_block_recipe(self.config)

    def rope_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(freq_h, freq_w) [3 * embed_dim]``: for each output column of qkv (interleaved,
        :func:`interleave_order`), the frequency its row position and its column position are
        multiplied by; 0 for the other, and for v. ``pos_h * freq_h + pos_w * freq_w`` is then the
        same single fp32 product :meth:`rotary` takes."""
        cached = getattr(self, "_rope_columns", None)
        if cached is None or cached[0].device != self.inv_freq.device:
            cfg = self.config
            quarter = cfg.head_dim // 4  # h and w each rotate half of the head
            inv_freq = self.inv_freq.float()
            pair = torch.arange(cfg.head_dim, device=inv_freq.device) // 2  # [h pairs | w pairs]
            zero = torch.zeros((), device=inv_freq.device)
            per_head_h = torch.where(pair < quarter, inv_freq[pair.clamp(max=quarter - 1)], zero)
            per_head_w = torch.where(pair >= quarter, inv_freq[(pair - quarter).clamp(min=0)], zero)
            v = torch.zeros(cfg.embed_dim, device=inv_freq.device)
            cached = tuple(torch.cat([f.repeat(2 * cfg.num_heads), v]) for f in (per_head_h, per_head_w))
            self._rope_columns = cached
        return cached

    def rope_rows(self, batch: VisionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(pos_h, pos_w) [T]`` for qkv's rotary epilogue; ``pos_h`` is -1 on padding rows
        (the epilogue zeroes them)."""
        positions = batch.positions.float()
        return torch.where(batch.segment_ids >= 0, positions[:, 0], -1.0), positions[:, 1].contiguous()

    def fused_paths(self, batch: VisionBatch) -> FusedPaths:
        """The kernels :meth:`forward_fused` takes for ``batch`` (a Python-level choice, fixed
        per layout)."""
        rows, backend = batch.positions.shape[0], self.blocks[0].attn.backend
        traits = attention_backend(backend)
        lane = self.config.head_dim + LANE_PAD if batch.dense and batch.padded and traits.lane_pad else None
        return FusedPaths(
            lane=lane,
            rope_epilogue=lane is None and rope_in_gemm(rows, self.blocks[0].attn.qkv.weight, self.tuning.gemm),
            ragged=batch.padded and not batch.dense and traits.ragged,
            zero_padding=batch.padded and lane is None and traits.reads_past_segments,
            bias_free=bias_free_stream(rows, self.tuning.gemm))

    def jit_kernels(self, batch: VisionBatch) -> list[tuple[str, tuple]]:
        """The kernels compiled on first use (FlashAttention 4's, quack's) that :meth:`forward`
        runs for ``batch``: ``(op, key)`` pairs, ``op`` one of ``JIT_OPS``; equal keys are one
        kernel. :meth:`run_jit_kernel` runs one of them alone."""
        rows = batch.positions.shape[0]
        attn, block = self.blocks[0].attn, self.blocks[0]
        weight = attn.qkv.weight
        found = []
        paths = self.fused_paths(batch) if self.fused else FusedPaths(None, False, False, False)
        if paths.rope_epilogue:
            found.append(("qkv_rope", qkv_rope_kernel(rows, weight, self.tuning.gemm)))
        elif self.fused and (key := qkv_kernel(rows, weight, self.tuning.gemm)) is not None:
            found.append(("qkv", key))
        if attention_backend(attn.backend).compiles and paths.lane is None and not paths.ragged:
            found.append(("attention", fa4_kernel(batch.max_seqlen, self.config.num_heads, rows, weight.dtype,
                                                  self.tuning.attention)))
        if self.fused and block.act_name == "quick_gelu":
            if (key := fc1_kernel(rows, block.mlp.fc1.weight, self.tuning.gemm)) is not None:
                found.append(("fc1", key))
        return found

    def run_jit_kernel(self, op: str, batch: VisionBatch) -> None:
        """Run ``op`` (see :meth:`jit_kernels`) of the first block once on zeros laid out for
        ``batch`` (on the device): the call the forward makes, so it compiles, or loads from
        disk, the same kernel."""
        cfg, attn, mlp = self.config, self.blocks[0].attn, self.blocks[0].mlp
        rows = batch.positions.shape[0]
        weight = attn.qkv.weight
        h = torch.zeros(rows, cfg.embed_dim, device=weight.device, dtype=weight.dtype)
        if op == "qkv_rope":
            linear_qkv_rope(h, weight, attn.qkv.bias, *self.rope_columns(), *self.rope_rows(batch), self.tuning.gemm)
        elif op == "qkv":
            linear_qkv(h, weight, attn.qkv.bias, self.tuning.gemm)
        elif op == "attention":
            q, k, v = torch.zeros(rows, 3, cfg.num_heads, cfg.head_dim, device=weight.device,
                                  dtype=weight.dtype).unbind(1)
            attend(attn.backend, q, k, v, batch, padding_zeroed=True, tuning=self.tuning.attention)
        elif op == "fc1":
            linear_quick_gelu(h, mlp.fc1.weight, mlp.fc1.bias, self.tuning.gemm)
        else:
            raise ValueError(f"op must be one of {JIT_OPS}, got {op!r}")

    def run_triton_kernels(self, batch: VisionBatch) -> None:
        """Run each Triton kernel :meth:`forward_fused` runs for ``batch`` once, on zeros laid
        out for ``batch`` (on the device), through the forward's own calls, and none of the
        kernels of :meth:`jit_kernels`: Triton compiles (or loads) every variant the forward
        needs, with the GEMMs on cuBLAS where the forward's would compile. Nothing for the
        plain forward."""
        if not self.fused:
            return
        cfg, block = self.config, self.blocks[0]
        attn, mlp = block.attn, block.mlp
        rows, device, dtype = batch.positions.shape[0], attn.qkv.weight.device, attn.qkv.weight.dtype
        paths, gemm, norms = self.fused_paths(batch), self.tuning.gemm, self.tuning.norms
        x = torch.zeros(rows, cfg.embed_dim, device=device, dtype=dtype)
        kernels.add_layernorm(x, None, block.norm1.weight, block.norm1.bias, block.norm1.eps, tuning=norms)
        if not paths.rope_epilogue:
            qkv = torch.zeros(rows, attn.qkv.weight.shape[0], device=device, dtype=dtype)
            self._rotate(qkv, *self.rotary(batch.positions), batch, paths)
        if paths.bias_free:  # every LayerNorm after proj and fc2 is this one (addmm_ adds on cuBLAS)
            offset = kernels.prefix_sums(self.stream_biases())[0]
            kernels.add_layernorm(x, None, block.norm2.weight, block.norm2.bias, block.norm2.eps, offset=offset,
                                  tuning=norms)
        else:
            y, y_bias = linear_split_k(x, attn.proj.weight, attn.proj.bias, gemm)
            kernels.add_layernorm(x, y, block.norm2.weight, block.norm2.bias, block.norm2.eps, y_bias, tuning=norms)
        if block.act_name == "quick_gelu" and fc1_kernel(rows, mlp.fc1.weight, gemm) is None:
            linear_quick_gelu(x, mlp.fc1.weight, mlp.fc1.bias, gemm)  # cuBLAS, then the Triton pass
        if not paths.bias_free:
            f = torch.zeros(rows, mlp.fc2.weight.shape[1], device=device, dtype=dtype)
            z, z_bias = linear_split_k(f, mlp.fc2.weight, mlp.fc2.bias, gemm)
            kernels.add_layernorm(x, z, self.merger.ln_q.weight, self.merger.ln_q.bias, self.merger.ln_q.eps, z_bias,
                                  tuning=norms)

    def stream_biases(self) -> torch.Tensor:
        """proj's and fc2's biases in the order they join the residual stream, ``[2 * depth, E]``
        (read at every forward, so the graphs follow weights updated in place)."""
        return torch.stack([b for block in self.blocks for b in (block.attn.proj.bias, block.mlp.fc2.bias)])

    def _rotate(self, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, batch: VisionBatch,
                paths: FusedPaths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``qkv``, rotated by the Triton kernel unless qkv's GEMM did (``paths``)."""
        heads = self.config.num_heads
        if paths.rope_epilogue:
            return qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
        # cuDNN's ragged attention reads q, k, v out of qkv itself (no segment ids, no zeroing).
        return kernels.rotary_(qkv, cos, sin, heads, None if paths.ragged else batch.segment_ids, paths.lane,
                               paths.zero_padding)

    def forward_fused(self, pixels: torch.Tensor, batch: VisionBatch,
                      blocks: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """The same math with three Triton kernels per half-block (see :mod:`vitgraph.ops.kernels`).

        The residual stream ``x`` is updated in place; each add is fused with the LayerNorm
        that follows it, the last one with the merger's. Which kernels qkv, attention, proj and
        fc2 take is :meth:`fused_paths`' (a padded one-segment layout: cuDNN with a masking lane;
        the ``cudnn`` backend's packed layouts: its ragged attention; quack's GEMM: the rotary in
        qkv's epilogue; proj and fc2 split K at small row counts and add into the stream above).
        ``blocks``: a prefix of the tower's blocks to run instead of all (see :meth:`warm_up`).
        """
        blocks = self.blocks if blocks is None else blocks
        paths = self.fused_paths(batch)
        # The rotary inputs first: they live through the forward while their temporaries
        # do not, so the holes those leave sit at the start of the graphs' memory pool
        # rather than between the big activations.
        rotary = self._rotary_inputs(batch, paths)
        # The biases the stream would hold after each proj and fc2, summed in fp32 (all blocks': one kernel variant).
        offsets = kernels.prefix_sums(self.stream_biases()) if paths.bias_free else None
        x = self.patch_embed(pixels)
        ragged = None
        if paths.ragged:
            ragged = cudnn_attention.ragged_metadata(batch.cu_seqlens, self.config.num_heads, self.config.head_dim)
        h = self._add_norm(x, None, blocks[0].norm1, None)
        # Each intermediate is dropped as soon as it is dead: a name held until the next block
        # would keep a second copy alive (qkv, the fc1 output) and double the activation peak,
        # in eager runs and in the graphs' pool alike. out (and fc1's output) goes back before the
        # LayerNorm after it allocates h, so h takes its block and not the start of qkv's: there it
        # would split the space fc1's output needs next and grow the pool (benchmarks/HISTORY.md).
        for i, block in enumerate(blocks):
            qkv = self._qkv(h, block.attn, rotary, paths)
            del h
            out = self._attend_fused(qkv, block.attn, batch, rotary, paths, ragged)
            del qkv
            product = self._into_stream(x, out, block.attn.proj, paths)
            del out
            h = self._add_norm(x, product, block.norm2, offsets, 2 * i)
            del product
            f = self._fc1(h, block)
            del h
            product = self._into_stream(x, f, block.mlp.fc2, paths)
            del f
            norm = blocks[i + 1].norm1 if i + 1 < len(blocks) else self.merger.ln_q
            h = self._add_norm(x, product, norm, offsets, 2 * i + 1)
            del product
        return self.merger.mlp(h.view(-1, self.merger.merged_dim))

    def _rotary_inputs(self, batch: VisionBatch, paths: FusedPaths) -> tuple:
        """qkv's epilogue's ``(freq_h, freq_w, pos_h, pos_w)``, or the rotary kernel's ``(cos, sin)``."""
        if paths.rope_epilogue:
            return (*self.rope_columns(), *self.rope_rows(batch))
        return self.rotary(batch.positions)

    def _qkv(self, h: torch.Tensor, attn: nn.Module, rotary: tuple, paths: FusedPaths) -> torch.Tensor:
        if paths.rope_epilogue:
            return linear_qkv_rope(h, attn.qkv.weight, attn.qkv.bias, *rotary, self.tuning.gemm)
        return linear_qkv(h, attn.qkv.weight, attn.qkv.bias, self.tuning.gemm)

    def _attend_fused(self, qkv: torch.Tensor, attn: nn.Module, batch: VisionBatch, rotary: tuple,
                      paths: FusedPaths, ragged) -> torch.Tensor:
        """Attention over ``qkv``, rotated first unless its GEMM did."""
        cfg = self.config
        q, k, v = self._rotate(qkv, *((None, None) if paths.rope_epilogue else rotary), batch, paths)
        if paths.lane is not None:
            return dense_masked(q, k, v, cfg.head_dim ** -0.5)
        if ragged is not None:  # reads q, k, v out of qkv itself
            finite_values_(v)  # its tiles past a segment's end weigh the next one's values 0
            return cudnn_attention.ragged_attention(qkv.view(qkv.shape[0], 3, cfg.num_heads, -1), ragged,
                                                    batch.max_seqlen)
        # The rotary kernel (zero_padding) or qkv's epilogue zeroed v's padding rows and non-finite values.
        zeroed = paths.zero_padding or paths.rope_epilogue
        return attend(attn.backend, q, k, v, batch, padding_zeroed=zeroed, tuning=self.tuning.attention,
                      values_finite=zeroed)

    def _into_stream(self, x: torch.Tensor, y: torch.Tensor, linear: nn.Linear, paths: FusedPaths):
        """proj's or fc2's product of ``y``: added into ``x`` in place (cuBLAS, ``addmm_``; None
        returned) where the stream is bias-free, else its split-K partials and bias."""
        if paths.bias_free:
            x.addmm_(y.reshape(x.shape[0], -1), linear.weight.t())
            return None
        return linear_split_k(y.reshape(x.shape[0], -1), linear.weight, linear.bias, self.tuning.gemm)

    def _add_norm(self, x: torch.Tensor, product, norm: nn.Module, offsets: torch.Tensor | None,
                  index: int = 0) -> torch.Tensor:
        """``x += product`` (if any, see :meth:`_into_stream`), then ``norm(x)``; ``offsets``: the
        bias-free stream's summed biases, row ``index`` of them added."""
        y, y_bias = (None, None) if product is None else product
        offset = None if offsets is None else offsets[index]
        return kernels.add_layernorm(x, y, norm.weight, norm.bias, norm.eps, y_bias, offset=offset,
                                     tuning=self.tuning.norms)

    def _fc1(self, h: torch.Tensor, block: nn.Module) -> torch.Tensor:
        mlp = block.mlp
        if block.act_name == "quick_gelu":
            return linear_quick_gelu(h, mlp.fc1.weight, mlp.fc1.bias, self.tuning.gemm)
        return ACTIVATIONS[block.act_name](F.linear(h, mlp.fc1.weight, mlp.fc1.bias))
