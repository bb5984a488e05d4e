"""One base for every family's tower (:class:`TowerBase`): the engine's contract, one reference
block loop (plain PyTorch, exact against transformers) and one fused one
(:class:`~vitgraph.models.fused_loop.FusedLoop`), warm-up and kernel precompile.

Every block is pre-norm: ``x + proj(attn(norm1 x))``, then ``x + mlp_out(act(mlp_in(norm2 x)))``,
with the 2-D rotary on q and k (their head dims kept interleaved, :func:`interleave_order`). A
family file declares only what differs, as class attributes and hooks:

* ``NORM``: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm), the kernel the fused loop calls;
* ``MLP``: the names of a block's MLP linears (in, out), ``GATED``: whether ``in`` is
  ``[gate; up]`` and the MLP ``act(gate) * up``; ``config.hidden_act`` names the activation;
* hooks: :meth:`embed` (patch rows to the blocks' input), :meth:`attention_segments` (windows),
  :meth:`tap` (deepstack features), :meth:`finish` (the output from the merger's rows), and the
  ``merger`` module (``norm``, ``merged_dim``, ``project``).
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.contract import TowerDims
from ..ops import fp8, kernels
from ..ops.activations import ACTIVATIONS
from ..ops.attention import attend
from ..ops.backend_names import PRECISIONS
from ..ops.tuning import KernelTuning
from .fused_loop import FusedLoop
from .rotary import RotaryFrequencies


def tower_dims(config) -> TowerDims:
    """The widths the runtime reads of a tower of ``config`` (its contract's ``shape``)."""
    return TowerDims(config.embed_dim, config.num_heads, config.head_dim,
                     getattr(config, "mlp_dim", None) or config.intermediate_size, config.patch_width,
                     config.spatial_merge_size)


def one_block_recipe(config) -> dict:
    """How a kernel-compiling worker builds a tower of ``config``'s family and widths with one
    block of each kind (:meth:`vitgraph.engine.contract.Precompiled.one_block_recipe`, built by
    :func:`vitgraph.models.one_block_tower`): the config's :meth:`one_block_fields`."""
    return {"builder": "vitgraph.models:one_block_tower",
            "kwargs": {"family": config.FAMILY, "config": asdict(replace(config, **one_block_fields(config)))}}


def one_block_fields(config) -> dict:
    """``depth`` and the block-index fields of a tower with one block of each kind of ``config``'s:
    block 0 plain, block 1 the kind the index fields name (Qwen2.5-VL's full attention, a
    deepstack tap), where there are such blocks."""
    indexed = {name: getattr(config, name) for name in ("fullatt_block_indexes", "deepstack_visual_indexes")
               if getattr(config, name, ())}
    if not indexed:
        return {"depth": 1}
    return {"depth": 2, **{name: (1,) for name in indexed}}


def interleave_order(num_heads: int, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The order in which a tower keeps qkv's output features: within each head of q and k,
    dim ``d`` of the checkpoint moves to ``2d`` and dim ``d + head_dim/2`` to ``2d + 1``, so the
    two dims one rotation mixes sit side by side; v keeps its order. ``order[new] = old``.

    Attention only takes dot products of q and k over the head dim, so permuting both the
    same way leaves it unchanged; side by side, a pair can rotate inside a GEMM's epilogue
    (:mod:`vitgraph.ops.gemm_rope`)."""
    half = head_dim // 2
    # Built on the CPU: on the meta device (the checkpoint loader's) these ops run through
    # torch._refs, which imports torch._dynamo (seconds).
    within = torch.arange(head_dim)
    within = within // 2 + (within % 2) * half
    qk = (torch.arange(2 * num_heads)[:, None] * head_dim + within).flatten()
    return torch.cat([qk, torch.arange(2 * num_heads * head_dim, 3 * num_heads * head_dim)]).to(device)


def keep_qkv_interleaved(attn: nn.Module, num_heads: int, head_dim: int) -> None:
    """Keep ``attn.qkv``'s rows with q's and k's head dims interleaved (:func:`interleave_order`),
    the layout the rotary kernels read; state dicts, in and out, keep the checkpoint's order."""
    attn._head_layout = (num_heads, head_dim)
    attn.register_load_state_dict_pre_hook(_interleave_qkv_on_load)
    attn.register_state_dict_post_hook(_restore_qkv_on_save)


def _interleave_qkv_on_load(attn: nn.Module, state_dict, prefix, *args) -> None:
    for name in ("qkv.weight", "qkv.bias"):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.shape[:1] == (attn.qkv.out_features,):
            state_dict[prefix + name] = value[interleave_order(*attn._head_layout, device=value.device)]


def _restore_qkv_on_save(attn: nn.Module, state_dict, prefix, local_metadata) -> None:
    for name in ("qkv.weight", "qkv.bias"):
        value = state_dict.get(prefix + name)
        if value is not None:
            inverse = torch.argsort(interleave_order(*attn._head_layout))
            state_dict[prefix + name] = value[inverse.to(value.device)]


def attention_module(cfg, width: int) -> nn.Module:
    """A block's attention parameters (``qkv``, ``proj``, interleaved) and its backend's slot."""
    attn = nn.Module()
    attn.qkv, attn.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
    attn.num_heads, attn.backend = cfg.num_heads, "sdpa"
    keep_qkv_interleaved(attn, cfg.num_heads, cfg.head_dim)
    return attn


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k (``[T, H, D]``, pairs side by side: :func:`interleave_order`) in fp32 and
    cast back, as the reference does; ``cos``/``sin``: ``[T, D/2]``, one angle per pair."""
    dtype = q.dtype
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def rotate(x):
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2).to(dtype)

    return rotate(q), rotate(k)


class TowerBase(FusedLoop, RotaryFrequencies, nn.Module):
    """A family's tower: ``config`` (a ``TowerShape``), ``patch_embed.proj``, ``blocks`` (each with
    ``norm1``, ``norm2``, ``attn``, ``mlp``) and ``merger``. Knows nothing of CUDA graphs; keeps the
    engine's contract (:class:`vitgraph.engine.contract.VisionTower`)."""

    gemm_backends: tuple[str, ...] = ("cublas", "quack")  # the GEMM backends its fused forward has
    # The kernel settings its forwards read (a group, or "group.field"); the others cannot be set.
    tuning_reads: frozenset[str] = frozenset({"gemm", "norms", "attention"})
    output_parts: int = 1  # outputs side by side in each row
    NORM = "layer"
    MLP = ("fc1", "fc2")
    GATED = False
    precision = "bf16"  # set_precision's
    fp8_grouped = False  # set_precision's: FP8 activations in groups of 128 columns (a block checkpoint's)

    def _init_tower(self, cfg) -> None:
        self.config = cfg
        self._init_rotary()
        self.fused = False
        self.tuning = KernelTuning()  # the kernels' (vitgraph.ops.tuning): the plain paths until set

    # -- the engine's contract ----------------------------------------------------------

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

    @property
    def activation(self) -> str:
        return self.config.hidden_act

    def configure(self, attention: str, fused: bool, tuning, precision: str = "bf16") -> None:
        """The attention backend, whether the fused forward runs, the kernels' tuning
        (:class:`vitgraph.ops.tuning.KernelTuning`) and the blocks' GEMM precision: everything
        the runtime sets."""
        self.set_attention_backend(attention)
        self.fuse(fused)
        self.set_tuning(tuning)
        self.set_precision(precision)

    def block_linears(self, block: nn.Module) -> tuple[nn.Linear, ...]:
        """qkv, proj and the MLP's two: the GEMMs ``precision="fp8"`` runs in FP8 (not the merger's)."""
        return (block.attn.qkv, block.attn.proj, *self.mlp_linears(block))

    def set_precision(self, precision: str, keep_float: bool = False) -> None:
        """``"fp8"``: the fused forward runs the blocks' four GEMMs in FP8 (:mod:`vitgraph.ops.fp8`:
        a per-tensor FP8 checkpoint's own e4m3 weights, or weights quantized per output channel now,
        and activations per row; a block FP8 checkpoint's own weights and activations in groups of
        128 columns), and their float weights are released unless ``keep_float`` (then
        ``forward_reference`` and ``"bf16"`` stay open); ``"bf16"``: in the weights' dtype. Call it
        after the tower has its device and dtype."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        ids = {id(linear) for block in self.blocks for linear in self.block_linears(block)}
        named = [(name, m) for name, m in self.named_modules() if id(m) in ids]
        linears = [m for _, m in named]
        grouped = fp8.runs_grouped(linears)
        if precision == "fp8":
            if not self.fused:
                raise ValueError("precision='fp8' runs in the fused forward: it needs fuse=True")
            if grouped:
                fp8.check_grouped_device(self.blocks[0].attn.proj.bias.device)
            unaligned = sorted({(lin.in_features, lin.out_features) for lin in linears if not fp8.fits(lin)})
            if unaligned:
                raise ValueError(f"precision='fp8': FP8 GEMMs take widths in multiples of {fp8.ALIGN}; the "
                                 f"{type(self).__name__} has linears (in, out) {unaligned}")
        for name, linear in named:
            fp8.quantize_linear_(linear, grouped) if precision == "fp8" else fp8.dequantize_linear_(linear, name)
        self.precision, self.fp8_grouped = precision, grouped and precision == "fp8"
        if precision == "fp8" and not keep_float:  # only once every linear is quantized
            for _, linear in named:
                fp8.release_float_(linear)

    def check_float_weights(self) -> None:
        """Refuse what reads the blocks' float weights once ``precision="fp8"`` released them."""
        linears = (linear for block in self.blocks for linear in self.block_linears(block))
        if self.precision == "fp8" and any(fp8.released(linear) for linear in linears):
            raise ValueError("the blocks' float weights were released by precision='fp8' (the fused forward "
                             "reads their e4m3 copies); set_precision('fp8', keep_float=True) keeps them")

    def _apply(self, fn, recurse=True):
        # Module.to and friends leave released weights (meta tensors) as they are.
        return super()._apply(lambda t: t if t.is_meta else fn(t), recurse)

    def set_attention_backend(self, backend: str) -> None:
        for block in self.blocks:
            block.attn.backend = backend

    @property
    def attention_backend(self) -> str:
        return self.blocks[0].attn.backend

    def set_tuning(self, tuning: KernelTuning) -> None:
        """The kernels' tuning: GEMM backend and tiles, the norms' layouts, FlashAttention 4's tiles."""
        self.tuning = tuning
        if tuning.gemm.backend == "quack":
            self.rope_columns()  # built now, never inside a capture

    def fuse(self, enabled: bool = True) -> None:
        """Run the elementwise work through vitgraph's Triton kernels (:mod:`vitgraph.ops.kernels`),
        and the GEMM epilogues where the tuning takes quack. Needs triton and a CUDA device (or
        Triton's interpreter)."""
        if enabled and not kernels.usable(self.patch_embed.proj.weight.device):
            raise ValueError("fuse=True needs the triton package and a CUDA device (or TRITON_INTERPRET=1)")
        if not enabled and self.precision == "fp8":
            raise ValueError("precision='fp8' runs in the fused forward: set_precision('bf16') before fuse(False)")
        self.fused = enabled

    def forward(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        """``[T, input_width]`` pixel rows -> ``[T / merge_unit, output_width]``."""
        return self.forward_fused(pixels, batch) if self.fused else self.forward_reference(pixels, batch)

    # -- the reference block loop ----------------------------------------------------------

    def forward_reference(self, pixels: torch.Tensor, batch, blocks=None) -> torch.Tensor:
        """Plain PyTorch ops, one per step of the reference model (any device and dtype).
        ``blocks``: the indexes of the blocks to run instead of all (their taps run too; see
        :meth:`warm_up`)."""
        self.check_float_weights()
        cos, sin = self.rotary(batch.positions)
        x = self.embed(pixels, batch)
        taps = []
        for i in range(len(self.blocks)) if blocks is None else blocks:
            x = self.reference_block(self.blocks[i], x, cos, sin, self.attention_segments(batch, i))
            if (feature := self.tap(i, x, fused=False)) is not None:
                taps.append(feature)
        return self.finish(self.merger(x), taps, batch)

    def reference_block(self, block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        segments) -> torch.Tensor:
        attn = block.attn
        qkv = attn.qkv(block.norm1(x))
        q, k, v = qkv.view(x.shape[0], 3, attn.num_heads, -1).unbind(1)  # [T, H, D] each
        q, k = apply_rotary(q, k, cos, sin)
        out = attend(attn.backend, q, k, v.contiguous(), segments, tuning=self.tuning.attention)
        x = x + attn.proj(out.reshape(x.shape[0], -1))
        mlp_in, mlp_out = self.mlp_linears(block)
        f = mlp_in(block.norm2(x))
        if self.GATED:
            gate, up = f.split(f.shape[-1] // 2, dim=-1)
            f = ACTIVATIONS[self.activation](gate) * up
        else:
            f = ACTIVATIONS[self.activation](f)
        return x + mlp_out(f)

    def mlp_linears(self, block: nn.Module) -> tuple[nn.Linear, nn.Linear]:
        return getattr(block.mlp, self.MLP[0]), getattr(block.mlp, self.MLP[1])

    # -- what a family names -------------------------------------------------------------

    def embed(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        """The blocks' input ``[T, E]`` from pixel rows, in the order the blocks read it: the
        patch embedding (a stride == kernel Conv3d over one patch per row is a plain GEMM)."""
        proj = self.patch_embed.proj
        return F.linear(pixels.to(proj.weight.dtype), proj.weight.view(proj.weight.shape[0], -1), proj.bias)

    def attention_segments(self, batch, index: int):
        """The segmentation block ``index`` attends within."""
        return batch

    def tap(self, index: int, x: torch.Tensor, fused: bool, offset: torch.Tensor | None = None
            ) -> torch.Tensor | None:
        """A feature read from block ``index``'s output ``x`` (``[T, E]``), or None; ``offset``: the
        fused loop's biases kept out of ``x`` (fp32 ``[E]``), if any."""
        return None

    def finish(self, merged: torch.Tensor, taps: list[torch.Tensor], batch) -> torch.Tensor:
        """The output from the merger's ``[T / merge_unit, out]`` and the taps, in block order."""
        return merged

    # -- warm-up ----------------------------------------------------------------------

    def block_kind(self, index: int) -> object:
        """What sets block ``index``'s work apart from another block's (its attention's
        segmentation, a deepstack tap); blocks of one kind run the same kernels at the same shapes."""
        return None

    def warm_up_blocks(self) -> list[int]:
        """The first block of each kind, in order (see :meth:`block_kind`)."""
        return self.first_blocks(self.block_kind)

    def warm_up(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        """The forward through one block of each kind (:meth:`warm_up_blocks`), then the merger
        (not the model's output): every kernel, shape and library plan a forward reaches, for a
        few blocks' work. Released towers' block 0 is no sample (a window block in Qwen2.5-VL,
        no deepstack tap in Qwen3-VL)."""
        run = self.forward_fused if self.fused else self.forward_reference
        return run(pixels, batch, blocks=self.warm_up_blocks())

    def one_block_recipe(self) -> dict:
        """How a precompile worker builds a tower of this one's widths, one block of each kind."""
        return one_block_recipe(self.config)
