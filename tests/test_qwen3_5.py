"""Qwen3.5, Qwen3.6 and Qwen4-Exp (``qwen3_5``, ``qwen3_5_moe``, ``qwen4_exp``): Qwen3-VL's tower
with no deepstack merger. The one-part output layout of each kind, their processors' published
defaults and a checkpoint's own files over them, the configs and the presets (fp32 parity with
each of transformers' three classes from hub-layout checkpoints, as every family's:
tests/test_families.py)."""

import json

import pytest
import torch
from helpers import FAMILY_GRIDS, QWEN35_KINDS, TINY_CHECKPOINTS, diff_report, pixels_for, rel_err
from PIL import Image

from vitgraph import GraphedVisionEncoder
from vitgraph.models import Qwen35VisionConfig, Qwen3VisionTower, family_for

# An 8 x 8 position grid (not the released 48 x 48), three blocks.
TINY = TINY_CHECKPOINTS["qwen3_5"].config
GRIDS = FAMILY_GRIDS["qwen3_5"]


@pytest.fixture(params=QWEN35_KINDS)
def kind(request):
    """Each kind's checkpoint (helpers.TINY_CHECKPOINTS: its model_type, key prefix and transformers class)."""
    return request.param


def test_one_tower_no_deepstack_split_and_width(tiny_checkpoints, kind):
    model_type, encoder = TINY_CHECKPOINTS[kind].model_type, tiny_checkpoints.encoder(kind)
    assert type(encoder.tower) is Qwen3VisionTower and len(encoder.tower.deepstack_merger_list) == 0
    assert type(encoder.tower.config) is Qwen35VisionConfig and encoder.tower.config.deepstack_visual_indexes == ()
    assert family_for(model_type).config is Qwen35VisionConfig and encoder.output_width == 32
    grids = GRIDS["mixed"]
    out = encoder.encode(pixels_for(encoder, grids, seed=3), grids)
    main, deepstack = encoder.split(out)
    assert deepstack == [] and torch.equal(main, out) and main.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match=r"\[rows, 32\]"):
        encoder.split(torch.zeros(4, 64))


