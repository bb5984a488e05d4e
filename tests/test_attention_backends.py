"""The attention backends as one table of traits (vitgraph.ops.backend_names): the towers, the
buckets and the precompile ask a backend's traits, never its name, so a backend is one row."""

import dataclasses

import pytest
import torch

from vitgraph.checkpoints.loading import build_tower
from vitgraph.models import PRESETS
from vitgraph.ops import backend_names
from vitgraph.ops.attention import resolve_backend
from vitgraph.ops.backend_names import ATTENTION, attention_backend


def test_the_table_names_every_backend_fastest_first_and_refuses_others():
    assert tuple(ATTENTION) == backend_names.BACKENDS == ("fa4", "cudnn", "varlen", "flash", "sdpa")
    assert [n for n, b in ATTENTION.items() if not b.half_only] == ["sdpa"]  # fp32's and the CPU's
    assert resolve_backend("auto", "cpu", torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="attention backend must be one of"):
        attention_backend("auto")


def _paths(backend: str, grids, tokens: int, segments: int):
    tower = build_tower(PRESETS["tiny"], torch.device("cpu"), torch.float32)
    tower.set_attention_backend(backend)
    return tower.fused_paths(tower.build_batch(grids, num_tokens=tokens, num_segments=segments,
                                              max_seqlen=tokens))


@pytest.mark.parametrize("backend", list(ATTENTION))
def test_the_fused_paths_follow_the_traits(backend):
    traits = ATTENTION[backend]
    dense = _paths(backend, [(1, 4, 4)], 32, 1)  # one padded segment slot
    packed = _paths(backend, [(1, 4, 4), (1, 2, 4)], 32, 4)
    assert (dense.lane is not None) == traits.lane_pad
    assert packed.ragged == traits.ragged and packed.zero_padding == traits.reads_past_segments


def test_a_new_row_changes_the_paths_without_a_name_anywhere(monkeypatch):
    """A backend the code has never heard of, declared like cuDNN, takes cuDNN's paths."""
    monkeypatch.setitem(ATTENTION, "mine", dataclasses.replace(ATTENTION["cudnn"], name="mine"))
    assert _paths("mine", [(1, 4, 4), (1, 2, 4)], 32, 4) == _paths("cudnn", [(1, 4, 4), (1, 2, 4)], 32, 4)
    assert _paths("mine", [(1, 4, 4), (1, 2, 4)], 32, 4).ragged
