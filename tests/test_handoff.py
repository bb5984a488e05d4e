"""vitgraph.handoff on a CPU: the encoder-cache files vLLM's ECExampleConnector reads (layout,
key, values equal to encode_images), atomic writes (a writer killed mid-write leaves nothing
at the consumer's path), id refusal, foreign files left alone, bounded eviction of vitgraph's
own entries, the CLI form, and SGLang's precomputed-embedding item."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from array import array

import pytest
import torch
from helpers import TINY_FAMILIES, png_bytes as png
from safetensors.torch import load_file, save_file

from vitgraph import GraphedVisionEncoder
from vitgraph.models.qwen3_vl import Qwen3VisionConfig
from vitgraph.handoff import (CACHE_FILE, CACHE_KEY, EncoderCache, clean, encode_to_cache, item_id,
                              sglang_request, write_encoder_cache)


@pytest.fixture(scope="module")
def enc():
    return GraphedVisionEncoder.from_config("tiny", device="cpu")


def test_files_hold_ec_cache_equal_to_encode_images(enc, tmp_path):
    images = [png((64, 48), "red"), png((40, 90), "teal")]
    ids = encode_to_cache(enc, images, tmp_path, model="preset:tiny")
    assert ids == [item_id(b, model="preset:tiny", processor=enc.processor) for b in images]
    assert len(ids[0]) == 64 and ids[0] != ids[1]
    for i, expected in zip(ids, enc.encode_images(images=images)):
        loaded = load_file(str(tmp_path / i / CACHE_FILE))  # as ECExampleConnector.start_load_caches reads it
        assert list(loaded) == [CACHE_KEY] and loaded[CACHE_KEY].equal(expected)
    assert sorted(os.listdir(tmp_path)) == sorted(ids) and all(os.listdir(tmp_path / i) == [CACHE_FILE] for i in ids)


def test_item_id_follows_its_documented_recipe_and_the_row_settings(enc):
    import hashlib
    import json

    settings = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136,
                "max_pixels": 12845056, "image_mean": list(enc.processor.image_mean),
                "image_std": list(enc.processor.image_std), "rescale_factor": 1 / 255, "resample": 3}
    header = json.dumps({"model": "m", "processor": settings, "recipe": "vitgraph-item-v1"},
                        sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    expected = hashlib.sha256(header.encode("ascii") + b"\n" + b"img").hexdigest()
    assert item_id(b"img", model="m", processor=enc.processor) == expected
    assert item_id(b"img", model="m", processor=dict(settings, max_pixels=65536)) != expected
    assert item_id(b"img", model="other", processor=enc.processor) != expected
    with pytest.raises(ValueError, match="image_std"):
        item_id(b"img", model="m", processor={k: v for k, v in settings.items() if k != "image_std"})


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../x", "a\\b", "a\x00b", "x" * 201, "é", "a b", "/abs"])
def test_ids_that_would_leave_the_directory_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="item_id"):
        write_encoder_cache(tmp_path, bad, torch.ones(2, 4))
    assert os.listdir(tmp_path) == []


def test_non_finite_and_non_2d_tensors_are_refused(tmp_path):
    with pytest.raises(ValueError, match="item a.*NaN"):
        write_encoder_cache(tmp_path, "a", torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="item a.*2-D"):
        write_encoder_cache(tmp_path, "a", torch.ones(2, 3, 4))
    assert os.listdir(tmp_path) == []


def test_a_foreign_file_is_never_overwritten(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / CACHE_FILE).write_bytes(b"someone else's")
    save_file({CACHE_KEY: torch.zeros(1, 2)}, str(tmp_path / "y.st"))
    (tmp_path / "y").mkdir()
    os.replace(tmp_path / "y.st", tmp_path / "y" / CACHE_FILE)  # a safetensors file without vitgraph's mark
    before = {i: (tmp_path / i / CACHE_FILE).read_bytes() for i in "xy"}
    for i in "xy":
        with pytest.raises(ValueError, match=f"item {i}: .*not written by vitgraph"):
            write_encoder_cache(tmp_path, i, torch.ones(2, 4))
        assert (tmp_path / i / CACHE_FILE).read_bytes() == before[i] and os.listdir(tmp_path / i) == [CACHE_FILE]
    write_encoder_cache(tmp_path, "z", torch.ones(2, 4))
    write_encoder_cache(tmp_path, "z", torch.full((3, 4), 2.0))  # its own entry: replaced
    assert load_file(str(tmp_path / "z" / CACHE_FILE))[CACHE_KEY].equal(torch.full((3, 4), 2.0))


def test_a_write_failing_midway_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    def broken(tensors, name, metadata=None):
        with open(name, "wb") as f:
            f.write(b"\x00" * 100)  # a partial file, then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError):
        write_encoder_cache(tmp_path, "a", torch.ones(2, 4))
    assert os.listdir(tmp_path) == []


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    import vitgraph.handoff as h
    real_replace = os.replace
    def stall(src, dst):  # the temporary file is whole and fsynced: the writer dies before the rename
        print("written", flush=True)
        time.sleep(60)
    h.os.replace = stall
    h.write_encoder_cache(sys.argv[1], "big", torch.randn(4096, 1024))
""")


