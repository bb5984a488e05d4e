"""Bad and hostile input outside ``encode``: checkpoints, configs, preprocessing, the CLI and
broken optional extras. Each case asserts the exception type and that the message names the
file, key or field; the encoder and the CLI keep working afterwards."""

import json
import shutil
import sys
import time

import numpy as np
import pytest
import torch
from helpers import TINY_VISION, hf_forward, random_pixels, rel_err, vision_state, write_checkpoint
from PIL import Image
from safetensors.torch import save_file

import vitgraph.checkpoints.loading
from vitgraph import GraphedVisionEncoder, preprocess_images, preprocess_video
from vitgraph.cli import main as cli_main

INDEX = "model.safetensors.index.json"
GRID = [(1, 4, 6)]


def good_encoder_still_works(checkpoint, hf_model):
    enc = GraphedVisionEncoder.from_pretrained(checkpoint, device="cpu")
    pixels = random_pixels(GRID, seed=5)
    assert rel_err(enc.encode(pixels, GRID), hf_forward(hf_model, pixels, GRID)) <= 1e-5


@pytest.fixture
def ckpt(tmp_path, hf_model):
    """A fresh two-shard checkpoint in tmp_path/ckpt, plus another model's in tmp_path/other."""
    write_checkpoint(tmp_path / "other", hf_model, shards=1)
    return write_checkpoint(tmp_path / "ckpt", hf_model, shards=2)


def edit_index(ckpt, edit):
    index = json.loads((ckpt / INDEX).read_text())
    edit(index)
    (ckpt / INDEX).write_text(json.dumps(index))


@pytest.fixture
def opened(monkeypatch):
    """Every path the loader hands to safe_open."""
    paths = []
    real = vitgraph.checkpoints.loading.safe_open

    def recording(path, *args, **kwargs):
        paths.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(vitgraph.checkpoints.loading, "safe_open", recording)
    return paths


# -- loading: the checkpoint folder is a boundary ---------------------------------------

@pytest.mark.parametrize("shard", ["../other/model.safetensors", "ABSOLUTE", "sub/../../other/model.safetensors"])
def test_index_shards_outside_the_folder_are_refused(ckpt, hf_model, opened, shard):
    target = str((ckpt.parent / "other" / "model.safetensors").resolve()) if shard == "ABSOLUTE" else shard
    edit_index(ckpt, lambda ix: ix["weight_map"].update({k: target for k in ix["weight_map"]}))
    with pytest.raises(ValueError, match="outside the checkpoint folder") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert INDEX in str(err.value) and not any("other" in p for p in opened)
    shutil.rmtree(ckpt)
    good_encoder_still_works(write_checkpoint(ckpt, hf_model, shards=2), hf_model)


def test_a_shard_symlinked_outside_the_folder_is_refused(ckpt, opened):
    shard = sorted(ckpt.glob("model-0000*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(ckpt.parent / "other" / "model.safetensors")
    with pytest.raises(ValueError, match="outside the checkpoint folder") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert shard.name in str(err.value) and not opened


def test_a_hub_cache_snapshot_folder_loads(tmp_path, hf_model):
    """The Hub cache's snapshot files are links into the repo's blobs folder: allowed."""
    flat = write_checkpoint(tmp_path / "flat", hf_model, shards=2)
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(flat.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    good_encoder_still_works(snapshot, hf_model)


@pytest.mark.parametrize("weight_map", [["a"], "shard.safetensors", None, 7])
def test_an_index_of_the_wrong_shape(ckpt, weight_map):
    edit_index(ckpt, lambda ix: ix.update(weight_map=weight_map))
    with pytest.raises(ValueError, match="weight_map") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert INDEX in str(err.value)


@pytest.mark.parametrize("shard", [3, ["a.safetensors"], "", None])
def test_a_shard_name_that_is_no_file_name(ckpt, shard):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"visual.merger.ln_q.bias": shard}))
    with pytest.raises(ValueError, match=r"weight_map\['visual.merger.ln_q.bias'\]") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert INDEX in str(err.value)


