"""The host segmentation every family's build_batch uses: ids and offsets, padding by
repeating the last offset, the exact case, and the capacity and max_seqlen errors."""

import pytest
import torch

from vitgraph.models.segments import bounded_seqlen, check_capacity, segment, segmentation


def test_exact_layout_keeps_its_lengths():
    out = segment([4, 2, 3])
    assert out.ids.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert out.cu.tolist() == [0, 4, 6, 9]
    assert out.ids.dtype == out.cu.dtype == torch.int32
    assert out.max_seqlen == 4 and out.lengths == (4, 2, 3)


def test_padded_layout_repeats_the_last_offset_and_marks_padding_rows():
    out = segment([4, 2], num_tokens=8, num_segments=4, max_seqlen=6)
    assert out.ids.tolist() == [0, 0, 0, 0, 1, 1, -1, -1]
    assert out.cu.tolist() == [0, 4, 6, 6, 6]  # empty slots, never zeros
    assert out.max_seqlen == 6 and out.lengths is None
    assert segment([4, 2], num_tokens=6, num_segments=3).lengths is None  # a spare slot is padding too


def test_empty_layouts():
    assert segment([]).cu.tolist() == [0] and segment([]).max_seqlen == 1
    padded = segmentation([], tokens=4, slots=2)
    assert padded.ids.tolist() == [-1] * 4 and padded.cu.tolist() == [0, 0, 0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_tokens=5), "layout of 5 tokens / 2 segments cannot hold 6 tokens / 2 segments"),
    (dict(num_segments=1), "layout of 6 tokens / 1 segments cannot hold 6 tokens / 2 segments"),
    (dict(max_seqlen=3), r"max_seqlen 3 is shorter than the longest segment \(4\)"),
])
def test_layouts_that_cannot_hold_the_segments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        segment([4, 2], **kwargs)


def test_the_checks_name_each_segmentation():
    with pytest.raises(ValueError, match="layout of 8 tokens / 2 frames / 3 windows cannot hold "
                                         "8 tokens / 2 frames / 4 windows"):
        check_capacity(8, 8, {"frames": (2, 2), "windows": (3, 4)})
    check_capacity(8, 8, {"frames": (2, 2), "windows": (4, 4)})
    with pytest.raises(ValueError, match=r"shorter than the longest frame \(5\)"):
        bounded_seqlen(4, [5, 1], "frame")
    assert bounded_seqlen(None, [5, 1]) == 5 and bounded_seqlen(7, [5]) == 7
