"""FP8 checkpoints (issue 78, loading): block FP8 (quant_method "fp8", weight_scale_inv) and
ModelOpt's per-tensor FP8 (weight_scale, input_scale), written here as hub-layout files from tiny
random towers quantized in this file, load dequantized to the compute dtype and encode as the
float checkpoint of the same weights; every bad scale and config is refused by name."""

import functools
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import TINY_FAMILIES, hf_tower, random_pixels, rel_err, vision_state, write_two_shards
from safetensors.torch import save_file

from vitgraph import GraphedVisionEncoder
from vitgraph.checkpoints.fp8 import Fp8Reader, QuantFormat, dequantize

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GRID = [(1, 4, 6), (2, 2, 2)]
PREFIX = {"qwen2_vl": "visual.", "qwen2_5_vl": "visual.", "qwen3_vl": "model.visual."}  # as their hub repos
BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head"]}
MODELOPT = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}


@functools.lru_cache(maxsize=None)
def _float_state(family: str, size: str = "cpu") -> dict:
    tiny = TINY_FAMILIES[family]
    return vision_state(hf_tower(tiny.model_type, getattr(tiny, size), seed=0), PREFIX[family])


def float_state(family: str, size: str = "cpu") -> dict:
    """A tiny tower's checkpoint tensors; ``size`` "cuda": widths of 288-1280 (several groups of 128)."""
    return dict(_float_state(family, size))


def is_linear(key: str, w: torch.Tensor) -> bool:
    return key.endswith(".weight") and w.ndim == 2 and ".pos_embed." not in key


def quantize_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale_inv, the dequantized weight), tile by tile."""
    b0, b1 = block
    rows, cols = w.shape
    scale = torch.empty(-(-rows // b0), -(-cols // b1))
    q = torch.empty(rows, cols, dtype=FP8)
    ref = torch.empty(rows, cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
            scale[i, j] = w[tile].abs().max().clamp_min(1e-12) / E4M3_MAX
            q[tile] = (w[tile] / scale[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
            ref[tile] = q[tile].float() * scale[i, j]
    return q, scale, ref


def quantize(state: dict, block=None, keep=(), scale_shape=(), input_scale=None) -> tuple[dict, dict]:
    """(checkpoint tensors, float reference): each linear weight of ``state`` whose key starts
    with none of ``keep`` stored in FP8 with its scale(s); block FP8 for a ``block``, else
    ModelOpt's per-tensor FP8 (scales of ``scale_shape``, an ``input_scale`` if one is given)."""
    out, ref = dict(state), dict(state)
    for key, w in state.items():
        if not is_linear(key, w) or any(key.startswith(k) for k in keep):
            continue
        stem = key.removesuffix("weight")
        if block is not None:
            out[key], out[stem + "weight_scale_inv"], ref[key] = quantize_blocks(w, block)
            continue
        s = w.abs().max() / E4M3_MAX
        out[key] = (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
        ref[key] = out[key].float() * s
        out[stem + "weight_scale"] = s.reshape(scale_shape).clone()
        if input_scale is not None:
            out[stem + "input_scale"] = torch.tensor(input_scale).reshape(scale_shape)
    return out, ref


def lm_fp8() -> dict:
    """The language model's FP8 keys: never read."""
    w = torch.randn(256, 48, generator=torch.Generator().manual_seed(1))
    q, s, _ = quantize_blocks(w, (128, 128))
    return {"model.language_model.layers.0.mlp.up_proj.weight": q,
            "model.language_model.layers.0.mlp.up_proj.weight_scale_inv": s, "lm_head.weight": w}


def write(directory: Path, family: str, tensors: dict, quantization=None, shards: int = 2, size: str = "cpu") -> Path:
    """A hub-layout checkpoint: config.json (with ``quantization`` as its quantization_config), and
    two shards with an index (a weight and its scale often in different shards) or one file."""
    directory.mkdir(parents=True)
    config = {"model_type": TINY_FAMILIES[family].model_type, "vision_config": getattr(TINY_FAMILIES[family], size)}
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in {**tensors, **lm_fp8()}.items()}
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        write_two_shards(directory, tensors)
    return directory


