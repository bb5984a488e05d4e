"""A safetensors index whose shard name holds a NUL byte: the refusal names the index and the
shard (it was only "embedded null byte"), in the API and on the command line."""

import json

import pytest
from helpers import write_checkpoint

from vitgraph import GraphedVisionEncoder
from vitgraph.cli import main as cli_main

SHARD = "model-00001\x00-of-00002.safetensors"


@pytest.fixture
def ckpt(tmp_path, hf_model):
    folder = write_checkpoint(tmp_path / "c", hf_model, shards=2)
    index = folder / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"] = {k: SHARD if v.startswith("model-00001") else v for k, v in raw["weight_map"].items()}
    index.write_text(json.dumps(raw))
    return folder


def test_a_nul_byte_in_a_shard_name_names_the_index_and_the_shard(ckpt):
    with pytest.raises(ValueError) as err:
        GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    assert str(ckpt / "model.safetensors.index.json") in str(err.value) and repr(SHARD) in str(err.value)
    assert "NUL byte" in str(err.value)


def test_on_the_command_line_it_is_one_line(ckpt, capsys):
    assert cli_main(["info", "--model", str(ckpt), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors.index.json" in err and "model-00001\\x00-of-00002" in err
