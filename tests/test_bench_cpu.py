"""The benchmarks on a CPU: their defaults finish, each row is printed as it is measured, what
a CPU run leaves out is said first, and --help shows every default."""

import os
import sys
from pathlib import Path

import pytest

from vitgraph.bench import common, images, latency

ROOT = Path(__file__).resolve().parents[1]


def test_latency_prints_each_row_as_it_is_measured(monkeypatch, capsys):
    seen = []
    check = latency._checked

    def checked(*args):  # each case is checked, then timed
        seen.append(capsys.readouterr().out)  # what was printed before this case
        return check(*args)

    monkeypatch.setattr(latency, "_checked", checked)
    latency.main(["--preset", "tiny", "--device", "cpu", "--cases", "1x256", "16x256", "--systems", "vitgraph_eager",
                  "--iters", "1", "--warmup", "0"])
    assert len(seen) == 2 and "vitgraph_eager ms" in seen[0]
    assert not any(line.split()[:1] == ["1x256"] for line in seen[0].splitlines())
    assert [line.split()[:2] for line in seen[1].splitlines()] == [["1x256", "256"]]  # before 16x256 is timed
    assert capsys.readouterr().out.split()[:2] == ["16x256", "4096"]


def test_bench_images_prints_each_row_as_it_is_measured(monkeypatch, capsys):
    seen, err = [], []
    measure = images.saturation

    def saturation(*args):
        printed = capsys.readouterr()
        seen.append(printed.out)
        err.append(printed.err)
        return measure(*args)

    monkeypatch.setattr(images, "saturation", saturation)
    images.main(["--preset", "tiny", "--device", "cpu", "--systems", "vitgraph_host", "vitgraph_device",
                 "--repeats", "1", "--concurrency", "1", "--saturation-images", "1", "--max-pixels", "50176"])
    assert len(seen) == 2 and "img/s C=1" in seen[0] and "vitgraph_host" not in seen[0]
    assert [line.split()[0] for line in seen[1].splitlines()] == ["vitgraph_host"]
    out = capsys.readouterr()
    assert out.out.split()[0] == "vitgraph_device" and images.SATURATION_NOTE in out.out
    assert err[0].startswith("bench-images on a CPU: an eager encoder (no CUDA graphs)")


@pytest.mark.parametrize("parser", [latency.build_parser, images.build_parser], ids=["bench", "bench-images"])
def test_help_shows_every_default(parser):
    for action in parser()._actions:
        if action.option_strings and action.nargs != 0:  # not --help or a switch
            assert "default" in action.help, action.option_strings
    (iters,) = [a for a in latency.build_parser()._actions if "--iters" in a.option_strings]
    assert iters.help.endswith("(default 30 on a GPU, 10 on a CPU)")


def _defaults(command, *sizes):
    """``vitgraph COMMAND --device cpu`` (and ``sizes``), run ahead of the test (tests/early_runs.py)."""
    return pytest.mark.early_run(lambda out: [dict(
        args=[sys.executable, "-m", "vitgraph", command, "--device", "cpu", *sizes],
        env={**os.environ, "PYTHONPATH": str(ROOT)})])


@pytest.mark.slow
@pytest.mark.parametrize("command, rows", [
    pytest.param("bench", list(latency.CPU_CASES), marks=_defaults("bench"), id="bench-rows0"),
    # Fewer and smaller images than the CPU's defaults (2 per saturation run, not 14; 200704 pixels
    # at most, not 1003520: about 25 s on 2 cores): the same code for each, run 6x quicker.
    pytest.param("bench-images", ["hf_pil", "vitgraph_host", "vitgraph_device"],
                 marks=_defaults("bench-images", "--saturation-images", "2", "--max-pixels", "200704"),
                 id="bench-images-rows1")])
def test_the_cpu_defaults_finish(early_run, command, rows):
    """Each benchmark with its CPU defaults (``bench``: all of them, about 10 s on 2 cores;
    ``bench-images``: all but its sizes, given smaller): it ends, with a row per case or system
    (the CPU's: no preset, case or system given), after a first line that says what a CPU run
    leaves out. (Run ahead of the test: tests/early_runs.py.)"""
    _, (proc,) = early_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{command} on a CPU: " in proc.stderr.splitlines()[0]
    firsts = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert all(row in firsts for row in rows), proc.stdout