def load(directory: Path) -> GraphedVisionEncoder:
    return GraphedVisionEncoder.from_pretrained(directory, device="cpu", dtype=torch.float32)


def assert_same_encoder(enc: GraphedVisionEncoder, reference: dict, ref_dir: Path, family: str) -> None:
    """``enc``'s weights are ``reference`` (bitwise) and it encodes as the float checkpoint of them."""
    prefix = PREFIX[family]
    weights = enc.tower.state_dict()
    assert sorted(weights) == sorted(k.removeprefix(prefix) for k in reference)
    for key, value in reference.items():
        assert torch.equal(weights[key.removeprefix(prefix)], value), key
    float_enc = load(write(ref_dir, family, reference))
    pixels = random_pixels(GRID, enc.shape.patch_width, seed=3)
    assert torch.equal(enc.encode(pixels, GRID), float_enc.encode(pixels, GRID))


# -- the two formats load dequantized ---------------------------------------------------------

@pytest.mark.parametrize("family, block", [(f, b) for f in PREFIX for b in ([128, 128], [24, 40])]
                         + [("qwen2_vl", [5, 7])], ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_block_fp8_loads_dequantized(tmp_path, family, block):
    tensors, reference = quantize(float_state(family), tuple(block))
    scales = {k: tuple(v.shape) for k, v in tensors.items() if k.endswith("weight_scale_inv")}
    if block == [128, 128]:  # a tiny tower: every dim under 256, some not a multiple of 128
        assert scales[PREFIX[family] + "blocks.0.attn.proj.weight_scale_inv"] == (1, 1)  # 64 x 64
        assert scales[PREFIX[family] + "blocks.0.attn.qkv.weight_scale_inv"] == (2, 1)  # 192 rows: cropped
    else:  # blocks cropped along both dims somewhere
        shapes = [tuple(tensors[k.removesuffix("_scale_inv")].shape) for k in scales]
        assert any(r % block[0] for r, _ in shapes) and any(c % block[1] for _, c in shapes)
    enc = load(write(tmp_path / "fp8", family, tensors, dict(BLOCK, weight_block_size=block)))
    assert_same_encoder(enc, reference, tmp_path / "float", family)


def test_block_fp8_in_one_file_and_bf16(tmp_path):
    tensors, reference = quantize(float_state("qwen2_vl"), (128, 128))
    ckpt = write(tmp_path / "fp8", "qwen2_vl", tensors, BLOCK, shards=1)
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=torch.bfloat16)
    weight = enc.tower.state_dict()["blocks.0.mlp.fc1.weight"]
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, reference["visual.blocks.0.mlp.fc1.weight"].bfloat16())


@pytest.mark.parametrize("scale_shape, input_scale", [((), None), ((1,), None), ((), 0.05), ((1,), 0.05)])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_per_tensor_fp8_loads_dequantized(tmp_path, monkeypatch, family, scale_shape, input_scale):
    tensors, reference = quantize(float_state(family), None, scale_shape=scale_shape, input_scale=input_scale)
    handed_back = []
    real = Fp8Reader.linears
    monkeypatch.setattr(Fp8Reader, "linears", lambda self: handed_back.append(real(self)) or handed_back[-1])
    enc = load(write(tmp_path / "fp8", family, tensors, MODELOPT))
    assert_same_encoder(enc, reference, tmp_path / "float", family)
    # What FP8 GEMMs will take: the FP8 weight, its scale and kind, the static input scale.
    linear = handed_back[0]["blocks.0.attn.qkv.weight"]
    stem = PREFIX[family] + "blocks.0.attn.qkv."
    assert linear.weight.dtype == FP8 and torch.equal(linear.weight, tensors[stem + "weight"])
    assert linear.scale_kind == "tensor" and linear.scale.shape == () and linear.block is None
    assert (linear.input_scale is None) == (input_scale is None)
    if input_scale is not None:
        assert linear.input_scale.item() == pytest.approx(input_scale)


