"""quack imported without torch._dynamo (vitgraph.lazy_dynamo), and torch.compile still
treating what it decorated as disabled. Each case runs in a fresh interpreter, where nothing
has imported dynamo yet, against a stand-in quack package that decorates the way quack does."""

import json
import subprocess
import sys
import textwrap

import pytest

FAKE_QUACK = textwrap.dedent("""
    import torch

    class Autotuner:  # quack.autotuner decorates a method this way as the package is imported
        @torch.compiler.disable
        def check_disk_cache(self, x):
            return x + 1, torch.compiler.is_compiling()
""")

CASE = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from vitgraph.lazy_dynamo import import_quack
    real = torch.compiler.disable
    if sys.argv[2] == "lazy":
        import_quack()
    import quack
    report = {"restored": torch.compiler.disable is real, "dynamo_after_import": "torch._dynamo" in sys.modules}
    tuner = quack.Autotuner()
    report["eager"] = list(tuner.check_disk_cache(1))
    report["dynamo_after_call"] = "torch._dynamo" in sys.modules

    def f(x):
        y, compiling = tuner.check_disk_cache(x * 2)
        return y + (100 if compiling else 0)  # traced into, it would see is_compiling() True

    from torch._dynamo.utils import counters
    report["compiled"] = torch.compile(f, backend="eager")(torch.ones(2)).tolist()
    report["graph_breaks"] = sum(counters["graph_break"].values())
    report["eager_after_compile"] = list(tuner.check_disk_cache(5))
    print(json.dumps(report))
""")


def run_case(tmp_path, mode: str, package: str = FAKE_QUACK) -> dict:
    (tmp_path / "quack").mkdir(exist_ok=True)
    (tmp_path / "quack" / "__init__.py").write_text(package)
    done = subprocess.run([sys.executable, "-c", CASE, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_quack_defers_dynamo_and_compile_still_skips_the_disabled_method(tmp_path):
    lazy, real = run_case(tmp_path, "lazy"), run_case(tmp_path, "real")
    assert real["dynamo_after_import"] is True  # what the plain import costs
    assert lazy["dynamo_after_import"] is False and lazy["dynamo_after_call"] is False
    assert lazy["restored"] is True
    # The same behaviour as the real decorator, eagerly and under torch.compile: called
    # untraced (is_compiling() False inside, a graph break around it).
    for report in (lazy, real):
        assert report["eager"] == [2, False]
        assert report["compiled"] == [3.0, 3.0]
        assert report["graph_breaks"] >= 1
        assert report["eager_after_compile"] == [6, False]


def test_a_failing_quack_import_restores_torch_compiler_disable(tmp_path):
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from vitgraph.lazy_dynamo import import_quack
        real = torch.compiler.disable
        try:
            import_quack()
        except RuntimeError as err:
            print(str(err), torch.compiler.disable is real, "quack" in sys.modules)
    """)
    (tmp_path / "quack").mkdir()
    (tmp_path / "quack" / "__init__.py").write_text("raise RuntimeError('broken-install')\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["broken-install", "True", "False"]


@pytest.mark.parametrize("recursive", [True, False])
def test_lazy_disable_takes_the_decorators_arguments(recursive):
    """Bare and with arguments, as ``torch.compiler.disable`` is used; a non-recursive disable
    is the real one at once (dynamo imported)."""
    code = textwrap.dedent(f"""
        import sys
        from vitgraph.lazy_dynamo import lazy_disable
        bare = lazy_disable(lambda: 1, recursive={recursive})
        called = lazy_disable(recursive={recursive}, reason="why")(lambda: 2)
        print(bare(), called(), bare._torchdynamo_disable, "torch._dynamo" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "2", "True", str(not recursive)]


def test_precompile_skips_a_quack_that_fails_to_import(tmp_path):
    (tmp_path / "quack").mkdir()
    (tmp_path / "quack" / "__init__.py").write_text("raise RuntimeError('broken-install')\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from vitgraph.precompile import _cache_roots\n"
            "print(_cache_roots(['quack.cache.jit']))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["{}"]
