"""``vitgraph encode --encoder-cache DIR``: each image's embeddings written where vLLM's
``ECExampleConnector`` reads them (:mod:`vitgraph.handoff`); the ids printed one per line."""

from __future__ import annotations

from pathlib import Path


def model_identity(model: str | None, preset: str) -> str:
    """The model part of default ids: ``--model`` as given, or ``preset:NAME`` for random weights."""
    return model or f"preset:{preset}"


def check_targets(args) -> None:
    """Exactly one of ``--out`` and ``--encoder-cache``; ``--id`` only with the cache, one per file."""
    from .handoff import check_item_id

    if (args.out is None) == (args.encoder_cache is None):
        raise ValueError("give exactly one of --out FILE and --encoder-cache DIR")
    if args.id and args.encoder_cache is None:
        raise ValueError("--id names entries of --encoder-cache; give --encoder-cache DIR")
    if args.id and len(args.id) != len(args.files):
        raise ValueError(f"--id: {len(args.id)} given for {len(args.files)} files; give one per file")
    for item in args.id or []:  # refused before the model loads
        check_item_id(item)
    if args.encoder_cache is not None and not Path(args.encoder_cache).is_dir():
        raise ValueError(f"--encoder-cache {args.encoder_cache}: is not an existing directory")


def encode_to_cache_command(args, enc, paths: list[Path]) -> None:
    from .handoff import encode_to_cache

    ids = encode_to_cache(enc, [str(p) for p in paths], args.encoder_cache, ids=args.id or None,
                          model=model_identity(args.model, args.preset), min_pixels=args.min_pixels,
                          max_pixels=args.max_pixels)
    print("\n".join(ids))