def test_modelopt_config_nested_as_hf_quant_config_writes_it(tmp_path):
    tensors, reference = quantize(float_state("qwen2_vl"), None, keep=("visual.merger.",))
    config = {"quant_method": "modelopt", "quantization": {"quant_algo": "fp8", "exclude_modules": ["visual.merger*"]}}
    assert_same_encoder(load(write(tmp_path / "fp8", "qwen2_vl", tensors, config)), reference, tmp_path / "f",
                        "qwen2_vl")
    everything, _ = quantize(float_state("qwen2_vl"), None)  # the merger too: the nested list names it
    with pytest.raises(ValueError, match=r"quantization_config\.quantization\.exclude_modules entry 'visual.merger\*'"):
        load(write(tmp_path / "bad", "qwen2_vl", everything, config))


def test_dequantize_crops_the_last_blocks():
    weight = torch.tensor([[1, 2, 3, 4, 5], [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]], dtype=torch.float32).to(FP8)
    scale = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    expected = torch.tensor([[1, 2, 6, 8, 20], [1, 1, 2, 2, 4], [1, 1, 0.5, 0.5, 16]])
    assert torch.equal(dequantize(weight, scale, (2, 2)), expected)
    assert torch.equal(dequantize(weight, torch.tensor([0.5]), None), weight.float() * 0.5)


@pytest.mark.parametrize("block", [(2 ** 40, 128), (128, 10 ** 12), (2 ** 70, 2 ** 70)])
def test_a_block_larger_than_its_weight_is_one_block(tmp_path, block):
    """A declared block far beyond the weight is one block over it: loaded (and run grouped where
    its columns allow) without expanding its scales to the block's size (2^40 rows would ask for
    terabytes), and dequantized as a block of the weight's own size is."""
    tensors, reference = quantize(float_state("qwen2_vl"), block)
    ckpt = write(tmp_path / "fp8", "qwen2_vl", tensors, dict(BLOCK, weight_block_size=list(block)))
    enc = load(ckpt)
    weights = enc.tower.state_dict()
    assert all(torch.equal(weights[k.removeprefix("visual.")], v) for k, v in reference.items() if "blocks.0" in k)
    fp8 = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=torch.float32, precision="fp8", fuse=True)
    pixels = random_pixels(GRID, enc.shape.patch_width, seed=3)
    assert rel_err(fp8.encode(pixels, GRID), enc.encode(pixels, GRID)) < 0.1


# -- precision="fp8" on FP8 checkpoints ------------------------------------------------------