def test_published_processor_values_are_the_defaults(tiny_checkpoints, kind):
    encoder = tiny_checkpoints.encoder(kind)
    image, video = encoder.processor, encoder.video_processor
    for proc in (image, video):
        assert (proc.patch_size, proc.temporal_patch_size, proc.merge_size) == (16, 2, 2)
        assert proc.image_mean == proc.image_std == (0.5, 0.5, 0.5)
    assert (image.min_pixels, image.max_pixels) == (65536, 16777216)
    assert (video.min_pixels, video.max_pixels) == (4096, 25165824)
    # A 64 x 64 clip keeps its size by the video defaults (4096 pixels at least); as an image it
    # is resized up to 256 x 256 (65536 at least).
    frame = Image.new("RGB", (64, 64), "gray")
    as_image, as_video = encoder.encode_images([frame], [[frame, frame]])
    assert as_image.shape == (16 * 16 // 4, 32) and as_video.shape == (4 * 4 // 4, 32)


def test_the_checkpoints_processor_files_override_the_defaults(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints.write("qwen3_5", tmp_path / "c")
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 1024, "longest_edge": 128 * 128}, "patch_size": 16, "merge_size": 2}))
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 1024, "longest_edge": 64 * 64}, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": [0.25, 0.5, 0.75], "image_std": [0.5, 0.5, 0.5]}))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert (encoder.processor.min_pixels, encoder.processor.max_pixels) == (1024, 16384)
    # The file leaves image_mean out: Qwen2VLImageProcessor's own default (OpenAI CLIP's), as transformers
    assert encoder.processor.image_mean == (0.48145466, 0.4578275, 0.40821073)
    assert (encoder.video_processor.min_pixels, encoder.video_processor.max_pixels) == (1024, 4096)
    assert encoder.video_processor.image_mean == (0.25, 0.5, 0.75)
    frame = Image.new("RGB", (128, 128), "gray")
    as_image, as_video = encoder.encode_images([frame], [[frame, frame]])
    # The image stays 128 x 128 (8 x 8 patches); the clip's two frames go down to 32 x 32 (2 x 2):
    # its 4096 pixels bound both frames, as transformers' Qwen3-VL video processor reads them.
    assert as_image.shape == (8 * 8 // 4, 32) and as_video.shape == (2 * 2 // 4, 32)
    from vitgraph.images.preprocess import preprocess_video

    pixels, grid = preprocess_video([frame, frame], processor=encoder.video_processor)
    alone = encoder.encode_images(videos=[[frame, frame]])[0]  # one call's rows: the same GEMM shapes
    assert grid.tolist() == [[1, 2, 2]] and torch.equal(alone, encoder.encode(pixels, grid))
    torch.testing.assert_close(as_video, alone, rtol=1e-5, atol=1e-5)


def _limits(encoder):
    return [(p.min_pixels, p.max_pixels) for p in (encoder.processor, encoder.video_processor)]


def test_processor_files_are_found_and_read_as_transformers_finds_and_reads_them(tiny_checkpoints, tmp_path):
    """transformers (video_processing_utils, image_processing_base): a processor nested in
    processor_config.json first; for videos then video_preprocessor_config.json, then
    preprocessor_config.json. Qwen3-VL's video processor takes ``size`` alone (its kwargs have no
    min_pixels / max_pixels); the image processor lets top-level ones replace size's edges."""
    ckpt = tiny_checkpoints.write("qwen3_5", tmp_path / "c")
    small, large = {"shortest_edge": 1024, "longest_edge": 64 * 64}, {"shortest_edge": 1024, "longest_edge": 128 * 128}
    # No video file: the image file serves videos too, its size only; the released checkpoints'
    # image class has no video twin, so transformers takes the model's (Qwen3VLVideoProcessor).
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {"size": large, "max_pixels": 96 * 96, "image_processor_type": "Qwen2VLImageProcessorFast"}))
    assert _limits(GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")) == [(1024, 96 * 96), (1024, 128 * 128)]
    # The slow class has one (Qwen2VLVideoProcessor, per frame): its videos are refused, not read
    # another way (test_a_checkpoint_without_a_video_file_loads_and_refuses_only_videos).
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {"size": large, "max_pixels": 96 * 96, "image_processor_type": "Qwen2VLImageProcessor"}))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert "Qwen2VLVideoProcessor" in encoder.video_processor.refused and encoder.processor.refused is None
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"size": large, "max_pixels": 96 * 96}))
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({"size": small, "max_pixels": 96 * 96}))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert _limits(encoder) == [(1024, 96 * 96), (1024, 64 * 64)] and encoder.video_processor.clip_pixels
    # transformers 5's nested file comes first, for each processor it holds.
    (ckpt / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"size": small}, "video_processor": {"size": large}, "processor_class": "Qwen3VLProcessor"}))
    assert _limits(GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")) == [(1024, 64 * 64), (1024, 128 * 128)]
    (ckpt / "processor_config.json").write_text(json.dumps({"video_processor": {"size": large, "image_std": [2, 2, 2]}}))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert _limits(encoder) == [(1024, 96 * 96), (1024, 128 * 128)] and encoder.video_processor.image_std == (2, 2, 2)
    (ckpt / "processor_config.json").write_text(json.dumps({"video_processor": {"size": {"longest_edge": 4096}}}))
    with pytest.raises(ValueError, match=r"processor_config.json \(video_processor\): size"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    (ckpt / "processor_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="processor_config.json: a processor config must be a JSON object"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")


def test_a_checkpoint_without_a_video_file_loads_and_refuses_only_videos(tiny_checkpoints, tmp_path):
    """A Qwen3-family checkpoint whose only processor file names Qwen2VLImageProcessor (as the
    released ones do): transformers would read its videos per frame (Qwen2VLVideoProcessor), so
    vitgraph refuses a call given a video, with that message, and serves its images; the
    encoder stays usable."""
    from vitgraph.images.preprocess import preprocess_video

    ckpt = tiny_checkpoints.write("qwen3_5", tmp_path / "c")
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 1024, "longest_edge": 128 * 128}, "image_processor_type": "Qwen2VLImageProcessor"}))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    frame = Image.new("RGB", (64, 64), "gray")
    before = encoder.encode_images([frame])[0]
    message = ("preprocessor_config.json: transformers would read this checkpoint's videos with "
               "Qwen2VLVideoProcessor, which sizes each frame; vitgraph reads this family's videos with "
               "Qwen3VLVideoProcessor. Add a video_preprocessor_config.json for Qwen3VLVideoProcessor")
    assert encoder.video_processor.refused.endswith(message)
    for call in (lambda: encoder.encode_images([frame], [[frame, frame]]),
                 lambda: encoder.encode_images(videos=[[frame]]),
                 lambda: encoder.submit_images(videos=[[frame, frame]]).result(timeout=60),
                 lambda: preprocess_video([frame, frame], processor=encoder.video_processor)):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value).endswith(message)
    assert torch.equal(encoder.encode_images([frame], videos=[])[0], before)
    assert torch.equal(encoder.submit_images([frame]).result(timeout=60)[0], before)
    encoder.close()
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 1024,
                                                                               "longest_edge": 64 * 64}}))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")  # the file the message asks for
    assert encoder.video_processor.refused is None and encoder.encode_images(videos=[[frame, frame]])[0].shape[0] == 1


