"""``POST /encode?store=1`` of :mod:`vitgraph.serve`: the images' embeddings written to the
replica's encoder cache (:mod:`vitgraph.handoff`, vLLM's ``ECExampleConnector`` layout) and
answered with their ids and grids as JSON, not the tensors. Ids: ``?id=A&id=B`` (one per image),
else :func:`vitgraph.handoff.item_id` of each image's bytes."""

from __future__ import annotations

import base64
import json
from dataclasses import replace


def image_blobs(kind: str, payload, max_items: int | None = None) -> list[bytes]:
    """The request's encoded images (JSON or multipart); rows cannot be stored (no bytes to name
    them by). More than ``max_items`` is refused before any is base64-decoded."""
    if kind == "multipart/form-data":
        return list(payload)
    if kind == "application/json":
        try:
            images = json.loads(payload)["images"]
            count = len(images) if isinstance(images, list) else 0
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            raise ValueError(f"JSON body must be {{\"images\": [base64 image, ...]}}: {err}") from None
        if max_items is not None and count > max_items:
            raise ValueError(f"the request holds {count} items, above the server's max_items_per_request = "
                             f"{max_items}; split it")
        try:
            return [base64.b64decode(image, validate=True) for image in images]
        except (ValueError, TypeError) as err:
            raise ValueError(f"JSON body must be {{\"images\": [base64 image, ...]}}: {err}") from None
    raise ValueError("store=1 takes images (JSON or multipart), not rows")


def store_ids(kind: str, payload, given: list[str], model: str, processor, limits,
              max_items: int | None = None) -> list[str]:
    """The ids the request's items will be stored under, checked before anything is encoded."""
    from .handoff import check_item_id, item_id

    blobs = image_blobs(kind, payload, max_items)
    if given:
        ids = [check_item_id(i) for i in given]
        if len(ids) != len(blobs) or len(set(ids)) != len(ids):
            raise ValueError(f"id: {len(ids)} given for {len(blobs)} images; give one distinct id per image")
        return ids
    settings = replace(processor, min_pixels=limits[0], max_pixels=limits[1])
    return [item_id(blob, model=model, processor=settings) for blob in blobs]


def store(cache, ids: list[str], items: list, grids) -> bytes:
    """Write each item; the JSON answer ``{"ids": [...], "grid_thw": [...]}``."""
    cache.write_all(zip(ids, items))
    return json.dumps({"ids": ids, "grid_thw": [list(g) for g in grids]}).encode()
