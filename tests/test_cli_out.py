"""``vitgraph encode --out``: never inside a folder a checkpoint is read from, never a directory
named with a trailing slash, and a failed write (a full disk) is one line with the old file
left as it was."""

import errno
import os

import pytest
from helpers import write_checkpoint

from vitgraph.cli import main as cli_main


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
    import vitgraph.checkpoints.loading

    monkeypatch.setattr(vitgraph.checkpoints.loading, "find_on_hub", lambda text, **kwargs: vitgraph.checkpoints.loading.find_local(snapshot))
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


def full_disk_errors():
    from safetensors import SafetensorError

    # safetensors 0.8 on a full tmpfs: SafetensorError, not OSError (checked by hand on a 64 KiB tmpfs)
    return [OSError(errno.ENOSPC, "No space left on device"),
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                         'message: "No space left on device" })')]


@pytest.mark.parametrize("error", full_disk_errors(), ids=["OSError", "SafetensorError", "RuntimeError"])
def test_a_full_disk_is_one_line_and_exit_2_and_the_old_file_stays(png, tmp_path, capsys, monkeypatch, error):
    import safetensors.torch

    out = tmp_path / "e.safetensors"
    out.write_text("the old embeddings")

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise error

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, err = run([png, "--out", out, "--force"], capsys)
    *warning, last = err.splitlines()  # the random weights' warning, then the error
    assert code == 2 and len(warning) == 1 and "Traceback" not in err
    assert last == (f"vitgraph encode: error: --out {out}: could not be written (No space left on device); left as "
                    "it was") or (error.__class__.__name__ == "SafetensorError" and "No space left" in last)
    assert out.read_text() == "the old embeddings" and sorted(os.listdir(tmp_path)) == ["e.safetensors", "x.png"]


def test_an_error_that_is_not_the_disk_is_not_hidden(png, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    def bug(tensors, filename, metadata=None):
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(safetensors.torch, "save_file", bug)
    with pytest.raises(RuntimeError, match="a bug in the writer"):
        cli_main(["encode", str(png), "--out", str(tmp_path / "e.safetensors"), "--device", "cpu"])
    assert sorted(os.listdir(tmp_path)) == ["x.png"]  # the temporary file is gone