def test_an_index_that_is_not_json(ckpt):
    (ckpt / INDEX).write_bytes(b"\xff\xfe{not json")
    with pytest.raises(ValueError, match="not valid JSON") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert INDEX in str(err.value)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _header_claims_huge_size(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] = 1 << 50
    raw = json.dumps(header).encode().ljust(n)
    path.write_bytes(data[:8] + raw[:n] + data[8 + n:]) if len(raw) == n else path.write_bytes(
        len(raw).to_bytes(8, "little") + raw + data[8 + n:])


@pytest.mark.parametrize("damage", [
    _truncate,
    lambda p: p.write_bytes(b""),
    lambda p: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-header!!" + b"\0" * 64),
    lambda p: p.write_bytes((1 << 60).to_bytes(8, "little") + b"{}"),
    _header_claims_huge_size,
], ids=["truncated", "empty", "garbage-header", "absurd-header-length", "absurd-tensor-size"])
def test_a_broken_shard_names_the_file(ckpt, hf_model, damage):
    shard = sorted(ckpt.glob("model-0000*.safetensors"))[0]
    damage(shard)
    with pytest.raises(ValueError) as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert shard.name in str(err.value)
    shutil.rmtree(ckpt)
    good_encoder_still_works(write_checkpoint(ckpt, hf_model, shards=2), hf_model)


def test_a_key_in_the_wrong_shard(ckpt):
    index = json.loads((ckpt / INDEX).read_text())
    key = next(k for k, v in index["weight_map"].items() if k.startswith("visual.") and v.startswith("model-00001"))
    edit_index(ckpt, lambda ix: ix["weight_map"].update({key: "model-00002-of-00002.safetensors"}))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert key in str(err.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64])
def test_non_float_weights_are_refused(tmp_path, hf_model, dtype):
    state = vision_state(hf_model)
    state["visual.blocks.0.norm1.weight"] = state["visual.blocks.0.norm1.weight"].to(dtype)
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="visual.blocks.0.norm1.weight") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert "floating point" in str(err.value)
    with pytest.raises(ValueError, match="blocks.0.norm1.weight"):
        GraphedVisionEncoder.from_state_dict(state, {"vision_config": TINY_VISION}, device="cpu")


# -- loading: config values -------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("rope_theta", 0), ("rope_theta", -1.0), ("rope_theta", float("nan")), ("rope_theta", float("inf")),
    ("rope_theta", "10000"), ("mlp_ratio", float("inf")), ("mlp_ratio", 1e30), ("mlp_ratio", True),
    ("embed_dim", 1 << 40), ("depth", 100_000), ("depth", 2.0), ("num_heads", "4"), ("hidden_act", 3),
])
def test_config_values_are_checked_before_anything_is_built(tmp_path, hf_model, field, value):
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    config = json.loads((ckpt / "config.json").read_text())
    config["vision_config"][field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=field) as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert "config.json" in str(err.value) and time.perf_counter() - start < 5


