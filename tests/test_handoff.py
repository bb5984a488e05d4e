"""vitgraph.handoff on a CPU: the encoder-cache files vLLM's ECExampleConnector reads (layout,
key, values equal to encode_images), atomic writes (a writer killed mid-write leaves nothing
at the consumer's path), id refusal, foreign files left alone, bounded eviction of vitgraph's
own entries, the CLI form, and SGLang's precomputed-embedding item."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import png_bytes as png
from safetensors.torch import load_file, save_file

from vitgraph import GraphedVisionEncoder
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


def test_the_sglang_item_follows_sglangs_rules(enc):
    images = [png((64, 48), "red"), png((40, 90), "teal")]
    rows, grid = enc.image_rows(images)
    items = enc.encode_images(images=images)
    request = sglang_request(items, grid)
    # base_processor.py: format "precomputed_embedding", the tensor under "feature"; qwen_vl.py: grid [k, 3]
    assert set(request) == {"format", "feature", "image_grid_thw"}
    assert request["format"] == "precomputed_embedding"
    feature, thw = request["feature"], request["image_grid_thw"]
    assert feature.dim() == 2 and feature.shape[1] == enc.output_width and feature.dtype == items[0].dtype
    assert thw.dtype == torch.int64 and list(thw.shape) == [2, 3] and thw.tolist() == grid.tolist()
    assert feature.shape[0] == int((thw.prod(-1) // 4).sum())  # build_input_ids: t*h*w / merge**2 per image
    assert feature.equal(torch.cat(items)) and feature.is_contiguous() and feature.device.type == "cpu"
    assert sglang_request(torch.cat(items), grid)["feature"].equal(feature)
    with pytest.raises(ValueError, match="rows"):
        sglang_request(items[::-1], grid)
    with pytest.raises(ValueError, match="rows"):
        sglang_request(torch.cat(items)[1:], grid)
    with pytest.raises(ValueError, match="NaN"):
        sglang_request([torch.full_like(items[0], float("inf")), items[1]], grid)


def test_sglangs_own_parser_accepts_the_item(enc):
    pytest.importorskip("sglang")
    from sglang.srt.multimodal.modality import MultimodalInputFormat
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    rows, grid = enc.image_rows([png((64, 48), "red")])
    request = sglang_request(enc.encode_images(images=[png((64, 48), "red")]), grid)
    BaseMultimodalProcessor.validate_mm_data(image_data=[request])
    assert BaseMultimodalProcessor._get_preprocessed_input_format(request) == MultimodalInputFormat.PRECOMPUTED_EMBEDDING
    with pytest.raises(ValueError):
        BaseMultimodalProcessor.validate_mm_data(image_data=[request, request])  # one dict per modality


def test_vllms_consumer_loads_the_file(enc, tmp_path):
    pytest.importorskip("vllm")
    import safetensors.torch
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector  # noqa: F401

    (ident,) = encode_to_cache(enc, [png((64, 48), "red")], tmp_path, model="preset:tiny")
    filename = os.path.join(str(tmp_path), ident, "encoder_cache.safetensors")  # _generate_filename_debug
    assert os.path.exists(filename)  # _found_match_for_mm_data
    ec_cache = safetensors.torch.load_file(filename, device="cpu")["ec_cache"]  # start_load_caches
    assert ec_cache.equal(enc.encode_images(images=[png((64, 48), "red")])[0])
