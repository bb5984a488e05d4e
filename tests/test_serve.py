"""The Ray Serve deployment on a real local Ray cluster (the tiny model, CPU): batching by
patch tokens, responses equal to direct encodes, bad requests as 400s beside good ones,
an oversize request, and the Python handle."""

import base64
import io
import json
import socket
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SERVE_REQUEST_TIMEOUT_S, rel_err
from PIL import Image

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow  # a real Ray cluster: seconds per test
from safetensors.torch import load as load_safetensors  # noqa: E402
from safetensors.torch import save as save_safetensors  # noqa: E402

from vitgraph import GraphedVisionEncoder, preprocess_images  # noqa: E402

BUDGET = 512  # the deployment's largest bucket: a batch holds at most this many patch tokens
MAX_PIXELS = 65536  # images are resized to at most this many pixels (334 patch tokens)
REQUEST_TIMEOUT_S = SERVE_REQUEST_TIMEOUT_S  # the proxy answers any request within this (408), whatever happens to its replica
MAX_ITEMS = 8  # images (or grid rows) per request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(serve_cluster):
    """The application "vitgraph" at / on conftest's cluster (the proxy's timeout REQUEST_TIMEOUT_S)."""
    from vitgraph.serve import build_app

    assert serve_cluster.request_timeout_s == REQUEST_TIMEOUT_S
    handle = serve.run(build_app(preset="tiny", device="cpu", num_cpus=0, max_wait_ms=250,
                                 max_budget=BUDGET, max_pixels=MAX_PIXELS, max_items_per_request=MAX_ITEMS),
                       name="vitgraph", route_prefix="/")
    yield f"{serve_cluster.url}/encode", handle
    serve.delete("vitgraph", _blocking=False)  # the cluster goes on meanwhile; its shutdown waits for it


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
    front = handle.stats.remote().result()["encoder"]["front"]
    assert front["batches"] < front["requests"] and front["requests_per_batch"] > 1, front  # shared encode calls
    assert front["max_tokens"] == BUDGET and front["failed"] == 0


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
    assert handle.stats.remote().result()["encoder"]["front"]["alone"] >= 1


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


def exchange(url, method="POST", body=None, content_type=None):
    """(status, headers, body) of one HTTP exchange."""
    headers = {"Content-Type": content_type} if content_type else {}
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def test_a_raw_image_body_is_one_image(app, direct):
    url, _ = app
    image = Image.new("RGB", (84, 56), "purple")
    for form, kind in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        buffer = io.BytesIO()
        image.save(buffer, format=form)
        status, _, answer = exchange(url, body=buffer.getvalue(), content_type=kind)
        assert status == 200, answer
        (alone,) = direct.encode_images([buffer.getvalue()])
        assert rel_err(load_safetensors(answer)["embeddings"], alone) <= 1e-5
    status, _, answer = exchange(url, body=b"not an image", content_type="image/jpeg")
    assert status == 400 and b"images[0]" in answer


def test_methods_paths_formats_and_plain_text_errors(app):
    url, _ = app
    status, headers, _ = exchange(url, method="GET")
    assert status == 405 and headers["Allow"] == "POST"
    status, headers, _ = exchange(url, method="PUT", body=b"x", content_type="application/json")
    assert status == 405 and headers["Allow"] == "POST"
    status, _, _ = exchange(url.replace("/encode", "/other"), method="POST", body=b"x", content_type="text/plain")
    assert status == 404
    _, payload = rows_payload([(1, 4, 4)], seed=5)
    status, headers, answer = exchange(url + "?format=xml", body=payload, content_type="application/octet-stream")
    assert status == 400 and b"format" in answer and headers["Content-Type"].startswith("text/plain")
    status, headers, answer = exchange(url, body=b"{}", content_type="application/json")
    assert status == 400 and b'no "images" key' in answer and b"KeyError" not in answer
    assert headers["Content-Type"].startswith("text/plain")


def test_the_python_handle(app, direct):
    _, handle = app
    pixels, _ = rows_payload([(1, 4, 4)], seed=3)
    got = handle.encode.remote(pixels, [(1, 4, 4)]).result()
    assert rel_err(got, direct.encode(pixels, [(1, 4, 4)])) <= 1e-5
    from vitgraph.serve import BadRequest

    with pytest.raises(BadRequest, match="grid_thw"):
        handle.encode.remote(pixels, [(1, 4, 5)]).result()


def _until_signal(stop):
    """tests/serve_until_signal.py STOP, run ahead of the test (tests/early_runs.py)."""
    script = str(Path(__file__).with_name("serve_until_signal.py"))
    return pytest.mark.early_run(lambda out: [dict(args=[sys.executable, script, stop], timeout=400)])