def test_a_deep_config_fails_on_the_keys_before_building(tmp_path, hf_model):
    """depth 1024 (the ceiling) against a 2-block checkpoint: the key check comes first, so no
    1024-block tower is ever built."""
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    config = json.loads((ckpt / "config.json").read_text())
    config["vision_config"]["depth"] = 1024
    (ckpt / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="missing vision key"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert time.perf_counter() - start < 5


def test_expected_shapes_are_the_towers_own():
    from vitgraph import VisionConfig
    from vitgraph.models.qwen2_vl import Qwen2VisionTower, expected_shapes

    cfg = VisionConfig(**{k: v for k, v in TINY_VISION.items()})
    with torch.device("meta"):
        tower = Qwen2VisionTower(cfg)
    assert expected_shapes(cfg) == {n: tuple(t.shape) for n, t in tower.state_dict().items()}


@pytest.mark.parametrize("state,config,error,words", [
    ([("a", 1)], {"vision_config": TINY_VISION}, TypeError, "state_dict must be a mapping"),
    ({1: torch.zeros(1)}, {"vision_config": TINY_VISION}, TypeError, "keys must be strings"),
    ({"visual.blocks.0.norm1.weight": torch.zeros(64, device="meta")}, {"vision_config": TINY_VISION},
     TypeError, "blocks.0.norm1.weight"),
    ({}, [("depth", 2)], TypeError, "config must be a VisionConfig or a mapping"),
])
def test_from_state_dict_refuses_bad_containers(state, config, error, words):
    with pytest.raises(error, match=words):
        GraphedVisionEncoder.from_state_dict(state, config, device="cpu")


@pytest.mark.parametrize("layout", ["sparse", "sparse_csr", "meta"])
def test_from_state_dict_refuses_a_weight_that_is_not_dense(hf_model, layout):
    state = vision_state(hf_model)
    key = "visual.blocks.1.mlp.fc2.weight"
    state[key] = {"sparse": torch.Tensor.to_sparse, "sparse_csr": torch.Tensor.to_sparse_csr,
                  "meta": lambda t: t.to("meta")}[layout](state[key])
    with pytest.raises(TypeError, match=r"state_dict\['blocks.1.mlp.fc2.weight'\] must be a dense tensor"):
        GraphedVisionEncoder.from_state_dict(state, {"vision_config": TINY_VISION}, device="cpu")


def test_a_checkpoint_with_non_finite_weights_is_refused_unless_allowed(tmp_path, hf_model):
    import copy

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        model.blocks[1].mlp.fc2.weight[3, 5] = float("nan")
        model.merger.ln_q.bias[0] = float("-inf")
    ckpt = write_checkpoint(tmp_path / "c", model, shards=2)
    with pytest.raises(ValueError, match="non-finite") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    message = str(err.value)
    assert "blocks.1.mlp.fc2.weight" in message and "merger.ln_q.bias" in message and "allow_nonfinite" in message
    assert "blocks.0" not in message
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", allow_nonfinite_weights=True)
    assert enc.tower.blocks[1].mlp.fc2.weight[3, 5].isnan()
    with pytest.raises(TypeError, match="allow_nonfinite_weights must be a bool"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", allow_nonfinite_weights="yes")
    # A finite fp32 weight that fp16 cannot hold is as non-finite as it runs.
    with torch.no_grad():
        model = copy.deepcopy(hf_model)
        model.blocks[0].attn.qkv.weight[0, 0] = 1e6
    ckpt = write_checkpoint(tmp_path / "big", model, shards=1)
    assert GraphedVisionEncoder.from_pretrained(ckpt, device="cpu").tower.blocks[0].attn.qkv.weight.isfinite().all()
    with pytest.raises(ValueError, match="blocks.0.attn.qkv.weight"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", dtype=torch.float16)


# -- preprocessing ----------------------------------------------------------------------

IMAGE = Image.new("RGB", (60, 40), "blue")


@pytest.mark.parametrize("kwargs,error,words", [
    ({"min_pixels": 10 ** 12}, ValueError, "min_pixels"),
    ({"min_pixels": 4000, "max_pixels": 3000}, ValueError, "must not exceed max_pixels"),
    ({"max_pixels": 0}, ValueError, "max_pixels"),
    ({"max_pixels": -5}, ValueError, "max_pixels"),
    ({"max_pixels": "big"}, TypeError, "max_pixels"),
    ({"min_pixels": 3.5}, TypeError, "min_pixels"),
    ({"max_pixels": 1 << 29}, ValueError, "max_pixels"),
])
def test_pixel_limits_are_bounded(kwargs, error, words):
    start = time.perf_counter()
    for call in (lambda: preprocess_images([IMAGE], **kwargs), lambda: preprocess_video([IMAGE], **kwargs)):
        with pytest.raises(error, match=words):
            call()
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("images,words", [
    (IMAGE, "images must be a list"),
    (np.zeros((2, 28, 28, 3), dtype=np.uint8), r"images must be a list .*shape \[2, 28, 28, 3\]"),
    (torch.zeros(3, 28, 28, dtype=torch.uint8), "images must be a list"),
    ("cat.png", "images must be a list"),
])
def test_a_lone_image_or_batch_array_is_not_a_list(images, words):
    with pytest.raises(TypeError, match=words):
        preprocess_images(images)


def test_encode_images_names_the_bad_item():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu")
    with pytest.raises(TypeError, match=r"videos\[1\] must be a list of frames"):
        enc.encode_images(videos=[[IMAGE, IMAGE], IMAGE])
    with pytest.raises(TypeError, match="videos must be a list"):
        enc.encode_images(videos=IMAGE)
    with pytest.raises(ValueError, match=r"images\[1\]: not an image: no such file"):  # a str is a path
        enc.encode_images([IMAGE, "not an image"])
    with pytest.raises(TypeError, match=r"images\[1\] must be a PIL image"):
        enc.encode_images([IMAGE, 3.5])
    with pytest.raises(ValueError, match=r"videos\[0\]\[1\]"):
        enc.encode_images(videos=[[IMAGE, Image.new("RGB", (0, 0))]])
    with pytest.raises(ValueError, match="min_pixels"):
        enc.encode_images([IMAGE], min_pixels=0)
    assert [e.shape for e in enc.encode_images([IMAGE], videos=[[IMAGE] * 3])] == [(6, 48), (12, 48)]


def test_truncated_and_unsupported_files_name_the_item(tmp_path):
    path = tmp_path / "cut.png"
    Image.effect_noise((64, 64), 40).convert("RGB").save(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"images\[1\].*cannot be decoded"):
        preprocess_images([IMAGE, Image.open(path)])
    odd = Image.new("I;16", (32, 32))
    try:
        odd.convert("RGB")
        convertible = True
    except (ValueError, OSError):
        convertible = False
    if not convertible:
        with pytest.raises(ValueError, match=r"images\[0\].*I;16"):
            preprocess_images([odd])


# -- the CLI ----------------------------------------------------------------------------

def run_cli(args, capsys):
    code = cli_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_encode_never_overwrites_an_input(png, capsys):
    before = png.read_bytes()
    for out in (png, png.parent / "." / png.name):
        code, _, err = run_cli(["encode", png, "--out", out, "--force"], capsys)
        assert code == 2 and "is one of the input images" in err and err.count("\n") == 1
    assert png.read_bytes() == before


def test_encode_checks_out_before_loading(png, tmp_path, capsys, monkeypatch):
    import vitgraph.cli

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(vitgraph.cli, "make_encoder", no_load)
    for out, words in ((tmp_path / "missing" / "e.safetensors", "does not exist"), (tmp_path, "is a directory")):
        code, _, err = run_cli(["encode", png, "--out", out], capsys)
        assert code == 2 and words in err and err.count("\n") == 1


def test_encode_asks_for_force_and_records_its_source(png, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "e.safetensors"
    out.write_text("keep me")
    code, _, err = run_cli(["encode", png, "--out", out], capsys)
    assert code == 2 and "--force" in err and out.read_text() == "keep me"
    code, _, err = run_cli(["encode", png, "--out", out, "--force"], capsys)
    assert code == 0 and "random weights" in err
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        assert f.get_tensor("x.png").shape == (6, 48)
    assert json.loads(meta["grid_thw"]) == {"x.png": [1, 6, 4]} and "tiny" in meta["vitgraph_model"]


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dangling symlink"])
def test_encode_writes_only_a_regular_file_or_a_new_one(png, tmp_path, capsys, kind):
    import os

    target = tmp_path / "target.safetensors"
    target.write_text("keep me")
    out = tmp_path / "out.safetensors"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        out.symlink_to(target if kind == "symlink" else tmp_path / "nowhere")
    code, _, err = run_cli(["encode", png, "--out", out, "--force"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert ("not a regular file" if kind == "fifo" else "symbolic link") in err
    assert target.read_text() == "keep me" and (out.is_fifo() if kind == "fifo" else out.is_symlink())


@pytest.mark.parametrize("name", ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                                  "preprocessor_config.json", "README.md"])
def test_encode_never_overwrites_a_file_of_the_checkpoint(png, tmp_path, capsys, hf_model, name):
    import os

    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=2)
    (ckpt / "preprocessor_config.json").write_text("{}")
    (ckpt / "README.md").write_text("a model card")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    for out in (ckpt / name, ckpt / "." / name):
        code, _, err = run_cli(["encode", png, "--model", ckpt, "--out", out, "--force"], capsys)
        assert code == 2 and "inside the folder of the checkpoint" in err and err.count("\n") == 1
    # A path into it through a linked folder; a hard link elsewhere to a file the run reads.
    (tmp_path / "via").symlink_to(ckpt)
    os.link(ckpt / name, tmp_path / "hard")
    for out in [tmp_path / "via" / name] + [tmp_path / "hard"] * (name != "README.md"):
        code, _, err = run_cli(["encode", png, "--model", ckpt, "--out", out, "--force"], capsys)
        assert code == 2 and "of the checkpoint" in err
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    # A new file beside them is refused too (tests/test_cli_out.py).


def test_a_failed_write_leaves_the_old_output_and_no_temporary_file(png, tmp_path, capsys, monkeypatch):
    import errno

    import safetensors.torch

    out = tmp_path / "e.safetensors"
    out.write_text("the old embeddings")

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, _, err = run_cli(["encode", png, "--out", out, "--force"], capsys)
    error = err.splitlines()[-1]  # after the random weights' warning
    assert code == 2 and "No space left on device" in error and str(out) in error and err.count("error:") == 1
    assert out.read_text() == "the old embeddings" and sorted(tmp_path.iterdir()) == sorted([out, png])
    monkeypatch.undo()
    code, _, _ = run_cli(["encode", png, "--out", out, "--force"], capsys)
    assert code == 0 and out.read_bytes() != b"the old embeddings" and sorted(tmp_path.iterdir()) == sorted([out, png])


def test_encode_one_line_errors_for_bad_files(png, tmp_path, capsys, monkeypatch, hf_model):
    bomb = tmp_path / "bomb.png"
    Image.new("RGB", (300, 300)).save(bomb)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 90000 > 2x this: a DecompressionBombError
    code, _, err = run_cli(["encode", bomb, "--out", tmp_path / "o.safetensors"], capsys)
    assert code == 2 and "bomb.png" in err and err.count("\n") == 1
    monkeypatch.undo()
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=2)
    edit_index(ckpt, lambda ix: ix["weight_map"].update({k: "../x.png" for k in ix["weight_map"]}))
    code, _, err = run_cli(["encode", png, "--out", tmp_path / "o.safetensors", "--model", ckpt], capsys)
    assert code == 2 and "outside the checkpoint folder" in err and err.count("\n") == 1


@pytest.mark.parametrize("args,words", [
    (["--iters", "0"], "--iters"), (["--attention", "bogus"], "--attention"), (["--gemm", "bogus"], "--gemm"),
    (["--systems", "foo"], "--systems"), (["--systems"], "--systems"), (["--warmup", "-1"], "--warmup"),
])
@pytest.mark.parametrize("command", ["bench", "bench-serving"])
def test_bench_usage_errors_exit_2_without_a_traceback(command, args, words, capsys):
    if command == "bench-serving" and args[0] in ("--iters", "--attention", "--gemm", "--warmup"):
        args = ["--requests", "0"] if args[0] == "--iters" else ["--loads", "-1"]
        words = args[0]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([command, *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and words in err and "Traceback" not in err
    assert err.startswith(f"usage: vitgraph {command}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusals")
@pytest.mark.parametrize("args,words", [(["--systems", "vitgraph_graph"], "needs a CUDA device"),
                                        (["--device", "cuda", "--iters", "1"], "CUDA is not available")])
def test_bench_refuses_gpu_work_on_a_cpu(args, words, capsys):
    try:
        code = cli_main(["bench", *args])
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


# -- optional extras installed but broken -----------------------------------------------

def test_broken_extras_fall_back_with_one_warning(tmp_path, monkeypatch, caplog):
    """flash-attn-4 whose CuTe package cannot import (the H200 case: cutlass missing), and a
    cudnn frontend that raises on import: each is found, tried, warned about once, not used."""
    import vitgraph.ops.attention as attention
    import vitgraph.ops.cudnn_attention as cudnn_attention

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "interface.py").write_text("import cutlass_not_installed_xyz\n")
    (tmp_path / "quack").mkdir()
    (tmp_path / "quack" / "__init__.py").write_text("")
    (tmp_path / "cudnn").mkdir()
    (tmp_path / "cudnn" / "__init__.py").write_text("raise OSError('libcudnn.so.9: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface", "quack", "cudnn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    attention.fa4_importable.cache_clear()
    cudnn_attention.available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert attention.fa4_importable() is False and attention.fa4_importable() is False
            assert cudnn_attention.available() is False and cudnn_attention.available() is False
        warnings = [r.getMessage() for r in caplog.records]
        assert sum("flash-attn-4" in w and "cutlass_not_installed_xyz" in w for w in warnings) == 1
        assert sum("cudnn-frontend" in w and "libcudnn" in w for w in warnings) == 1
        assert GraphedVisionEncoder.from_config("tiny", device="cpu").attention == "sdpa"
    finally:
        attention.fa4_importable.cache_clear()
        cudnn_attention.available.cache_clear()


@pytest.mark.parametrize("raw, values", [
    ({"merge_size": 4}, ("merge_size = 4", "spatial_merge_size = 2")),
    ({"patch_size": 7, "temporal_patch_size": 8}, ("patch_size = 7", "patch_size = 14")),  # the same row width
    ({"patch_size": 16}, ("patch_size = 16", "patch_size = 14")),  # another row width
    ({"temporal_patch_size": 1}, ("temporal_patch_size = 1", "temporal_patch_size = 2")),
])
def test_a_processor_that_disagrees_with_the_tower_is_refused_at_load(tmp_path, hf_model, raw, values):
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    (ckpt / "preprocessor_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    message = str(err.value)
    assert "preprocessor_config.json" in message and "config.json " in message
    assert all(v in message for v in values), message
    # Agreeing values load, and so do files that leave them to the tower.
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "merge_size": 2}))
    assert GraphedVisionEncoder.from_pretrained(ckpt, device="cpu").processor.row_width == 3 * 2 * 14 * 14


@pytest.mark.parametrize("raw, field", [
    ({"size": {"shortest_edge": 3136}}, "size"), ({"size": {"longest_edge": 3136}}, "size"),
    ({"size": {"height": 224, "width": 224}}, "size"), ({"size": 224}, "size"),
    ({"image_std": [1e-6, 0.5, 0.5]}, "image_std"),  # a pixel of 1 normalises past fp16's range
    ({"image_mean": [10 ** 400, 0.5, 0.5]}, "image_mean"), ({"image_std": [0.5, 0.5, 10 ** 400]}, "image_std"),
    ({"rescale_factor": 10 ** 400}, "rescale_factor"),  # ints no float holds
    ({"image_mean": [0.5] * 3, "image_std": [7e-6] * 3}, "65504"),
])
def test_a_processor_size_or_std_transformers_would_refuse_or_fp16_cannot_hold_is_refused(tmp_path, hf_model, raw,
                                                                                          field):
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    (ckpt / "preprocessor_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field) as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert "preprocessor_config.json" in str(err.value)
    # The largest std that still fits: (1 - 0) / std just under 65504.
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.0] * 3, "image_std": [1 / 65000] * 3}))
    assert GraphedVisionEncoder.from_pretrained(ckpt, device="cpu").processor.image_std == (1 / 65000,) * 3


