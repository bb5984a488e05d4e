"""A newcomer's mistakes on the command line: each is one line on stderr, exit code 2, naming
the thing that is wrong and the fix, before any model is built or loaded."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

import vitgraph.cli
from vitgraph.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(vitgraph.cli, "make_encoder", refuse)


def one_error_line(code: int, err: str) -> str:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def vitgraph_cli(*args, env=None, timeout=120):
    """``python -m vitgraph ARGS`` in a fresh process: (exit code, stderr, seconds)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vitgraph", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout)
    return proc.returncode, proc.stderr, time.perf_counter() - start


@pytest.mark.parametrize("command", [["info"], ["demo"], ["encode", "PNG", "--out", "OUT"], ["bench"]])
def test_a_preset_given_to_model_points_to_preset(png, tmp_path, capsys, no_load, command):
    args = [str(png) if a == "PNG" else str(tmp_path / "e.safetensors") if a == "OUT" else a for a in command]
    err = one_error_line(cli_main([*args, "--model", "tiny", "--device", "cpu"]), capsys.readouterr().err)
    assert "--model tiny: is a preset name" in err and "use --preset tiny" in err


@pytest.mark.parametrize("flags, words", [
    (["--max-pixels", "0"], "--max-pixels must be in [1, 268435456]"),
    (["--min-pixels", "5000", "--max-pixels", "4000"], "--min-pixels 5000 exceeds --max-pixels 4000"),
    (["--min-pixels", "99999999"], "--min-pixels 99999999 exceeds the model's max_pixels (12845056); pass a larger"),
    (["--max-pixels", "100"], "--max-pixels 100 is below the model's min_pixels (3136); pass a smaller --min-pixels"),
])
def test_pixel_limits_are_checked_before_the_model_loads(png, tmp_path, capsys, no_load, flags, words):
    code = cli_main(["encode", str(png), "--out", str(tmp_path / "e.safetensors"), "--device", "cpu", *flags])
    assert words in one_error_line(code, capsys.readouterr().err)


