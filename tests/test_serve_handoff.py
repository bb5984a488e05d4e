"""POST /encode?store=1 on a real local Ray Serve app (the tiny model, CPU): the images'
embeddings written to the encoder cache (vitgraph.handoff's layout, equal to encode_images),
the answer their ids and grids as JSON; store=1 refused without a cache, and for rows."""

import base64
import json
import os

import pytest
from helpers import png_bytes as png

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow  # a real Ray cluster: seconds per test
from safetensors.torch import load_file  # noqa: E402
from test_serve import post  # noqa: E402

from vitgraph import GraphedVisionEncoder  # noqa: E402
from vitgraph.handoff import CACHE_FILE, CACHE_KEY, item_id  # noqa: E402

MAX_PIXELS = 65536


@pytest.fixture(scope="module")
def app(serve_cluster, tmp_path_factory):
    """The application "store" at /store on conftest's cluster, writing to an encoder cache of its own."""
    from vitgraph.serve import build_app

    cache = tmp_path_factory.mktemp("encoder_cache")
    serve.run(build_app(preset="tiny", device="cpu", num_cpus=0, max_pixels=MAX_PIXELS, encoder_cache=str(cache)),
              name="store", route_prefix="/store")
    yield f"{serve_cluster.url}/store/encode", cache
    serve.delete("store", _blocking=False)  # the cluster goes on meanwhile; its shutdown waits for it


def test_store_writes_the_items_and_answers_ids_and_grids(app):
    url, cache = app
    direct = GraphedVisionEncoder.from_config("tiny", device="cpu")
    images = [png((84, 56), "orange"), png((300, 200), "green")]
    body = json.dumps({"images": [base64.b64encode(b).decode() for b in images]}).encode()
    status, answer = post(url, body, "application/json", "?store=1")
    assert status == 200, answer
    reply = json.loads(answer)
    expected = direct.encode_images(images=images, max_pixels=MAX_PIXELS)
    processor = direct.processor.__class__(**{**direct.processor.__dict__, "max_pixels": MAX_PIXELS})
    assert reply["ids"] == [item_id(b, model="preset:tiny", processor=processor) for b in images]
    assert reply["grid_thw"] == direct.image_rows(images, max_pixels=MAX_PIXELS)[1].tolist()
    for ident, tensor in zip(reply["ids"], expected):
        assert load_file(str(cache / ident / CACHE_FILE))[CACHE_KEY].equal(tensor)
    status, answer = post(url, body, "application/json", "?store=1&id=first&id=second")
    assert status == 200 and json.loads(answer)["ids"] == ["first", "second"]
    assert load_file(str(cache / "second" / CACHE_FILE))[CACHE_KEY].equal(expected[1])


def test_bad_store_requests_are_400s_and_write_nothing(app):
    url, cache = app
    before = sorted(os.listdir(cache))
    body = json.dumps({"images": [base64.b64encode(png((84, 56), "red")).decode()]}).encode()
    for query, payload, kind, words in [("?store=1&id=../x", body, "application/json", "item_id"),
                                        ("?store=1&id=a&id=b", body, "application/json", "one distinct id"),
                                        ("?store=1", b"rows", "application/octet-stream", "not rows")]:
        status, answer = post(url, payload, kind, query)
        assert status == 400 and words in answer.decode(), (query, status, answer)
    assert sorted(os.listdir(cache)) == before


def test_store_without_a_cache_is_a_400():
    import asyncio

    from starlette.requests import Request

    from vitgraph.serve import VisionEncoderDeployment

    deployment = VisionEncoderDeployment.func_or_class(preset="tiny", device="cpu")  # no encoder_cache
    body = json.dumps({"images": [base64.b64encode(png((84, 56), "red")).decode()]}).encode()
    scope = {"type": "http", "method": "POST", "path": "/encode", "query_string": b"store=1",
             "headers": [(b"content-type", b"application/json")]}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    response = asyncio.run(deployment(Request(scope, receive)))
    assert response.status_code == 400 and b"--encoder-cache" in response.body


def test_build_app_refuses_a_missing_cache_directory_and_a_bad_bound(tmp_path):
    from vitgraph.serve import build_app

    with pytest.raises(ValueError, match="encoder_cache"):
        build_app(preset="tiny", device="cpu", encoder_cache=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="encoder_cache_max_items must be a positive int"):
        build_app(preset="tiny", device="cpu", encoder_cache=str(tmp_path), encoder_cache_max_items=0)
    with pytest.raises(ValueError, match="encoder_cache_max_bytes bounds encoder_cache"):
        build_app(preset="tiny", device="cpu", encoder_cache_max_bytes=1 << 20)


def test_a_bounded_replica_keeps_the_newest_entries(tmp_path):
    import asyncio

    from starlette.requests import Request

    from vitgraph.serve import VisionEncoderDeployment

    deployment = VisionEncoderDeployment.func_or_class(preset="tiny", device="cpu", encoder_cache=str(tmp_path),
                                                       encoder_cache_max_items=2)
    answers = []
    for ident in ("a", "b", "c"):
        body = json.dumps({"images": [base64.b64encode(png((84, 56), "red")).decode()]}).encode()
        scope = {"type": "http", "method": "POST", "path": "/encode", "query_string": f"store=1&id={ident}".encode(),
                 "headers": [(b"content-type", b"application/json")]}

        async def receive(body=body):
            return {"type": "http.request", "body": body, "more_body": False}

        answers.append(asyncio.run(deployment(Request(scope, receive))).status_code)
    assert answers == [200, 200, 200] and sorted(os.listdir(tmp_path)) == ["b", "c"]