SIZE_FORMS = [
    {}, {"min_pixels": 5000}, {"max_pixels": 500000}, {"size": {"shortest_edge": 5000, "longest_edge": 600000}},
    # the form transformers 4.45-4.48 saved: size's own min/max keys, replaced by the top-level ones
    {"size": {"min_pixels": 3136, "max_pixels": 1003520}, "min_pixels": 3136, "max_pixels": 1003520},
    {"size": {"shortest_edge": 3136}, "max_pixels": 500000}, {"size": {"longest_edge": 500000}, "min_pixels": 5000},
    {"size": {"shortest_edge": 5000, "longest_edge": 600000}, "max_pixels": 400000, "min_pixels": None},
    # refused by both
    {"size": {"min_pixels": 3136, "max_pixels": 1003520}}, {"size": {"shortest_edge": 5000}},
    {"size": {"shortest_edge": 5000, "longest_edge": 600000, "height": 3}}, {"size": {"height": 224, "width": 224}},
]


@pytest.mark.parametrize("raw", SIZE_FORMS)
def test_size_and_pixel_keys_are_read_as_transformers_reads_them(raw):
    """transformers' Qwen2-VL processor on the same file is the oracle: the same pixel bounds, or both refuse."""
    import copy

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vitgraph.images.preprocess import ProcessorConfig

    image = Image.new("RGB", (1280, 720))
    # transformers' class defaults stand in for the file's missing size (vitgraph's are the Hub's)
    default = Qwen2VLImageProcessorPil.size
    base = ProcessorConfig(min_pixels=default["shortest_edge"], max_pixels=default["longest_edge"])
    try:
        hf = Qwen2VLImageProcessorPil(**copy.deepcopy(raw))
        hf(images=[image])  # transformers checks size's edges at its first call
    except ValueError:
        with pytest.raises(ValueError, match="size"):
            ProcessorConfig.from_dict(raw, base=base)
        return
    ours = ProcessorConfig.from_dict(raw, base=base)
    assert (ours.min_pixels, ours.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)