def _unreachable_hub(out):
    """``vitgraph [-v] info --model Qwen/No-Such-VL`` with a closed port for the Hub (vitgraph_cli's
    command and environment), HF_HOME a fresh folder."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(out),
           "HF_HUB_OFFLINE": "0"}
    return [dict(args=[sys.executable, "-m", "vitgraph", *verbose, "info", "--model", "Qwen/No-Such-VL", "--device",
                       "cpu"], env=env, timeout=120) for verbose in (["-v"], [])]


@pytest.mark.slow
@pytest.mark.early_run.with_args(_unreachable_hub)  # (a named function alone would be decorated)
def test_an_unreachable_hub_is_named_at_once_and_logged_once(early_run):
    """A closed port stands in for the Hub: one request, no retries, the model named; with -v
    no line is printed twice (huggingface_hub's own handler and the root's). (Run ahead of the
    test: tests/early_runs.py.)"""
    _, (verbose, quiet) = early_run
    code, err, seconds = verbose.returncode, verbose.stderr, verbose.seconds
    lines = err.strip().splitlines()
    assert code == 2 and seconds < 20 and len(lines) == len(set(lines)), err
    assert lines[-1].startswith("vitgraph info: error: model Qwen/No-Such-VL: config.json is not in the local "
                                "Hugging Face cache and the Hugging Face Hub cannot be reached")
    assert "Qwen/No-Such-VL" in one_error_line(quiet.returncode, quiet.stderr)


def test_an_input_folder_is_named_as_one(tmp_path, capsys, no_load):
    code = cli_main(["encode", str(tmp_path), "--out", str(tmp_path / "e.safetensors"), "--device", "cpu"])
    assert f"{tmp_path}: is a directory" in one_error_line(code, capsys.readouterr().err)


def test_the_cli_imports_no_benchmark():
    code = "import sys, vitgraph.cli; print(sorted(m for m in sys.modules if m.startswith('vitgraph.bench')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(vitgraph.cli, "make_encoder", interrupted)
    assert cli_main(["demo", "--device", "cpu"]) == 130
    assert capsys.readouterr().err == "vitgraph demo: interrupted\n"


def test_help_and_argument_errors_import_no_torch():
    code = "import sys, vitgraph.cli; vitgraph.cli.build_parser(); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
    code = ("import sys, vitgraph.cli\ntry:\n    vitgraph.cli.main(ARGS)\nexcept SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules)")
    for args, exit_code in ((["--help"], 0), (["encode", "--help"], 0), (["encode"], 2), (["info", "--preset", "x"], 2)):
        proc = subprocess.run([sys.executable, "-c", code.replace("ARGS", repr(args))], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.stdout.split()[-2:] == [str(exit_code), "False"], (args, proc.stdout, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "vitgraph", "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "usage: vitgraph" in proc.stdout


@pytest.mark.parametrize("args, exit_code, words", [
    (["bench", "--help"], 0, "usage: vitgraph bench "),
    (["bench", "--iters", "0"], 2, "argument --iters: must be at least 1, got 0"),
    (["bench", "--case", "bad"], 2, "--case must look like name=t,h,w+t,h,w, got 'bad'"),
    (["bench-serving", "--help"], 0, "usage: vitgraph bench-serving"),
    (["bench-serving", "--loads", "0"], 2, "argument --loads: must be a positive finite number, got 0"),
    (["bench-images", "--help"], 0, "usage: vitgraph bench-images"),
    (["bench-images", "--systems", "nope"], 2, "argument --systems: invalid choice: 'nope'"),
    (["bench-coalesce", "--help"], 0, "usage: vitgraph bench-coalesce"),
    (["bench-coalesce", "--traffic", "nope"], 2, "argument --traffic: invalid choice: 'nope'"),
])
def test_bench_help_and_argument_errors_import_no_torch(args, exit_code, words):
    code = ("import sys, vitgraph.cli\ntry:\n    vitgraph.cli.main(ARGS)\nexcept SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code.replace("ARGS", repr(args))], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.split()[-2:] == [str(exit_code), "False"], (proc.stdout, proc.stderr)
    assert words in (proc.stdout if exit_code == 0 else proc.stderr), (proc.stdout, proc.stderr)


def test_the_bench_parsers_describe_their_modules():
    """``--help``'s description (vitgraph.bench.args, read without torch) is the first paragraph
    of the benchmark module's docstring, and the library uses the torch-free names."""
    from vitgraph.images import preprocess
    from vitgraph.bench import args, coalesce, images, latency, serving
    from vitgraph.ops import attention, backend_names, gemm

    for command, module in (("bench", latency), ("bench-serving", serving), ("bench-images", images),
                            ("bench-coalesce", coalesce)):
        assert args.PARSERS[command]().description == module.__doc__.split("\n\n")[0], command
    assert attention.BACKENDS is backend_names.BACKENDS == tuple(backend_names.ATTENTION)
    assert gemm.GEMM_BACKENDS is backend_names.GEMM_BACKENDS and serving.build_parser().get_default("max_pixels") \
        == preprocess.MAX_PIXELS == preprocess.ProcessorConfig().max_pixels


def test_the_cheap_preset_names_are_the_presets():
    from vitgraph.models import PRESETS
    from vitgraph.preset_names import PRESET_NAMES

    assert sorted(PRESET_NAMES) == sorted(PRESETS) and len(set(PRESET_NAMES)) == len(PRESET_NAMES)


def test_two_inputs_of_one_file_name_are_both_named(tmp_path, capsys, no_load):
    paths = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / "x.gif")
        Image.new("RGB", (30, 30), "red").save(paths[-1])
    code = cli_main(["encode", *map(str, paths), "--out", str(tmp_path / "e.safetensors"), "--device", "cpu"])
    err = one_error_line(code, capsys.readouterr().err)
    assert f"two inputs share the file name x.gif ({paths[0]} and {paths[1]})" in err


def test_a_missing_input_is_reported_before_a_bad_model(tmp_path, capsys, no_load):
    code = cli_main(["encode", str(tmp_path / "missing.png"), "--model", str(tmp_path / "no" / "model"),
                     "--out", str(tmp_path / "e.safetensors"), "--device", "cpu"])
    err = one_error_line(code, capsys.readouterr().err)
    assert "missing.png" in err and "no such file" in err.lower() and "model" not in err.split("missing.png")[1], err
