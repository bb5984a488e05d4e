"""Checkpoint loading: layouts, the Hub cache (offline), and every error case (either key prefix and a
bad config field, in every family: tests/test_families.py)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_VISION, hf_forward, hub_config, random_pixels, rel_err, write_checkpoint

from vitgraph import GraphedVisionEncoder, VisionConfig
from vitgraph.models.tower_base import interleave_order

GRID = [(1, 4, 6), (2, 2, 2)]


def _assert_matches(encoder, hf_model):
    pixels = random_pixels(GRID, seed=3)
    assert rel_err(encoder.encode(pixels, GRID), hf_forward(hf_model, pixels, GRID)) <= 1e-5


def test_two_shards_with_index_and_lm_keys(checkpoint, hf_model):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shards_with_vision = {v for k, v in index["weight_map"].items() if k.startswith("visual.")}
    assert len(shards_with_vision) == 2 and any(not k.startswith("visual.") for k in index["weight_map"])
    _assert_matches(GraphedVisionEncoder.from_pretrained(checkpoint, device="cpu"), hf_model)


def test_single_file_bf16(tmp_path, hf_model):
    write_checkpoint(tmp_path, hf_model, shards=1, dtype=torch.bfloat16)
    enc = GraphedVisionEncoder.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    weight = enc.tower.blocks[0].attn.qkv.weight
    assert weight.dtype == torch.float32
    ref = hf_model.blocks[0].attn.qkv.weight.to(torch.bfloat16).float()
    # The tower keeps q's and k's head dims interleaved; its state dict gives the checkpoint's order back.
    cfg = enc.tower.config
    assert torch.equal(weight, ref[interleave_order(cfg.num_heads, cfg.head_dim)])
    assert torch.equal(enc.tower.state_dict()["blocks.0.attn.qkv.weight"], ref)


def test_config_spellings_are_equivalent():
    hub = VisionConfig.from_dict(hub_config())
    native = VisionConfig.from_dict(dict(TINY_VISION))
    assert hub == native and hub.patch_size == 14 and hub.in_channels == 3 and hub.patch_width == 1176


def _make_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """A huggingface_hub cache, laid out as the library itself writes it, holding ``source``'s files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for f in source.iterdir():
        shutil.copy(f, snapshot / f.name)
    return snapshot


