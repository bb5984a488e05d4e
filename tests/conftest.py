import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():
    # vitgraph's Triton kernels then run on CPU tensors through Triton's interpreter.
    # Set before vitgraph.ops.kernels is imported: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_model():
    from helpers import hf_tower
    return hf_tower(seed=0)


@pytest.fixture(scope="session")
def checkpoint(hf_model, tmp_path_factory):
    from helpers import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), hf_model, shards=2)


# The CUDA suites' encoders of one tiny family: each module names it with a ``family`` fixture
# (a key of helpers.TINY_FAMILIES; parametrised where a module runs several).
@pytest.fixture(scope="module")
def weights(family):
    from helpers import family_weights
    return family_weights(family)


@pytest.fixture(scope="module")
def graph_enc(weights):
    from helpers import make
    return make(weights, mode="graph")


@pytest.fixture(scope="module")
def eager_enc(weights):
    from helpers import make
    return make(weights, mode="eager")


@pytest.fixture
def png(tmp_path):
    """A small PNG file (56 x 84, green) in the test's folder."""
    from PIL import Image

    path = tmp_path / "x.png"
    Image.new("RGB", (56, 84), "green").save(path)
    return path
