"""The benchmarks (tiny preset, CPU) and the vitgraph command line."""

import importlib.util
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from vitgraph import GraphedVisionEncoder
from vitgraph.bench import latency, serving
from vitgraph.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
AB_SETTING = str(ROOT / "benchmarks" / "ab_setting.py")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_latency_json_schema(tmp_path, capsys):
    out = tmp_path / "lat.json"
    result = latency.main(["--preset", "tiny", "--device", "cpu", "--iters", "2", "--warmup", "1",
                           "--cases", "1x256", "16x256", "--case", "mine=1,4,6+2,2,2", "--json", str(out),
                           "--preheat", "0.01"])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "median ms per call; floor:" in printed and "vitgraph_eager ms" in printed and "floor ms" in printed
    assert "{" not in printed and "gemm" not in printed  # no JSON on the terminal; no GPU GEMM choice on a CPU
    assert {"machine", "torch", "date", "ceilings", "cases"} <= set(result) and result["preheat_s"] == 0.01
    assert result["ceilings"]["gemm_tflops"] > 0 and result["ceilings"]["copy_tbps"] > 0
    assert [c["case"] for c in result["cases"]] == ["1x256", "16x256", "mine"]
    for case in result["cases"]:
        assert {"case", "grid", "tokens", "floor_ms", "ms", "compile_s"} <= set(case)
        assert case["floor_ms"] > 0 and set(case["ms"]) == {"hf_eager", "vitgraph_eager"}
        assert all(v > 0 for v in case["ms"].values())
        assert set(case["check"]) == set(case["ms"]) and all(e < 1e-4 for e in case["check"].values())
    assert result["cases"][2]["grid"] == [[1, 4, 6], [2, 2, 2]] and result["cases"][2]["tokens"] == 32


