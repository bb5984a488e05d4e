"""The image side of :class:`vitgraph.runtime.encoder.GraphedVisionEncoder`: images, clips and uint8
rows to the normalised rows ``encode`` runs on (:mod:`vitgraph.images.pipeline`)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from ..images.decode import MAX_IMAGE_PIXELS, MAX_ITEMS_PER_REQUEST
from ..ops.normalize import normalize_rows
from ..images.preprocess import ProcessorConfig, check_same_rows, statistics
from .validation import check_pixels


class ImageInput:
    """A mixin of the encoder: it holds ``processor``, ``video_processor``, ``device``, ``dtype``,
    the processors' column statistics and a lazily made thread pool. Also the forms of its
    output: per item (:meth:`per_item`) and per output (:meth:`split`)."""

    def _set_statistics(self) -> None:
        """uint8 rows are normalised on the device with these (vitgraph.ops.normalize); a clip's
        with the video processor's where they differ. None: no processor, float rows only."""
        self._pixel_statistics = self._video_statistics = None
        if self.processor is None:
            if self.video_processor is not None:
                raise ValueError("video_processor needs processor too: clips are normalised and checked by both")
            return
        for name, proc in (("processor", self.processor), ("video_processor", self.video_processor)):
            if not isinstance(proc, ProcessorConfig):
                raise TypeError(f"{name} must be a vitgraph.images.preprocess.ProcessorConfig, got {type(proc).__name__}")
            if (proc.row_width, proc.merge_size) != (self.tower.input_width, self.shape.spatial_merge_size):
                raise ValueError(f"{name} makes rows of {proc.row_width} values merged {proc.merge_size}x"
                                 f"{proc.merge_size}; the tower ({self.tower.name}) takes {self.tower.input_width}, "
                                 f"merged {self.shape.spatial_merge_size}x{self.shape.spatial_merge_size}")
        check_same_rows(self.processor, self.video_processor)
        self._pixel_statistics = statistics(self.processor, self.device)
        video, image = self.video_processor, self.processor
        if (video.image_mean, video.image_std) != (image.image_mean, image.image_std):
            self._video_statistics = statistics(video, self.device)

    def _no_processor(self, what: str) -> ValueError:
        return ValueError(f"{what} need an image processor, and this encoder's tower ({self.tower.name}) has "
                          "none: pass processor= (a vitgraph.images.preprocess.ProcessorConfig) to the encoder")

    def device_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """Rows on the encoder's device in its dtype; uint8 rows normalised there with
        :attr:`processor`'s mean and std (as ``encode`` does)."""
        check_pixels(pixels, self.tower.input_width)
        return self.normalized_rows(pixels)

    def normalized_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """:meth:`device_rows` of rows already checked (``encode``'s, a server's validated ones)."""
        pixels = pixels.to(self.device, non_blocking=True)
        if pixels.dtype == torch.uint8:
            if self._pixel_statistics is None:
                raise self._no_processor("pixels: uint8 rows (normalised with its mean and std)")
            return normalize_rows(pixels, *self._pixel_statistics, self.dtype)
        return pixels.to(self.dtype)

    def image_rows(self, images: Sequence | None = None, videos: Sequence[Sequence] | None = None, *,
                   min_pixels: int | None = None, max_pixels: int | None = None, preprocess: str = "auto",
                   decode: str = "auto", max_image_pixels: int = MAX_IMAGE_PIXELS,
                   max_items_per_request: int = MAX_ITEMS_PER_REQUEST) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`encode_images` encodes: ``(uint8 rows, grid_thw)`` of the images, then the
        clips, as :attr:`processor` and :attr:`video_processor` make them (:func:`vitgraph.images.pipeline.image_rows`).
        ``encode`` normalises uint8 rows with the image processor's mean and std."""
        from ..images.pipeline import image_rows

        if self.processor is None:
            raise self._no_processor("images and videos")
        return image_rows(images, videos, processor=self.processor, video_processor=self.video_processor,
                          device=self.device, min_pixels=min_pixels, max_pixels=max_pixels, preprocess=preprocess,
                          decode=decode, executor=self._pool(), max_image_pixels=max_image_pixels,
                          max_items_per_request=max_items_per_request)

    def encode_images(self, images: Sequence | None = None, videos: Sequence[Sequence] | None = None, *,
                      min_pixels: int | None = None, max_pixels: int | None = None, preprocess: str = "auto",
                      decode: str = "auto", max_image_pixels: int = MAX_IMAGE_PIXELS,
                      max_items_per_request: int = MAX_ITEMS_PER_REQUEST) -> list[torch.Tensor]:
        """Images and clips -> one tensor of embeddings per item (images first, then videos, each
        in the order given), encoded in one call.

        An image is a PIL image, an ``HxWx3`` / ``HxWx4`` uint8 array, a ``3xHxW`` / ``4xHxW`` uint8
        tensor (any device; 4 channels: RGBA, composited onto white), encoded bytes (JPEG, PNG, ...)
        or a file path; a clip is a list of them, or one ``[T, H, W, C]`` or ``[T, C, H, W]`` uint8
        array or tensor as decoders give (:mod:`vitgraph.images.pixel_forms`). Both are lists: a lone
        image or clip, which transformers would take, is refused with the list to pass. ``preprocess``:
        ``"device"`` (torch on the encoder's device, as transformers' torchvision processors),
        ``"pil"`` (PIL on the host, as ``Qwen2VLImageProcessorPil``), ``"auto"``: device on
        CUDA, else PIL. ``decode``: ``"auto"`` (with ``"device"`` on CUDA: sequential JPEGs by
        nvJPEG, to PIL's very pixels, everything else on the host), ``"host"`` (PIL, in a thread
        pool) or ``"gpu"`` (as ``"auto"``, an error without the device preprocessing on CUDA).
        ``max_image_pixels``: the most pixels an encoded image may declare (refused from its header,
        before decoding).
        ``max_items_per_request``: the most images plus video frames in one call (refused from
        the count, before anything is decoded).
        """
        rows, grid = self.encodable_rows(images, videos, min_pixels=min_pixels, max_pixels=max_pixels,
                                         preprocess=preprocess, decode=decode, max_image_pixels=max_image_pixels,
                                         max_items_per_request=max_items_per_request)
        if grid.shape[0] == 0:
            return []
        return self.per_item(self.encode(rows, grid), grid)

    def encodable_rows(self, images=None, videos=None, **image_rows_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`encode_images` (and ``submit_images``) encode: :meth:`image_rows`' rows in
        the encoder's dtype on its device, the images' normalised with the image processor's mean
        and std, the clips' with the video processor's where they differ; and ``grid_thw``."""
        rows, grid = self.image_rows(images, videos, **image_rows_kwargs)
        first_clip = len(images) if images is not None else 0
        if first_clip < grid.shape[0] and self._video_statistics is not None:
            split = int(grid[:first_clip].prod(-1).sum())
            rows = rows.to(self.device, non_blocking=True)
            return torch.cat([self.normalized_rows(rows[:split]),
                              normalize_rows(rows[split:], *self._video_statistics, self.dtype)]), grid
        return self.normalized_rows(rows), grid

    def _pool(self) -> ThreadPoolExecutor:
        if self._host_pool is None:
            with self._lock:
                if self._host_pool is None:
                    self._host_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                         thread_name_prefix="vitgraph-images")
        return self._host_pool

    def split(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``encode``'s rows as ``(main, [deepstack features...])``, views of ``embeddings``
        (no deepstack features but for Qwen3-VL)."""
        parts = self.tower.output_parts
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2 or embeddings.shape[1] != self.output_width:
            raise ValueError(f"embeddings must be [rows, {self.output_width}] as encode returns them, got "
                             f"{getattr(embeddings, 'shape', type(embeddings).__name__)}")
        main, *deepstack = embeddings.split(self.output_width // parts, dim=1)
        return main, deepstack

    def per_item(self, embeddings: torch.Tensor, grid_thw) -> list[torch.Tensor]:
        """``encode``'s rows as one tensor (a view) per item of ``grid_thw``: ``t*h*w / merge_unit`` rows each."""
        grids = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        return list(embeddings.split([int(t * h * w) // self.tower.merge_unit for t, h, w in grids]))