def test_a_video_processor_that_caps_pixels_per_frame_loads_and_is_followed(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints.write("qwen3_5", tmp_path / "c")
    video = ckpt / "video_preprocessor_config.json"
    video.write_text(json.dumps({"cap_pixels_per_frame": True, "max_video_tokens": 4,
                                 "size": {"shortest_edge": 4096, "longest_edge": 25165824}}))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert encoder.video_processor.cap_pixels_per_frame and encoder.video_processor.max_video_tokens == 4
    frame = Image.new("RGB", (256, 256), "gray")  # 64 tokens a frame uncapped; 4 capped (2 x 2 merged patches)
    assert encoder.encode_images(videos=[[frame, frame]])[0].shape == (4, 32)
    for raw, field in (({"cap_pixels_per_frame": "yes"}, "cap_pixels_per_frame"), ({"max_video_tokens": 0}, "max_video_tokens")):
        video.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=field):
            GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")


@pytest.mark.parametrize("raw, field", [({"patch_size": 0}, "patch_size"), ({"image_std": [1, 0, 1]}, "image_std"),
                                        ({"size": {"shortest_edge": 1024, "longest_edge": -1}}, "max_pixels"),
                                        ({"size": {"longest_edge": 4096}}, "shortest_edge"),
                                        ({"merge_size": "2"}, "merge_size"), ([1, 2], "JSON object")])
def test_a_bad_video_preprocessor_config_is_refused_by_file_and_field(tiny_checkpoints, tmp_path, raw, field):
    ckpt = tiny_checkpoints.write("qwen4_exp", tmp_path / "c")
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field) as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert "video_preprocessor_config.json" in str(err.value)


@pytest.mark.parametrize("raw, field", [
    ({"fps": -2}, "fps"), ({"fps": float("nan")}, "fps"), ({"fps": float("inf")}, "fps"), ({"fps": "2"}, "fps"),
    ({"fps": True}, "fps"), ({"num_frames": -1}, "num_frames"), ({"num_frames": 2.5}, "num_frames"),
    ({"num_frames": float("nan")}, "num_frames"), ({"min_frames": 0}, "min_frames"),
    ({"max_frames": "768"}, "max_frames"), ({"min_frames": 8, "max_frames": 4}, "min_frames"),
    ({"do_sample_frames": "yes"}, "do_sample_frames"), ({"do_sample_frames": 1}, "do_sample_frames")])
def test_hostile_frame_sampling_values_are_refused_by_file_and_field(tiny_checkpoints, tmp_path, raw, field):
    ckpt = tiny_checkpoints.write("qwen3_5", tmp_path / "c")
    for file in ("video_preprocessor_config.json", "preprocessor_config.json"):  # the second: videos' fallback
        (ckpt / file).write_text(json.dumps(raw))  # json writes NaN and Infinity, and Python reads them
        with pytest.raises(ValueError, match=f"{file}: {field} (must|\\(8\\) must)") as err:
            GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
        assert str(err.value).count("\n") == 0
        (ckpt / file).unlink()