@pytest.mark.parametrize("stop", [pytest.param(stop, marks=_until_signal(stop), id=stop)
                                  for stop in ("SIGINT", "SIGTERM")])
def test_the_cli_serves_until_interrupted(early_run, stop):
    """``vitgraph serve`` starts Ray and the app, answers, and Ctrl-C (SIGINT) or SIGTERM stops
    both cleanly. Whatever happens, nothing it started is left running (its process group). (The
    server is started, asked and stopped by tests/serve_until_signal.py, ahead of the test.)"""
    _, (driver,) = early_run
    assert driver.returncode == 0, driver.stderr[-3000:]
    run = json.loads(driver.stdout)
    assert run["status"] == 200, (run["status"], run["poll"])
    assert run["shape"] == [4, 48]
    err, out = run["err"], run["out"]
    assert run["returncode"] == 0, err[-3000:]
    assert "Traceback" not in err
    assert out == "", out[-3000:]  # no Ray line (its coloured "(raylet) ..." shutdown noise) on stdout either
    # A quiet start: on a pipe no status line (a terminal's only), and the line that says what is
    # served where unless the signal came first (a request can succeed before serve.run returns);
    # no Ray or Serve log line.
    assert not err.strip() or "random weights of the tiny preset" in err
    assert all(line.startswith(("starting Ray", "vitgraph serving random weights of the tiny preset on http"))
               for line in err.strip().splitlines()), err


