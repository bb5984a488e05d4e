"""``vitgraph encode --out``: never inside a folder a checkpoint is read from, never a directory
named with a trailing slash, and a failed write (a full disk) is one line with the old file
left as it was."""

import errno
import os

import pytest
from PIL import Image
from helpers import write_checkpoint

from vitgraph.cli import main as cli_main


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "x.png"
    Image.new("RGB", (56, 84), "green").save(path)
    return path


def run(args, capsys):
    code = cli_main(["encode", *map(str, args), "--device", "cpu"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", ["preprocessor_config.json", "video_preprocessor_config.json",
                                  "processor_config.json", "new.safetensors", "sub/e.safetensors"])
def test_a_new_file_inside_the_checkpoint_folder_is_refused(png, tmp_path, capsys, hf_model, name):
    ckpt = write_checkpoint(tmp_path / "c", hf_model, shards=1)
    (ckpt / "sub").mkdir()
    before = sorted(p.name for p in ckpt.rglob("*"))
    code, err = run([png, "--model", ckpt, "--out", ckpt / name], capsys)
    assert code == 2 and err.count("\n") == 1 and f"--out {ckpt / name}: is inside the folder of the checkpoint" in err
    assert sorted(p.name for p in ckpt.rglob("*")) == before


def test_a_new_file_inside_a_hub_snapshot_or_its_blobs_is_refused(png, tmp_path, capsys, hf_model, monkeypatch):
    """A Hub checkpoint lives in the cache's repo folder (snapshots/REV/ links into blobs/)."""
    repo = tmp_path / "hub" / "models--Qwen--Tiny"
    snapshot = write_checkpoint(repo / "snapshots" / "abc123", hf_model, shards=1)
    (repo / "blobs").mkdir()
    import vitgraph.loading

    monkeypatch.setattr(vitgraph.loading, "find_on_hub", lambda text, **kwargs: vitgraph.loading.find_local(snapshot))
    for out in (snapshot / "preprocessor_config.json", repo / "blobs" / "new", repo / "snapshots" / "other" / "e"):
        out.parent.mkdir(parents=True, exist_ok=True)
        code, err = run([png, "--model", "Qwen/Tiny", "--out", out], capsys)
        assert code == 2 and "is inside the folder of the checkpoint Qwen/Tiny" in err and not out.exists(), err


@pytest.mark.parametrize("suffix", ["/", "/.", "/.."])
def test_an_out_with_a_trailing_slash_names_a_directory(png, tmp_path, capsys, suffix):
    out = f"{tmp_path / 'name'}{suffix}"
    code, err = run([png, "--out", out], capsys)
    assert code == 2 and err == f"vitgraph encode: error: --out {out}: names a directory; give a file path\n"
    assert not (tmp_path / "name").exists()
