"""The fused block loop of every family's tower (a mixin of
:class:`~vitgraph.models.tower_base.TowerBase`): the reference loop's math with vitgraph's Triton
kernels for the elementwise work, quack's GEMM epilogues where they fit (qkv with the rotary,
the MLP's first GEMM with its activation or ``act(gate) * up``), and the attention kernel each
layout takes; and what compiles or runs its kernels ahead of a capture."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn as nn

from ..ops import cudnn_attention, fp8, kernels
from ..ops.attention import LANE_PAD, attend, dense_masked, fa4_kernel, finite_values_
from ..ops.backend_names import attention_backend
from ..ops.fp8_kernels import activation_fp8, add_norm_fp8, fp8_outputs, quantize_rows_fp8
from ..ops.gemm import (activation_pass, bias_free_stream, fc1_kernel, linear_act, linear_activation, linear_qkv,
                        linear_qkv_rope, linear_split_k, qkv_kernel, qkv_rope_kernel, rope_in_gemm)


class FusedPaths(NamedTuple):
    """Which kernels the fused forward takes for a batch and one of its segmentations (see
    :meth:`FusedLoop.fused_paths`)."""

    lane: int | None  # head-dim lanes of dense masked cuDNN attention (a padded one-segment layout)
    rope_epilogue: bool  # qkv's quack GEMM rotates q and k, zeroes padding rows and v's non-finite values
    ragged: bool  # cuDNN ragged attention (the cudnn backend's packed layouts)
    zero_padding: bool  # the rotary kernel zeroes padding rows (FlashAttention 4 reads them)
    # proj's and the MLP's last biases kept out of the residual stream, added by each norm (vitgraph.ops.gemm)
    bias_free: bool = False


# Ops whose kernels compile on first use; "attention" is the first attention kind's (see
# :meth:`FusedLoop.attention_blocks`), "attention_2" the second's.
JIT_OPS = ("qkv", "qkv_rope", "attention", "attention_2", "fc1")
# FP8 MLPs of more rows run fc1 and the activation in chunks of this many: fc1's bf16 output for
# one chunk plus the whole e4m3 activation then take no more than bf16's one activation (gate_up's
# double width included) in the default largest (16384-token) bucket; buckets up to it run whole.
FP8_MLP_ROWS = 4096


class FusedLoop:
    """The fused forward and what compiles or runs its kernels ahead of a capture."""

    _stand_ins = False  # run_triton_kernels: zeros in place of each kernel compiled on first use

    # -- which kernels ---------------------------------------------------------------------

    def attention_kind(self, index: int) -> object:
        """What sets block ``index``'s segmentation apart (Qwen2.5-VL's windows or frames)."""
        return None

    def attention_blocks(self) -> list[int]:
        """The first block of each attention kind, in order."""
        return self.first_blocks(self.attention_kind)

    def first_blocks(self, kind) -> list[int]:
        """The first block of each value of ``kind(index)``, in order."""
        first: dict[object, int] = {}
        for i in range(len(self.blocks)):
            first.setdefault(kind(i), i)
        return sorted(first.values())

    def fused_paths(self, batch, segments=None) -> FusedPaths:
        """The kernels :meth:`forward_fused` takes for ``batch`` in a block attending within
        ``segments`` (default: block 0's): a Python-level choice, fixed per layout. qkv's epilogue
        rotates where no segmentation of the batch takes the masking lane."""
        rows, traits = batch.positions.shape[0], attention_backend(self.attention_backend)
        segments = self.attention_segments(batch, 0) if segments is None else segments
        lane = self._lane(segments, traits)
        lanes = [self._lane(self.attention_segments(batch, i), traits) for i in self.attention_blocks()]
        qkv = self.blocks[0].attn.qkv
        rope = all(v is None for v in lanes) and rope_in_gemm(rows, qkv.weight, self.tuning.gemm) \
            and not fp8.is_quantized(qkv)
        return FusedPaths(lane=lane, rope_epilogue=rope,
                          ragged=segments.padded and not segments.dense and traits.ragged,
                          zero_padding=segments.padded and lane is None and traits.reads_past_segments,
                          bias_free=bias_free_stream(rows, self.tuning.gemm) and self.precision != "fp8")

    def _lane(self, segments, traits) -> int | None:
        return self.config.head_dim + LANE_PAD if segments.dense and segments.padded and traits.lane_pad else None

    def _qkv_kernel(self, rows: int) -> tuple | None:
        """qkv's quack kernel without the rotary (None: cuBLAS, or an FP8 GEMM)."""
        qkv = self.blocks[0].attn.qkv
        return None if fp8.is_quantized(qkv) else qkv_kernel(rows, qkv.weight, self.tuning.gemm)

    def _fc1_kernel(self, rows: int) -> tuple | None:
        linear = self.mlp_linears(self.blocks[0])[0]
        if fp8.is_quantized(linear):  # an FP8 GEMM, then the activation's Triton pass
            return None
        return fc1_kernel(rows, linear.weight, self.tuning.gemm, self.activation, self.GATED)

    def jit_kernels(self, batch) -> list[tuple[str, tuple]]:
        """The kernels compiled on first use (FlashAttention 4's, quack's) that :meth:`forward`
        runs for ``batch``: ``(op, key)`` pairs, ``op`` one of ``JIT_OPS``; equal keys are one
        kernel. :meth:`run_jit_kernel` runs one of them alone."""
        rows, weight = batch.positions.shape[0], self.blocks[0].attn.qkv.weight
        found = []
        if self.fused and self.fused_paths(batch).rope_epilogue:
            found.append(("qkv_rope", qkv_rope_kernel(rows, weight, self.tuning.gemm)))
        elif self.fused and (key := self._qkv_kernel(rows)) is not None:
            found.append(("qkv", key))
        for op, segments in self._compiled_attention(batch):
            key = fa4_kernel(segments.max_seqlen, self.config.num_heads, rows, weight.dtype, self.tuning.attention)
            if all(key != k for _, k in found):
                found.append((op, key))
        if self.fused and (key := self._fc1_kernel(rows)) is not None:
            found.append(("fc1", key))
        return found

    def _attention_ops(self, batch) -> dict[str, object]:
        """Each attention kind's op name (``JIT_OPS``) and its segmentation of ``batch``."""
        blocks = self.attention_blocks()
        return {"attention" if n == 0 else f"attention_{n + 1}": self.attention_segments(batch, i)
                for n, i in enumerate(blocks)}

    def _compiled_attention(self, batch) -> list[tuple[str, object]]:
        """``(op, segmentation)`` of each attention kind that runs a kernel compiled on first use."""
        if not attention_backend(self.attention_backend).compiles:
            return []
        found = []
        for op, segments in self._attention_ops(batch).items():
            paths = self.fused_paths(batch, segments) if self.fused else None
            if paths is None or (paths.lane is None and not paths.ragged):
                found.append((op, segments))
        return found

    def run_jit_kernel(self, op: str, batch) -> None:
        """Run ``op`` (see :meth:`jit_kernels`) of the first block once on zeros laid out for
        ``batch`` (on the device): the call the forward makes, so it compiles, or loads from
        disk, the same kernel."""
        cfg, attn = self.config, self.blocks[0].attn
        rows, weight = batch.positions.shape[0], attn.qkv.weight  # FP8: a meta tensor (released)
        device, dtype = attn.qkv.bias.device, self._stream_dtype
        h = torch.zeros(rows, cfg.embed_dim, device=device, dtype=dtype)
        attention = self._attention_ops(batch)
        if op == "qkv_rope":
            linear_qkv_rope(h, weight, attn.qkv.bias, *self.rope_columns(), *self.rope_rows(batch), self.tuning.gemm)
        elif op == "qkv":
            linear_qkv(h, weight, attn.qkv.bias, self.tuning.gemm)
        elif op in attention:
            q, k, v = torch.zeros(rows, 3, cfg.num_heads, cfg.head_dim, device=device, dtype=dtype).unbind(1)
            attend(attn.backend, q, k, v, attention[op], padding_zeroed=True, tuning=self.tuning.attention)
        elif op == "fc1":
            linear = self.mlp_linears(self.blocks[0])[0]
            linear_act(h, linear.weight, linear.bias, self.activation, self.GATED, self.tuning.gemm)
        else:
            raise ValueError(f"op must be one of {JIT_OPS} that this batch runs, got {op!r}")

    def run_triton_kernels(self, batch) -> None:
        """Run each Triton kernel :meth:`forward_fused` runs for ``batch`` once, on zeros laid out
        for ``batch`` (on the device): the fused forward through one block of each kind, with
        zeros in place of each kernel of :meth:`jit_kernels` (the GEMMs around them on cuBLAS),
        so Triton compiles (or loads) every variant the forward needs. Nothing for the plain forward."""
        if not self.fused:
            return
        weight = self.patch_embed.proj.weight
        pixels = torch.zeros(batch.positions.shape[0], self.input_width, device=weight.device, dtype=weight.dtype)
        self._stand_ins = True
        try:
            self.warm_up(pixels, batch)
        finally:
            del self._stand_ins

    @property
    def _stream_dtype(self) -> torch.dtype:
        return self.blocks[0].attn.proj.bias.dtype

    # -- the rotary's inputs -------------------------------------------------------------

    def rope_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(freq_h, freq_w) [3 * embed_dim]``: for each output column of qkv (interleaved),
        the frequency its row position and its column position are multiplied by; 0 for the
        other, and for v. ``pos_h * freq_h + pos_w * freq_w`` is then the same single fp32
        product :meth:`rotary` takes."""
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

    def rope_rows(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(pos_h, pos_w) [T]`` for qkv's rotary epilogue; ``pos_h`` is -1 on padding rows
        (the epilogue zeroes them)."""
        positions, ids = batch.positions.float(), self.attention_segments(batch, 0).segment_ids
        return torch.where(ids >= 0, positions[:, 0], -1.0), positions[:, 1].contiguous()

    def stream_biases(self, order: list[int] | None = None) -> torch.Tensor:
        """proj's and the MLP's last biases in the order they join the residual stream, ``[2 * depth,
        E]`` (read at every forward, so the graphs follow weights updated in place). ``order``: the
        blocks that run (a warm-up's), their biases first and zeros after, the same shape: one
        kernel variant of the running sums, and a warm-up's stream equal to a tower of those blocks."""
        blocks = [self.blocks[i] for i in (range(len(self.blocks)) if order is None else order)]
        biases = [b for block in blocks for b in (block.attn.proj.bias, self.mlp_linears(block)[1].bias)]
        rest = 2 * (len(self.blocks) - len(blocks))
        return torch.stack(biases + [torch.zeros_like(biases[0])] * rest)

    # -- the loop ------------------------------------------------------------------------

    def forward_fused(self, pixels: torch.Tensor, batch, blocks=None) -> torch.Tensor:
        """The reference loop's math, each residual add joined to the norm after it (the last to
        the merger's), the rotary in qkv's epilogue or in place; which kernels qkv, attention,
        proj and the MLP take is :meth:`fused_paths`' (a padded one-segment layout: cuDNN with a
        masking lane; the ``cudnn`` backend's packed layouts: its ragged attention; proj and the
        MLP's last GEMM split K at small row counts and add into the stream above). A tap reads
        its block's output once the next add+norm has written it. ``blocks``: the indexes of the
        blocks to run instead of all (see :meth:`warm_up`)."""
        order = list(range(len(self.blocks))) if blocks is None else list(blocks)
        first = self.fused_paths(batch)
        # The rotary inputs first: they live through the forward while their temporaries
        # do not, so the holes those leave sit at the start of the graphs' memory pool
        # rather than between the big activations.
        rotary = self._rotary_inputs(batch, first)
        # The biases the stream would hold after each proj and MLP, summed in fp32 (all blocks': one kernel variant).
        offsets = kernels.prefix_sums(self.stream_biases(order)) if first.bias_free else None
        kinds = {self.attention_kind(i): self._attention_layout(batch, i) for i in self.attention_blocks()}
        x = self.embed(pixels, batch)
        h = self._add_norm(x, None, self.blocks[order[0]].norm1, None)
        taps = []
        # Each intermediate is dropped as soon as it is dead: a name held until the next block
        # would keep a second copy alive (qkv, the MLP's) and double the activation peak, in
        # eager runs and in the graphs' pool alike. out (and the MLP's) goes back before the
        # norm after it allocates h, so h takes its block and not the start of qkv's: there it
        # would split the space the MLP's output needs next and grow the pool (benchmarks/HISTORY.md).
        for k, i in enumerate(order):
            block, mlp_out = self.blocks[i], self.mlp_linears(self.blocks[i])[1]
            segments, paths, ragged = kinds[self.attention_kind(i)]
            qkv = self._qkv(h, block.attn, rotary, paths)
            del h
            out = self._attend_fused(qkv, segments, rotary, paths, ragged)
            del qkv
            product = self._into_stream(x, out, block.attn.proj, paths)
            del out
            h = self._add_norm(x, product, block.norm2, offsets, 2 * k)
            del product
            f = self._mlp_in_act(h, block)
            del h
            product = self._into_stream(x, f, mlp_out, paths)
            del f
            last = k + 1 == len(order)
            norm = self.merger.norm if last else self.blocks[order[k + 1]].norm1
            h = self._add_norm(x, product, norm, offsets, 2 * k + 1, gemm_input=not last)  # x: block i's output now
            del product
            feature = self.tap(i, x, fused=True, offset=None if offsets is None else offsets[2 * k + 1])
            if feature is not None:
                taps.append(feature)
        merger = self.merger
        return self.finish(merger.project(h.view(-1, merger.merged_dim)), taps, batch)

    def _attention_layout(self, batch, index: int) -> tuple:
        """Block ``index``'s segmentation, its paths, and cuDNN's ragged metadata where it takes it."""
        segments = self.attention_segments(batch, index)
        paths = self.fused_paths(batch, segments)
        ragged = None
        if paths.ragged:
            ragged = cudnn_attention.ragged_metadata(segments.cu_seqlens, self.config.num_heads, self.config.head_dim)
        return segments, paths, ragged

    def _rotary_inputs(self, batch, paths: FusedPaths) -> tuple:
        """qkv's epilogue's ``(freq_h, freq_w, pos_h, pos_w)``, or the rotary kernel's ``(cos, sin)``."""
        if paths.rope_epilogue:
            return (*self.rope_columns(), *self.rope_rows(batch))
        return self.rotary(batch.positions)

    def _qkv(self, h: torch.Tensor, attn: nn.Module, rotary: tuple, paths: FusedPaths) -> torch.Tensor:
        weight, gemm = attn.qkv.weight, self.tuning.gemm
        if self._stand_ins and (paths.rope_epilogue or self._qkv_kernel(h.shape[0]) is not None):
            return torch.zeros(h.shape[0], weight.shape[0], device=h.device, dtype=h.dtype)
        if paths.rope_epilogue:
            return linear_qkv_rope(h, weight, attn.qkv.bias, *rotary, gemm)
        if fp8.is_quantized(attn.qkv):
            return fp8.linear_fp8(h, attn.qkv, self._stream_dtype)
        return linear_qkv(h, weight, attn.qkv.bias, gemm)

    def _attend_fused(self, qkv: torch.Tensor, segments, rotary: tuple, paths: FusedPaths, ragged) -> torch.Tensor:
        """Attention over ``qkv`` within ``segments``, rotated first unless its GEMM did: ``[T, H, D]``."""
        cfg, rows = self.config, qkv.shape[0]
        if paths.rope_epilogue:
            q, k, v = qkv.view(rows, 3, cfg.num_heads, -1).unbind(1)
        else:  # cuDNN's ragged attention reads q, k, v out of qkv itself (no segment ids, no zeroing)
            q, k, v = kernels.rotary_(qkv, *rotary, cfg.num_heads, None if paths.ragged else segments.segment_ids,
                                      paths.lane, paths.zero_padding)
        if paths.lane is not None:
            return dense_masked(q, k, v, cfg.head_dim ** -0.5)
        if ragged is not None:
            finite_values_(v)  # its tiles past a segment's end weigh the next one's values 0
            return cudnn_attention.ragged_attention(qkv.view(rows, 3, cfg.num_heads, -1), ragged, segments.max_seqlen)
        if self._stand_ins and attention_backend(self.attention_backend).compiles:
            return torch.zeros_like(v)
        # The rotary kernel (zero_padding) or qkv's epilogue zeroed v's padding rows and non-finite values.
        zeroed = paths.zero_padding or paths.rope_epilogue
        return attend(self.attention_backend, q, k, v, segments, padding_zeroed=zeroed, tuning=self.tuning.attention,
                      values_finite=zeroed)

    def _into_stream(self, x: torch.Tensor, y: torch.Tensor, linear: nn.Linear, paths: FusedPaths):
        """proj's or the MLP's last product of ``y``: added into ``x`` in place (cuBLAS, ``addmm_``;
        None returned) where the stream is bias-free, else its split-K partials and bias."""
        if paths.bias_free:
            x.addmm_(y.reshape(x.shape[0], -1), linear.weight.t())
            return None
        if fp8.is_quantized(linear):  # attention's output quantized here, the MLP's by its activation
            y = y if isinstance(y, tuple) else quantize_rows_fp8(y.reshape(x.shape[0], -1), grouped=self.fp8_grouped)
            return fp8.linear_fp8(y, linear, x.dtype), None
        return linear_split_k(y.reshape(x.shape[0], -1), linear.weight, linear.bias, self.tuning.gemm)

    def _add_norm(self, x: torch.Tensor, product, norm: nn.Module, offsets: torch.Tensor | None,
                  index: int = 0, gemm_input: bool = True):
        """``x += product`` (if any, see :meth:`_into_stream`), then ``norm(x)``; ``offsets``: the
        bias-free stream's summed biases, row ``index`` of them added. The input of a block's FP8
        GEMM (``gemm_input``, not the merger's) comes as e4m3 rows and their scales."""
        y, y_bias = (None, None) if product is None else product
        offset = None if offsets is None else offsets[index]
        rms = self.NORM == "rms"
        fp8_input = gemm_input and self.precision == "fp8"
        add_norm = functools.partial(add_norm_fp8, grouped=self.fp8_grouped) if fp8_input else kernels.add_layernorm
        return add_norm(x, y, norm.weight, norm.weight if rms else norm.bias, norm.eps, y_bias, offset=offset, rms=rms,
                        tuning=self.tuning.norms)

    def _mlp_in_act_fp8(self, h: tuple, linear: nn.Linear, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8: the first GEMM and the activation's kernel over ``FP8_MLP_ROWS`` rows at a time, so that
        the GEMM's bf16 output is never held for more rows: FP8 pools stay within bf16's."""
        rows, grouped = h[0].shape[0], self.fp8_grouped
        if rows <= FP8_MLP_ROWS:
            return activation_fp8(fp8.linear_fp8(h, linear, self._stream_dtype), name, self.GATED, grouped=grouped)
        out = fp8_outputs(rows, linear.fp8.q.shape[0] // (2 if self.GATED else 1), grouped, h[0].device)
        for start in range(0, rows, FP8_MLP_ROWS):
            stop = min(start + FP8_MLP_ROWS, rows)
            # One call: a chunk's bf16 output is dead before the next one is made (a name would hold two).
            activation_fp8(fp8.linear_fp8(fp8.input_rows(h, start, stop, grouped), linear, self._stream_dtype), name,
                           self.GATED, grouped=grouped, out=(out[0][start:stop], out[1][start:stop]))
        return out

    def _mlp_in_act(self, h, block: nn.Module):
        """The MLP's first GEMM and its activation: one quack GEMM with the activation (or
        ``act(gate) * up``) in its epilogue where it fits, else cuBLAS and a Triton pass; in FP8,
        the activation's kernel hands the last GEMM e4m3 rows."""
        linear, name = self.mlp_linears(block)[0], self.activation
        if fp8.is_quantized(linear):
            if name in kernels.FUSED_ACTIVATIONS and (not self.GATED or name == "silu"):
                return self._mlp_in_act_fp8(h, linear, name)
            f = fp8.linear_fp8(h, linear, self._stream_dtype)
            return quantize_rows_fp8(activation_pass(f, name, self.GATED).contiguous(), grouped=self.fp8_grouped)
        if self._stand_ins and self._fc1_kernel(h.shape[0]) is not None:
            width = linear.weight.shape[0] // (2 if self.GATED else 1)
            return torch.zeros(h.shape[0], width, device=h.device, dtype=h.dtype)
        return linear_activation(h, linear.weight, linear.bias, name, self.GATED, self.tuning.gemm)