@pytest.mark.parametrize("family", list(PREFIX))
def test_fp8_runs_a_per_tensor_checkpoint_on_its_own_e4m3_values(tmp_path, family):
    """The FP8 GEMMs take the checkpoint's e4m3 values (as the tower lays its rows out) and its
    scale in every channel, taken back out of the dequantized weight in bf16 as in fp32, and the
    forward sits at the floor of rounding the activations alone."""
    from vitgraph.models.fp8_floor import fp8_floor

    tensors, reference = quantize(float_state(family), None, scale_shape=(1,), input_scale=0.05)
    ckpt = write(tmp_path / "fp8", family, tensors, MODELOPT)
    encs = {dtype: GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=dtype, precision="fp8", fuse=True)
            for dtype in (torch.float32, torch.bfloat16)}
    tower, prefix = encs[torch.float32].tower, PREFIX[family]
    dequantized = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=torch.float32).tower  # precision bf16
    float_linears = dict(dequantized.named_modules())
    bf16_linears = dict(encs[torch.bfloat16].tower.named_modules())
    quantized = [(name, m) for name, m in tower.named_modules() if hasattr(m, "fp8")]
    assert len(quantized) == 4 * len(tower.blocks)
    for name, module in quantized:
        q, scale, _ = module.fp8
        assert torch.equal(q.float() * scale.reshape(-1, 1), float_linears[name].weight), name  # the checkpoint's values
        stem = f"{prefix}{name}."
        if stem + "weight" in tensors:  # rows reordered (qkv's interleaving), zero columns added (down_proj's)
            stored = tensors[stem + "weight"]
            byte_values = lambda t: t.contiguous().view(torch.uint8).flatten().sort().values
            assert torch.equal(byte_values(q[:, :stored.shape[1]]), byte_values(stored)), name
            assert not q[:, stored.shape[1]:].float().any(), name
            assert torch.equal(scale, tensors[stem + "weight_scale"].expand(1, q.shape[0])), name
        else:  # Qwen2.5-VL's gate_up: [gate; zero rows; up; zero rows], each part with its own scale
            mlp = tower.get_submodule(name.rsplit(".", 1)[0])
            w, p, base = mlp.width, mlp.padded, stem.rsplit(".", 2)[0]
            assert torch.equal(scale[0, :w], tensors[base + ".gate_proj.weight_scale"].expand(w)), name
            assert torch.equal(scale[0, p:p + w], tensors[base + ".up_proj.weight_scale"].expand(w)), name
            assert not q[w:p].float().any() and not q[p + w:].float().any(), name
        bf16_q, bf16_scale, _ = bf16_linears[name].fp8
        assert torch.equal(bf16_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(bf16_scale, scale), name
    float_tower = load(write(tmp_path / "float", family, reference)).tower
    pixels = random_pixels(GRID, tower.input_width, seed=3)
    batch = float_tower.build_batch(GRID)
    with torch.inference_mode():
        ref = float_tower.forward_reference(pixels, batch)
        with fp8_floor(dequantized):  # the checkpoint's weights: only the activations rounded
            floor = dequantized.forward_reference(pixels, batch)
    assert rel_err(encs[torch.float32].encode(pixels, GRID), ref) <= 1.1 * rel_err(floor, ref)


def test_checkpoint_scales_hold_only_where_the_weights_are_the_checkpoints(tmp_path):
    """A gate_up joined from an FP8 gate and a float up takes no checkpoint scales (per channel,
    as a float linear), but is marked block-scaled in a block checkpoint; a weight changed in place
    after loading is quantized per channel again, not clipped to the stale scale."""
    from vitgraph.ops.fp8 import checkpoint_weight, quantize_linear_, quantize_weight

    keep = ("visual.blocks.0.mlp.up_proj.",)
    tensors, _ = quantize(float_state("qwen2_5_vl"), None, keep=keep)
    ckpt = write(tmp_path / "tensor", "qwen2_5_vl", tensors, dict(MODELOPT, ignore=["lm_head", *keep]))
    tower = load(ckpt).tower  # dequantized (precision bf16): the float weights stay for quantize_linear_
    mixed, whole = tower.blocks[0].mlp.gate_up, tower.blocks[1].mlp.gate_up
    assert not hasattr(mixed, "checkpoint_fp8") and whole.checkpoint_fp8.row_scale is not None
    expected = quantize_weight(mixed.weight)
    quantize_linear_(mixed)
    assert mixed.fp8.blocks is None and all(torch.equal(a, b) for a, b in zip(mixed.fp8[:2], expected[:2]))
    proj = tower.blocks[0].attn.proj
    assert checkpoint_weight(proj) is not None
    proj.weight.mul_(3)
    assert checkpoint_weight(proj) is None  # quantize_linear_ then scales it per channel

    tensors, _ = quantize(float_state("qwen2_5_vl"), (128, 128), keep=keep)
    ckpt = write(tmp_path / "block", "qwen2_5_vl", tensors, dict(BLOCK, modules_to_not_convert=["lm_head", *keep]))
    tower = load(ckpt).tower
    mixed, whole = tower.blocks[0].mlp.gate_up.checkpoint_fp8, tower.blocks[1].mlp.gate_up.checkpoint_fp8
    assert mixed.block == whole.block == (128, 128) and mixed.group_scale is None and whole.group_scale is not None


@pytest.mark.slow
@pytest.mark.parametrize("family, block", [("qwen2_vl", (128, 128)), ("qwen2_vl", (64, 256)),
                                           ("qwen2_5_vl", (128, 128)), ("qwen3_vl", (128, 128))])
def test_fp8_runs_a_block_checkpoint_on_its_own_e4m3_values_in_groups(tmp_path, family, block):
    """A block checkpoint (column blocks of whole 128s) runs its GEMMs grouped: the checkpoint's
    e4m3 values (as the tower lays its rows out: qkv interleaved, gate_up joined and padded) and
    each row's scale per 128 input columns, taken back out of the dequantized weight in bf16 as in
    fp32; activations in groups of 128 columns too; the forward sits at the floor of rounding the
    activations alone. The default stays the dequantized checkpoint."""
    from vitgraph.models.fp8_floor import fp8_floor
    from vitgraph.ops.fp8 import group_scales

    tensors, reference = quantize(float_state(family, "cuda"), block)
    ckpt = write(tmp_path / "fp8", family, tensors, dict(BLOCK, weight_block_size=list(block)), size="cuda")
    encs = {dtype: GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=dtype, precision="fp8", fuse=True)
            for dtype in (torch.float32, torch.bfloat16)}
    tower, prefix = encs[torch.float32].tower, PREFIX[family]
    assert tower.fp8_grouped and encs[torch.float32].stats()["precision"] == "fp8"
    dequantized = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=torch.float32).tower
    assert dequantized.precision == "bf16"  # the default: dequantized
    float_linears, bf16_linears = dict(dequantized.named_modules()), dict(encs[torch.bfloat16].tower.named_modules())
    quantized = [(name, m) for name, m in tower.named_modules() if hasattr(m, "fp8")]
    assert len(quantized) == 4 * len(tower.blocks)
    groups_seen = set()
    for name, module in quantized:
        q, scale, _ = module.fp8
        assert module.fp8.grouped and scale.shape == (q.shape[0], -(-q.shape[1] // 128)) and scale.stride(0) == 1
        groups_seen.add(scale.shape[1])
        spread = group_scales(scale, q.shape[1])
        assert torch.equal(q.float() * spread, float_linears[name].weight), name  # the checkpoint's values
        stem = f"{prefix}{name}."
        if stem + "weight" in tensors:  # the same e4m3 bytes, rows reordered (qkv), zero columns added (down_proj)
            stored = tensors[stem + "weight"]
            byte_values = lambda t: t.contiguous().view(torch.uint8).flatten().sort().values
            assert torch.equal(byte_values(q[:, :stored.shape[1]]), byte_values(stored)), name
            assert not q[:, stored.shape[1]:].float().any(), name
            expected = sorted(tensors[stem + "weight_scale_inv"].flatten().tolist())
            assert sorted(set(scale[:, :-(-stored.shape[1] // 128)].flatten().tolist())) == sorted(set(expected)), name
        bf16_q, bf16_scale, _ = bf16_linears[name].fp8
        assert torch.equal(bf16_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(bf16_scale, scale), name
    assert max(groups_seen) > 2  # several groups per row, and a short last one (288 or 320 wide)
    float_tower = load(write(tmp_path / "float", family, reference, size="cuda")).tower
    pixels = random_pixels(GRID, tower.input_width, seed=3)
    batch = float_tower.build_batch(GRID)
    with torch.inference_mode():
        ref = float_tower.forward_reference(pixels, batch)
        with fp8_floor(dequantized):  # the checkpoint's weights: only the activations rounded, in groups
            floor = dequantized.forward_reference(pixels, batch)
        with fp8_floor(float_tower):  # a float checkpoint's floor: rows, per-channel weights
            rowwise_floor = float_tower.forward_reference(pixels, batch)
    got = rel_err(encs[torch.float32].encode(pixels, GRID), ref)
    assert 1e-4 < rel_err(floor, ref) < rel_err(rowwise_floor, ref) and got <= 1.1 * rel_err(floor, ref)


@pytest.mark.slow
def test_a_block_checkpoint_whose_blocks_split_groups_runs_quantized_again(tmp_path):
    """Column blocks that are no whole 128s (40 wide) cannot be read per group: such a checkpoint's
    linears are quantized again in groups, and a float linear beside them (not converted) too; the
    forward sits at the floor of that rounding."""
    from vitgraph.models.fp8_floor import reference_and_floor

    keep = ("visual.blocks.0.mlp.fc2.",)
    tensors, _ = quantize(float_state("qwen2_vl", "cuda"), (24, 40), keep=keep)
    ckpt = write(tmp_path / "fp8", "qwen2_vl", tensors,
                 dict(BLOCK, weight_block_size=[24, 40], modules_to_not_convert=["lm_head", *keep]), size="cuda")
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=torch.float32, precision="fp8", fuse=True)
    linears = [m for b in enc.tower.blocks for m in enc.tower.block_linears(b)]
    assert enc.tower.fp8_grouped and all(m.fp8.grouped for m in linears)
    dequantized = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=torch.float32).tower
    pixels = random_pixels(GRID, dequantized.input_width, seed=4)
    batch = dequantized.build_batch(GRID)
    ref, floor = reference_and_floor(dequantized, pixels, batch)
    assert rel_err(enc.encode(pixels, GRID), ref) <= 1.1 * rel_err(floor, ref)


# -- modules_to_not_convert: every spelling, a module or a prefix -----------------------------

def test_not_converted_matches_every_spelling_and_no_neighbour():
    fmt = QuantFormat("fp8", Path("config.json"), (128, 128), ("model.visual.blocks.1", "visual.merger.",
                                                               "blocks.0.attn.qkv", "*.mlp.fc2"))
    assert fmt.excluded_by("blocks.1.attn.qkv") == "model.visual.blocks.1"
    assert fmt.excluded_by("blocks.1") == "model.visual.blocks.1"
    assert fmt.excluded_by("merger.mlp.0") == "visual.merger"
    assert fmt.excluded_by("blocks.0.attn.qkv") == "blocks.0.attn.qkv"
    assert fmt.excluded_by("blocks.3.mlp.fc2") == "*.mlp.fc2"
    for module in ("blocks.11.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc1",
                   "deepstack_merger_list.0.linear_fc1"):
        assert fmt.excluded_by(module) is None, module
    assert QuantFormat("fp8", Path("c"), (1, 1), ("visual",)).excluded_by("blocks.0.mlp.fc1") == "visual"
    assert QuantFormat("fp8", Path("c"), (1, 1), ("model.visual",)).excluded_by("merger.mlp.0") == "model.visual"
    language_model = QuantFormat("fp8", Path("c"), (1, 1), ("lm_head", "model.language_model"))
    assert language_model.excluded_by("merger.mlp.0") is None


@pytest.mark.parametrize("family, entry, kept", [
    ("qwen2_vl", "visual.merger", "merger."), ("qwen2_vl", "model.visual.merger", "merger."),
    ("qwen2_vl", "merger", "merger."), ("qwen2_vl", "visual.blocks.0.attn.qkv", "blocks.0.attn.qkv."),
    ("qwen3_vl", "model.visual.deepstack_merger_list", "deepstack_merger_list."),
    ("qwen3_vl", "visual.blocks.1", "blocks.1."), ("qwen3_vl", "blocks.2.mlp.linear_fc2", "blocks.2.mlp.linear_fc2."),
])
def test_modules_not_converted_load_float_and_refuse_fp8(tmp_path, family, entry, kept):
    prefix = PREFIX[family]
    config = dict(BLOCK, modules_to_not_convert=["lm_head", entry])
    tensors, reference = quantize(float_state(family), (128, 128), keep=(prefix + kept,))
    assert any(k.startswith(prefix + kept) and v.dtype == torch.float32 for k, v in tensors.items())
    assert_same_encoder(load(write(tmp_path / "ok", family, tensors, config)), reference, tmp_path / "f", family)
    everything, _ = quantize(float_state(family), (128, 128))
    words = (r"is F8_E4M3, but .*config.json's quantization_config.modules_to_not_convert "
             rf"entry {re.escape(repr(entry))} keeps module '{re.escape(kept.rstrip('.'))}")
    with pytest.raises(ValueError, match=words):
        load(write(tmp_path / "bad", family, everything, config))


@pytest.mark.parametrize("config", [
    dict(BLOCK, modules_to_not_convert=["lm_head", "model.visual"]), dict(BLOCK, modules_to_not_convert=["visual"]),
    dict(BLOCK, modules_to_not_convert=None), BLOCK, dict(MODELOPT, ignore=["lm_head", "model.visual*"]), MODELOPT,
    {"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["visual"]},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["*visual*"]},
], ids=["fp8-model.visual", "fp8-visual", "fp8-null", "fp8-silent", "modelopt", "modelopt-silent", "awq", "nvfp4"])
def test_a_float_tower_under_a_quantization_config_loads_as_today(tmp_path, config):
    state = float_state("qwen3_vl")
    assert_same_encoder(load(write(tmp_path / "c", "qwen3_vl", state, config)), state, tmp_path / "f", "qwen3_vl")


# -- every bad scale refused, naming the weight, the scale and the shard ---------------------

QKV = "blocks.0.attn.qkv."


def _edit(edit: str, fmt: str, tensors: dict, p: str) -> tuple[str, str]:
    """Apply ``edit`` to ``tensors``; return (the weight's key, the scale's key) the error must name."""
    scale = p + QKV + ("weight_scale_inv" if fmt == "block" else "weight_scale")
    if edit == "missing":
        del tensors[scale]
    elif edit == "wrong shape":
        tensors[scale] = torch.ones(1, 1) if fmt == "block" else torch.ones(2)
    elif edit in ("nan", "inf", "zero", "negative"):
        tensors[scale] = tensors[scale].clone()
        tensors[scale].view(-1)[0] = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0, "negative": -0.5}[edit]
    elif edit == "float weight":  # a scale whose weight is not FP8
        scale = p + "blocks.0.norm1.weight_scale_inv"
        tensors[scale] = torch.ones(1, 1)
        return p + "blocks.0.norm1.weight", scale
    elif edit == "no weight":
        scale = p + "blocks.7.attn.qkv.weight_scale_inv"
        tensors[scale] = torch.ones(2, 1)
        return p + "blocks.7.attn.qkv.weight", scale
    elif edit == "int scale":
        tensors[scale] = torch.ones(2, 1, dtype=torch.int32)
    elif edit == "input_scale in block fp8":
        scale = p + QKV + "input_scale"
        tensors[scale] = torch.tensor(0.1)
    elif edit in ("input_scale nan", "input_scale negative", "input_scale shape"):
        scale = p + QKV + "input_scale"
        tensors[scale] = {"input_scale nan": torch.tensor(float("nan")), "input_scale negative": torch.tensor(-1.0),
                          "input_scale shape": torch.ones(3)}[edit]
    return p + QKV + "weight", scale


@pytest.mark.parametrize("fmt, edit, words", [
    ("block", "missing", "has no scale"), ("block", "wrong shape", r"has shape \[1, 1\]; expected \[2, 1\]"),
    ("block", "nan", "a NaN or an inf"), ("block", "inf", "a NaN or an inf"),
    ("block", "zero", "zero or negative"), ("block", "negative", "zero or negative"),
    ("block", "float weight", "belongs to no FP8 weight: .* is F32"),
    ("block", "no weight", "belongs to no FP8 weight: .* is absent"), ("block", "int scale", "is I32"),
    ("block", "input_scale in block fp8", "no scale of quant_method 'fp8'"),
    ("tensor", "missing", "has no scale"), ("tensor", "wrong shape", r"has shape \[2\]; expected a scalar"),
    ("tensor", "nan", "a NaN or an inf"), ("tensor", "negative", "zero or negative"),
    ("tensor", "input_scale nan", "a NaN or an inf"), ("tensor", "input_scale negative", "zero or negative"),
    ("tensor", "input_scale shape", r"has shape \[3\]; expected a scalar"),
])
def test_a_bad_scale_is_refused_naming_weight_scale_and_shard(tmp_path, fmt, edit, words):
    p = PREFIX["qwen2_vl"]
    tensors, _ = quantize(float_state("qwen2_vl"), (128, 128) if fmt == "block" else None, input_scale=None)
    weight, scale = _edit(edit, fmt, tensors, p)
    ckpt = write(tmp_path / "c", "qwen2_vl", tensors, BLOCK if fmt == "block" else MODELOPT)
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map[weight if edit == "missing" else scale]
    with pytest.raises(ValueError, match=words) as err:
        load(ckpt)
    message = str(err.value)
    assert repr(weight) in message and repr(scale) in message and shard in message, message


# -- FP8 where it cannot be, and bad configs ---------------------------------------------------

@pytest.mark.parametrize("key, words", [
    ("blocks.0.mlp.fc1.weight", "F8_E5M2; vision weights must be floating point .* or F8_E4M3"),
    ("patch_embed.proj.weight", "only linear weights are read in FP8"),
    ("blocks.0.attn.qkv.bias", "only linear weights are read in FP8"),
    ("blocks.0.norm1.weight", "only linear weights are read in FP8"),
])
def test_fp8_is_refused_where_neither_format_puts_it(tmp_path, key, words):
    tensors, _ = quantize(float_state("qwen2_vl"), (128, 128))
    kind = torch.float8_e5m2 if "E5M2" in words else FP8
    tensors["visual." + key] = tensors["visual." + key].float().to(kind)
    with pytest.raises(ValueError, match=words) as err:
        load(write(tmp_path / "c", "qwen2_vl", tensors, BLOCK))
    assert repr("visual." + key) in str(err.value)


def test_fp8_without_a_quantization_config_is_refused(tmp_path):
    tensors, _ = quantize(float_state("qwen2_vl"), (128, 128))
    with pytest.raises(ValueError, match=r"'visual\.[\w.]+\.weight' is F8_E4M3; .*config.json has no "
                                         r"quantization_config"):
        load(write(tmp_path / "c", "qwen2_vl", {k: v for k, v in tensors.items() if "scale" not in k}))


@pytest.mark.parametrize("config, field", [
    ("fp8", "quantization_config must be a JSON object"), ({"bits": 8}, "quantization_config.quant_method"),
    (dict(BLOCK, weight_block_size=[128]), "weight_block_size"),
    (dict(BLOCK, weight_block_size=[0, 128]), "weight_block_size"),
    (dict(BLOCK, weight_block_size=[128, 128.0]), "weight_block_size"),
    (dict(BLOCK, weight_block_size=[True, 1]), "weight_block_size"),
    (dict(BLOCK, weight_block_size=None), r"weight_block_size .* with no blocks"),
    ({k: v for k, v in BLOCK.items() if k != "weight_block_size"}, "weight_block_size"),
    (dict(BLOCK, activation_scheme="static"), "activation_scheme"), (dict(BLOCK, fmt="e5m2"), "fmt"),
    (dict(BLOCK, scale_fmt="ue8m0"), "scale_fmt"),
    (dict(BLOCK, modules_to_not_convert="visual"), "modules_to_not_convert"),
    ({"quant_method": "modelopt"}, "quant_algo"), ({"quant_method": "modelopt", "quantization": "FP8"}, "quantization"),
    (dict(MODELOPT, ignore=[1]), "ignore"),
    ({"quant_method": "awq", "bits": 4}, r"quantization_config.quant_method is 'awq'"),  # refused as the tower is FP8
    (dict(MODELOPT, quant_algo="NVFP4"), r"quantization_config.quant_algo is 'NVFP4'"),
])
def test_a_bad_quantization_config_is_refused_by_name(tmp_path, config, field):
    tensors, _ = quantize(float_state("qwen2_vl"), (128, 128))
    with pytest.raises(ValueError, match=rf"config.json: .*{field}"):
        load(write(tmp_path / "c", "qwen2_vl", tensors, config))


@pytest.mark.parametrize("config", [
    {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["visual"]},  # AutoFP8, per tensor
    {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
    {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "exclude_modules": "visual"}}])
def test_a_float_tower_under_an_fp8_form_vitgraph_does_not_read_loads(tmp_path, config):
    ref = load(write(tmp_path / "f", "qwen2_vl", float_state("qwen2_vl"), None))
    tower = load(write(tmp_path / "q", "qwen2_vl", float_state("qwen2_vl"), config))
    assert all(torch.equal(a, b) for a, b in zip(ref.tower.state_dict().values(), tower.tower.state_dict().values()))


def test_from_state_dict_refuses_fp8_tensors():
    tensors, _ = quantize(float_state("qwen2_vl"), (128, 128))
    state = {k: v for k, v in tensors.items() if "scale" not in k}  # else the scales are unexpected keys
    config = {"model_type": "qwen2_vl", "vision_config": TINY_FAMILIES["qwen2_vl"].cpu}
    with pytest.raises(ValueError, match=r"is torch.float8_e4m3fn; vision weights must be floating point, 16 bits"):
        GraphedVisionEncoder.from_state_dict(state, config, device="cpu")
