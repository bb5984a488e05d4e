"""FP8 checkpoints: the vision linears of the two FP8 formats, checked and dequantized on load.

* Fine-grained block FP8 (``quant_method: "fp8"``: Qwen's own ``-FP8`` repos, DeepSeek style):
  a quantized linear stores ``weight`` (float8_e4m3fn, ``[out, in]``) and ``weight_scale_inv``
  (``[ceil(out / b0), ceil(in / b1)]`` for ``weight_block_size: [b0, b1]``); the weight is
  ``weight * weight_scale_inv``, each scale over its b0 x b1 block (the last blocks cropped).
* Per-tensor FP8 of NVIDIA Model Optimizer (``quant_method: "modelopt"``, ``quant_algo: "FP8"``):
  ``weight`` (float8_e4m3fn), one ``weight_scale`` and, optionally, a static activation scale
  ``input_scale`` (read and checked here; FP8 GEMMs will use it). Patch embedding and attention
  stay in high precision.

The checkpoint's dtypes say which linears are quantized: an F8_E4M3 weight needs its scale, a
float weight loads as from any checkpoint (a pack may leave the whole tower unquantized). The
config's ``modules_to_not_convert`` (ModelOpt: ``ignore`` or ``exclude_modules``) forbids FP8 in
the modules it names, spelled ``model.visual.``, ``visual.`` or bare, a module or a prefix of
modules (``*`` and ``?`` wildcards too, as ModelOpt writes them).

FP8 checkpoints load dequantized on every machine: each quantized linear becomes ``weight *
scale`` in fp32 on load, then the compute dtype (bf16 or fp32), and the tower is built, captured
and run exactly as from a float checkpoint: the default, as FP8 GEMMs measured slower than bf16
on these towers (BENCHMARKS.md). ``precision="fp8"`` (:mod:`vitgraph.ops.fp8`) runs the blocks on
the checkpoint's own e4m3 values and scales (:class:`CheckpointScales`, taken back out of the
dequantized weights: no second rounding): a per-tensor checkpoint's rowwise, a block checkpoint's
grouped (a scale per row and 128 columns; column blocks that are not whole 128s are quantized
again in groups). Activations are quantized as they are made; a static ``input_scale`` is checked
but not used (a row's own scale is at least as close, and free).

Other methods (AWQ, GPTQ, compressed-tensors, ModelOpt's NVFP4, ...) mostly leave the vision
tower in float: such a checkpoint loads as before, and a quantized vision tensor under one is
refused, naming the method.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import VISION_PREFIXES
from ..models.config_parsing import read_json
from ..ops.fp8 import GROUP

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names; anything else is refused, not cast
FP8_DTYPE = "F8_E4M3"  # torch.float8_e4m3fn: the one FP8 kind of both formats
SCALE_NAMES = ("weight_scale_inv", "weight_scale", "input_scale")
# Every spelling of a vision module in a not-converted list: model.visual.X, visual.X, X.
_SPELLINGS = VISION_PREFIXES + ("",)
_READS = "vitgraph reads FP8 vision weights of 'fp8' (block) and 'modelopt' (quant_algo 'FP8') checkpoints"


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's ``quantization_config``, as far as the vision tower goes."""

    method: str  # quant_method as written
    config: Path  # config.json, for messages
    block: tuple[int, int] | None = None  # fp8: weight_block_size (rows, cols); None: one scale per tensor
    not_converted: tuple[str, ...] = ()
    not_converted_field: str = "modules_to_not_convert"  # where the list was, for messages
    unsupported: str | None = None  # a method vitgraph does not read: why a quantized vision tensor is refused

    @property
    def scale_name(self) -> str:
        return "weight_scale" if self.block is None else "weight_scale_inv"

    @property
    def scale_names(self) -> tuple[str, ...]:
        """The scales a quantized linear of this format may store."""
        return (self.scale_name, "input_scale") if self.block is None else (self.scale_name,)

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """``weight_scale_inv``'s shape for a weight of ``weight_shape``; None: a scalar ([] or [1])."""
        if self.block is None:
            return None
        (rows, cols), (b0, b1) = weight_shape, self.block
        return (-(-rows // b0), -(-cols // b1))

    def excluded_by(self, module: str) -> str | None:
        """The not-converted entry naming the tower's ``module`` (or a prefix of it), if any."""
        for entry in self.not_converted:
            entry = entry.rstrip(".")
            wild = any(c in entry for c in "*?[")
            for prefix in _SPELLINGS:
                name = prefix + module
                if name == entry or name.startswith(entry + ".") or (wild and fnmatch.fnmatchcase(name, entry)):
                    return entry
        return None


def read_quantization(config: Path) -> QuantFormat | None:
    """``config.json``'s ``quantization_config``, checked (None where it has none). A ValueError
    names the file and the field for a malformed one; an ``fp8`` or ``modelopt`` form vitgraph does
    not read, or another method, is recorded with the reason, refused (by file and field) only
    where a vision tensor is quantized: a float tower under it loads as any."""
    raw = read_json(config)
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    if q is None:
        return None
    where = f"{config}: quantization_config"
    if not isinstance(q, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(q).__name__}")
    method = q.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ValueError(f"{where}.quant_method must be a string naming the method, got {method!r}")
    try:
        if method.lower() == "fp8":
            return _block_fp8(q, method, config, where)
        if method.lower() == "modelopt":
            return _modelopt(q, method, config, where)
    except ValueError as err:  # an FP8 form vitgraph does not read: refused only where the tower holds FP8
        return QuantFormat(method, config, unsupported=str(err))
    return QuantFormat(method, config, unsupported=f"{where}.quant_method is {method!r}; {_READS} only")


def _block_fp8(q: dict, method: str, config: Path, where: str) -> QuantFormat:
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
        missing = " (an 'fp8' checkpoint with no blocks, one scale per tensor, is not read)" if block is None else ""
        raise ValueError(f"{where}.weight_block_size must be two positive ints [rows, cols], got {block!r}{missing}")
    for name, only in (("activation_scheme", "dynamic"), ("fmt", "e4m3"), ("scale_fmt", "float")):
        value = q.get(name, only)
        if not isinstance(value, str) or value.lower() != only:
            raise ValueError(f"{where}.{name} is {value!r}; block FP8 is read with {name} {only!r} only")
    entries, field = _module_list(q, ("modules_to_not_convert", "ignored_layers"), where)
    return QuantFormat(method, config, (block[0], block[1]), entries, field)


def _modelopt(q: dict, method: str, config: Path, where: str) -> QuantFormat:
    """ModelOpt's config as vLLM reads it (modelopt.py, ``ModelOptQuantConfigBase.from_config``):
    flat (``quant_algo``, ``ignore`` or ``exclude_modules``) or nested in ``quantization`` as
    hf_quant_config.json writes it (``quant_algo``, ``exclude_modules``)."""
    source, keys, within = q, ("ignore", "exclude_modules"), ""
    if "quantization" in q:
        source, keys, within, where = q["quantization"], ("exclude_modules",), "quantization.", where + ".quantization"
        if not isinstance(source, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(source).__name__}")
    algo = source.get("quant_algo")
    if not isinstance(algo, str) or not algo:
        raise ValueError(f"{where}.quant_algo must name the ModelOpt algorithm (such as 'FP8'), got {algo!r}")
    entries, field = _module_list(source, keys, where, within)
    if algo.upper() != "FP8":
        return QuantFormat(method, config, unsupported=f"{where}.quant_algo is {algo!r}; {_READS} only")
    return QuantFormat(method, config, None, entries, field)


def _module_list(q: dict, keys: tuple[str, ...], where: str, within: str = "") -> tuple[tuple[str, ...], str]:
    """The first of ``keys`` that ``q`` has (null: none), a list of module names, and its field
    under ``quantization_config`` (``within``: the nested object's name and a dot)."""
    for key in keys:
        if key in q:
            value = q[key] if q[key] is not None else []
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{where}.{key} must be a list of module names, got {q[key]!r}")
            return tuple(value), within + key
    return (), within + keys[0]


@dataclass(frozen=True)
class QuantizedLinear:
    """One FP8 linear as its checkpoint stores it, while the checkpoint loads: every machine
    :meth:`dequantize` s it; the tower keeps its scales (:class:`CheckpointScales`)."""

    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # fp32: [ceil(out / b0), ceil(in / b1)] per block, [] per tensor
    block: tuple[int, int] | None  # the block (rows, cols); None: one scale for the whole weight
    input_scale: torch.Tensor | None = None  # fp32 []: a static activation scale; None: dynamic

    @property
    def scale_kind(self) -> str:
        return "tensor" if self.block is None else "block"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.block).to(dtype)


@dataclass(frozen=True)
class CheckpointScales:
    """What a tower's linear keeps of an FP8 checkpoint (``linear.checkpoint_fp8``), in the tower's
    row order, from which :func:`vitgraph.ops.fp8.quantize_linear_` takes the checkpoint's e4m3
    values back out of the dequantized weight, bit for bit (its bf16 rounding, 2^-9 relative, is
    far within half an e4m3 step, 2^-4): each output row's scale (per-tensor checkpoints), or each
    row's scale per 128 input columns (block checkpoints whose column blocks are whole groups of
    128). A block checkpoint's linear without them is quantized again, in groups."""

    row_scale: torch.Tensor | None  # fp32 [out]; None for a block-scaled linear
    block: tuple[int, int] | None
    group_scale: torch.Tensor | None = None  # fp32 [out, ceil(in / 128)]: a block checkpoint's


def attach_checkpoint_scales(tower: torch.nn.Module, empty_tower: torch.nn.Module, state: dict,
                             quantized: dict[str, QuantizedLinear]) -> None:
    """Give each of ``tower``'s linears that the checkpoint stores in FP8 its
    :class:`CheckpointScales`. The tower may reorder, join and pad a checkpoint's rows on load
    (qkv's interleaving, Qwen2.5-VL's padded gate_up); a linear's bias follows its output rows,
    so ``empty_tower`` (on the meta device) loads the scales in the biases' place and lays them
    out as ``tower`` laid its rows, once per group of 128 input columns for a block checkpoint.
    A linear with no bias, or joined from FP8 and float rows, gets none (``precision="fp8"`` then
    quantizes it again: per channel, or in groups beside a block checkpoint's linears)."""
    block = next(iter(quantized.values())).block  # one format per checkpoint
    grouped = block is not None and block[1] % GROUP == 0  # each 128 columns under one block's scale
    columns = max(linear.weight.shape[1] for linear in quantized.values())
    # Biases real (a NaN row: not from an FP8 linear), everything else shapes only.
    image = {name: torch.full(t.shape, float("nan")) if name.endswith(".bias") else torch.empty(t.shape, device="meta")
             for name, t in state.items()}
    traced = [_traced_biases(empty_tower, image, quantized, g) for g in range(-(-columns // GROUP) if grouped else 1)]
    for name, module in tower.named_modules():
        bias = traced[0].get(name) if isinstance(module, torch.nn.Linear) else None
        if bias is None:
            continue
        float_rows = bias.isnan()
        padding = bias == 0  # rows padded with zeros: any scale divides them exactly
        if not (~padding & ~float_rows).any():
            continue
        if block is not None:
            scales = None
            if grouped and not float_rows.any():
                scales = torch.stack([t[name] for t in traced[:-(-module.weight.shape[1] // GROUP)]], 1)
                scales = torch.where(scales == 0, torch.ones_like(scales), scales).to(module.weight.device)
            module.checkpoint_fp8 = CheckpointScales(None, block, scales)
        elif not float_rows.any():
            rows = torch.where(padding, torch.ones_like(bias), bias)
            module.checkpoint_fp8 = CheckpointScales(rows.to(module.weight.device), None)


def _traced_biases(empty_tower: torch.nn.Module, image: dict, quantized: dict[str, QuantizedLinear],
                   group: int) -> dict[str, torch.Tensor]:
    """Each linear's bias in ``empty_tower`` loaded with ``image``, each FP8 linear's bias holding
    its rows' scales over input columns ``group * 128`` on (per tensor: its one scale; columns past
    its width: 1): the scales laid out as the tower lays its rows (NaN rows: float ones)."""
    image = dict(image)
    for name, linear in quantized.items():
        bias = name.removesuffix("weight") + "bias"
        if bias in image:
            image[bias] = _row_scales(linear, group)
    empty_tower.load_state_dict(image, strict=True, assign=True)
    return {name: module.bias.detach() for name, module in empty_tower.named_modules()
            if isinstance(module, torch.nn.Linear) and module.bias is not None and not module.bias.is_meta}


def _row_scales(linear: QuantizedLinear, group: int) -> torch.Tensor:
    """``linear``'s scale for each output row over input columns ``group * 128`` on."""
    rows, cols = linear.weight.shape
    if linear.block is None:
        return linear.scale.float().reshape(()).cpu().expand(rows).clone()
    column = group * GROUP
    if column >= cols:
        return torch.ones(rows)
    return linear.scale.float().cpu()[:, column // linear.block[1]][block_of(rows, linear.block[0])]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``weight * scale`` in fp32: one scale for the tensor (``block`` None), or each scale over
    its ``block`` of the weight, the expanded scales cropped to the weight's shape."""
    w = weight.float()
    if block is None:
        return w * scale.float().reshape(())
    rows, cols = w.shape
    rows_at, cols_at = block_of(rows, block[0], w.device), block_of(cols, block[1], w.device)
    return w * scale.float()[rows_at][:, cols_at]


def block_of(size: int, block: int, device=None) -> torch.Tensor:
    """Each of ``size`` indices' block (of ``block``), by index: no expansion the size of the block,
    which a config may declare far larger than the weight."""
    return torch.arange(size, device=device) // min(block, size)


@dataclass(frozen=True)
class _Key:
    shard: Path
    key: str  # the checkpoint's full name
    kind: str  # safetensors' dtype name
    shape: tuple[int, ...]


class Fp8Reader:
    """A checkpoint's vision keys as :func:`vitgraph.checkpoints.loading.load_tower` meets them: each key
    sorted (:meth:`sort`), the FP8 linears checked once names and shapes are (:meth:`check`),
    their tensors held (:meth:`holds`), then handed back (:meth:`linears`)."""

    def __init__(self, config: Path):
        self.fmt = read_quantization(config)
        self.config = config
        self.kinds: dict[str, str] = {}  # every vision key's dtype, by the tower's name
        self.weights: dict[str, _Key] = {}  # F8_E4M3 weights
        self.scales: dict[str, _Key] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def sort(self, shard: Path, key: str, name: str, kind: str, shape: tuple[int, ...]) -> bool:
        """Whether ``name`` is a scale (kept out of the tower's names and shapes). An F8_E4M3
        weight of an FP8 checkpoint is noted (its shape is checked as any weight's); another
        tensor that is not floating point is refused, naming it."""
        self.kinds[name] = kind
        fmt, here = self.fmt, _Key(shard, key, kind, shape)
        if fmt is not None and name.rsplit(".", 1)[-1] in SCALE_NAMES:
            if fmt.unsupported:
                raise ValueError(f"{shard}: tensor {key!r} is a quantization scale; {fmt.unsupported}")
            self.scales[name] = here
            return True
        if kind in FLOAT_DTYPES:
            return False
        if kind == FP8_DTYPE and fmt is not None and fmt.unsupported is None:
            self.weights[name] = here
            return False
        why = f"vision weights must be floating point ({', '.join(FLOAT_DTYPES)})"
        if kind == FP8_DTYPE and fmt is None:
            why = f"{self.config} has no quantization_config to scale it by; {why}"
        elif fmt is not None and fmt.unsupported:
            why = fmt.unsupported
        else:
            why += f", or {FP8_DTYPE} in an FP8 checkpoint"
        raise ValueError(f"{shard}: tensor {key!r} is {kind}; {why}")

    def check(self) -> None:
        """Every F8 weight a linear's, in a module the config converts, with its scale; every
        scale of an F8 weight, of this format's kinds and of the shape its weight implies."""
        fmt = self.fmt
        for name, w in self.weights.items():
            module = name.removesuffix(".weight")
            if module == name or len(w.shape) != 2 or name.startswith("pos_embed."):
                raise ValueError(f"{w.shard}: tensor {w.key!r} is {FP8_DTYPE}, but only linear weights are read "
                                 "in FP8 (patch and position embeddings, norms and biases stay in high precision)")
            entry = fmt.excluded_by(module)
            if entry is not None:
                raise ValueError(f"{w.shard}: tensor {w.key!r} is {FP8_DTYPE}, but {fmt.config}'s quantization_config."
                                 f"{fmt.not_converted_field} entry {entry!r} keeps module {module!r} unquantized")
            if f"{module}.{fmt.scale_name}" not in self.scales:
                raise ValueError(f"{w.shard}: FP8 weight {w.key!r} has no scale "
                                 f"{w.key.removesuffix('weight') + fmt.scale_name!r} in the checkpoint")
        for name, s in self.scales.items():
            self._check_scale(name, s)

    def _check_scale(self, name: str, s: _Key) -> None:
        fmt = self.fmt
        module, what = name.rsplit(".", 1)
        weight = self.weights.get(module + ".weight")
        weight_key = s.key.removesuffix(what) + "weight"
        if what not in fmt.scale_names:
            raise ValueError(f"{s.shard}: scale {s.key!r} (of weight {weight_key!r}) is no scale of quant_method "
                             f"{fmt.method!r}, which stores {' and '.join(fmt.scale_names)}")
        if weight is None:
            kind = self.kinds.get(module + ".weight")
            found = "absent from the checkpoint" if kind is None else f"{kind}, not {FP8_DTYPE}"
            raise ValueError(f"{s.shard}: scale {s.key!r} belongs to no FP8 weight: {weight_key!r} is {found}")
        expected = fmt.scale_shape(weight.shape) if what == fmt.scale_name else None
        if (s.shape != expected) if expected is not None else (s.shape not in ((), (1,))):
            want = (f"{list(expected)} (blocks of {fmt.block[0]} x {fmt.block[1]})" if expected is not None
                    else "a scalar ([] or [1])")
            raise ValueError(f"{s.shard}: scale {s.key!r} of FP8 weight {weight.key!r} {list(weight.shape)} has "
                             f"shape {list(s.shape)}; expected {want}")
        if s.kind not in FLOAT_DTYPES:
            raise ValueError(f"{s.shard}: scale {s.key!r} of FP8 weight {weight.key!r} is {s.kind}; scales must be "
                             f"floating point ({', '.join(FLOAT_DTYPES)})")

    def holds(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep an FP8 weight or a scale for :meth:`linears`; False for any other tensor."""
        if name in self.weights or name in self.scales:
            self.tensors[name] = tensor
            return True
        return False

    def linears(self) -> dict[str, QuantizedLinear]:
        """The FP8 linears by weight name, each scale checked finite and positive (two flags per
        scale on its device, read back once)."""
        names = list(self.scales)
        if not names:
            return {}
        flags = torch.stack([torch.stack([torch.isfinite(t).all(), (t > 0).all()])
                             for t in (self.tensors[n].float() for n in names)]).tolist()
        for name, (finite, positive) in zip(names, flags):
            if not (finite and positive):
                s = self.scales[name]
                weight_key = s.key.removesuffix(name.rsplit(".", 1)[1]) + "weight"
                why = "a NaN or an inf" if not finite else "a zero or negative value; scales must be positive"
                raise ValueError(f"{s.shard}: scale {s.key!r} of FP8 weight {weight_key!r} holds {why}")
        out = {}
        for name in self.weights:
            module = name.removesuffix(".weight")
            input_scale = self.tensors.get(module + ".input_scale")
            scale = self.tensors[f"{module}.{self.fmt.scale_name}"].float()
            if input_scale is not None:
                input_scale = input_scale.float().reshape(())
            out[name] = QuantizedLinear(self.tensors[name], scale if self.fmt.block else scale.reshape(()),
                                        self.fmt.block, input_scale)
        return out