def test_hub_offline_opens_only_vision_shards(tmp_path, hf_model, monkeypatch):
    import huggingface_hub

    src = write_checkpoint(tmp_path / "src", hf_model, shards=3)
    snapshot = _make_hub_cache(tmp_path / "cache", "Qwen/Tiny-VL", src)
    lm_shard = "model-00003-of-00003.safetensors"
    (snapshot / lm_shard).write_bytes(b"not a safetensors file: opening it would fail")

    requested = []
    real = huggingface_hub.hf_hub_download

    def spy(repo_id, filename, **kwargs):
        requested.append(filename)
        return real(repo_id, filename, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    enc = GraphedVisionEncoder.from_pretrained("Qwen/Tiny-VL", device="cpu", cache_dir=tmp_path / "cache")
    # The preprocessor configs are asked for too (small, optional: absent from this cache).
    assert sorted(requested) == sorted(["config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                                        "processor_config.json", "model.safetensors.index.json",
                                        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"])
    assert lm_shard not in requested
    _assert_matches(enc, hf_model)


def test_hub_passes_revision_cache_and_offline_flags(tmp_path, hf_model, monkeypatch):
    import huggingface_hub

    src = write_checkpoint(tmp_path / "src", hf_model, shards=1)
    _make_hub_cache(tmp_path / "cache", "Qwen/Tiny-VL-2", src)
    calls = []
    real = huggingface_hub.hf_hub_download

    def spy(repo_id, filename, **kwargs):
        calls.append(dict(kwargs))
        return real(repo_id, filename, **{**kwargs, "revision": None})  # the test cache only has refs/main

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    GraphedVisionEncoder.from_pretrained("Qwen/Tiny-VL-2", device="cpu", cache_dir=tmp_path / "cache",
                                         revision="v1.0", local_files_only=True)
    assert calls and all(c["revision"] == "v1.0" and c["local_files_only"] and
                         c["cache_dir"] == tmp_path / "cache" for c in calls)


def test_hub_offline_single_file(tmp_path, hf_model, monkeypatch):
    src = write_checkpoint(tmp_path / "src", hf_model, shards=1)
    _make_hub_cache(tmp_path / "cache", "Qwen/Tiny-VL-1", src)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    enc = GraphedVisionEncoder.from_pretrained("Qwen/Tiny-VL-1", device="cpu", cache_dir=tmp_path / "cache")
    _assert_matches(enc, hf_model)


def test_hub_offline_missing_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"model Qwen/Not-Cached: config.json is not in the local Hugging Face "
                                         r"cache and downloads are off"):
        GraphedVisionEncoder.from_pretrained("Qwen/Not-Cached", device="cpu", cache_dir=tmp_path)


def _hub_head_raises(monkeypatch, error) -> list[dict]:
    """The Hub's one HEAD request raises ``error``; returns the hf_hub_download calls that follow."""
    import huggingface_hub

    def head(url, **kwargs):
        raise error

    calls = []
    real = huggingface_hub.hf_hub_download
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", head)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def test_an_unreachable_hub_reads_the_cache_without_retries(tmp_path, hf_model, monkeypatch):
    import httpx2

    calls = _hub_head_raises(monkeypatch, httpx2.ConnectError("Name or service not known"))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"model Qwen/Nowhere: config.json is not in the local Hugging Face cache "
                                         r"and the Hugging Face Hub cannot be reached"):
        GraphedVisionEncoder.from_pretrained("Qwen/Nowhere", device="cpu", cache_dir=tmp_path)
    assert time.perf_counter() - start < 5 and calls and all(c["local_files_only"] for c in calls)
    src = write_checkpoint(tmp_path / "src", hf_model, shards=1)  # a cached model still loads
    _make_hub_cache(tmp_path / "cache", "Qwen/Cached", src)
    _assert_matches(GraphedVisionEncoder.from_pretrained("Qwen/Cached", device="cpu", cache_dir=tmp_path / "cache"),
                    hf_model)


def test_an_unknown_hub_repo_or_a_preset_name_is_named(tmp_path, monkeypatch):
    import httpx2
    from huggingface_hub.errors import RepositoryNotFoundError

    request = httpx2.Request("HEAD", "https://huggingface.co/Qwen/Nope/resolve/main/config.json")
    calls = _hub_head_raises(monkeypatch, RepositoryNotFoundError("404", response=httpx2.Response(404, request=request)))
    with pytest.raises(ValueError, match=r"model Qwen/Nope: no such model on the Hugging Face Hub"):
        GraphedVisionEncoder.from_pretrained("Qwen/Nope", device="cpu", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"'tiny' is a preset name.*from_config\('tiny'\)"):
        GraphedVisionEncoder.from_pretrained("tiny", device="cpu", cache_dir=tmp_path)
    assert calls == []


def _rewrite(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    f = directory / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_key(tmp_path, hf_model):
    write_checkpoint(tmp_path, hf_model, shards=1)
    _rewrite(tmp_path, lambda t: t.pop("visual.blocks.1.mlp.fc2.bias"))
    with pytest.raises(ValueError, match=r"missing vision key\(s\): \['blocks.1.mlp.fc2.bias'\]"):
        GraphedVisionEncoder.from_pretrained(tmp_path, device="cpu")


def test_unexpected_key(tmp_path, hf_model):
    write_checkpoint(tmp_path, hf_model, shards=1)
    _rewrite(tmp_path, lambda t: t.update({"visual.blocks.9.extra": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected vision key\(s\): \['blocks.9.extra'\]"):
        GraphedVisionEncoder.from_pretrained(tmp_path, device="cpu")


def test_wrong_shape(tmp_path, hf_model):
    write_checkpoint(tmp_path, hf_model, shards=1)
    _rewrite(tmp_path, lambda t: t.update({"visual.merger.ln_q.weight": torch.zeros(65)}))
    with pytest.raises(ValueError, match=r"merger.ln_q.weight: expected \[64\], got \[65\]"):
        GraphedVisionEncoder.from_pretrained(tmp_path, device="cpu")


def test_missing_directory_and_files(tmp_path, hf_model):
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a Hub repo id"):
        GraphedVisionEncoder.from_pretrained(str(tmp_path / "nope" / "deeper"), device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        GraphedVisionEncoder.from_pretrained(empty, device="cpu")
    (empty / "config.json").write_text(json.dumps(hub_config()))
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        GraphedVisionEncoder.from_pretrained(empty, device="cpu")
    sharded = write_checkpoint(tmp_path / "sharded", hf_model, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        GraphedVisionEncoder.from_pretrained(sharded, device="cpu")


@pytest.mark.slow
def test_loading_a_checkpoint_and_encoding_never_imports_torch_dynamo(checkpoint):
    """Building the tower on the meta device ran ops through torch._refs, which import
    torch._dynamo (seconds of every start); the loader and the forward keep clear of it."""
    code = ("import sys, torch\n"
            "from vitgraph import GraphedVisionEncoder\n"
            "enc = GraphedVisionEncoder.from_pretrained(sys.argv[1], device='cpu')\n"
            "enc.encode(torch.randn(64, enc.shape.patch_width), [(1, 8, 8)])\n"
            "enc.tower.state_dict()\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, str(checkpoint)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]


# -- JSON files: bounded, regular, and every failure a ValueError naming the file -----------

JSON_FILES = ["config.json", "preprocessor_config.json", "model.safetensors.index.json"]


def _load_in_thread(ckpt):
    """from_pretrained, given 20 s: a FIFO read would block it for ever."""
    import threading

    result = {}

    def run():
        try:
            GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
            result["error"] = None
        except Exception as err:  # noqa: BLE001 - the test inspects it
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert "error" in result, "from_pretrained blocked"
    return result["error"]


def _replace_with(path: Path, kind: str, tmp_path: Path) -> None:
    path.unlink(missing_ok=True)
    if kind == "huge":  # sparse: 17 MiB long, nothing on disk
        with open(path, "wb") as f:
            f.truncate(17 << 20)
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "long int":
        path.write_text('{"model_type": "qwen2_vl", "weight_map": {}, "patch_size": 1' + "0" * 5000 + "}")
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "nowhere.json")


@pytest.mark.parametrize("kind, words", [("huge", "bytes"), ("deep", "nested too deeply"),
                                         ("long int", "not valid JSON"), ("directory", "not a regular file"),
                                         ("fifo", "not a regular file"), ("dangling symlink", "")])
@pytest.mark.parametrize("name", JSON_FILES)
def test_a_json_file_that_is_huge_deep_or_not_a_file_is_a_named_error(tmp_path, hf_model, name, kind, words):
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=2)
    (ckpt / "preprocessor_config.json").write_text("{}")
    _replace_with(ckpt / name, kind, tmp_path)
    err = _load_in_thread(ckpt)
    assert isinstance(err, ValueError) and name in str(err) and words in str(err), repr(err)
    (ckpt / name).rmdir() if kind == "directory" else (ckpt / name).unlink()
    if name != "preprocessor_config.json":  # put it back: the encoder then loads
        write_checkpoint(tmp_path / "c", hf_model, shards=2)
    assert _load_in_thread(ckpt) is None


def test_read_json_bounds_and_names(tmp_path):
    from vitgraph.models.config_parsing import read_json

    small = tmp_path / "small.json"
    small.write_text(json.dumps({"a": [1, 2, 3]}))
    assert read_json(small) == {"a": [1, 2, 3]}
    size = small.stat().st_size
    with pytest.raises(ValueError, match=f"small.json: is {size} bytes; a JSON config must be at most {size - 1}"):
        read_json(small, max_bytes=size - 1)
    assert read_json(small, max_bytes=size) == {"a": [1, 2, 3]}
    for path, words in ((tmp_path / ("x" * 300 + ".json"), "cannot be read"),
                        (tmp_path / "missing.json", "no such file")):
        with pytest.raises(ValueError, match=words) as err:
            read_json(path)
        assert str(path) in str(err.value)
    (tmp_path / "folder.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")  # opened non-blocking: refused, never waited on
    for path, words in ((tmp_path / "folder.json", "folder.json: is a directory, not a JSON config"),
                        (tmp_path / "fifo.json", "fifo.json: is not a regular file")):
        with pytest.raises(ValueError, match=words):
            read_json(path)


def test_a_very_long_model_path_is_a_named_error(tmp_path):
    for source in (str(tmp_path / ("a" * 300)), str(tmp_path / ("a" * 300) / "b")):
        with pytest.raises(ValueError, match="cannot be looked up"):
            GraphedVisionEncoder.from_pretrained(source, device="cpu")
