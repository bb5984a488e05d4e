"""Work before refusal: a call of too many items (images plus video frames) is refused from its
count, and a bad item anywhere in a call from its type, shape or encoded header, before any
image of the call is decoded (the decoder is patched to count its calls)."""

import io
import zlib

import numpy as np
import pytest
from PIL import Image

import vitgraph.images.decode
import vitgraph.images.png
from vitgraph import GraphedVisionEncoder
from vitgraph.images.decode import MAX_ITEMS_PER_REQUEST


def png(width=56, height=56) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "teal").save(buffer, format="PNG")
    return buffer.getvalue()


def huge_png_header() -> bytes:
    """A PNG whose header declares 12000 x 12000 pixels, above the default limit (its data is never read)."""
    data = bytearray(png())
    data[16:24] = (12000).to_bytes(4, "big") * 2  # IHDR's width and height, then its CRC
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


@pytest.fixture(scope="module")
def enc():
    encoder = GraphedVisionEncoder.from_config("tiny", device="cpu")
    yield encoder
    encoder.close()


@pytest.fixture
def decodes(monkeypatch):
    """The images decoded, by PIL or (plain PNGs, the png extra) by libspng."""
    calls = []
    real, plain = vitgraph.images.decode.decode_pil, vitgraph.images.png.decode_plain

    def counting(data, name, *args, **kwargs):
        calls.append(name)
        return real(data, name, *args, **kwargs)

    def counting_plain(data, channels):
        pixels = plain(data, channels)
        if pixels is not None:
            calls.append("libspng")
        return pixels

    monkeypatch.setattr(vitgraph.images.decode, "decode_pil", counting)
    monkeypatch.setattr(vitgraph.images.png, "decode_plain", counting_plain)
    return calls


def test_too_many_items_are_refused_from_the_count_before_any_decoding(enc, decodes):
    with pytest.raises(ValueError, match=r"holds 4 items \(images and video frames\), above max_items_per_request = 3"):
        enc.encode_images([png()] * 4, max_items_per_request=3)
    with pytest.raises(ValueError, match="holds 4 items"):  # two images and a clip of two frames
        enc.encode_images([png()] * 2, [[png(), png()]], max_items_per_request=3)
    with pytest.raises(ValueError, match="holds 4 items"):
        enc.submit_images([png()] * 4, max_items_per_request=3).result(timeout=60)
    with pytest.raises(ValueError, match=f"holds {MAX_ITEMS_PER_REQUEST + 1} items"):  # the default cap
        enc.encode_images([b""] * (MAX_ITEMS_PER_REQUEST + 1))
    assert decodes == []
    assert len(enc.encode_images([png()] * 3, max_items_per_request=3)) == 3  # at the cap: served
    assert len(decodes) == 3


@pytest.mark.parametrize("last, error, message", [
    (b"not an image", ValueError, r"images\[5\]: not a readable image"),
    (b"", ValueError, r"images\[5\]: is empty"),
    (None, TypeError, r"images\[5\] must be a PIL image"),
    (np.zeros((4, 4), dtype=np.uint8), ValueError, r"images\[5\] array must be HxWx3"),
    (Image.new("RGB", (0, 3)), ValueError, r"images\[5\] is empty"),
])
def test_a_bad_last_item_is_refused_before_any_item_is_decoded(enc, decodes, last, error, message):
    with pytest.raises(error, match=message):
        enc.encode_images([png()] * 5 + [last])
    with pytest.raises(error, match=message):
        enc.submit_images([png()] * 5 + [last]).result(timeout=60)
    assert decodes == []


def test_a_header_declaring_too_many_pixels_is_refused_before_any_decoding(enc, decodes):
    with pytest.raises(ValueError, match=r"videos\[0\]\[1\]: declares 12000x12000 = .* refused before decoding"):
        enc.encode_images([png()] * 3, [[png(), huge_png_header()]])
    assert decodes == []
    assert enc.encode_images([png()])[0].shape[0] == 4  # the encoder is usable


@pytest.mark.parametrize("cap", [0, -1, True, 2.0, "10", None])
def test_the_cap_itself_is_checked(enc, cap):
    with pytest.raises(ValueError, match="max_items_per_request must be a positive int"):
        enc.encode_images([png()], max_items_per_request=cap)


# -- over HTTP: the deployment's handler itself, called with starlette requests (no Ray cluster) ----

