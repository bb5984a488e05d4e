import os
import sys
from pathlib import Path

# OpenMP threads (torch's, here and in every process the tests start: the CLI, Ray's workers) wait
# for work asleep rather than spinning. Set before torch is imported (libgomp reads it as it loads).
# On two cores shared with other work, spinning threads wait on a descheduled one: a busy machine
# then runs the tiny models' many small ops several times slower (10x per encode measured here).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():
    # vitgraph's Triton kernels then run on CPU tensors through Triton's interpreter.
    # Set before vitgraph.ops.kernels is imported: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")


import early_runs  # noqa: E402
from early_runs import early_run  # noqa: E402,F401 - the fixture

_LAST_SERVE_CLUSTER_USER = pytest.StashKey()  # the item after whose teardown serve_cluster shuts down
_SERVE_CLUSTER = pytest.StashKey()
_SERVE_CLUSTER_DONE = pytest.StashKey()  # whether the last test using serve_cluster has run


def pytest_configure(config):
    config.addinivalue_line("markers", "early_run(commands): commands run to completion ahead of the test "
                                       "(tests/early_runs.py)")


def pytest_collection_finish(session):
    early_runs.start(session)


def pytest_sessionfinish(session):
    early_runs.stop(session)


def pytest_terminal_summary(terminalreporter):
    early_runs.summary(terminalreporter)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    early_runs.order_last(items)
    users = [item for item in items if "serve_cluster" in getattr(item, "fixturenames", ())]
    config.stash[_LAST_SERVE_CLUSTER_USER] = users[-1] if users else None
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def serve_cluster(request):
    """One Ray instance with Serve for the modules that deploy on a real cluster (test_serve.py,
    test_serve_handoff.py): each deploys its own application on it and deletes it. Started once,
    and shut down right after the last test that uses it (not at the session's end)."""
    pytest.importorskip("ray.serve")
    from helpers import ServeCluster

    cluster = ServeCluster()
    request.addfinalizer(cluster.close)
    request.config.stash[_SERVE_CLUSTER] = cluster
    return cluster


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the item's fixtures are torn down, its module's too where the next item is in another module
    stash = item.config.stash
    if item is stash.get(_LAST_SERVE_CLUSTER_USER, None):
        stash[_SERVE_CLUSTER_DONE] = True
    if stash.get(_SERVE_CLUSTER_DONE, False) and (nextitem is None or nextitem.module is not item.module):
        cluster = stash.get(_SERVE_CLUSTER, None)
        if cluster is not None:
            cluster.close()  # after the applications the last module using it deletes at its end


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """helpers.TINY_CHECKPOINTS' towers, checkpoint folders and CPU encoders, each built once a session."""
    from helpers import TinyCheckpoints
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoints):
    """The tiny Qwen2-VL tower of transformers (seed 0)."""
    return tiny_checkpoints.model("qwen2_vl")


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoints):
    """hf_model as a two-shard checkpoint under visual., the language model's keys in the second shard."""
    return tiny_checkpoints.checkpoint("qwen2_vl")


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
