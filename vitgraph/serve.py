"""A Ray Serve deployment of the encoder (extra ``serve``): one replica per GPU, requests
batched by patch tokens into single ``encode`` calls that fill the largest bucket.

    from vitgraph.serve import build_app
    from ray import serve
    serve.run(build_app(model="Qwen/Qwen2-VL-2B-Instruct", num_replicas=2))   # POST /encode

HTTP ``POST /encode`` takes preprocessed rows as a safetensors payload
(``Content-Type: application/octet-stream``; tensors ``pixels [N, row width]`` and
``grid_thw [k, 3]``), or images as JSON (``{"images": [base64 PNG/JPEG, ...]}``) or as
multipart files. It answers with a safetensors payload (``embeddings``, ``grid_thw``; with
deepstack features side by side), or JSON with ``?format=json``. A bad request gets 400 and
its message; it is validated before it joins a batch, so the requests batched with it are
unaffected. In-cluster callers use the handle's ``encode(pixels, grid_thw)``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections import deque
from typing import Any

import torch
from ray import serve
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .encoder import GraphedVisionEncoder
from .validation import check_pixels, check_rows, normalize_grid

DEFAULT_WAIT_S = 0.005  # how long a batch waits for more requests once its first arrives
# Requests a replica holds at once. Ray's default (5) starves the GPU: a batch then holds at
# most five requests and the next ones are only sent once it returns (on an H200 one replica
# served 16.6 req/s of the serving mix over HTTP against 61.4 in process).
DEFAULT_MAX_ONGOING = 64


class _Request:
    """One validated request: rows on the CPU and its grids."""

    def __init__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        self.pixels, self.grids = pixels, grids
        self.tokens = pixels.shape[0]


def _tokens(requests: list[_Request]) -> int:
    return sum(r.tokens for r in requests)


class BadRequest(ValueError):
    """A request that cannot be served; the HTTP status is 400."""


@serve.deployment
class VisionEncoderDeployment:
    """Holds one encoder (graphs captured before the replica reports ready)."""

    def __init__(self, model: str | None = None, preset: str | None = None, device: str | None = None,
                 dtype: str | None = None, batch_wait_timeout_s: float = DEFAULT_WAIT_S,
                 engine_options: dict | None = None) -> None:
        options = dict(engine_options or {}, progress=False)
        if model:
            self.encoder = GraphedVisionEncoder.from_pretrained(model, device=device, dtype=dtype, **options)
        else:
            self.encoder = GraphedVisionEncoder.from_config(preset or ("qwen2-vl-2b" if torch.cuda.is_available()
                                                                       else "tiny"), device=device, dtype=dtype,
                                                            **options)
        buckets = self.encoder.buckets or self.encoder.requested_buckets
        # One batch fills the largest bucket at most; a larger request is encoded alone.
        self.max_batch_tokens = max(b.tokens for b in buckets) if buckets else self.encoder.options.max_budget
        self._batched.set_max_batch_size(self.max_batch_tokens)
        self._batched.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self._lock = threading.Lock()
        self._batches: deque = deque(maxlen=10_000)  # (requests, tokens) per batch
        try:  # which replica answered (a response header), and on which device
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (constructed directly)
            self.replica = "local"
        self._alone = 0

    # -- validation (before batching) ------------------------------------------------

    def _validated(self, pixels, grid_thw) -> _Request:
        enc = self.encoder
        try:
            if not isinstance(pixels, torch.Tensor):
                raise TypeError(f"pixels must be a tensor, got {type(pixels).__name__}")
            check_pixels(pixels, enc.tower.input_width)
            grids = normalize_grid(grid_thw, enc.config.spatial_merge_size)
            check_rows(pixels, grids)
        except (TypeError, ValueError) as err:
            raise BadRequest(str(err)) from None
        if not grids:
            raise BadRequest("grid_thw holds no item")
        # In the encoder's dtype at once (the cast encode would make): a batch concatenates
        # fewer bytes, and a caller that sends bf16 rows sends half of fp32's.
        return _Request(pixels.detach().to("cpu", enc.dtype).contiguous(), [tuple(g) for g in grids])

    # -- encoding ---------------------------------------------------------------------

    def _encode_now(self, pixels: torch.Tensor, grids) -> torch.Tensor:
        enc = self.encoder
        return enc.encode(pixels.to(enc.device), grids).to("cpu")  # rows are in enc.dtype (_validated)

    # Two batches at once: one stages and plans on the host while the other runs on the GPU.
    @serve.batch(max_batch_size=16384, batch_wait_timeout_s=DEFAULT_WAIT_S, batch_size_fn=_tokens,
                 max_concurrent_batches=2)
    async def _batched(self, requests: list[_Request]) -> list[torch.Tensor]:
        pixels = torch.cat([r.pixels for r in requests])
        grids = [g for r in requests for g in r.grids]
        merged = await asyncio.get_running_loop().run_in_executor(None, self._encode_now, pixels, grids)
        with self._lock:
            self._batches.append((len(requests), _tokens(requests)))
        unit = self.encoder.tower.merge_unit
        return list(merged.split([r.tokens // unit for r in requests]))

    async def _encode(self, request: _Request) -> torch.Tensor:
        if request.tokens > self.max_batch_tokens:  # Ray refuses an item above max_batch_size
            with self._lock:
                self._alone += 1
            return await asyncio.get_running_loop().run_in_executor(None, self._encode_now, request.pixels,
                                                                    request.grids)
        return await self._batched(request)

    async def encode(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        """For in-cluster callers (``handle.encode.remote(pixels, grid_thw)``): ``[N / 4, width]`` on the CPU."""
        return await self._encode(self._validated(pixels, grid_thw))

    def stats(self) -> dict[str, Any]:
        """Requests and patch tokens of each batch so far, requests encoded alone, GPU memory
        (empty on a CPU) and the encoder's stats."""
        with self._lock:
            batches = list(self._batches)
            alone = self._alone
        encoder = self.encoder.stats()
        return {"replica": self.replica, "device": str(self.encoder.device), "max_batch_tokens": self.max_batch_tokens,
                "batches": batches, "encoded_alone": alone, "memory": self._memory(encoder["pool_bytes"]),
                "encoder": encoder}

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
        from starlette.responses import JSONResponse, Response

        if http_request.method != "POST" or http_request.url.path.rstrip("/").split("/")[-1] != "encode":
            return Response("POST /encode", status_code=404)
        try:
            pixels, grid_thw = await self._parse(http_request)
            request = self._validated(pixels, grid_thw)
        except BadRequest as err:
            return Response(str(err), status_code=400)
        embeddings = await self._encode(request)
        grid = torch.tensor(request.grids, dtype=torch.int64)
        headers = {"X-Vitgraph-Replica": self.replica}
        if http_request.query_params.get("format") == "json":
            return JSONResponse({"embeddings": embeddings.float().tolist(), "grid_thw": grid.tolist()},
                                headers=headers)
        return Response(save_safetensors({"embeddings": embeddings.contiguous(), "grid_thw": grid}),
                        media_type="application/octet-stream", headers=headers)

    async def _parse(self, http_request):
        kind = http_request.headers.get("content-type", "").split(";")[0].strip()
        if kind == "application/octet-stream":
            try:
                tensors = load_safetensors(await http_request.body())
            except Exception as err:  # safetensors' own error type for a broken payload
                raise BadRequest(f"body is not a safetensors payload: {err}") from None
            missing = {"pixels", "grid_thw"} - set(tensors)
            if missing:
                raise BadRequest(f"safetensors payload lacks {sorted(missing)}")
            return tensors["pixels"], tensors["grid_thw"]
        if kind == "application/json":
            try:
                body = json.loads(await http_request.body())
                images = body["images"]
                if not isinstance(images, list):
                    raise TypeError("images must be a list")
                blobs = [base64.b64decode(image, validate=True) for image in images]
            except (ValueError, KeyError, TypeError) as err:
                raise BadRequest(f"JSON body must be {{\"images\": [base64 image, ...]}}: {err}") from None
            return self._images(blobs)
        if kind == "multipart/form-data":
            form = await http_request.form()
            blobs = [await part.read() for _, part in form.multi_items() if hasattr(part, "read")]
            return self._images(blobs)
        raise BadRequest(f"Content-Type must be application/octet-stream (safetensors), application/json or "
                         f"multipart/form-data, got {kind or 'none'!r}")

    def _images(self, blobs: list[bytes]):
        from PIL import Image, UnidentifiedImageError

        from .preprocess import preprocess_images

        if not blobs:
            raise BadRequest("no images in the request")
        images = []
        for i, blob in enumerate(blobs):
            try:
                with Image.open(io.BytesIO(blob)) as image:
                    images.append(image.convert("RGB"))
            except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
                raise BadRequest(f"images[{i}] is not a readable image: {err}") from None
        try:
            return preprocess_images(images, processor=self.encoder.processor)
        except (TypeError, ValueError) as err:
            raise BadRequest(str(err)) from None