def test_the_cli_on_an_existing_cluster_touches_only_its_own_application(app):
    """``vitgraph serve`` with RAY_ADDRESS naming the cluster of this module's app, whose Serve instance
    already runs the application "vitgraph" (at /, port and timeout of its own): the CLI refuses
    that name; under its own name it warns of each HTTP option that cannot apply, serves at its
    own prefix on the cluster's port, and on SIGTERM deletes its application alone. (The refused
    process and the one under its own name run side by side.)"""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from ray.serve._private import constants

    from vitgraph.serve_cluster import CONTROLLER, NAMESPACE

    assert (CONTROLLER, NAMESPACE) == (constants.SERVE_CONTROLLER_NAME, constants.SERVE_NAMESPACE)
    url, _ = app
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    command = [sys.executable, "-m", "vitgraph", "serve", "--preset", "tiny", "--device", "cpu"]
    taken = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(command + ["--app-name", "mine", "--port", str(free_port())], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    mine = url.replace("/encode", "/mine/encode")
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # until it exits
    reader.start()
    try:
        try:
            _, taken_err = taken.communicate(timeout=300)
            assert taken.returncode == 2 and "--app-name vitgraph: the cluster already runs" in taken_err, \
                taken_err[-2000:]
            deadline = time.time() + 150
            while time.time() < deadline and proc.poll() is None and not any("vitgraph serving" in x for x in lines):
                time.sleep(0.5)
            assert serve.status().applications["mine"].status == "RUNNING", (proc.poll(), lines)
            status, _ = post(mine, rows_payload([(1, 4, 4)], seed=2)[1], "application/octet-stream")
            assert status == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
            reader.join(timeout=30)
            err = "".join(lines)
    finally:
        taken.kill()
        taken.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind (the cluster is the fixture's)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "warning: --port" in err and f"port = {url.split(':')[2].split('/')[0]}" in err
    assert f"warning: --request-timeout 60.0 does not apply" in err and f"request_timeout_s = {REQUEST_TIMEOUT_S}" in err
    assert f"on {mine} as application mine" in err and f"after {REQUEST_TIMEOUT_S} s" in err
    assert "mine" not in serve.status().applications and "vitgraph" in serve.status().applications
    status, _ = post(url, rows_payload([(1, 4, 4)], seed=2)[1], "application/octet-stream")
    assert status == 200  # the cluster's own application still answers


def test_a_request_of_too_many_items_is_a_400_naming_the_cap(app):
    url, handle = app
    blob = base64.b64encode(jpeg(np.zeros((32, 32, 3), dtype=np.uint8))).decode()
    status, answer = post(url, json.dumps({"images": [blob] * (MAX_ITEMS + 1)}).encode(), "application/json")
    assert status == 400 and f"holds {MAX_ITEMS + 1} items, above the server's max_items_per_request = {MAX_ITEMS}" \
        in answer.decode(), answer
    pixels = torch.zeros(4 * (MAX_ITEMS + 1), 1176)
    from vitgraph.serve import BadRequest

    with pytest.raises(BadRequest, match="max_items_per_request"):
        handle.encode.remote(pixels, [(1, 2, 2)] * (MAX_ITEMS + 1)).result()


@pytest.mark.parametrize("args, words", [
    (["--model", "/nonexistent/checkpoint"], "neither a checkpoint directory nor a Hub repo id"),
    (["--device", "cuda"], "no CUDA GPU is available"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--replicas", "0"], "--replicas"),
    (["--port", "70000"], "--port"),
    (["--request-timeout", "0"], "--request-timeout must be a positive number of seconds, got 0"),
    (["--model", "tiny"], "use --preset tiny"),
])
def test_serve_refuses_bad_arguments_before_ray_starts(monkeypatch, capsys, args, words):
    import sys

    from vitgraph.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # importing Ray now fails: the checks come first
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["serve", *args])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_serve_passes_its_request_timeout_and_starts_ray_quietly(monkeypatch, capsys):
    """Ray and Serve as stand-ins that record their arguments; the app's deployment ends the run."""
    import sys
    import types

    import vitgraph.serve
    from vitgraph.cli import main

    monkeypatch.setattr(vitgraph.serve, "build_app", lambda *args, **kwargs: "the app")
    calls = {}

    def no_actor(name, namespace):
        raise ValueError(f"Failed to look up actor {name}")  # as Ray: no Serve running yet

    fake_ray = types.SimpleNamespace(init=lambda **kw: calls.setdefault("init", kw), get_actor=no_actor,
                                     shutdown=lambda: calls.setdefault("ray.shutdown", True))

    def run(app, **kw):
        calls["run"] = kw
        raise KeyboardInterrupt  # as Ctrl-C once the app is up

    def shutdown():
        raise AssertionError("serve.shutdown() ends every application on the cluster")

    fake_serve = types.SimpleNamespace(start=lambda **kw: calls.setdefault("start", kw), run=run, shutdown=shutdown,
                                       status=lambda: types.SimpleNamespace(applications={"other": None}),
                                       delete=lambda name: calls.setdefault("delete", name))
    fake_ray.serve = fake_serve
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setitem(sys.modules, "ray.serve", fake_serve)
    assert main(["serve", "--preset", "tiny", "--device", "cpu", "--request-timeout", "7.5", "--port", "8123"]) == 0
    assert calls["start"]["http_options"] == {"host": "127.0.0.1", "port": 8123, "request_timeout_s": 7.5}
    assert calls["run"] == {"name": "vitgraph", "route_prefix": "/"} and calls["delete"] == "vitgraph"
    assert calls["ray.shutdown"]
    assert calls["init"]["log_to_driver"] is False and calls["init"]["include_dashboard"] is False
    assert calls["init"]["logging_level"] >= 40  # logging.ERROR: Ray's INFO and WARNING lines stay out


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


@pytest.mark.early_run(lambda out: [dict(
    args=[sys.executable, "-m", "vitgraph", "bench-serving", "--preset", "tiny", "--device", "cpu", "--closed-loop", "2",
          "--requests", "4", "--systems", "vitgraph_eager", "--target", "serve", "--replicas", "2",
          "--port", str(free_port()), "--json", str(out / "saturation.json")], timeout=300)])
def test_the_saturation_benchmark_drives_the_app_over_http(early_run):
    """``vitgraph bench-serving --closed-loop --target serve --replicas 2`` (in its own process: its own
    Ray; run ahead of the test, tests/early_runs.py): both replicas answer as the benchmark's own
    encoder does, and report themselves."""
    out, (proc,) = early_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "saturation.json").read_text())
    systems = {r["system"]: r for r in result["closed_loop"]}
    assert set(systems) == {"vitgraph_eager", "ray_serve", "ray_handle"}
    assert systems["ray_serve"]["throughput_rps"] > 0 and systems["ray_handle"]["throughput_rps"] > 0
    assert len(result["serve_agreement"]) == 2, result["serve_agreement"]  # both replicas answered
    assert all(diff <= 1e-4 for diff in result["serve_agreement"].values()), result["serve_agreement"]
    assert set(result["replicas"]) == set(result["serve_agreement"])
    assert all(r["device"] == "cpu" and r["memory"] == {} for r in result["replicas"].values())


@pytest.fixture(scope="module")
def two_replicas(app):
    """The application "two" (two replicas, on the CPU) at /two beside ``app``'s: its URL. Used by
    test_two_replicas_share_the_requests, then by test_a_replica_killed_under_load, which kills one
    of the replicas (so it comes after in this file)."""
    from vitgraph.serve import build_app

    url, _ = app
    serve.run(build_app(preset="tiny", device="cpu", num_cpus=0, num_replicas=2, max_wait_ms=10,
                        max_budget=BUDGET), name="two", route_prefix="/two")
    yield url.replace("/encode", "/two/encode")
    serve.delete("two", _blocking=False)  # the cluster goes on meanwhile; its shutdown waits for it