def test_a_model_type_without_a_family_is_named(tmp_path, hf_model):
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llava"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'llava' is not supported") as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert "config.json" in str(err.value)


def test_the_checkpoints_preprocessor_config_is_followed_and_checked(tmp_path, hf_model):
    from vitgraph.images.preprocess import ProcessorConfig

    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    image = Image.new("RGB", (560, 420), "white")
    plain = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert plain.processor == ProcessorConfig() and plain.encode_images([image])[0].shape == (300, 48)
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 3136, "longest_edge": 56 * 56 * 4}, "patch_size": 14, "merge_size": 2,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert enc.processor.max_pixels == 12544 and enc.processor.image_mean == (0.5, 0.5, 0.5)
    assert enc.encode_images([image])[0].shape == (12, 48)  # 112 x 84 pixels: 8 x 6 patches
    for raw, field in (({"patch_size": 0}, "patch_size"), ({"image_std": [1, 0, 1]}, "image_std"),
                       ({"size": {"shortest_edge": 3136, "longest_edge": -1}}, "max_pixels"), ([1, 2], "JSON object")):
        (ckpt / "preprocessor_config.json").write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=field) as err:
            GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
        assert "preprocessor_config.json" in str(err.value)
    (ckpt / "preprocessor_config.json").unlink()
    (ckpt / "preprocessor_config.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")


