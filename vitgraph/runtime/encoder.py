"""``GraphedVisionEncoder``: validate, plan, replay (or run eagerly), return rows in item order."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
import time
from dataclasses import asdict
from typing import Any, Mapping

import torch

from .coalesce import CoalescingFront, EncoderClosed
from ..images.decode import MAX_IMAGE_PIXELS, MAX_ITEMS_PER_REQUEST
from ..models import FAMILIES, PRESETS, family_for, family_of, one_block_recipe
from ..engine.contract import Precompiled, VisionTower
from ..engine.graphs import GraphBank
from ..engine.planner import EAGER_MIN_PADDING, Bucket, Plan, Step, padded_batch, plan_call
from ..engine.routing import faster_next_buckets, single_frame_thresholds
from ..ops.backend_names import attention_backend
from ..checkpoints.loading import build_tower, find_checkpoint, load_tower, read_config, tower_from_state_dict
from .options import (EngineOptions, buckets_for, configure_tower, engine_options, resolve_device, resolve_dtype,
                      uses_graphs)
from .encoder_stats import BucketStats, Counters, encoder_stats
from .plans import PlanCache, PreparedPlan
from ..images.processor_files import read_processor, read_video_processor
from .precompile import PrecompileReport, TowerSetup, precompile, start_early
from .tuning import Tuning, check_reads, derive_tuning
from .encoder_images import ImageInput
from .validation import check_finite_rows, check_out, check_pixels, check_rows, normalize_grid

logger = logging.getLogger(__name__)


def _start_early(recipe: dict | None, device: torch.device, dtype: torch.dtype, options: EngineOptions):
    """Kernel-compiling workers for a tower whose forward compiles kernels (``recipe``: its
    :meth:`Precompiled.one_block_recipe`; None: it compiles none)."""
    return None if recipe is None else start_early(recipe, device, dtype, asdict(options))


class GraphedVisionEncoder(ImageInput):
    """A vision encoder of the Qwen VL families (ViT + patch merger), replayed from CUDA graphs.

    ``encode(pixels, grid_thw)`` validates, plans the call into bucket replays on the host,
    copies each step into static buffers, replays, and returns ``[N / 4, output_width]`` in
    item order (a frame larger than every bucket: eager; empty input: ``[0, width]``).
    ``submit`` (``submit_images``, ``encode_async``, ``encode_images_async``) returns at once
    and merges concurrent callers' requests into shared replays (:mod:`vitgraph.runtime.coalesce`)
    until ``close()``.

    Threads and streams: ``encode`` may be called from several threads. Replays are serialised
    by one lock; each runs on the caller's current stream and waits (on the device) for the
    previous replay's output copy, so streams never race on the static buffers. The result is
    produced on the caller's current stream. Eager steps run outside the lock.

    The encoder takes ownership of ``tower``: it moves it, sets its attention backend and
    fusion, and captures graphs that read its weights in place. Any tower that keeps the
    contract (:class:`vitgraph.engine.contract.VisionTower`) runs, in graph mode too.
    ``processor`` / ``video_processor`` (:class:`vitgraph.images.preprocess.ProcessorConfig`): how
    ``encode_images`` makes rows; default: the tower's (its family's, or the checkpoint's files).
    """

    def __init__(self, tower: VisionTower, *, device=None, dtype=None, processor=None, video_processor=None,
                 _early_workers=None, **options: Any) -> None:
        try:
            self.options = engine_options(options)
            self.device = resolve_device(device)
            self.dtype = resolve_dtype(dtype, self.device)
            if self.options.mode == "graph" and self.device.type != "cuda":
                raise ValueError(f"mode='graph' needs a CUDA device, got {self.device}")
            self.use_graphs = uses_graphs(self.options, self.device)
            # Every threshold, tile and switch this encoder runs by (see vitgraph.runtime.tuning).
            self.tuning: Tuning = derive_tuning(tower.shape, self.device, self.options.tuning,
                                                tower=tower)
            # With no compiled kernel on disk, kernel-compiling workers start now (or started
            # as from_pretrained read the checkpoint's config), before this process loads the
            # kernel libraries, so that their start-up overlaps its own.
            if _early_workers is None and self.use_graphs:
                recipe = tower.one_block_recipe() if isinstance(tower, Precompiled) else None
                _early_workers = _start_early(recipe, self.device, self.dtype, self.options)
            elif _early_workers is not None and not self.use_graphs:  # nothing will wait for them
                _early_workers.stop()
                _early_workers = None
            self.tower = tower.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
            self.attention, self.tuning = configure_tower(self.tower, self.options, self.tuning, self.device,
                                                          self.dtype)
            self.gemm = self.tuning.gemm.backend
            self.requested_buckets = buckets_for(self.tower, self.options, self.attention, self.device, self.tuning)
            self.shape = tower.shape  # the widths: patch_width (values per pixel row), spatial_merge_size, ...
            # How encode_images turns images into rows: the checkpoint's processor files
            # (from_pretrained; vitgraph.images.processor_files), else the tower's; none: float rows only.
            self.processor = processor or tower.processor
            # And videos: the checkpoint's video processor, else the tower's, else the image processor.
            self.video_processor = video_processor or tower.video_processor or self.processor
            self._set_statistics()  # each checked against the tower's rows
        except BaseException:
            if _early_workers is not None:
                _early_workers.stop()
            raise
        self._early_workers = _early_workers
        self._host_pool: ThreadPoolExecutor | None = None  # decodes and preprocesses images
        self.bank: GraphBank | None = None
        self._lock = threading.Lock()
        self._idle: torch.cuda.Event | None = None
        self._plans = PlanCache()
        self._packed_single_below: dict[int, int] = {}  # measured at capture (routing)
        self._faster_next: dict[Bucket, Bucket] = {}  # measured at capture (routing)
        self._routing_seconds = 0.0
        self._precompile = PrecompileReport()
        self._precompile_seconds = 0.0
        self._counters = Counters()
        self._front: CoalescingFront | None = None  # made by the first submit
        self._closed = False
        if self.use_graphs:
            layouts = {b: padded_batch(self.tower, b) for b in self.requested_buckets}  # empty: for capture
            self.bank = GraphBank(self.tower, layouts, self.device, self.dtype)
            if self.options.capture:
                self.capture()

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, source, *, device=None, dtype=None, revision: str | None = None, cache_dir=None,
                        local_files_only: bool = False, token=None, allow_nonfinite_weights: bool = False,
                        **options: Any) -> "GraphedVisionEncoder":
        """Load from a local checkpoint directory or a Hub repo id (vision shards only). A weight
        holding a NaN or an inf is refused, naming it, unless ``allow_nonfinite_weights``."""
        engine = engine_options(options)  # refuse bad options before any download or load
        if not isinstance(allow_nonfinite_weights, bool):
            raise TypeError(f"allow_nonfinite_weights must be a bool, got {allow_nonfinite_weights!r}")
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        files = find_checkpoint(source, revision=revision, cache_dir=cache_dir,
                                local_files_only=local_files_only, token=token)
        config = read_config(files)
        check_reads(engine.tuning, family_of(config).tower)  # before the weights load
        processor = read_processor(files, config)
        video_processor = read_video_processor(files, config)
        # Cold kernel caches: the workers need only the shapes, so they compile while the
        # weights load (seconds for a 2B tower's shards).
        recipe = one_block_recipe(config) if issubclass(family_of(config).tower, Precompiled) else None
        early = _start_early(recipe, device, dtype, engine) if uses_graphs(engine, device) else None
        try:
            tower = load_tower(files, config, device, dtype, allow_nonfinite_weights)
        except BaseException:
            if early is not None:
                early.stop()
            raise
        return cls(tower, device=device, dtype=dtype, processor=processor, video_processor=video_processor,
                   _early_workers=early, **options)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config, *,
                        device=None, dtype=None, **options: Any) -> "GraphedVisionEncoder":
        """Build from weights already in memory (``visual.``-prefixed, ``model.visual.``-prefixed or bare)."""
        engine_options(options)
        if not isinstance(config, tuple(f.config for f in FAMILIES) + (Mapping,)):
            raise TypeError(f"config must be a VisionConfig or a mapping (a config.json object), "
                            f"got {type(config).__name__}")
        if isinstance(config, Mapping):
            config = family_for(config.get("model_type")).config.from_dict(dict(config))
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        return cls(tower_from_state_dict(state_dict, config, device, dtype), device=device, dtype=dtype, **options)

    @classmethod
    def from_config(cls, config, *, device=None, dtype=None, seed: int = 0,
                    **options: Any) -> "GraphedVisionEncoder":
        """Random weights of a given shape (a :class:`VisionConfig` or a preset name), for demos and benchmarks."""
        if isinstance(config, str):
            if config not in PRESETS:
                raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {config!r}")
            config = PRESETS[config]
        engine_options(options)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # leave the global RNG be
            torch.manual_seed(seed)
            tower = build_tower(config, device, torch.float32)
        return cls(tower, device=device, dtype=dtype, **options)

    def _stage(self, bucket: Bucket, grids):
        """``grids``' metadata laid out for ``bucket``, flat, as the bank loads it (host work)."""
        return self.bank.stage(padded_batch(self.tower, bucket, grids))

    def _time_replay(self, bucket: Bucket, grids) -> float:
        return self.bank.time_replay(bucket, self._stage(bucket, grids), reps=1)

    def capture(self) -> None:
        """Capture every bucket (largest first, one shared pool). Idempotent."""
        if self.bank is None:
            raise ValueError(f"capture() needs graph mode on CUDA; this encoder runs eagerly on {self.device}")
        with self._lock:
            before = self.bank.buckets
            todo = self.bank.uncaptured
            if todo:
                setup = TowerSetup(self.attention, self.tower.fused, self.tuning.kernels, self.dtype)
                self._precompile = precompile(self.tower, setup, todo, self.device, self.options.compile_workers,
                                              early=self._early_workers)
                self._early_workers = None
                self._precompile_seconds += self._precompile.seconds
            self.bank.capture(pool_limit_bytes=self.options.pool_limit_bytes, progress=self.options.progress)
            if self.bank.buckets != before:  # else the timings still hold
                start = time.perf_counter()
                merge = self.shape.spatial_merge_size

                def frame(tokens: int) -> tuple[int, int, int]:  # one frame of that many tokens
                    return 1, merge, tokens // merge

                if self.tuning.routing.single_frames:
                    self._packed_single_below = single_frame_thresholds(
                        self.bank.buckets, self._time_replay, frame, self.tower.merge_unit)
                if self.tuning.routing.faster_buckets:
                    self._faster_next = faster_next_buckets(self.bank.buckets, self._time_replay, frame,
                                                            self.tuning.routing)
                self._routing_seconds += time.perf_counter() - start
            self._plans.clear()
            if self._front is not None:  # its batches are bounded by the buckets
                self._front.refresh(self)

    # -- the face -------------------------------------------------------------------

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets that have a captured graph."""
        return self.bank.buckets if self.bank is not None else []

    def plan(self, grid_thw) -> Plan:
        """The host-side plan ``encode`` would follow (no GPU work)."""
        grids = normalize_grid(grid_thw, self.shape.spatial_merge_size)
        return copy.deepcopy(self._prepare(grids).plan)

    def _prepare(self, grids, cache: bool = True) -> PreparedPlan:
        """The plan for ``grids`` plus each graph step's staged metadata, cached per grid tuple
        (``cache``: also kept when made here)."""
        if not self.use_graphs:
            plan = plan_call(grids, [])
            for step in plan.steps:
                step.reason = "eager_mode"
            return PreparedPlan(plan, [None] * len(plan.steps))
        key = tuple(grids)
        prepared = self._plans.get(key)
        if prepared is not None:
            return prepared
        start = time.perf_counter()
        eager_padding = None if attention_backend(self.attention).eager_slower else EAGER_MIN_PADDING
        plan = plan_call(grids, self.buckets, self.options.exact_eager_above, self._packed_single_below,
                         eager_padding, self._faster_next)
        staged = [None if step.bucket is None else self._stage(step.bucket, step.grids) for step in plan.steps]
        prepared = PreparedPlan(plan, staged)
        self._plans.add(key, prepared, time.perf_counter() - start, cache, self.tuning.plans)
        return prepared

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grid_thw, *, out: torch.Tensor | None = None,
               check_finite: bool = False) -> torch.Tensor:
        """``pixels [N, C*T*P*P]`` + ``grid_thw [k, 3]`` -> ``[N / 4, output_width]`` on the encoder's device.

        ``pixels``: normalised float rows, or the processor's uint8 rows (resized and
        patchified, not normalised), which are rescaled and normalised on the device with
        :attr:`processor`'s mean and std. Item ``i`` owns ``t*h*w / 4`` consecutive rows. The
        result is an inference-mode tensor (no autograd history), or ``out`` when given.
        ``check_finite``: refuse float rows holding NaN or inf, naming the items (off: encoded as they are).
        """
        check_pixels(pixels, self.tower.input_width)
        grids = normalize_grid(grid_thw, self.shape.spatial_merge_size)
        tokens = check_rows(pixels, grids)
        check_finite_rows(pixels, grids, check_finite)
        if out is not None:
            check_out(out, tokens // self.tower.merge_unit, self.tower.output_width, self.device, self.dtype)
        return self._encode_checked(pixels, grids, tokens, out)

    @torch.inference_mode()
    def _encode_checked(self, pixels: torch.Tensor, grids, tokens: int, out: torch.Tensor | None = None, *,
                        cache_plan: bool = True) -> torch.Tensor:
        """:meth:`encode` of input already checked. ``cache_plan``: keep the plan for these grids
        (the front's merged calls rarely recur, and would evict the plans that do)."""
        with self._lock:
            self._counters.calls += 1
        if tokens == 0:
            return out if out is not None else self._new_output(0)
        if pixels.dtype == torch.uint8:  # 8x fewer bytes than fp32 rows to bring over
            pixels = self.normalized_rows(pixels)
        result = out if out is not None else self._new_output(tokens // self.tower.merge_unit)
        unit = self.tower.merge_unit
        prepared = self._prepare(grids, cache=cache_plan)
        for step, staged in zip(prepared.plan.steps, prepared.staged):
            whole = step.tokens == tokens  # the whole call: no slice to make
            step_pixels = pixels if whole else pixels[step.token_offset:step.token_offset + step.tokens]
            target = result if whole else result[step.token_offset // unit:(step.token_offset + step.tokens) // unit]
            if step.bucket is None:
                self._run_eager(step, step_pixels, target)
            else:
                self._run_graph(step, staged, step_pixels, target)
        return result

    @property
    def output_width(self) -> int:
        """Values per returned row: ``out_hidden_size`` times the outputs side by side (Qwen3-VL:
        the main embeddings, then each deepstack feature)."""
        return self.tower.output_width

    def _new_output(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.tower.output_width, device=self.device, dtype=self.dtype)

    def _run_eager(self, step: Step, pixels: torch.Tensor, target: torch.Tensor) -> None:
        batch = self.tower.build_batch(step.grids)
        batch = batch.to(self.device, non_blocking=True)
        target.copy_(self.tower(pixels.to(self.device, non_blocking=True), batch))
        with self._lock:
            self._counters.eager[step.reason or "eager"] += 1

    def _run_graph(self, step: Step, staged, pixels: torch.Tensor, target: torch.Tensor) -> None:
        bucket = step.bucket
        with self._lock:
            stream = torch.cuda.current_stream(self.device)
            if self._idle is not None:
                stream.wait_event(self._idle)  # the previous replay's output copy is done reading the pool
            self.bank.load(bucket, pixels, staged, replay=True)
            output = self.bank.replay(bucket)
            target.copy_(output[:step.tokens // self.tower.merge_unit])
            if self._idle is None:
                self._idle = torch.cuda.Event()
            self._idle.record(stream)
            stats = self._counters.buckets.setdefault(bucket.name, BucketStats())
            stats.replays += 1
            stats.real_tokens += step.tokens
            stats.padded_tokens += step.padded_tokens

    # -- the coalescing front (vitgraph.runtime.coalesce) ------------------------------------------

    def submit(self, pixels: torch.Tensor, grid_thw, *, check_finite: bool = False) -> Future:
        """:meth:`encode` as a ``concurrent.futures.Future``: concurrent requests share replays.
        Its rows (a view of its batch's output, complete when it resolves) equal the request made
        alone within the distance two buckets give. A bad request fails it with ``encode``'s error."""
        return self._coalescer().submit(pixels, grid_thw, check_finite)

    def submit_images(self, images=None, videos=None, *, min_pixels: int | None = None,
                      max_pixels: int | None = None, preprocess: str = "auto", decode: str = "auto",
                      max_image_pixels: int = MAX_IMAGE_PIXELS, max_items_per_request: int = MAX_ITEMS_PER_REQUEST) -> Future:
        """:meth:`encode_images` as a future of its list of tensors; decoding and preprocessing
        run in the front's threads, then the request joins shared replays as :meth:`submit`'s."""
        return self._coalescer().submit_images(images, videos, dict(
            min_pixels=min_pixels, max_pixels=max_pixels, preprocess=preprocess, decode=decode,
            max_image_pixels=max_image_pixels, max_items_per_request=max_items_per_request))

    async def encode_async(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        """``await``-able :meth:`submit` (its checks and copy to the device run off the event loop)."""
        submitted = await asyncio.get_running_loop().run_in_executor(None, self.submit, pixels, grid_thw)
        return await asyncio.wrap_future(submitted)

    async def encode_images_async(self, images=None, videos=None, **kwargs) -> list[torch.Tensor]:
        """``await``-able :meth:`submit_images`."""
        return await asyncio.wrap_future(self.submit_images(images, videos, **kwargs))

    def _coalescer(self) -> CoalescingFront:
        if self._front is None:  # made on first use: an encoder nobody submits to runs no thread
            with self._lock:
                if self._closed:
                    raise EncoderClosed("the encoder is closed: it takes no more requests")
                self._front = self._front or CoalescingFront(self)
        return self._front

    def close(self, cancel_pending: bool = False) -> None:
        """Stop the front: encode what was submitted (``cancel_pending``: fail what is not yet
        dispatched with ``EncoderClosed``), then join its threads and the image threads.
        ``submit`` refuses afterwards; ``encode`` and ``encode_images`` still work. Idempotent."""
        with self._lock:
            self._closed = True
            front = self._front
        if front is not None:
            front.close(cancel_pending)
        pool, self._host_pool = self._host_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    @property
    def config(self):  # the runtime reads only the tower's contract; say where the config went
        raise AttributeError("GraphedVisionEncoder has no config: encoder.shape holds the widths "
                             "(patch_width, spatial_merge_size, ...), encoder.tower.config the family's own")

    def __repr__(self) -> str:
        return (f"GraphedVisionEncoder({self.tower.name}, {self.device}, "
                f"{str(self.dtype).replace('torch.', '')}, {'graph' if self.use_graphs else 'eager'}, "
                f"{len(self.buckets)} buckets captured)")

    def __enter__(self) -> "GraphedVisionEncoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Replays and padding per bucket, eager fallbacks by reason, capture seconds (the kernel
        precompile included, whose report is under ``"precompile"``), pool bytes (library
        workspaces included, also given alone), the plan cache and the front (:mod:`vitgraph.runtime.encoder_stats`)."""
        return encoder_stats(self)