def build_app(model: str | None = None, *, preset: str | None = None, device: str | None = None,
              dtype: str | None = None, num_replicas: int | str = 1, num_gpus: float | None = None,
              autoscaling_config: dict | None = None, batch_wait_timeout_s: float = DEFAULT_WAIT_S,
              num_cpus: float | None = None, max_ongoing_requests: int = DEFAULT_MAX_ONGOING, **engine_options):
    """The Ray Serve application: ``num_replicas`` replicas (or ``autoscaling_config``), each
    holding one encoder on ``num_gpus`` GPUs (default: 1 where CUDA is present, else 0). With
    ``num_gpus=1`` Ray places one replica per GPU and gives each only its own device
    (``CUDA_VISIBLE_DEVICES``): the encoder runs on it, and nothing crosses GPUs. Fractions
    (``0.5``) put several replicas on one GPU, each with its own encoder and graphs.
    ``max_ongoing_requests``: requests each replica holds at once (queued for its batches)."""
    if num_gpus is None:
        num_gpus = 1 if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else 0
    actor = {"num_gpus": num_gpus}
    if num_cpus is not None:
        actor["num_cpus"] = num_cpus
    scale = {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": num_replicas}
    if isinstance(max_ongoing_requests, bool) or not isinstance(max_ongoing_requests, int) or max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be a positive int, got {max_ongoing_requests!r}")
    return VisionEncoderDeployment.options(ray_actor_options=actor, max_ongoing_requests=max_ongoing_requests,
                                           **scale).bind(
        model=model, preset=preset, device=device, dtype=dtype, batch_wait_timeout_s=batch_wait_timeout_s,
        engine_options=engine_options)