def test_qwen2_vl_reads_its_processor_files_in_transformers_order(tmp_path, hf_model):
    """transformers' order (video_processing_utils): processor_config.json's nested processor,
    then the per-kind file, and for videos preprocessor_config.json last (the file, not the
    nested image processor), each over its transformers class's defaults. Qwen2-VL's video
    processor, unlike Qwen3-VL's, lets a top-level max_pixels replace size's edge. A file naming
    Qwen3-VL's whole-clip processor is refused."""
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 56 * 56 * 16}))
    (ckpt / "processor_config.json").write_text(json.dumps({"image_processor": {"max_pixels": 56 * 56 * 4}}))
    # Qwen2VLVideoProcessor's own minimum (100352) is above this file's maximum: refused, named
    with pytest.raises(ValueError, match=r"preprocessor_config.json: min_pixels \(100352\) must not exceed"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 56 * 56 * 16, "min_pixels": 3136}))
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert [(p.min_pixels, p.max_pixels) for p in (enc.processor, enc.video_processor)] == [
        (3136, 56 * 56 * 4), (3136, 56 * 56 * 16)]
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 3136, "longest_edge": 56 * 56 * 16}, "max_pixels": 56 * 56 * 9}))
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert (enc.processor.max_pixels, enc.video_processor.max_pixels) == (56 * 56 * 4, 56 * 56 * 9)
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({"video_processor_type": "Qwen3VLVideoProcessor"}))
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")  # its images load; its videos are refused
    with pytest.raises(ValueError, match="video_preprocessor_config.json: transformers would read .* Qwen3VLVideoProcessor"):
        enc.encode_images(videos=[[Image.new("RGB", (56, 56))] * 2])
    assert enc.encode_images([Image.new("RGB", (56, 56))])[0].shape[0] == 4


