"""The README's Python examples run as written on a CPU machine (those that say they need CUDA,
Ray or the Hub excepted), in order, in one namespace, as a reader would paste them."""

import re

import pytest
import torch
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_the_readme_examples_run_on_a_cpu(capsys):
    blocks = python_blocks()
    runnable = [b for b in blocks if "needs the Hub" not in b and "from ray" not in b]
    assert len(blocks) >= 5 and len(runnable) >= 4, blocks
    names: dict = {}
    for i, block in enumerate(runnable):
        exec(compile(block, str(README), "exec"), names)  # noqa: S102 - the project's own README
        if i == 0:  # the image example: one tensor per item, an image's rows those of its grid
            enc = names["enc"]
            grid = enc.image_rows([names["jpeg"].getvalue()])[1]
            assert tuple(names["photo"].shape) == (int(grid.prod(-1).sum()) // 4, enc.output_width)
            assert names["clip"].shape[1] == enc.output_width
            assert "eager" in capsys.readouterr().out  # print(..., enc.stats()["mode"]) on a CPU
        if i == 1:  # the rows example: one row per 4 patches, written into out as well; uint8 rows
            rows = sum(t * h * w for t, h, w in names["grid_thw"]) // 4
            assert tuple(names["emb"].shape) == (rows, names["enc"].output_width)
            assert names["out"].equal(names["emb"])
            assert names["rows"].dtype == torch.uint8
            assert tuple(names["cat"].shape) == (int(names["grid"].prod(-1).sum()) // 4, names["enc"].output_width)
    assert names["q25"].output_width == 2048
    # Qwen3-VL: the main rows, then each deepstack feature; split() views them apart.
    emb, main, deepstack = names["emb"], names["main"], names["deepstack"]
    assert tuple(emb.shape) == (64, 4 * 2048) and tuple(main.shape) == (64, 2048) and len(deepstack) == 3
    assert main.equal(emb[:, :2048]) and deepstack[2].equal(emb[:, 3 * 2048:])


def test_the_readme_sets_up_in_order_and_ci_runs_its_test_command():
    text = README.read_text()
    steps = ["git clone <url> && cd vitgraph", "python3 -m venv .venv && . .venv/bin/activate",
             "pip install torch --index-url https://download.pytorch.org/whl/cpu",
             "pip install -e . && vitgraph demo", 'pip install -e ".[test]" && python -m pytest -q']
    at = [text.index(step) for step in steps]
    assert at == sorted(at) and "On a CUDA machine, `pip install torch`" in text
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == steps[-1] and any("pip install -q torch==2.13.0" in line for line in ci)
    assert len(text.splitlines()) <= 190