def test_a_writer_killed_mid_write_leaves_no_file_at_the_consumers_path(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        target = tmp_path / "big" / CACHE_FILE
        assert not target.exists()  # what ECExampleConnector._found_match_for_mm_data checks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not target.exists()
    leftovers = os.listdir(tmp_path / "big")
    assert len(leftovers) == 1 and leftovers[0].startswith(".") and leftovers[0] != CACHE_FILE
    assert clean(tmp_path) == 0 and os.listdir(tmp_path) == []  # clean() removes a killed writer's temp file


def age(directory, ids):
    for i, name in enumerate(ids):  # distinct, increasing times: the order does not rest on the clock's grain
        os.utime(directory / name / CACHE_FILE, ns=(10**18 + i * 10**9,) * 2)


def test_eviction_keeps_the_newest_within_the_bound_and_never_touches_foreign_files(tmp_path):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / CACHE_FILE).write_bytes(b"not vitgraph's")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "empty").mkdir()  # as vLLM's consumer leaves for an id it looked up (makedirs)
    cache = EncoderCache(tmp_path, max_items=2)
    for name in ("a", "b"):
        cache.write(name, torch.ones(4, 8))
    age(tmp_path, ["a", "b"])
    cache.write("c", torch.ones(4, 8))
    assert sorted(os.listdir(tmp_path)) == ["b", "c", "empty", "foreign", "notes.txt"]
    size = (tmp_path / "c" / CACHE_FILE).stat().st_size
    bytes_cache = EncoderCache(tmp_path, max_bytes=2 * size)
    age(tmp_path, ["b", "c"])
    bytes_cache.write("d", torch.ones(4, 8))
    bytes_cache.write("e", torch.ones(40, 8))  # larger than the bound alone: kept, every older one evicted
    assert sorted(os.listdir(tmp_path)) == ["e", "empty", "foreign", "notes.txt"]
    assert clean(tmp_path) == 1
    assert sorted(os.listdir(tmp_path)) == ["empty", "foreign", "notes.txt"]
    assert (tmp_path / "foreign" / CACHE_FILE).read_bytes() == b"not vitgraph's"


def test_concurrent_writers_in_one_process_respect_the_bound(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cache = EncoderCache(tmp_path, max_items=3)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: cache.write(f"i{i}", torch.full((8, 8), float(i))), range(16)))
    left = os.listdir(tmp_path)
    assert len(left) == 3 and all(os.listdir(tmp_path / i) == [CACHE_FILE] for i in left)


