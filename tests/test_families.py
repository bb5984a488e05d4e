"""What every family's tower must do on a CPU, one test each parametrised over the families
(helpers.TINY_CHECKPOINTS: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5's three kinds): fp32
parity with transformers' own tower from a hub-layout checkpoint, every output (Qwen3-VL's
deepstack features too); loading under either key prefix, from disk and from memory; the padded
layout a bucket gives equal to the exact one; the fused forward against transformers; a bad
config field refused by name. What one family alone does: tests/test_qwen*.py."""

import json

import pytest
import torch
from helpers import (FAMILY_GRIDS, TINY_CHECKPOINTS, diff_report, hf_forward, hub_config, pixels_for, rel_err,
                     vision_state)

from vitgraph import GraphedVisionEncoder

FAMILIES = [name for name, tiny in TINY_CHECKPOINTS.items() if tiny.family == name]  # each family's own entry
SLOW = {"qwen2_5_vl"}  # its windows: seconds a parity sweep on 2 cores
# Per family: values per output row, and the deepstack features among them (Qwen3-VL: main, then two).
OUTPUT = {"qwen2_vl": (48, 0), "qwen2_5_vl": (48, 0), "qwen3_vl": (96, 2), "qwen3_5": (32, 0)}


def _param(name, *values, sweep=True):
    """``name``'s parameters, id ``name-values``; a ``sweep`` of a SLOW family's is marked slow."""
    marks = [pytest.mark.slow] if sweep and TINY_CHECKPOINTS[name].family in SLOW else []
    return pytest.param(name, *values, marks=marks, id="-".join(map(str, (name, *values))))


def assert_outputs_match(encoder, got, ref_main, ref_deepstack, family, label=""):
    """``got`` (encode's rows) against transformers' main output and deepstack features, each to 1e-5."""
    width, deepstack_count = OUTPUT[family]
    assert got.shape == (ref_main.shape[0], width) and encoder.output_width == width
    main, deepstack = encoder.split(got)
    assert main.shape == ref_main.shape
    assert rel_err(main, ref_main) <= 1e-5, (label, diff_report(main, ref_main))
    if deepstack_count:
        assert len(deepstack) == len(ref_deepstack) == deepstack_count
        for part, ref in zip(deepstack, ref_deepstack):
            assert rel_err(part, ref) <= 1e-5, (label, diff_report(part, ref))
    else:
        assert deepstack == [] and ref_deepstack is None


