"""A Ray Serve deployment of the encoder (extra ``serve``): one replica per GPU, concurrent
requests sharing replays through the encoder's coalescing front (:mod:`vitgraph.runtime.coalesce`).

    from vitgraph.serve import build_app
    from ray import serve
    serve.run(build_app(model="Qwen/Qwen2-VL-2B-Instruct", num_replicas=2))   # POST /encode

HTTP ``POST /encode`` takes preprocessed rows as a safetensors payload
(``Content-Type: application/octet-stream``; tensors ``pixels [N, row width]``, float rows or
the processor's uint8 rows, and ``grid_thw [k, 3]``), or images as JSON (``{"images": [base64
PNG/JPEG, ...]}``) or as multipart files. It answers with a safetensors payload
(``embeddings``, ``grid_thw``; with deepstack features side by side), or JSON with
``?format=json``. A body of one encoded image (``Content-Type: image/jpeg``, ``image/png``...) is
one image. Other methods get 405 (``Allow: POST``). A bad request gets 400 and its message as
plain text; it is validated before it joins a batch, so the requests beside it are unaffected.
In-cluster callers use the handle's ``encode(pixels, grid_thw)`` and ``encode_images(images)``.

Nothing CPU-heavy runs on a replica's event loop: parsing, decoding, preprocessing and the
answer's serialisation run in threads, so a large image never holds up the requests behind
it; an image request joins the batches by its patch tokens like any other.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from concurrent.futures import Future
from typing import Any

import torch
from ray import serve
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .images.decode import MAX_ITEMS_PER_REQUEST, check_image_ceiling
from .runtime.encoder import GraphedVisionEncoder
from .runtime.options import engine_options as check_engine_options
from .images.preprocess import check_pixel_arguments, pixel_limits
from .runtime.validation import check_int, check_pixels, check_rows, normalize_grid

# The most pixels an encoded image in a request may declare: refused from its header, before
# decoding (a small file can inflate to its declared size: 2**26 RGB pixels are 200 MB).
SERVE_MAX_IMAGE_PIXELS = 1 << 26
# The largest request body a replica reads (a larger one is answered 413 before it is read on);
# 128 MiB holds 16384 fp32 rows of Qwen2-VL's 1176 values with room to spare.
SERVE_MAX_BODY_BYTES = 1 << 27
# Requests a replica holds at once. Ray's default (5) starves the GPU: a batch then holds at
# most five requests and the next ones are only sent once it returns (benchmarks/HISTORY.md).
DEFAULT_MAX_ONGOING = 64


class _Request:
    """One validated request: its rows (uint8, or the encoder's dtype; on the CPU, or on the
    encoder's device where it preprocessed them) and its grids."""

    def __init__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        self.pixels, self.grids = pixels, grids
        self.submitted: Future | None = None  # its embeddings, once handed to the encoder's front


class BadRequest(ValueError):
    """A request that cannot be served; the HTTP status is 400."""

    status = 400


class TooLarge(BadRequest):
    """A request body over the replica's ``max_body_bytes``: 413."""

    status = 413


def _bad(message: str, status: int = 400, headers: dict | None = None):
    """A 400 (or ``status``) answer: the message, as plain text."""
    from starlette.responses import Response

    return Response(message, status_code=status, headers=headers, media_type="text/plain")


def check_request_caps(max_items_per_request, max_body_bytes) -> None:
    check_int("max_items_per_request", max_items_per_request)
    check_int("max_body_bytes", max_body_bytes)


@serve.deployment
class VisionEncoderDeployment:
    """Holds one encoder (graphs captured before the replica reports ready)."""

    def __init__(self, model: str | None = None, preset: str | None = None, device: str | None = None,
                 dtype: str | None = None, engine_options: dict | None = None, min_pixels: int | None = None,
                 max_pixels: int | None = None, max_image_pixels: int = SERVE_MAX_IMAGE_PIXELS,
                 encoder_cache: str | None = None, max_items_per_request: int = MAX_ITEMS_PER_REQUEST,
                 max_body_bytes: int = SERVE_MAX_BODY_BYTES, encoder_cache_max_items: int | None = None,
                 encoder_cache_max_bytes: int | None = None) -> None:
        options = dict(engine_options or {}, progress=False)
        preset = preset or ("qwen2-vl-2b" if torch.cuda.is_available() else "tiny")
        if model:
            self.encoder = GraphedVisionEncoder.from_pretrained(model, device=device, dtype=dtype, **options)
        else:
            self.encoder = GraphedVisionEncoder.from_config(preset, device=device, dtype=dtype, **options)
        try:  # which replica answered (a response header), and on which device
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (constructed directly)
            self.replica = "local"
        # Images are resized into [min_pixels, max_pixels] (the processor's, unless given).
        self.pixel_limits = pixel_limits(self.encoder.processor, min_pixels, max_pixels)
        self.max_image_pixels = max_image_pixels
        check_request_caps(max_items_per_request, max_body_bytes)
        self.max_items, self.max_body_bytes = max_items_per_request, max_body_bytes
        from .handoff import EncoderCache  # POST /encode?store=1 writes here (vitgraph.serve_store)

        self.cache = (EncoderCache(encoder_cache, max_bytes=encoder_cache_max_bytes, max_items=encoder_cache_max_items)
                      if encoder_cache else None)
        self.model_identity = model or f"preset:{preset}"  # the model part of default ids (handoff.item_id)

    # -- validation (before batching) ------------------------------------------------

    def _validated(self, pixels, grid_thw) -> _Request:
        enc = self.encoder
        try:
            if not isinstance(pixels, torch.Tensor):
                raise TypeError(f"pixels must be a tensor, got {type(pixels).__name__}")
            check_pixels(pixels, enc.tower.input_width)
            grids = normalize_grid(grid_thw, enc.shape.spatial_merge_size)
            check_rows(pixels, grids)
        except (TypeError, ValueError) as err:
            raise BadRequest(str(err)) from None
        self._check_count(len(grids))
        if not grids:
            raise BadRequest("grid_thw holds no item")
        # uint8 rows stay uint8 (normalised on the device); float rows take the encoder's dtype
        # at once (the cast encode would make): a batch concatenates fewer bytes.
        dtype = torch.uint8 if pixels.dtype == torch.uint8 else enc.dtype
        return _Request(pixels.detach().to("cpu", dtype).contiguous(), [tuple(g) for g in grids])

    # -- encoding: the encoder's front merges concurrent requests into shared replays -----------

    def _accepted(self, request: _Request) -> _Request:
        """``request`` handed to the encoder's front (in a thread: the rows go to the device there)."""
        request.submitted = self.encoder.submit(request.pixels, request.grids)
        return request

    async def _encode(self, submitted: Future) -> torch.Tensor:
        """The request's embeddings, on the CPU (copied in a thread)."""
        embeddings = await asyncio.wrap_future(submitted)
        return await asyncio.get_running_loop().run_in_executor(None, embeddings.cpu)

    async def encode(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        """For in-cluster callers (``handle.encode.remote(pixels, grid_thw)``): ``[N / 4, width]`` on the CPU."""
        request = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._accepted(self._validated(pixels, grid_thw)))
        return await self._encode(request.submitted)

    async def encode_images(self, images: list) -> list[torch.Tensor]:
        """For in-cluster callers: images (encoded bytes, arrays, PIL images...) -> one
        ``[rows, width]`` tensor per image, on the CPU."""
        request = await asyncio.get_running_loop().run_in_executor(None, lambda: self._accepted(self._images(images)))
        return self.encoder.per_item(await self._encode(request.submitted), request.grids)

    def stats(self) -> dict[str, Any]:
        """This replica's id and device, GPU memory (empty on a CPU) and the encoder's stats
        (its front's requests, batches and queue wait under ``"front"``)."""
        encoder = self.encoder.stats()
        return {"replica": self.replica, "device": str(self.encoder.device),
                "memory": self._memory(encoder["pool_bytes"]), "encoder": encoder}

    def _memory(self, graph_pool: int) -> dict[str, Any]:
        """This replica's share of its GPU (bytes): what its process holds, and the device's use."""
        device = self.encoder.device
        if device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(device)
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
                "peak_allocated": torch.cuda.max_memory_allocated(device),
                "graph_pool": graph_pool, "device_used": total - free, "device_total": total}

    # -- HTTP -------------------------------------------------------------------------

    async def __call__(self, http_request):
        from starlette.responses import Response

        if http_request.url.path.rstrip("/").split("/")[-1] != "encode":
            return _bad("not found: POST /encode", 404)
        if http_request.method != "POST":
            return _bad("POST /encode", 405, {"Allow": "POST"})
        loop = asyncio.get_running_loop()
        answer_format = http_request.query_params.get("format", "safetensors")
        if answer_format not in ("safetensors", "json"):
            return _bad(f"format must be 'safetensors' (the default) or 'json', got {answer_format!r}")
        as_json = answer_format == "json"
        stored = http_request.query_params.get("store") == "1"
        if stored and self.cache is None:
            return _bad("store=1 needs an encoder cache (vitgraph serve --encoder-cache DIR)")
        try:
            kind, payload = await self._receive(http_request)
            ids = await loop.run_in_executor(None, self._store_ids, http_request, kind, payload) if stored else None
            request = await loop.run_in_executor(None, lambda: self._accepted(self._parse(kind, payload, as_json)))
        except BadRequest as err:
            return _bad(str(err), err.status)
        embeddings = await self._encode(request.submitted)
        if ids is not None:  # written to the cache; the answer names them
            return await loop.run_in_executor(None, self._stored, ids, embeddings, request.grids)
        try:
            body, media = await loop.run_in_executor(None, self._answer, embeddings, request.grids, as_json)
        except ValueError:  # finite pixels whose embeddings overflowed: strict JSON cannot carry them
            return _bad("the embeddings are not finite; ask for safetensors", 500)
        return Response(body, media_type=media, headers={"X-Vitgraph-Replica": self.replica})

    def _store_ids(self, http_request, kind: str, payload) -> list[str]:
        from .serve_store import store_ids

        try:
            ids = store_ids(kind, payload, http_request.query_params.getlist("id"), self.model_identity,
                            self.encoder.processor, self.pixel_limits, self.max_items)
            self.cache.check_count(len(ids))  # before anything is encoded
            return ids
        except (TypeError, ValueError) as err:
            raise BadRequest(str(err)) from None

    def _stored(self, ids: list[str], embeddings: torch.Tensor, grids):
        from starlette.responses import Response

        from .serve_store import store

        try:
            body = store(self.cache, ids, self.encoder.per_item(embeddings, grids), grids)
        except ValueError as err:  # a foreign file at an id's path, non-finite embeddings
            return _bad(str(err), 409)
        return Response(body, media_type="application/json", headers={"X-Vitgraph-Replica": self.replica})

    @staticmethod
    def _answer(embeddings: torch.Tensor, grids, as_json: bool) -> tuple[bytes, str]:
        grid = torch.tensor(grids, dtype=torch.int64)
        if as_json:
            payload = {"embeddings": embeddings.float().tolist(), "grid_thw": grid.tolist()}
            return json.dumps(payload, allow_nan=False).encode(), "application/json"  # strict JSON, always
        return save_safetensors({"embeddings": embeddings.contiguous(), "grid_thw": grid}), "application/octet-stream"

    async def _receive(self, http_request) -> tuple[str, Any]:
        """The request's media type and its raw content: the body's bytes, or a multipart form's
        files' bytes (read here, parsed in a thread)."""
        kind = http_request.headers.get("content-type", "").split(";")[0].strip().lower()  # case-insensitive
        length = http_request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:  # refused before a byte of it is read
            raise TooLarge(f"the body is {int(length)} bytes, above the server's max_body_bytes = {self.max_body_bytes}")
        if kind == "multipart/form-data":
            try:
                form = await http_request.form(max_files=self.max_items, max_fields=self.max_items)
            except Exception as err:  # python-multipart's and starlette's parse errors
                raise BadRequest(f"multipart body cannot be read (at most max_items_per_request = {self.max_items} "
                                 f"files): {err}") from None
            return kind, [await part.read() for _, part in form.multi_items() if hasattr(part, "read")]
        if kind.startswith("image/"):  # the body is one encoded image, as a newcomer sends it first
            return "multipart/form-data", [await self._body(http_request)]
        if kind not in ("application/octet-stream", "application/json"):
            raise BadRequest(f"Content-Type must be application/octet-stream (safetensors), application/json, "
                             f"multipart/form-data or an image type (image/jpeg...), got {kind or 'none'!r}")
        return kind, await self._body(http_request)

    async def _body(self, http_request) -> bytes:
        """The body's bytes, read no further than ``max_body_bytes`` (a body sent without a length)."""
        chunks, size = [], 0
        async for chunk in http_request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise TooLarge(f"the body is over the server's max_body_bytes = {self.max_body_bytes}")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, kind: str, payload, as_json: bool = False) -> _Request:
        """A request's content -> a validated request (in a thread: parsing, decoding and checking
        rows are CPU work). ``as_json``: the answer is to be JSON, which cannot carry NaN."""
        if kind == "multipart/form-data":
            return self._images(payload)
        if kind == "application/octet-stream":
            try:
                tensors = load_safetensors(payload)
            except Exception as err:  # safetensors' own error type for a broken payload
                raise BadRequest(f"body is not a safetensors payload: {err}") from None
            missing = {"pixels", "grid_thw"} - set(tensors)
            if missing:
                raise BadRequest(f"safetensors payload lacks {sorted(missing)}")
            self._check_count(tensors["grid_thw"].shape[0] if tensors["grid_thw"].ndim else 1)
            request = self._validated(tensors["pixels"], tensors["grid_thw"])
            if as_json and request.pixels.dtype != torch.uint8 and not torch.isfinite(request.pixels).all():
                raise BadRequest("pixels hold NaN or inf, and ?format=json cannot carry the embeddings they give "
                                 "(strict JSON has no NaN): send finite pixels, or ask for safetensors")
            return request
        try:
            body = json.loads(payload)
            if not isinstance(body, dict) or "images" not in body:
                raise ValueError("it has no \"images\" key")
            images = body["images"]
            if not isinstance(images, list):
                raise TypeError("images must be a list")
            self._check_count(len(images))  # before a single image is base64-decoded
            blobs = [base64.b64decode(image, validate=True) for image in images]
        except (ValueError, TypeError, RecursionError) as err:
            raise BadRequest(f"JSON body must be {{\"images\": [base64 image, ...]}}: {err}") from None
        return self._images(blobs)

    def _check_count(self, items: int) -> None:
        if items > self.max_items:
            raise BadRequest(f"the request holds {items} items, above the server's max_items_per_request = "
                             f"{self.max_items}; split it")

    def _images(self, images: list) -> _Request:
        """Images (encoded bytes or any form encode_images takes) -> their rows as one request:
        uint8, preprocessed as the encoder's processor does (on its device where it is CUDA)."""
        if not isinstance(images, (list, tuple)) or not images:
            raise BadRequest("no images in the request")
        try:
            low, high = self.pixel_limits
            self._check_count(len(images))
            rows, grid = self.encoder.image_rows(list(images), min_pixels=low, max_pixels=high,
                                                 max_image_pixels=self.max_image_pixels,
                                                 max_items_per_request=self.max_items)
        except (TypeError, ValueError) as err:
            raise BadRequest(str(err)) from None
        return _Request(rows, [tuple(g) for g in grid.tolist()])