def test_the_cli_writes_the_cache_and_prints_the_ids(tmp_path, capsys, enc):
    from vitgraph.cli import main

    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path, size in zip(paths, [(64, 48), (32, 80)]):
        path.write_bytes(png(size, "navy"))
    cache = tmp_path / "cache"
    cache.mkdir()
    assert main(["encode", *map(str, paths), "--encoder-cache", str(cache), "--preset", "tiny", "--device", "cpu"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids == [item_id(p.read_bytes(), model="preset:tiny", processor=enc.processor) for p in paths]
    for i, expected in zip(ids, enc.encode_images(images=[str(p) for p in paths])):
        assert load_file(str(cache / i / CACHE_FILE))[CACHE_KEY].equal(expected)
    assert main(["encode", str(paths[0]), "--encoder-cache", str(cache), "--id", "mine", "--preset", "tiny"]) == 0
    assert capsys.readouterr().out.split() == ["mine"]
    for argv, words in [(["--encoder-cache", str(cache), "--id", "../up"], "item_id"),
                        (["--encoder-cache", str(cache), "--out", str(tmp_path / "o.st")], "exactly one"),
                        ([], "exactly one"), (["--id", "x"], "exactly one"),
                        (["--encoder-cache", str(cache), "--id", "x", "--id", "y"], "one per file"),
                        (["--encoder-cache", str(tmp_path / "missing")], "not an existing directory")]:
        assert main(["encode", str(paths[0]), "--preset", "tiny", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert words in err[-1] and len([line for line in err if "error" in line]) == 1, (argv, err)
    assert sorted(os.listdir(cache)) == sorted(ids + ["mine"])


def test_the_cli_bounds_the_cache_it_writes(tmp_path, capsys):
    from vitgraph.cli import main

    paths = [tmp_path / f"{i}.png" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_bytes(png((32 + 8 * i, 40), "navy"))
    cache = tmp_path / "cache"
    (cache / "foreign").mkdir(parents=True)  # not vitgraph's: never evicted
    assert main(["encode", *map(str, paths), "--encoder-cache", str(cache), "--cache-max-items", "3",
                 "--preset", "tiny", "--device", "cpu"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 3 and sorted(os.listdir(cache)) == sorted(ids + ["foreign"])  # one call's own: all kept
    assert main(["encode", str(paths[0]), "--encoder-cache", str(cache), "--cache-max-items", "3",
                 "--id", "newest", "--preset", "tiny", "--device", "cpu"]) == 0
    assert sorted(os.listdir(cache)) == sorted(ids[1:] + ["newest", "foreign"])  # then the oldest went
    capsys.readouterr()
    assert main(["encode", *map(str, paths), "--encoder-cache", str(cache), "--cache-max-items", "2",
                 "--preset", "tiny", "--device", "cpu"]) == 2  # 3 items cannot all stay: refused, nothing written
    assert "more than the encoder cache's max_items 2" in capsys.readouterr().err
    assert sorted(os.listdir(cache)) == sorted(ids[1:] + ["newest", "foreign"])
    for argv, words in [(["--encoder-cache", str(cache), "--cache-max-items", "0"], "--cache-max-items must be"),
                        (["--encoder-cache", str(cache), "--cache-max-bytes", "-5"], "--cache-max-bytes must be"),
                        (["--out", str(tmp_path / "o.st"), "--cache-max-items", "3"], "give --encoder-cache")]:
        assert main(["encode", str(paths[0]), "--preset", "tiny", *argv]) == 2
        assert words in capsys.readouterr().err.strip().splitlines()[-1], argv


def test_the_sglang_item_follows_sglangs_rules(enc):
    images = [png((64, 48), "red"), png((40, 90), "teal")]
    rows, grid = enc.image_rows(images)
    items = enc.encode_images(images=images)
    request = sglang_request(items, grid)
    # base_processor.py collect_mm_items_from_processor_output: "precomputed_embeddings" becomes the
    # item's precomputed_embeddings, "image_grid_thw" its grid ([k, 3], qwen_vl.py)
    assert set(request) == {"format", "precomputed_embeddings", "image_grid_thw"}
    assert request["format"] == "processor_output"
    embeds, thw = request["precomputed_embeddings"], request["image_grid_thw"]
    assert embeds.dim() == 2 and embeds.shape[1] == enc.output_width and embeds.dtype == items[0].dtype
    assert thw.dtype == torch.int64 and list(thw.shape) == [2, 3] and thw.tolist() == grid.tolist()
    assert embeds.shape[0] == int((thw.prod(-1) // 4).sum())  # t*h*w / merge**2 <|image_pad|> per image
    assert embeds.equal(torch.cat(items)) and embeds.is_contiguous() and embeds.device.type == "cpu"
    assert sglang_request(torch.cat(items), grid)["precomputed_embeddings"].equal(embeds)
    with pytest.raises(ValueError, match="rows"):
        sglang_request(items[::-1], grid)
    with pytest.raises(ValueError, match="rows"):
        sglang_request(torch.cat(items)[1:], grid)
    with pytest.raises(ValueError, match="NaN"):
        sglang_request([torch.full_like(items[0], float("inf")), items[1]], grid)


# SGLang's own code on a CPU, from the request Engine.generate(prompt=..., image_data=[item]) builds
# to the input embeddings of the model's forward: a tiny hub-layout checkpoint built here (no
# network), SGLang's QwenVLImageProcessor built as its tokenizer manager builds it, and SGLang's
# model class with a vision tower that refuses to run (no weights, no GPU).
QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|image_pad|>", "<|video_pad|>")


def tiny_checkpoint(directory, model_type: str, width: int, processor) -> None:
    """config.json from transformers' config class (a one-layer language model ``width`` wide),
    preprocessor_config.json of vitgraph's ``processor``, and a one-character-a-token tokenizer
    holding Qwen's special tokens at the config's ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2VLConfig, Qwen3VLConfig

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    ids = {token: len(chars) + i for i, token in enumerate(QWEN_TOKENS)}
    tokenizer = Tokenizer(models.WordLevel({**{c: i for i, c in enumerate(chars)}, **ids}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    text = dict(vocab_size=len(chars) + len(ids), hidden_size=width, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=ids["<|im_end|>"])
    vision = dict(patch_size=processor.patch_size, temporal_patch_size=processor.temporal_patch_size,
                  spatial_merge_size=processor.merge_size)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if model_type == "qwen2_vl":
        config = Qwen2VLConfig(text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                               vision_config=dict(vision, depth=1, embed_dim=32, num_heads=2, hidden_size=width),
                               architectures=["Qwen2VLForConditionalGeneration"], **tokens)
    else:
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        config = Qwen3VLConfig(text_config=dict(text, head_dim=16, rope_scaling=rope),
                               vision_config=dict(vision, depth=3, hidden_size=32, num_heads=2, intermediate_size=64,
                                                  out_hidden_size=width, deepstack_visual_indexes=[0, 2]),
                               architectures=["Qwen3VLForConditionalGeneration"], **tokens)
    config.save_pretrained(directory)
    settings = {k: getattr(processor, k) for k in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                                                   "max_pixels", "image_mean", "image_std")}
    settings["size"] = {"shortest_edge": processor.min_pixels, "longest_edge": processor.max_pixels}
    (directory / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor",
                                                                    **settings}))


class RefusingTower(torch.nn.Module):
    """A vision tower that fails the test if SGLang calls it."""

    dtype, device = torch.float32, torch.device("cpu")

    def forward(self, pixel_values, grid_thw):
        raise AssertionError(f"tower ran on {tuple(pixel_values.shape)}")


def sglang_of(directory):
    """SGLang's QwenVLImageProcessor of ``directory`` (ServerArgs published, get_processor_wrapper,
    one worker, as TokenizerManager.init_tokenizer_and_processor builds it) and SGLang's model
    class of the checkpoint on a refusing tower, without its __init__ (no weights)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.environ import envs
    from sglang.srt.managers import mm_schedule
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.managers.tokenizer_manager import get_processor_wrapper
    from sglang.srt.models.qwen2_vl import Qwen2VLForConditionalGeneration
    from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_tokenizer

    server_args = ServerArgs(model_path=str(directory), device="cpu", mm_processor_worker_num=1)
    set_global_server_args_for_tokenizer(server_args)
    if mm_schedule.embedding_cache is None:  # as kv_cache_builder does, so that a tower may be reached
        mm_schedule.init_mm_embedding_cache(envs.SGLANG_VLM_CACHE_SIZE_MB.get() * 1024 * 1024)
    config = ModelConfig.from_server_args(server_args).hf_config
    processor = QwenVLImageProcessor(config, server_args, get_processor_wrapper(), "default")
    cls = Qwen3VLForConditionalGeneration if config.model_type == "qwen3_vl" else Qwen2VLForConditionalGeneration
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.config, model.visual, model.use_data_parallel = config, RefusingTower(), False
    if config.model_type == "qwen3_vl":
        model.deepstack_visual_indexes = config.vision_config.deepstack_visual_indexes
        model.num_deepstack_embeddings = len(model.deepstack_visual_indexes)
        model.use_deepstack = {Modality.IMAGE: True, Modality.VIDEO: True}
    return processor, model


def sglang_process(processor, image_data, prompt: str):
    """The processor's output for ``image_data`` with a text ``prompt``, sent as GenerateReqInput
    (Engine.generate's request) to process_mm_data_async (as TokenizerManager does)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    request = GenerateReqInput(text=prompt, image_data=image_data)
    request.normalize_batch_and_arguments()
    return asyncio.run(processor.process_mm_data_async(image_data=request.image_data, input_text=request.text,
                                                       request_obj=request))


def sglang_embeds(processor, model, image_data, prompt: str, table):
    """:func:`sglang_process`, then MultimodalInputs.from_processor_output, the model's pad_input_ids
    and mm_utils.embed_mm_inputs (``table`` embeds the text tokens): (processor output, input
    embeddings, deepstack embeddings or None)."""
    from sglang.srt.managers import mm_utils
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    out = sglang_process(processor, image_data, prompt)
    inputs = MultimodalInputs.from_processor_output(out)
    ids = torch.tensor(list(model.pad_input_ids(array("q", out.input_ids), inputs)))
    embeds, other = mm_utils.embed_mm_inputs([inputs], [0], [len(ids)], ids, table, model,
                                             use_deepstack=getattr(model, "use_deepstack", {}))
    return out, embeds, other.get("input_deepstack_embeds")


def chat(spans) -> str:
    return f"<|im_start|>user\n{''.join(spans)}Describe the images.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def restored_environ():
    """Importing SGLang sets cache paths and flags in os.environ and quiets transformers' logger;
    put both back for the tests after."""
    import logging

    environ, level = dict(os.environ), logging.getLogger("transformers").level
    yield
    os.environ.clear()
    os.environ.update(environ)
    logging.getLogger("transformers").setLevel(level)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_sglang_places_the_rows_as_given_and_runs_no_tower(model_type, tmp_path, restored_environ):
    pytest.importorskip("sglang.srt.multimodal.processors.qwen_vl")
    enc = GraphedVisionEncoder.from_config("tiny" if model_type == "qwen2_vl" else
                                           Qwen3VisionConfig.from_dict(TINY_FAMILIES["qwen3_vl"].cpu), device="cpu")
    images = [png((64, 48), "red"), png((40, 90), "teal")]
    _, grid = enc.image_rows(images)
    items = enc.encode_images(images=images)
    request = sglang_request(items, grid)
    main, deepstack = enc.split(torch.cat(items))
    tiny_checkpoint(tmp_path, model_type, main.shape[1], enc.processor)
    processor, model = sglang_of(tmp_path)
    try:
        table = torch.nn.Embedding(len(processor._tokenizer), main.shape[1])
        spans = [f"<|vision_start|>{'<|image_pad|>' * int(n)}<|vision_end|>" for n in grid.prod(-1) // 4]
        out, embeds, deepstack_embeds = sglang_embeds(processor, model, [request], chat(spans), table)
        (item,) = out.mm_items  # one item, two spans: the rows SGLang keeps are vitgraph's, untouched
        assert item.feature is None and item.precomputed_embeddings.equal(torch.cat(items))
        ids = torch.tensor(out.input_ids)
        image = ids == processor.mm_tokens.image_token_id
        assert embeds[image].equal(main) and embeds[~image].equal(table(ids[~image]))
        if model_type == "qwen3_vl":  # separate_deepstack_embeds put the rest beside the image tokens
            assert len(deepstack) == 2 and deepstack_embeds[image].equal(torch.cat(deepstack, 1))
            assert not deepstack_embeds[~image].any()
        else:
            assert deepstack == [] and deepstack_embeds is None
        # the same images sent as files (SGLang's own HF processor): the same tokens and mrope positions
        raw = sglang_process(processor, images, chat(["<|vision_start|><|image_pad|><|vision_end|>"] * 2))
        assert raw.input_ids == out.input_ids and raw.mrope_positions.equal(out.mrope_positions)
        assert raw.mrope_position_delta.equal(out.mrope_position_delta)
        # the other form SGLang documents puts the rows on item.feature: the model's tower runs on them
        old = {"format": "precomputed_embedding", "feature": torch.cat(items), "image_grid_thw": grid}
        with pytest.raises(AssertionError, match="tower ran"):
            sglang_embeds(processor, model, [old], chat(spans), table)
    finally:
        processor.shutdown()


def test_vllms_consumer_loads_the_file(enc, tmp_path):
    pytest.importorskip("vllm")
    import safetensors.torch
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector  # noqa: F401

    (ident,) = encode_to_cache(enc, [png((64, 48), "red")], tmp_path, model="preset:tiny")
    filename = os.path.join(str(tmp_path), ident, "encoder_cache.safetensors")  # _generate_filename_debug
    assert os.path.exists(filename)  # _found_match_for_mm_data
    ec_cache = safetensors.torch.load_file(filename, device="cpu")["ec_cache"]  # start_load_caches
    assert ec_cache.equal(enc.encode_images(images=[png((64, 48), "red")])[0])