def test_every_frame_given_is_encoded_whatever_the_file_says_of_sampling(tiny_checkpoints, tmp_path):
    """vitgraph does not sample frames: a file asking for sampling (Qwen3-VL's published fields)
    loads, and a clip of 12 frames gives 6 temporal patches, sized by transformers' Qwen3-VL
    video smart_resize for 12 frames, where transformers' own processor would sample 4 of them
    (its sample_frames, the frames taken as 24 fps): the documented difference."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    from vitgraph.images.preprocess import preprocess_video

    ckpt = tiny_checkpoints.write("qwen3_5", tmp_path / "c")
    published = {"do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768, "num_frames": None,
                 "size": {"shortest_edge": 4096, "longest_edge": 64 * 64 * 12}}
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(published))
    encoder = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    frames = [Image.new("RGB", (96, 80), (i * 20, 100, 50)) for i in range(12)]
    rows, grid = preprocess_video(frames, processor=encoder.video_processor)
    h, w = smart_resize(12, 80, 96, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=64 * 64 * 12)
    assert grid.tolist() == [[6, h // 16, w // 16]]
    assert len(Qwen3VLVideoProcessor(**published).sample_frames(VideoMetadata(total_num_frames=12, fps=24))) == 4
    out = encoder.encode_images(videos=[frames])[0]
    assert out.shape[0] == 6 * (h // 16) * (w // 16) // 4
    torch.testing.assert_close(out, encoder.encode(rows, grid), rtol=1e-5, atol=1e-5)


def test_a_video_preprocessor_config_outside_the_folder_is_refused(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints.write("qwen3_5_moe", tmp_path / "c")
    (tmp_path / "elsewhere.json").write_text("{}")
    (ckpt / "video_preprocessor_config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    (ckpt / "video_preprocessor_config.json").unlink()
    (ckpt / "video_preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="video_preprocessor_config.json is not valid JSON"):
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")


def test_deepstack_indexes_are_optional_here_and_refused_when_given():
    bare = {k: v for k, v in TINY.items()}
    for model_type in (TINY_CHECKPOINTS[kind].model_type for kind in QWEN35_KINDS):
        assert Qwen35VisionConfig.from_dict({"model_type": model_type, "vision_config": bare}) == \
            Qwen35VisionConfig(**bare)
    with pytest.raises(ValueError, match="deepstack_visual_indexes must be empty"):
        family_for("qwen3_5").config.from_dict({"vision_config": {**bare, "deepstack_visual_indexes": [1]}})
    with pytest.raises(ValueError, match="missing required field.*deepstack_visual_indexes"):
        family_for("qwen3_vl").config.from_dict({"vision_config": bare})  # Qwen3-VL's stays required
    with pytest.raises(ValueError, match="num_position_embeddings must be a square"):
        Qwen35VisionConfig.from_dict({"vision_config": {**bare, "num_position_embeddings": 60}})


def test_qwen36_preset_is_the_published_shape():
    from vitgraph.models import PRESETS

    cfg = PRESETS["qwen3.6-27b"]
    assert type(cfg) is Qwen35VisionConfig and cfg.deepstack_visual_indexes == ()
    assert (cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.out_hidden_size) == \
        (27, 1152, 4304, 16, 5120)
    assert cfg.num_position_embeddings == 2304 and cfg.patch_width == 1536 and cfg.head_dim == 72


# SPEC's three widths of the tower (hidden, depth, heads, MLP, head_dim), and Qwen4-Exp's.
TOWER_PRESETS = {"qwen3.5-768": (768, 12, 12, 3072, 64), "qwen3.5-1024": (1024, 24, 16, 4096, 64),
                 "qwen3.5-1152": (1152, 27, 16, 4304, 72), "qwen4-exp": (1152, 27, 16, 4304, 72)}


@pytest.mark.parametrize("name", list(TOWER_PRESETS))
def test_every_listed_family_has_a_preset_of_its_published_shape(name):
    """Qwen3.5's three tower widths and Qwen4-Exp can be tried without a checkpoint: each preset
    is the SPEC's shape, and transformers' own vision config accepts it (Qwen4-Exp's is that
    class's defaults)."""
    import importlib

    from vitgraph.cli import build_parser
    from vitgraph.models import PRESETS

    cfg = PRESETS[name]
    assert type(cfg) is Qwen35VisionConfig and cfg.deepstack_visual_indexes == ()
    assert (cfg.hidden_size, cfg.depth, cfg.num_heads, cfg.intermediate_size, cfg.head_dim) == TOWER_PRESETS[name]
    assert cfg.num_position_embeddings == 2304 and cfg.patch_width == 1536
    module = "qwen4_exp" if name == "qwen4-exp" else "qwen3_5"
    hf_cls = getattr(importlib.import_module(f"transformers.models.{module}.configuration_{module}"),
                     "Qwen4ExpVisionConfig" if module == "qwen4_exp" else "Qwen3_5VisionConfig")
    hf = hf_cls(**cfg.transformers_fields())
    assert (hf.hidden_size, hf.depth, hf.num_heads, hf.intermediate_size, hf.out_hidden_size) == (
        cfg.hidden_size, cfg.depth, cfg.num_heads, cfg.intermediate_size, cfg.out_hidden_size)
    if module == "qwen4_exp":
        assert {k: getattr(hf_cls(), k) for k in ("depth", "hidden_size", "num_heads", "intermediate_size",
                                                  "out_hidden_size")} == {k: getattr(cfg, k) for k in (
            "depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size")}
    assert build_parser().parse_args(["demo", "--preset", name]).preset == name  # the CLI offers it


def test_the_smallest_new_preset_builds_and_encodes_on_a_cpu():
    encoder = GraphedVisionEncoder.from_config("qwen3.5-768", device="cpu")
    assert len(encoder.tower.blocks) == 12 and encoder.output_width == 1024
    out = encoder.encode_images([Image.new("RGB", (64, 64), "gray")], min_pixels=64 * 64, max_pixels=64 * 64)
    assert out[0].shape == (4, 1024) and torch.isfinite(out[0]).all()


@pytest.mark.slow
def test_bench_reference_tower_is_transformers_qwen35(tiny_checkpoints, tmp_path, capsys):
    """The bench's hf_eager system: transformers' Qwen3_5VisionModel holding the encoder's weights."""
    from vitgraph.bench import common, latency

    encoder = GraphedVisionEncoder.from_config(Qwen35VisionConfig(**TINY), device="cpu", seed=1)
    hf = common.hf_tower_like(encoder)
    assert type(hf).__name__ == "Qwen3_5VisionModel"
    grids = GRIDS["mixed"]
    pixels = pixels_for(encoder, grids, seed=5)
    ref = common.hf_call(hf, encoder.device)(pixels, grids)
    got = encoder.encode(pixels, grids)
    assert rel_err(got, ref) <= 1e-5, diff_report(got, ref)
    ckpt = tiny_checkpoints.write("qwen3_5_moe", tmp_path / "c")
    result = latency.main(["--model", str(ckpt), "--device", "cpu", "--iters", "1", "--warmup", "0",
                           "--cases", "1x256", "--systems", "hf_eager", "vitgraph_eager"])
    check = result["cases"][0]["check"]
    assert set(check) == {"hf_eager", "vitgraph_eager"} and check["hf_eager"] <= 1e-5


def test_a_kernel_setting_the_family_never_reads_is_refused_before_the_weights_load(tiny_checkpoints, tmp_path,
                                                                                    monkeypatch):
    """Qwen3.5's tower runs no GEMM of vitgraph's: a GEMM setting is refused, naming it and the
    tower, from the checkpoint's config alone."""
    import vitgraph.runtime.encoder

    directory = tiny_checkpoints.write("qwen3_5", tmp_path / "ckpt")

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(vitgraph.runtime.encoder, "load_tower", no_load)
    with pytest.raises(ValueError, match="Qwen3VisionTower does not read 'gemm.split_k_max_rows'"):
        GraphedVisionEncoder.from_pretrained(directory, device="cpu", tuning={"gemm.split_k_max_rows": 64})