@pytest.mark.slow
def test_serving_reports_percentiles(tmp_path, capsys):
    out = tmp_path / "serving.json"
    result = serving.main(["--preset", "tiny", "--device", "cpu", "--loads", "2", "--requests", "4",
                           "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "{" not in capsys.readouterr().out  # the JSON goes to --json, not the terminal
    assert {r["system"] for r in result["runs"]} == {"hf_eager", "vitgraph_eager"}
    for run in result["runs"]:
        assert 0 < run["p50_ms"] <= run["p90_ms"] <= run["p99_ms"] and run["throughput_rps"] > 0
        slowest = [c["ms"] for c in run["slowest_calls"]]
        assert slowest == sorted(slowest, reverse=True) and 0 < len(slowest) <= 3
        assert all(c["tokens"] > 0 and c["frames"] > 0 for c in run["slowest_calls"])
    assert all(e < 1e-4 for e in result["check"].values())


@pytest.mark.slow
def test_serving_takes_fitted_budgets(capsys):
    result = serving.main(["--preset", "tiny", "--device", "cpu", "--loads", "2", "--requests", "3",
                           "--systems", "vitgraph_eager", "--fit-budgets", "6"])
    budgets = result["budgets"]
    assert len(budgets) <= 6 and budgets == sorted(budgets) and budgets[-1] == 16384
    assert [r["system"] for r in result["runs"]] == ["vitgraph_eager"]


@pytest.mark.slow
def test_serving_on_several_request_streams_reports_their_medians(capsys):
    result = serving.main(["--preset", "tiny", "--device", "cpu", "--loads", "2", "--requests", "3",
                           "--systems", "vitgraph_eager", "--seeds", "4", "5", "6"])
    assert result["seeds"] == [4, 5, 6] and [r["seed"] for r in result["runs"]] == [4, 5, 6]
    (median,) = result["medians"]
    assert median["streams"] == 3 and (median["load_rps"], median["system"]) == (2.0, "vitgraph_eager")
    for key in ("p50_ms", "p90_ms", "p99_ms", "utilisation"):
        assert median[key] == sorted(r[key] for r in result["runs"])[1]
    assert "medians across 3 request streams" in capsys.readouterr().out


def test_medians_across_seeds_group_by_load_and_system():
    runs = [{"load_rps": load, "system": system, "seed": seed, "p50_ms": p, "p90_ms": 2 * p, "p99_ms": 3 * p,
             "utilisation": p / 100}
            for seed, p in ((0, 10.0), (1, 30.0)) for load in (5.0, 10.0) for system in ("a", "b")]
    runs[0] = {**runs[0], "p50_ms": 50.0}  # seed 0, load 5, system a
    medians = serving.medians_across_seeds(runs)
    assert [(m["load_rps"], m["system"], m["streams"]) for m in medians] == [
        (5.0, "a", 2), (5.0, "b", 2), (10.0, "a", 2), (10.0, "b", 2)]
    assert medians[0]["p50_ms"] == 40.0 and medians[1]["p50_ms"] == 20.0 and medians[3]["p99_ms"] == 60.0


def test_serving_is_seeded():
    assert serving.request_grids(20, 3, 12845056) == serving.request_grids(20, 3, 12845056)


@pytest.fixture
def png_files(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(60, 90), (40, 40)]):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_cli_encode_matches_encode_images(tmp_path, png_files, checkpoint):
    out = tmp_path / "emb.safetensors"
    rc = cli_main(["encode", *map(str, png_files), "--model", str(checkpoint), "--out", str(out), "--device", "cpu"])
    assert rc == 0
    saved = load_file(str(out))
    enc = GraphedVisionEncoder.from_pretrained(checkpoint, device="cpu")
    expected = enc.encode_images([Image.open(p) for p in png_files])
    assert list(saved) == ["img0.png", "img1.png"]
    for key, ref in zip(saved, expected):
        assert torch.equal(saved[key], ref)


@pytest.mark.slow
@pytest.mark.parametrize("make_args, words", [
    (lambda d, png, ck: ["encode", str(d / "missing.png"), "--model", str(ck), "--out", str(d / "o.st")],
     "no such file"),
    (lambda d, png, ck: ["encode", str(d / "bad.png"), "--model", str(ck), "--out", str(d / "o.st")],
     "not a readable image"),
    (lambda d, png, ck: ["encode", str(png), "--model", str(d / "no" / "model"), "--out", str(d / "o.st")],
     "neither a checkpoint directory"),
])
def test_cli_errors_are_one_line(tmp_path, png_files, checkpoint, make_args, words):
    (tmp_path / "bad.png").write_text("not an image")
    args = make_args(tmp_path, png_files[0], checkpoint)
    proc = subprocess.run([sys.executable, "-m", "vitgraph", *args, "--device", "cpu"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_help_everywhere():
    for sub in ([], ["demo"], ["encode"], ["info"], ["bench"], ["bench-serving"], ["bench-images"]):
        proc = subprocess.run([sys.executable, "-m", "vitgraph", *sub, "--help"], capture_output=True, text=True)
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), sub


@pytest.mark.slow
def test_cli_demo_and_info_on_cpu(capsys):
    assert cli_main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "output [1888, 48]" in out and "per call (of 5)" in out
    assert out.startswith("vitgraph 0.1.0: random weights of the tiny preset on cpu") and "gemm" not in out
    assert cli_main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "attention backends: sdpa" in out and "planned: 76 buckets (tokens x frames):\n  256x1, 256x16, 288x1," in out
    assert "front (submit): batches of up to 16384 tokens and 16 frames, max_wait_ms 2, 2 batches in flight, 2 preprocessing threads" in out


def test_serving_loop_example_returns_one_embedding_per_request():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("serving_loop", Path(__file__).parents[1] / "examples" /
                                                  "serving_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu")
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(56, 56), (112, 84), (224, 224)] * 3]
    with enc:
        results = module.serve_requests(enc, images, threads=6)
    assert enc.stats()["front"]["requests"] == len(images)
    for image, got in zip(images, results):
        torch.testing.assert_close(got, enc.encode_images([image])[0], rtol=1e-5, atol=1e-6)


def test_call_timer_counts_every_call_and_keeps_the_result():
    from vitgraph.bench.common import CallTimer

    timer = CallTimer()
    square = timer.wrap("square", lambda x: x * x)

    def fail():
        raise RuntimeError("boom")

    failing = timer.wrap("fail", fail)
    assert square(3) == 9 and square(4) == 16
    with pytest.raises(RuntimeError, match="boom"):
        failing()
    timer.add("manual", 0.5)
    assert dict(timer.calls) == {"square": 2, "fail": 1, "manual": 1}
    assert timer.seconds["square"] > 0 and timer.seconds["fail"] > 0 and timer.seconds["manual"] == 0.5


@pytest.mark.slow
@pytest.mark.early_run(lambda out: [
    dict(args=[sys.executable, AB_SETTING, "gemm.split_k=4", "--both-orders", "--preset", "tiny", "--device", "cpu",
               "--rounds", "1", "--iters", "1", "--cases", "1x256", "--frames", "8x10", "--preheat", "0"],
         timeout=300),
    dict(args=[sys.executable, AB_SETTING, "gemm.no_such_field=1", "--preset", "tiny", "--device", "cpu"],
         timeout=300)])
def test_ab_setting_runs_both_build_orders(early_run):
    """benchmarks/ab_setting.py on the tiny preset (CPU, eager), both build orders with new
    encoders and the two deltas side by side. The setting changes nothing on the CPU (split-K
    runs on Hopper only), so both encoders give the same output; an unknown setting is refused.
    (Run ahead of the test: tests/early_runs.py.)"""
    _, (proc, bad) = early_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "gemm.split_k: default 2, changed 4" in out
    assert out.index("build order: default, changed") < out.index("build order: changed, default")
    assert "default built first:" in out and "changed built first:" in out
    last = out.split("both orders (delta ms = changed - default):")[1].splitlines()
    assert last[1].split()[:1] == ["case"] and last[2].split()[0] == "1x256" and last[2].split()[-1] in ("yes", "no")
    assert last[3].split()[:3] == ["1", "frame", "8x10"]  # --frames: one frame of 8x10 patches
    assert "0.0e+00" in out  # the same output either way
    assert bad.returncode != 0 and "unknown setting 'gemm.no_such_field'" in bad.stderr


def test_window_medians_take_the_samples_inside_the_window():
    from vitgraph.bench.common import window_medians

    samples = [(0.0, 1980.0, 200.0), (1.0, 1700.0, 690.0), (1.5, 1600.0, 700.0), (2.0, 1650.0, 680.0), (3.0, 1.0, 1.0)]
    assert window_medians(samples, 1.0, 2.0) == (1650.0, 690.0)  # both ends included
    assert window_medians(samples, 1.2, 1.8) == (1600.0, 700.0)
    assert window_medians(samples, 2.1, 2.9) == (None, None)


def test_alternating_ab_preheats_then_alternates_strictly():
    """Each case: the outputs' first calls, then ``preheat_s`` of calls of the first key alone,
    then rounds in which the keys strictly alternate (``iters`` timed calls after 3 warm-ups)."""
    from vitgraph.bench.common import alternating_ab

    calls = []

    def run(key, pixels, grids):
        calls.append(key)
        time.sleep(0.002)
        return pixels * (2 if key == "b" else 1)

    rows = alternating_ab(run, ("a", "b"), {"one": [(1, 2, 2)]}, 4, torch.device("cpu"), rounds=2, iters=1,
                          preheat_s=0.05)
    assert calls[:2] == ["a", "b"]  # the outputs compared
    heat = len(calls) - 2 - 2 * 2 * 4  # 2 rounds x 2 keys x (3 warm-ups + 1 timed)
    assert heat >= 5 and calls[2:2 + heat] == ["a"] * heat
    assert calls[2 + heat:] == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4
    (name, a_ms, b_ms, diff), = rows
    assert name == "one" and a_ms > 0 and b_ms > 0 and diff == pytest.approx(1.0)
    calls.clear()
    alternating_ab(run, ("a", "b"), {"one": [(1, 2, 2)]}, 4, torch.device("cpu"), rounds=1, iters=1, preheat_s=0)
    assert calls == ["a", "b"] + ["a"] * 4 + ["b"] * 4


@pytest.mark.slow
@pytest.mark.early_run(lambda out: [dict(
    args=[sys.executable, AB_SETTING, "gemm.split_k=4", "--both-orders", "--control", "--preset", "tiny",
          "--device", "cpu", "--rounds", "1", "--iters", "1", "--cases", "1x256", "--preheat", "0"], timeout=300)])
def test_ab_setting_control_encoder_reports_an_a_a(early_run):
    """``--control``: a third encoder with the default settings, built last and timed in turn
    with the other two; each table gains its time and its delta from ``default`` (an A/A).
    (Run ahead of the test: tests/early_runs.py.)"""
    _, (proc,) = early_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "build order: default, changed, control" in out and "build order: changed, default, control" in out
    table = out.split("default built first:")[1].splitlines()
    assert table[1].split() == ["case", "default", "ms", "changed", "ms", "control", "ms", "delta", "ms", "A/A", "ms",
                                "rel", "diff"]
    assert table[2].split()[0] == "1x256" and len(table[2].split()) == 7
    summary = out.split("both orders (delta ms = changed - default):")[1].splitlines()
    assert summary[1].split()[-2:] == ["largest", "|A/A|"] and float(summary[2].split()[-1]) >= 0


@pytest.mark.slow
def test_closed_loop_reports_throughput_at_saturation(capsys):
    from vitgraph.bench import serving

    result = serving.main(["--preset", "tiny", "--device", "cpu", "--closed-loop", "1", "3", "--requests", "6",
                           "--systems", "vitgraph_eager"])
    rows = result["closed_loop"]
    assert [(r["clients"], r["system"]) for r in rows] == [(1, "vitgraph_eager"), (3, "vitgraph_eager")]
    # One client: one request per call; three: calls take what the clients have waiting.
    assert rows[0]["mean_batch_requests"] == 1 and rows[1]["mean_batch_requests"] > 1
    for r in rows:
        assert r["throughput_rps"] > 0 and r["tokens_per_s"] > r["throughput_rps"] and r["p99_ms"] >= r["p50_ms"]


def test_closed_loop_clients_send_their_next_request_when_the_last_returns():
    from vitgraph.bench.saturation import closed_loop

    seen = []
    grids = [(1, 2, 2)] * 5  # 4 tokens each

    def run(pixels, batch_grids):
        seen.append(len(batch_grids))
        time.sleep(0.01)

    stats = closed_loop(run, lambda g: torch.zeros(4, 1), grids, clients=2, max_tokens=100, device=torch.device("cpu"))
    assert seen == [2, 2, 1] and stats["mean_batch_requests"] == pytest.approx(5 / 3)


@pytest.mark.slow
def test_bench_images_from_jpeg_bytes_on_cpu(tmp_path, capsys):
    """``vitgraph bench-images`` on a CPU: the CPU systems run, each stage and the saturation
    runs are reported, the table is printed and the JSON file written (GPU systems skip)."""
    out = tmp_path / "images.json"
    rc = cli_main(["bench-images", "--preset", "tiny", "--device", "cpu", "--repeats", "1", "--concurrency", "1", "2",
                   "--saturation-images", "7", "--max-pixels", "50176", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr()
    assert "img/s C=2" in printed.out and "hf_torchvision skipped" in printed.err
    result = json.loads(out.read_text())
    assert set(result["systems"]) == {"hf_pil", "vitgraph_host", "vitgraph_device"}
    assert len(result["images"]) == 7 and result["max_pixels"] == 50176
    for name, r in result["systems"].items():
        assert 0 < r["p50_ms"] <= r["p99_ms"], (name, r)
        assert set(r["stages_p50_ms"]) == {"decode", "preprocess", "copy", "encode"}
        assert all(v > 0 for v in r["images_per_s"].values()) and set(r["images_per_s"]) == {"1", "2"}


def test_bench_images_formats_writes_a_row_per_format_and_decoder(tmp_path):
    """``vitgraph bench-images --formats`` on a CPU: one host-decoded row per format (the JPEGs'
    three subsamplings, qualities and a progressive one, PNGs with and without alpha, a clip
    array), each timed against the encode alone, with the issue's fields; the samples are what
    they are named."""
    import io

    from PIL import Image

    from vitgraph.bench.image_formats import FORMATS, make_samples

    out = tmp_path / "formats.json"
    rc = cli_main(["bench-images", "--formats", "--preset", "tiny", "--device", "cpu", "--repeats", "1",
                   "--max-pixels", "12544", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == [name for name, *_ in FORMATS]  # no GPU here: host decoding only
    for r in rows:
        assert {"model", "format", "size", "encode_ms", "p50_ms", "decode", "max_level_diff"} <= set(r)
        assert r["model"] == "qwen2_vl" and r["decode"] == "host" and r["max_level_diff"] == 0
        assert r["encode_ms"] > 0 and r["p50_ms"] > 0 and r["images_per_s"] == pytest.approx(1e3 / r["p50_ms"])
    samples = {s["format"]: s["item"] for s in make_samples(0)}
    opened = {name: Image.open(io.BytesIO(item)) for name, item in samples.items() if isinstance(item, bytes)}
    assert opened["png screenshot with alpha"].mode == "RGBA" and opened["png screenshot"].mode == "RGB"
    assert opened["png screenshot with alpha"].getextrema()[3][0] < 255  # translucent panels
    assert opened["jpeg q90 progressive"].info.get("progressive") == 1
    from PIL import JpegImagePlugin
    assert [JpegImagePlugin.get_sampling(opened[f"jpeg q{q} {s}"]) for q, s in
            (("90", "4:2:0"), ("95", "4:4:4"), ("90", "4:2:2"))] == [2, 0, 1]
    assert samples["clip uint8 array"].shape == (8, 448, 448, 3) and samples["clip uint8 array"].dtype.name == "uint8"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray Serve (pip install 'vitgraph[serve]')")
@pytest.mark.early_run(lambda out: [dict(
    args=[sys.executable, "-m", "vitgraph", "bench-images", "--preset", "tiny", "--device", "cpu",
          "--systems", "vitgraph_device", "--repeats", "1", "--concurrency", "2", "--saturation-images", "4",
          "--max-pixels", "50176", "--serve", "--port", str(free_port()), "--json", str(out / "images_serve.json")],
    timeout=300, cwd=ROOT)])
def test_bench_images_serve_measures_the_ray_app_with_jpegs_and_rows(early_run):
    """``vitgraph bench-images --serve`` (in its own process: its own Ray, shut down as it ends):
    the JPEGs over HTTP (multipart) and through the handle, and the same images as client-made
    uint8 rows both ways, each at saturation; a mode whose answers are wrong or that errors
    fails the run (each mode's answers are checked against encode_images' rows first). (Run
    ahead of the test: tests/early_runs.py.)"""
    pytest.importorskip("ray.serve")
    out, (proc,) = early_run
    out = out / "images_serve.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vitgraph serve (Ray Serve, one replica)" in proc.stdout and "serve_rows_handle" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["systems"]) == {"vitgraph_device"}
    assert set(result["serve"]) == {"serve_jpeg_http", "serve_jpeg_handle", "serve_rows_http", "serve_rows_handle"}
    for name, by_clients in result["serve"].items():
        assert set(by_clients) == {"2"}, name
        stats = by_clients["2"]
        assert stats["throughput_rps"] > 0 and np.isfinite(stats["p50_ms"]), (name, stats)
        assert 0 < stats["p50_ms"] <= stats["p99_ms"], (name, stats)


def test_bench_images_jpegs_are_seeded_and_decodable():
    from vitgraph.bench.images import IMAGES, make_jpegs

    a, b, c = make_jpegs(0), make_jpegs(0), make_jpegs(1)
    assert a == b and a != c
    for (name, blob), (_, w, h, _) in zip(a, IMAGES):
        image = Image.open(io.BytesIO(blob))
        assert image.format == "JPEG" and image.size == (w, h), name


@pytest.mark.slow
@pytest.mark.early_run(lambda out: [dict(
    args=[sys.executable, str(ROOT / "benchmarks" / "profile_kernels.py"), "--presets", "tiny", "--device", "cpu",
          "--calls", "1", "--cases", "1x256", "4x1024", "--json", str(out / "profile.json")], timeout=300)])
def test_the_kernel_profile_sums_time_by_class(early_run):
    """benchmarks/profile_kernels.py (run on the H200 to choose what to speed up) on a CPU: every
    case gets ms per class summing to its total, GEMMs and attention among them. (Run ahead of
    the test: tests/early_runs.py.)"""
    out, (proc,) = early_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "profile.json").read_text())
    assert set(result) == {"tiny 1x256", "tiny 4x1024"}
    for entry in result.values():
        assert {"gemm", "attention"} <= set(entry["ms_per_class"])
        assert abs(sum(entry["ms_per_class"].values()) - entry["total_ms"]) < 1e-6 and entry["total_ms"] > 0
    # No ordering of the two totals: on a busy CPU the 16x larger case has come out faster.


def test_bench_coalesce_writes_the_issues_schema_and_reprints_it(tmp_path, capsys):
    from vitgraph.bench.coalesce import main as coalesce_main

    out = tmp_path / "coalesce.json"
    assert coalesce_main(["--callers", "2", "--traffic", "thumbs", "--scale", "0.02", "--images", "3",
                          "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert isinstance(result["gpu"], str)
    modes = {(c["mode"], c["callers"]) for c in result["cases"]}
    assert modes == {("grouped", 1), ("per_call", 2), ("coalesced", 2)}
    for case in result["cases"]:
        assert case["model"] == "tiny" and case["traffic"] == "thumbs"
        assert case["images_per_s"] > 0 and 0 < case["p50_ms"] <= case["p99_ms"]
    coalesced = next(c for c in result["cases"] if c["mode"] == "coalesced")
    assert coalesced["requests_per_batch"] >= 1 and coalesced["front_threads"] >= 1
    capsys.readouterr()
    assert coalesce_main(["--from-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "coalesced" in printed and "grouped" in printed
