"""The thread routing that lets vitgraph's persistent FA4 kernels and FA4's own coexist in one
process (the kernels themselves are tested on a Hopper GPU in test_cuda.py)."""

import threading

import pytest
import torch

from vitgraph import fa4_persistent


class Recorder(dict):
    """A compile cache that remembers its name."""

    def __init__(self, name):
        super().__init__()
        self.name = name


def test_compile_cache_follows_the_calling_thread():
    stock, persistent = Recorder("stock"), Recorder("persistent")
    cache = fa4_persistent._ThreadRoutedCache(stock, lambda name: persistent)
    cache["k"] = "stock kernel"
    assert "k" in cache and cache["k"] == "stock kernel" and "k" not in persistent
    inside, other_thread = threading.Event(), {}

    def elsewhere():  # runs while the main thread is inside the routed block
        inside.wait()
        other_thread["sees"] = cache["k"]
        cache["j"] = "compiled elsewhere"

    worker = threading.Thread(target=elsewhere)
    worker.start()
    with fa4_persistent._routed_here():
        assert "k" not in cache  # this thread looks in the persistent cache only
        cache["k"] = "persistent kernel"
        with fa4_persistent._routed_here():  # nested blocks keep routing
            assert cache["k"] == "persistent kernel"
        assert fa4_persistent._active()
        inside.set()
        worker.join()
    assert not fa4_persistent._active()
    assert other_thread["sees"] == "stock kernel" and stock["j"] == "compiled elsewhere" and "j" not in persistent
    assert cache["k"] == "stock kernel" and persistent["k"] == "persistent kernel"
    assert cache.name == "stock"  # anything else is FA4's own cache


def test_routing_ends_when_the_block_raises():
    try:
        with fa4_persistent._routed_here():
            raise RuntimeError("compile failed")
    except RuntimeError:
        pass
    assert not fa4_persistent._active()


@pytest.mark.parametrize("setting", ["OWN_O_SMEM", "LEAN_ADVANCE"])
def test_each_kernel_variant_has_its_own_cache(setting, monkeypatch):
    """Kernels compiled with a setting on and off (O in its own shared memory or through Q's;
    each tile mapped once or twice) never share a cache entry, so an A/B of either setting in
    one process compiles both."""
    opened = {}
    cache = fa4_persistent._ThreadRoutedCache(Recorder("stock"), lambda name: opened.setdefault(name, Recorder(name)))
    with fa4_persistent._routed_here():
        monkeypatch.setattr(fa4_persistent, setting, True)
        cache["k"] = "on"
        monkeypatch.setattr(fa4_persistent, setting, False)
        assert "k" not in cache
        cache["k"] = "off"
        monkeypatch.setattr(fa4_persistent, setting, True)
        assert cache["k"] == "on"
    assert len(opened) == 2 and all(name.startswith(fa4_persistent.CACHE_NAME) for name in opened)


@pytest.mark.parametrize("installed, expected", [("4.0.0b18", True), ("4.0.0b19", False), (None, False)])
def test_persistent_kernel_only_with_the_tested_fa4(installed, expected, monkeypatch, caplog):
    """vitgraph's scheduler, storage and epilogue reach into FA4's internals: with another
    release (or none found) the short tiles keep FA4's own scheduler, and a warning says so."""
    import importlib.metadata

    import vitgraph.attention

    def version(name):
        assert name == "flash-attn-4"
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(fa4_persistent, "TESTED_FA4", "4.0.0b18")
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(vitgraph.attention, "short_tile_sm_count", lambda device: 132)  # an H200's
    fa4_persistent.supported.cache_clear()
    try:
        assert fa4_persistent.supported() is expected
        tile, persistent = vitgraph.attention._fa4_kernel(1024, 16, torch.device("cpu"), rows=4096)
        assert tile == vitgraph.attention.FA4_SHORT_TILE and persistent is expected
        assert ("is not the tested" in caplog.text) is (not expected)
    finally:
        fa4_persistent.supported.cache_clear()


def test_the_fa4_extra_pins_the_tested_release():
    import pathlib
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert f"flash-attn-4=={fa4_persistent.TESTED_FA4}" in project["optional-dependencies"]["fa4"]
