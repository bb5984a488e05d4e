"""The vLLM examples on a CPU: the grids they hand vLLM beside the rows are vitgraph's own
(EXIF orientation included), and without a GPU or vLLM they say what they need."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from vitgraph.images.pipeline import image_rows
from vitgraph.images.preprocess import QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    sys.path.insert(0, str(EXAMPLES))  # as `python examples/NAME.py` runs it: the examples import each other
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def files(tmp_path):
    paths = []
    for i, (w, h) in enumerate([(640, 480), (300, 900), (1000, 60)]):
        image = Image.new("RGB", (w, h), (40 * i, 90, 200))
        exif = image.getexif()
        exif[0x0112] = 6 if i == 0 else 1  # the first turned a quarter by its EXIF orientation
        paths.append(tmp_path / f"{i}.jpg")
        image.save(paths[-1], "JPEG", exif=exif)
    return [str(p) for p in paths]


@pytest.mark.parametrize("processor", [QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR], ids=["qwen2", "qwen3"])
def test_the_examples_grids_are_vitgraphs(files, processor):
    grids = load("vllm_image_embeds").grid_thw(files, processor)
    expected = image_rows(files, processor=processor, device=torch.device("cpu"), preprocess="pil")[1]
    assert grids.tolist() == expected.tolist() and grids[0, 1] > grids[0, 2]  # the turned image stands upright


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the example goes on to load vLLM")
@pytest.mark.parametrize("name", ["vllm_image_embeds", "vllm_qwen3_image_embeds"])
def test_the_examples_say_they_need_a_gpu_and_vllm(files, name):
    with pytest.raises(SystemExit, match=r"needs a CUDA device and vLLM >= 0.11.1 .*: no CUDA device here"):
        load(name).main(files)
