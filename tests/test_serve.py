"""The Ray Serve deployment on a real local Ray cluster (the tiny model, CPU): batching by
patch tokens, responses equal to direct encodes, bad requests as 400s beside good ones,
an oversize request, and the Python handle."""

import base64
import io
import json
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import rel_err
from PIL import Image

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from safetensors.torch import load as load_safetensors  # noqa: E402
from safetensors.torch import save as save_safetensors  # noqa: E402

from vitgraph import GraphedVisionEncoder, preprocess_images  # noqa: E402

BUDGET = 512  # the deployment's largest bucket: a batch holds at most this many patch tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app():
    from vitgraph.serve import build_app

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build_app(preset="tiny", device="cpu", num_cpus=0, batch_wait_timeout_s=0.25,
                                 max_budget=BUDGET), name="vitgraph", route_prefix="/")
    yield f"http://127.0.0.1:{port}/encode", handle
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def direct():
    return GraphedVisionEncoder.from_config("tiny", device="cpu")  # the same seed as the replica's


def post(url, body: bytes, content_type: str, query: str = ""):
    request = urllib.request.Request(url + query, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def rows_payload(grids, seed):
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, generator=torch.Generator().manual_seed(seed))
    return pixels, save_safetensors({"pixels": pixels, "grid_thw": torch.tensor(grids)})


def test_concurrent_requests_are_batched_by_patch_tokens_and_match_direct_encodes(app, direct):
    url, handle = app
    grids = [[(1, 8, 8)], [(1, 4, 6), (1, 2, 2)], [(2, 8, 4)], [(1, 10, 10)], [(1, 6, 6)], [(1, 12, 8)]] * 2
    payloads = [rows_payload(g, seed=i) for i, g in enumerate(grids)]
    with ThreadPoolExecutor(len(payloads)) as pool:
        answers = list(pool.map(lambda p: post(url, p[1], "application/octet-stream"), payloads))
    for (pixels, _), g, (status, body) in zip(payloads, grids, answers):
        assert status == 200, body
        out = load_safetensors(body)
        assert out["grid_thw"].tolist() == [list(x) for x in g]
        assert rel_err(out["embeddings"], direct.encode(pixels, g)) <= 1e-5
    stats = handle.stats.remote().result()
    sizes = [n for n, _ in stats["batches"]]
    assert max(sizes) > 1, stats["batches"]  # concurrent requests shared encode calls
    assert all(tokens <= BUDGET for _, tokens in stats["batches"])
    assert sum(sizes) == len(payloads)


def test_bad_requests_get_400_and_the_good_ones_beside_them_succeed(app, direct):
    url, _ = app
    good = [rows_payload([(1, 8, 8)], seed=100 + i) for i in range(4)]
    wrong_grid = save_safetensors({"pixels": torch.randn(64, 1176), "grid_thw": torch.tensor([[1, 8, 4]])})
    wrong_width = save_safetensors({"pixels": torch.randn(64, 1000), "grid_thw": torch.tensor([[1, 8, 8]])})
    bad = [(wrong_grid, "application/octet-stream", "sums to 32"),
           (wrong_width, "application/octet-stream", "1176"),
           (b"not safetensors", "application/octet-stream", "safetensors"),
           (json.dumps({"images": ["bm90IGFuIGltYWdl"]}).encode(), "application/json", "images[0]"),
           (b"{}", "application/json", "images"),
           (b"x", "text/plain", "Content-Type")]
    jobs = [(p, "application/octet-stream", None) for _, p in good] + bad
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: post(url, j[0], j[1]), jobs))
    for (pixels, _), (status, body) in zip(good, answers[:4]):
        assert status == 200 and rel_err(load_safetensors(body)["embeddings"], direct.encode(pixels, [(1, 8, 8)])) <= 1e-5
    for (_, _, words), (status, body) in zip(bad, answers[4:]):
        assert status == 400 and words in body.decode(), (words, status, body)


def test_an_oversize_request_is_encoded_alone(app, direct):
    url, handle = app
    pixels, body = rows_payload([(1, 32, 24)], seed=7)  # 768 tokens > the 512-token budget
    status, answer = post(url, body, "application/octet-stream")
    assert status == 200 and rel_err(load_safetensors(answer)["embeddings"], direct.encode(pixels, [(1, 32, 24)])) <= 1e-5
    assert handle.stats.remote().result()["encoded_alone"] >= 1


def test_images_as_json_and_json_answers(app, direct):
    url, _ = app
    image = Image.new("RGB", (84, 56), "orange")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    body = json.dumps({"images": [base64.b64encode(buffer.getvalue()).decode()]}).encode()
    status, answer = post(url, body, "application/json", "?format=json")
    assert status == 200
    out = json.loads(answer)
    pixels, grid = preprocess_images([image])
    assert out["grid_thw"] == grid.tolist()
    assert rel_err(torch.tensor(out["embeddings"]), direct.encode(pixels, grid)) <= 1e-5