def http(deployment, body: bytes, content_type: str, length: int | None = None, chunks: int = 1,
         query: bytes = b""):
    """``deployment(request)`` for a POST /encode of ``body`` (declaring ``length``, or none where
    it is -1; sent in ``chunks`` pieces): ``(status, text)``."""
    import asyncio

    from starlette.requests import Request

    headers = [(b"content-type", content_type.encode())]
    if length != -1:
        headers.append((b"content-length", str(len(body) if length is None else length).encode()))
    step = max(1, -(-len(body) // chunks))
    pieces = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/encode", "query_string": query, "headers": headers,
             "scheme": "http", "server": ("127.0.0.1", 8000), "root_path": ""}
    response = asyncio.run(deployment(Request(scope, receive)))
    return response.status_code, response.body.decode(errors="replace")


@pytest.fixture(scope="module")
def deployment():
    from vitgraph.serve import VisionEncoderDeployment

    made = VisionEncoderDeployment.func_or_class(preset="tiny", device="cpu", max_items_per_request=3,
                                                 max_body_bytes=1 << 18)
    yield made
    made.encoder.close()


def test_http_too_many_items_is_a_fast_400_before_any_decoding(deployment, decodes):
    import base64
    import json

    from safetensors.torch import save
    import torch

    four = json.dumps({"images": [base64.b64encode(png()).decode()] * 4}).encode()
    status, text = http(deployment, four, "application/json")
    assert status == 400 and "holds 4 items, above the server's max_items_per_request = 3" in text
    many_grids = save({"pixels": torch.zeros(16, 1176), "grid_thw": torch.tensor([[1, 2, 2]] * 4)})
    status, text = http(deployment, many_grids, "application/octet-stream")
    assert status == 400 and "max_items_per_request = 3" in text
    bad_last = json.dumps({"images": [base64.b64encode(png()).decode()] * 2 + ["bm90IGFuIGltYWdl"]}).encode()
    status, text = http(deployment, bad_last, "application/json")
    assert status == 400 and "images[2]: not a readable image" in text
    assert decodes == []
    status, _ = http(deployment, json.dumps({"images": [base64.b64encode(png()).decode()] * 3}).encode(),
                     "application/json")
    assert status == 200 and len(decodes) == 3  # at the cap: served


def test_http_a_body_over_the_cap_is_a_413_read_no_further(deployment):
    status, text = http(deployment, b"{}", "application/json", length=10 ** 12)  # declared: refused unread
    assert status == 413 and "max_body_bytes = 262144" in text
    status, text = http(deployment, b"x" * 300_000, "application/json", length=-1, chunks=5)  # no length: counted
    assert status == 413 and "over the server's max_body_bytes" in text
    status, text = http(deployment, png(), "image/png")
    assert status == 200, text


def test_build_app_checks_the_caps_and_the_model_before_ray_starts(tmp_path):
    pytest.importorskip("ray")
    from vitgraph.serve import build_app

    for name in ("max_items_per_request", "max_body_bytes"):
        for bad in (0, -1, True, 1.5, None):
            with pytest.raises(ValueError, match=f"{name} must be a positive int"):
                build_app(preset="tiny", device="cpu", **{name: bad})
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a Hub repo id"):
        build_app("/nonexistent/checkpoint", device="cpu")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl", "vision_config": {"depth": -1}}')
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"visual.x": "a.safetensors"}}')
    (tmp_path / "a.safetensors").write_bytes(b"")  # never opened: the config is refused first
    with pytest.raises(ValueError, match="config.json"):
        build_app(str(tmp_path), device="cpu")


def test_build_app_with_an_unreachable_or_unknown_hub_id_fails_once_before_ray_starts():
    """README's serving block with a Hub id this machine cannot fetch: one error from build_app
    (offline: the cache and the network named; online: the Hub's not-found), and Ray untouched."""
    ray = pytest.importorskip("ray")
    from vitgraph.serve import build_app

    with pytest.raises(Exception) as err:
        build_app("vitgraph-tests/no-such-repo-72", device="cpu")
    assert isinstance(err.value, ValueError) or type(err.value).__module__.startswith("huggingface_hub"), err.value
    assert "vitgraph-tests/no-such-repo-72" in str(err.value) and not ray.is_initialized()


def test_the_serve_command_defaults_are_the_servers():
    pytest.importorskip("ray")
    from vitgraph.cli import build_parser
    from vitgraph.serve import SERVE_MAX_BODY_BYTES

    args = build_parser().parse_args(["serve"])
    assert (args.max_items_per_request, args.max_body_bytes) == (MAX_ITEMS_PER_REQUEST, SERVE_MAX_BODY_BYTES)
    assert args.app_name == "vitgraph"


def test_http_store_counts_the_images_before_decoding_them(tmp_path, decodes):
    import base64
    import json

    from vitgraph.serve import VisionEncoderDeployment

    made = VisionEncoderDeployment.func_or_class(preset="tiny", device="cpu", max_items_per_request=2,
                                                 encoder_cache=str(tmp_path))
    try:
        three = json.dumps({"images": [base64.b64encode(png()).decode()] * 3}).encode()
        status, text = http(made, three, "application/json", query=b"store=1")
        assert status == 400 and "holds 3 items, above the server's max_items_per_request = 2" in text
        two = json.dumps({"images": [base64.b64encode(png()).decode()] * 2}).encode()
        status, text = http(made, two, "application/json", query=b"store=1")
        assert status == 200 and len(json.loads(text)["ids"]) == 2 and len(decodes) == 2
    finally:
        made.encoder.close()