def build_app(model: str | None = None, *, preset: str | None = None, device: str | None = None,
              dtype: str | None = None, num_replicas: int | str = 1, num_gpus: float | None = None,
              autoscaling_config: dict | None = None, num_cpus: float | None = None, max_ongoing_requests: int = DEFAULT_MAX_ONGOING,
              min_pixels: int | None = None, max_pixels: int | None = None,
              max_image_pixels: int = SERVE_MAX_IMAGE_PIXELS, encoder_cache: str | None = None,
              max_items_per_request: int = MAX_ITEMS_PER_REQUEST, max_body_bytes: int = SERVE_MAX_BODY_BYTES,
              encoder_cache_max_items: int | None = None, encoder_cache_max_bytes: int | None = None,
              **engine_options):
    """The Ray Serve application: ``num_replicas`` replicas (or ``autoscaling_config``), each
    holding one encoder on ``num_gpus`` GPUs (default: 1 where CUDA is present, else 0). With
    ``num_gpus=1`` Ray places one replica per GPU and gives each only its own device
    (``CUDA_VISIBLE_DEVICES``): the encoder runs on it, and nothing crosses GPUs. Fractions
    (``0.5``) put several replicas on one GPU, each with its own encoder and graphs.
    ``max_ongoing_requests``: requests each replica holds at once (queued for its front).
    ``max_wait_ms`` (an engine option, as ``max_items``...): how long a request may wait for
    others to share its replay while the replica's GPU is busy.
    ``min_pixels`` / ``max_pixels``: the sizes images are resized into (default: the
    checkpoint's processor's); a lower ``max_pixels`` bounds an image request's tokens.
    ``max_image_pixels``: the most pixels an uploaded image may declare (checked before decoding).
    ``encoder_cache``: a directory ``POST /encode?store=1`` writes images' embeddings to
    (:mod:`vitgraph.serve_store`; vLLM's ``ECExampleConnector`` layout), bounded by
    ``encoder_cache_max_items`` / ``encoder_cache_max_bytes`` (:class:`vitgraph.handoff.EncoderCache`).
    ``max_items_per_request``: the most images (or grid rows) in one request, counted before
    anything is decoded (400 above it); ``max_body_bytes``: the largest body read (413 above it).
    ``model`` is found and its config and processor files read here, before any replica starts."""
    if encoder_cache is not None and not os.path.isdir(encoder_cache):
        raise ValueError(f"encoder_cache {encoder_cache}: is not an existing directory")
    for name, bound in (("encoder_cache_max_items", encoder_cache_max_items),
                        ("encoder_cache_max_bytes", encoder_cache_max_bytes)):
        check_int(name, bound, optional=True)
        if bound is not None and encoder_cache is None:
            raise ValueError(f"{name} bounds encoder_cache; give encoder_cache too")
    check_pixel_arguments(min_pixels, max_pixels)  # refused here, not in a replica's start-up
    check_image_ceiling(max_image_pixels)
    check_engine_options(engine_options)  # refused here, not in a replica's start-up
    check_request_caps(max_items_per_request, max_body_bytes)
    if model:  # an unreachable Hub id or a broken checkpoint: one error here, not one per replica start
        check_model(model)
    if num_gpus is None:
        num_gpus = 1 if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else 0
    actor = {"num_gpus": num_gpus}
    if num_cpus is not None:
        actor["num_cpus"] = num_cpus
    scale = {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": num_replicas}
    check_int("max_ongoing_requests", max_ongoing_requests)
    return VisionEncoderDeployment.options(ray_actor_options=actor, max_ongoing_requests=max_ongoing_requests,
                                           **scale).bind(
        model=model, preset=preset, device=device, dtype=dtype, engine_options=engine_options, min_pixels=min_pixels, max_pixels=max_pixels,
        max_image_pixels=max_image_pixels, encoder_cache=None if encoder_cache is None else os.path.abspath(encoder_cache),
        max_items_per_request=max_items_per_request, max_body_bytes=max_body_bytes,
        encoder_cache_max_items=encoder_cache_max_items, encoder_cache_max_bytes=encoder_cache_max_bytes)


def check_model(model: str) -> None:
    """What a replica's start would refuse of ``model``, found and read on the caller's side: a
    local folder with a config.json, or a Hub id that resolves (its vision shards are downloaded
    here, into the cache the replicas on this machine read); its config and processor files read
    and checked."""
    from .checkpoints.loading import find_checkpoint, read_config
    from .images.processor_files import read_processor, read_video_processor

    files = find_checkpoint(model)
    config = read_config(files)
    read_processor(files, config)
    read_video_processor(files, config)