def test_the_python_handle(app, direct):
    _, handle = app
    pixels, _ = rows_payload([(1, 4, 4)], seed=3)
    got = handle.encode.remote(pixels, [(1, 4, 4)]).result()
    assert rel_err(got, direct.encode(pixels, [(1, 4, 4)])) <= 1e-5
    from vitgraph.serve import BadRequest

    with pytest.raises(BadRequest, match="grid_thw"):
        handle.encode.remote(pixels, [(1, 4, 5)]).result()


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_the_cli_serves_until_interrupted(tmp_path, stop):
    """``vitgraph serve`` starts Ray and the app, answers, and Ctrl-C (SIGINT) or SIGTERM stops
    both cleanly. Whatever happens, nothing it started is left running (its process group)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vitgraph", "serve", "--preset", "tiny", "--device", "cpu",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        try:
            pixels, body = rows_payload([(1, 4, 4)], seed=1)
            deadline, status = time.time() + 150, None
            while time.time() < deadline and proc.poll() is None:
                try:
                    status, answer = post(f"http://127.0.0.1:{port}/encode", body, "application/octet-stream")
                    if status != 404:  # 404: the proxy is up, the app not deployed yet
                        break
                except (urllib.error.URLError, ConnectionError):
                    pass
                time.sleep(1)
            assert status == 200, (status, proc.poll())
            assert load_safetensors(answer)["embeddings"].shape == (4, 48)
        finally:
            proc.send_signal(getattr(signal, stop))
            out, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server and any Ray process it left behind
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("args, words", [
    (["--model", "/nonexistent/checkpoint"], "neither a checkpoint directory nor a Hub repo id"),
    (["--device", "cuda"], "no CUDA GPU is available"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--replicas", "0"], "--replicas"),
    (["--port", "70000"], "--port"),
])
def test_serve_refuses_bad_arguments_before_ray_starts(monkeypatch, capsys, args, words):
    import sys

    from vitgraph.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # importing Ray now fails: the checks come first
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["serve", *args])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_serve_checks_the_checkpoints_configs_before_ray_starts(tmp_path, monkeypatch, capsys):
    import sys

    from vitgraph.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl", "vision_config": {"depth": -1}}')
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"visual.x": "a.safetensors"}}')
    (tmp_path / "a.safetensors").write_bytes(b"")  # never opened: the config is refused first
    code = main(["serve", "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "config.json" in err and err.count("\n") == 1, err
    (tmp_path / "config.json").unlink()
    code = main(["serve", "--model", str(tmp_path)])
    assert code == 2 and "has no config.json" in capsys.readouterr().err


def test_serve_with_a_missing_model_exits_2_in_seconds():
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vitgraph", "serve", "--model", "/nonexistent/checkpoint"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "/nonexistent/checkpoint" in proc.stderr and time.perf_counter() - start < 60


def test_the_saturation_benchmark_drives_the_app_over_http(tmp_path):
    """``vitgraph bench-serving --closed-loop --target serve --replicas 2`` (in its own process: its own
    Ray): both replicas answer as the benchmark's own encoder does, and report themselves."""
    import subprocess
    import sys

    out = tmp_path / "saturation.json"
    proc = subprocess.run([sys.executable, "-m", "vitgraph", "bench-serving", "--preset", "tiny", "--device", "cpu",
                           "--closed-loop", "2", "--requests", "4", "--systems", "vitgraph_eager", "--target", "serve",
                           "--replicas", "2", "--port", str(free_port()), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    systems = {r["system"]: r for r in result["closed_loop"]}
    assert set(systems) == {"vitgraph_eager", "ray_serve", "ray_handle"}
    assert systems["ray_serve"]["throughput_rps"] > 0 and systems["ray_handle"]["throughput_rps"] > 0
    assert len(result["serve_agreement"]) == 2, result["serve_agreement"]  # both replicas answered
    assert all(diff <= 1e-4 for diff in result["serve_agreement"].values()), result["serve_agreement"]
    assert set(result["replicas"]) == set(result["serve_agreement"])
    assert all(r["device"] == "cpu" and r["memory"] == {} for r in result["replicas"].values())


def test_two_replicas_share_the_requests(app, direct):
    """N replicas (here two, on the CPU): requests are routed to both, each answer is right."""
    from vitgraph.serve import build_app

    url, _ = app
    serve.run(build_app(preset="tiny", device="cpu", num_cpus=0, num_replicas=2, batch_wait_timeout_s=0.05,
                        max_budget=BUDGET), name="two", route_prefix="/two")
    two = url.replace("/encode", "/two/encode")
    payloads = [rows_payload([(1, 8, 8)], seed=200 + i) for i in range(24)]
    replicas = set()

    def send(p):
        request = urllib.request.Request(two, data=p[1], headers={"Content-Type": "application/octet-stream"},
                                         method="POST")
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.headers["X-Vitgraph-Replica"], response.read()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, payloads))
    for (pixels, _), (replica, body) in zip(payloads, answers):
        replicas.add(replica)
        assert rel_err(load_safetensors(body)["embeddings"], direct.encode(pixels, [(1, 8, 8)])) <= 1e-5
    assert len(replicas) == 2, replicas
    serve.delete("two")


def test_build_app_refuses_a_bad_max_ongoing_requests():
    from vitgraph.serve import build_app

    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_ongoing_requests"):
            build_app(preset="tiny", device="cpu", max_ongoing_requests=bad)