def test_two_replicas_share_the_requests(two_replicas, direct):
    """N replicas (here two, on the CPU): requests are routed to both, each answer is right."""
    two = two_replicas
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


def test_build_app_refuses_a_bad_max_ongoing_requests():
    from vitgraph.serve import build_app

    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_ongoing_requests"):
            build_app(preset="tiny", device="cpu", max_ongoing_requests=bad)



def test_build_app_refuses_bad_engine_options_before_any_replica_starts():
    from vitgraph.serve import build_app

    with pytest.raises(ValueError, match="max_items"):
        build_app(preset="tiny", device="cpu", max_items=0)
    with pytest.raises(TypeError, match="tuning={'routing.faster_buckets': ...}"):
        build_app(preset="tiny", device="cpu", route_to_faster_buckets=False)


def jpeg(array, quality=90) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def multipart(files: list[tuple[str, bytes]], boundary: str = "vitgraphBoundary7MA4YWxk") -> tuple[bytes, str]:
    """A multipart/form-data body, as a browser or ``curl -F`` sends it."""
    parts = []
    for i, (name, data) in enumerate(files):
        parts.append(f"--{boundary}\r\nContent-Disposition: form-data; name=\"image{i}\"; filename=\"{name}\"\r\n"
                     f"Content-Type: image/jpeg\r\n\r\n".encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_multipart_upload(app, direct):
    url, _ = app
    arrays = [np.random.default_rng(i).integers(0, 256, (60 + 10 * i, 90, 3), dtype=np.uint8) for i in range(2)]
    blobs = [jpeg(a) for a in arrays]
    body, kind = multipart([("a.jpg", blobs[0]), ("b.jpg", blobs[1])])
    status, answer = post(url, body, kind)
    assert status == 200, answer
    out = load_safetensors(answer)
    want = direct.encode_images(blobs, max_pixels=MAX_PIXELS)
    assert out["grid_thw"].shape == (2, 3)
    assert rel_err(out["embeddings"], torch.cat(want)) <= 1e-5
    status, answer = post(url, b"--nope\r\n", "multipart/form-data; boundary=other")
    assert status == 400, (status, answer)


def test_uint8_rows_and_media_types_in_any_case(app, direct):
    """A safetensors payload may carry the processor's uint8 rows; media types match in any case."""
    url, _ = app
    array = np.random.default_rng(5).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    rows, grid = preprocess_images([array], normalize=False)
    body = save_safetensors({"pixels": rows, "grid_thw": grid})
    status, answer = post(url, body, "Application/Octet-Stream")
    assert status == 200, answer
    assert rel_err(load_safetensors(answer)["embeddings"], direct.encode(rows, grid)) <= 1e-5
    wrong = save_safetensors({"pixels": rows.to(torch.int16), "grid_thw": grid})
    status, answer = post(url, wrong, "application/octet-stream")
    assert status == 400 and b"uint8" in answer


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth colour fields plus grain: a photo's cost to decode, a fraction of noise's bytes."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (h // 64, w // 64, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR)).astype(np.int16)
    return np.clip(smooth + rng.integers(-8, 9, (h, w, 3)), 0, 255).astype(np.uint8)


def test_a_rows_request_is_not_held_up_behind_images_being_preprocessed(app, direct):
    """Four 24 MP JPEGs in one request (decoding and resizing them takes seconds here) and a small
    rows request sent just after: the rows request is answered in a fraction of the images' time
    (on the event loop it waited for all four), and both answers are right."""
    import time

    url, _ = app
    big = jpeg(photo(4000, 6000, 11))
    body, kind = multipart([(f"{i}.jpg", big) for i in range(4)])
    pixels, rows_body = rows_payload([(1, 4, 4)], seed=12)

    def send(body, kind, delay):
        time.sleep(delay)
        start = time.perf_counter()
        status, answer = post(url, body, kind)
        return status, answer, time.perf_counter() - start

    with ThreadPoolExecutor(2) as pool:
        images = pool.submit(send, body, kind, 0.0)
        rows = pool.submit(send, rows_body, "application/octet-stream", 0.2)
        (image_status, image_answer, image_s), (rows_status, rows_answer, rows_s) = images.result(), rows.result()
    assert image_status == 200 and rows_status == 200
    assert rows_s < 0.5 * (image_s - 0.2), (rows_s, image_s)
    assert rel_err(load_safetensors(rows_answer)["embeddings"], direct.encode(pixels, [(1, 4, 4)])) <= 1e-5
    want = direct.encode_images([big], max_pixels=MAX_PIXELS)[0]
    assert rel_err(load_safetensors(image_answer)["embeddings"], torch.cat([want] * 4)) <= 1e-5


def test_the_handle_takes_images(app, direct):
    _, handle = app
    blobs = [jpeg(np.random.default_rng(20 + i).integers(0, 256, (70, 70, 3), dtype=np.uint8)) for i in range(2)]
    got = handle.encode_images.remote(blobs).result()
    want = direct.encode_images(blobs, max_pixels=MAX_PIXELS)
    assert len(got) == 2 and all(rel_err(g, w) <= 1e-5 for g, w in zip(got, want))
    from vitgraph.serve import BadRequest

    with pytest.raises(BadRequest, match=r"images\[1\]: not a readable image"):
        handle.encode_images.remote([blobs[0], b"not an image"]).result()


def test_http_edge_cases_are_400s_with_readable_messages(app):
    url, _ = app
    pixels = torch.randn(16, 1176)
    pixels[3, 7] = float("nan")
    body = save_safetensors({"pixels": pixels, "grid_thw": torch.tensor([[1, 4, 4]])})
    status, answer = post(url, body, "application/octet-stream", "?format=json")
    assert status == 400 and b"NaN or inf" in answer, (status, answer)
    status, answer = post(url, body, "application/octet-stream")  # safetensors carries NaN: answered
    assert status == 200
    nested = b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, answer = post(url, nested, "application/json")
    assert status == 400 and b"JSON body" in answer, (status, answer[:200])
    status, answer = post(url, json.dumps({"images": [base64.b64encode(b"plain text").decode()]}).encode(),
                          "APPLICATION/JSON")
    assert status == 400 and b"images[0]: not a readable image" in answer and b"0x" not in answer, answer
    from test_images import _png_header

    inflating = _png_header(9000, 9000)  # 81 MP declared: over the server's 2**26, refused before decoding
    body, kind = multipart([("big.png", inflating)])
    status, answer = post(url, body, kind)
    assert status == 400 and b"images[0]: declares 9000x9000" in answer, answer


def test_a_replica_killed_under_load(two_replicas, direct):
    """Two replicas under a closed loop of 6 clients; one is killed mid-load. Every request gets
    an answer (no hang past the proxy's timeout), only requests in flight at the kill may fail,
    and throughput comes back: the load goes on until more than 10 requests sent over 10 s after
    the kill have succeeded (at most the proxy's timeout after it). The numbers are printed (-s)."""
    import threading
    import time

    target = two_replicas
    pixels, body = rows_payload([(1, 8, 8)], seed=300)
    want = direct.encode(pixels, [(1, 8, 8)])
    results, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            start = time.perf_counter()
            try:
                status, answer = post(target, body, "application/octet-stream")
            except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
                status, answer = type(err).__name__, b""
            ok = status == 200 and rel_err(load_safetensors(answer)["embeddings"], want) <= 1e-5
            results.append((start, time.perf_counter(), ok))

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(3)
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::two#")]
    assert len(replicas) == 2, replicas
    killed_at = time.perf_counter()
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    while (time.perf_counter() < killed_at + REQUEST_TIMEOUT_S
           and sum(ok for start, _, ok in list(results) if start > killed_at + 10) <= 10):
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a client hung past the proxy's timeout"
    failed = [r for r in results if not r[2]]
    longest = max(end - start for start, end, _ in results)
    after = [r for r in results if r[0] > killed_at]
    recovered = next((start for start, _, ok in after if ok), None)
    print(f"\nkilled one of two replicas: {len(results)} requests, {len(failed)} failed, longest "
          f"{longest:.1f} s, first success after the kill {recovered - killed_at if recovered else None} s")
    assert len(failed) <= 6, failed  # at most the requests in flight at the kill (one per client)
    assert all(start < killed_at + REQUEST_TIMEOUT_S for start, _, _ in failed)
    assert longest <= REQUEST_TIMEOUT_S + 10
    assert recovered is not None and sum(ok for start, _, ok in after if start > killed_at + 10) > 10


def test_build_app_refuses_a_bad_max_image_pixels():
    from vitgraph.serve import build_app

    for bad in (0, -1, 2.5, True, 1 << 40):
        with pytest.raises(ValueError, match="max_image_pixels"):
            build_app(preset="tiny", device="cpu", max_image_pixels=bad)