def transformers_outputs(model, pixels, grids):
    """transformers' tower's main output and deepstack features (None where it has none)."""
    with torch.no_grad():
        out = model(pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output, getattr(out, "deepstack_features", None)


@pytest.mark.parametrize("name, case", [_param(name, case) for name, tiny in TINY_CHECKPOINTS.items()
                                        for case in FAMILY_GRIDS[tiny.family]])
def test_fp32_parity_with_transformers(tiny_checkpoints, name, case):
    """The encoder of each hub-layout checkpoint against transformers' tower of its kind (Qwen3.5's
    three: each its own transformers class), main output and every deepstack feature."""
    tiny = TINY_CHECKPOINTS[name]
    model, encoder = tiny_checkpoints.model(name), tiny_checkpoints.encoder(name)
    if tiny.reference is not None:
        assert type(model).__name__ == tiny.reference[0].split(":")[1]
    grids = FAMILY_GRIDS[tiny.family][case]
    pixels = pixels_for(encoder, grids, seed=len(case))
    got = encoder.encode(pixels, grids)
    assert got.shape[0] == pixels.shape[0] // 4
    assert_outputs_match(encoder, got, *transformers_outputs(model, pixels, grids), tiny.family, case)


GRID = [(1, 4, 6), (2, 2, 2)]


def _assert_matches(encoder, model):
    pixels = pixels_for(encoder, GRID, seed=3)
    assert rel_err(encoder.encode(pixels, GRID), hf_forward(model, pixels, GRID)) <= 1e-5


@pytest.mark.parametrize("family, prefix", [_param(f, p, sweep=False) for f in FAMILIES
                                            for p in ("visual.", "model.visual.")])
def test_a_hub_checkpoint_loads_under_either_prefix(tiny_checkpoints, tmp_path, family, prefix):
    """Old repos keep the tower under visual., transformers 5's and Qwen3's under model.visual.:
    both load, the language model's keys (in the last shard) left unread."""
    tiny, model = TINY_CHECKPOINTS[family], tiny_checkpoints.model(family)
    folder = (tiny_checkpoints.checkpoint(family) if prefix == tiny.prefix
              else tiny_checkpoints.write(family, tmp_path, prefix=prefix, shards=2))
    keys = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    other = {"visual.": "model.visual.", "model.visual.": "visual."}[prefix]
    assert any(k.startswith(prefix + "blocks.") for k in keys) and not any(k.startswith(other) for k in keys)
    encoder = (tiny_checkpoints.encoder(family) if prefix == tiny.prefix
               else GraphedVisionEncoder.from_pretrained(folder, device="cpu"))
    _assert_matches(encoder, model)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_state_dict_in_memory_loads_under_any_prefix(tiny_checkpoints, family):
    tiny, model = TINY_CHECKPOINTS[family], tiny_checkpoints.model(family)
    config = hub_config({**tiny.config, **tiny.vision_extra}, tiny.model_type, tiny.top)
    for prefix in ("visual.", "model.visual.", ""):
        enc = GraphedVisionEncoder.from_state_dict(vision_state(model, prefix), config, device="cpu")
        _assert_matches(enc, model)


# Per family: the grids, and the bucket's layout: padding rows, frame slots, max_seqlen (Qwen2.5:
# window slots too).
PADDED = {"qwen2_vl": ("images_of_different_aspect", dict(padding=32, num_segments=6, max_seqlen=256)),
          "qwen2_5_vl": ("several images", dict(padding=64, num_segments=8, max_seqlen=512, num_windows=80)),
          "qwen3_vl": ("several images", dict(padding=32, num_segments=6, max_seqlen=256)),
          "qwen3_5": ("mixed", dict(padding=32, num_segments=6, max_seqlen=256))}


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_layout_equals_the_exact_one(tiny_checkpoints, family):
    """Rows padded to a bucket, spare frame (and window) slots, and NaN in every padding row: the
    real rows come out as from the exact layout."""
    case, layout = PADDED[family]
    layout = dict(layout)
    padding = layout.pop("padding")
    tower, grids = tiny_checkpoints.encoder(family).tower, FAMILY_GRIDS[family][case]
    pixels = pixels_for(tiny_checkpoints.encoder(family), grids, seed=4)
    exact = tower(pixels, tower.build_batch(grids))
    real = pixels.shape[0]
    padded_pixels = torch.cat([pixels, torch.full((padding, pixels.shape[1]), float("nan"))])
    batch = tower.build_batch(grids, num_tokens=real + padding, **layout)
    if family == "qwen2_5_vl":  # every window of the real rows, none of the padding
        assert batch.frame_lengths is None and int(batch.window_cu[-1]) == real
    got = tower(padded_pixels, batch)
    assert torch.isfinite(got[:real // 4]).all()
    assert rel_err(got[:real // 4], exact) <= 1e-5, diff_report(got[:real // 4], exact)


FUSED_GRIDS = {"qwen2_5_vl": ("mixed", "edge-cut windows", "video"),
               "qwen3_vl": ("mixed", "larger than the position grid", "video")}


@pytest.mark.slow
@pytest.mark.parametrize("family, split_k", [pytest.param("qwen2_5_vl", 0, id="qwen2_5_vl-unsplit"),
                                             pytest.param("qwen2_5_vl", 4096, id="qwen2_5_vl-split-K"),
                                             pytest.param("qwen3_vl", None, id="qwen3_vl")])
def test_fused_forward_matches_transformers(tiny_checkpoints, family, split_k):
    """The fused forward (Triton's interpreter on a CPU) against transformers in fp32, every
    output, exact and padded with NaN in the padding rows; state dicts keep the checkpoint's names
    and shapes. Qwen2.5: add+RMSNorm, rotary in place, SiLU * up, the padded SwiGLU width adding
    exact zeros, and proj and down_proj also split in K (what a GPU takes at small row counts),
    summed by add+RMSNorm. Qwen3-VL: add+LayerNorm, rotary and GELU-tanh in place, the deepstack
    mergers reading the stream."""
    tiny, model = TINY_CHECKPOINTS[family], tiny_checkpoints.model(family)
    options = {} if split_k is None else {"tuning": {"gemm.split_k_max_rows": split_k}}
    fused = GraphedVisionEncoder.from_state_dict(vision_state(model, tiny.prefix),
                                                 {"model_type": tiny.model_type, "vision_config": tiny.config},
                                                 device="cpu", fuse=True, **options)
    assert fused.tower.fused
    if family == "qwen2_5_vl":
        assert fused.tower.blocks[0].mlp.padded == 128
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in fused.tower.state_dict().items()} == shapes
    for case in FUSED_GRIDS[family]:
        grids = FAMILY_GRIDS[family][case]
        pixels = pixels_for(fused, grids, seed=9)
        assert_outputs_match(fused, fused.encode(pixels, grids), *transformers_outputs(model, pixels, grids), family,
                             case)
    tower, grids = fused.tower, FAMILY_GRIDS[family]["several images"]
    pixels = pixels_for(fused, grids, seed=4)
    real = pixels.shape[0]
    padded = tower(torch.cat([pixels, torch.full((64, pixels.shape[1]), float("nan"))]),
                   tower.build_batch(grids, num_tokens=real + 64, num_segments=8, max_seqlen=512))
    ref = hf_forward(model, pixels, grids)
    assert torch.isfinite(padded[:real // 4]).all() and rel_err(padded[:real // 4], ref) <= 1e-5


# (family, vision_config field, a bad value: None leaves the field out)
BAD_CONFIGS = [("qwen2_vl", "depth", None), ("qwen2_vl", "num_heads", 5), ("qwen2_vl", "embed_dim", -64),
               ("qwen2_vl", "hidden_act", "relu"),
               ("qwen2_5_vl", "intermediate_size", None), ("qwen2_5_vl", "fullatt_block_indexes", [9]),
               ("qwen2_5_vl", "window_size", 10), ("qwen2_5_vl", "out_hidden_size", 0),
               ("qwen3_vl", "deepstack_visual_indexes", [9]), ("qwen3_vl", "num_position_embeddings", 60),
               ("qwen3_5", "num_position_embeddings", 60), ("qwen3_5", "deepstack_visual_indexes", [1])]


@pytest.mark.parametrize("family, field, value", [pytest.param(*bad, id=f"{bad[0]}-{bad[1]}") for bad in BAD_CONFIGS])
def test_a_bad_config_field_is_refused_by_name(tiny_checkpoints, tmp_path, family, field, value):
    ckpt = tiny_checkpoints.write(family, tmp_path, shards=1)
    config = json.loads((ckpt / "config.json").read_text())
    if value is None:
        del config["vision_config"][field]
    else:
        config["vision_config"][field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