def test_a_processor_saved_by_transformers_makes_the_rows_transformers_makes_from_it(tmp_path, hf_model):
    """transformers' own save_pretrained writes the file; its processor loaded back from the same
    folder is the oracle for grids and rows; Qwen2-VL's videos read the same file."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56 * 2, max_pixels=56 * 56 * 30, image_mean=[0.4, 0.5, 0.6],
                             image_std=[0.2, 0.3, 0.4]).save_pretrained(ckpt)
    hf = Qwen2VLImageProcessorPil.from_pretrained(ckpt)
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
              [(480, 640), (40, 50), (1080, 1920), (300, 301)]]
    ref = hf(images=images, return_tensors="pt")
    rows, grid = preprocess_images(images, processor=enc.processor)
    assert torch.equal(grid, ref["image_grid_thw"].long())
    assert (rows - ref["pixel_values"].float()).abs().max().item() <= 1e-5
    assert enc.video_processor == enc.processor


@pytest.mark.parametrize("name, value", [("do_resize", False), ("do_rescale", False), ("rescale_factor", 1 / 127.5),
                                         ("do_normalize", False), ("do_convert_rgb", False), ("resample", 2),
                                         ("do_normalize", "yes")])
def test_a_processor_setting_vitgraph_does_not_implement_is_refused_by_name(tmp_path, hf_model, name, value):
    """transformers would make other rows from such a file; vitgraph refuses it rather than
    serve its own. The values transformers' processors take by default load."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vitgraph.images.preprocess import FIXED_SETTINGS

    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    for file in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (ckpt / file).write_text(json.dumps({name: value}))
        with pytest.raises(ValueError, match=f"{name} = {value!r} is not supported") as err:
            GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
        assert file in str(err.value)
        (ckpt / file).unlink()
    hf = Qwen2VLImageProcessorPil()
    assert {k: getattr(hf, k) for k in FIXED_SETTINGS} == pytest.approx(FIXED_SETTINGS)
    (ckpt / "preprocessor_config.json").write_text(json.dumps({**FIXED_SETTINGS, "rescale_factor": 0.00392156862745098,
                                                               "cap_pixels_per_frame": None}))
    assert GraphedVisionEncoder.from_pretrained(ckpt, device="cpu").processor.min_pixels > 0
