"""``vitgraph encode --encoder-cache DIR``: each image's embeddings written where vLLM's
``ECExampleConnector`` reads them (:mod:`vitgraph.handoff`); the ids printed one per line."""

from __future__ import annotations

from pathlib import Path


def model_identity(model: str | None, preset: str) -> str:
    """The model part of default ids: ``--model`` as given, or ``preset:NAME`` for random weights."""
    return model or f"preset:{preset}"


def add_cache_bounds(parser) -> None:
    """``--cache-max-items`` / ``--cache-max-bytes``: the bound of ``--encoder-cache``."""
    parser.add_argument("--cache-max-items", type=int, metavar="N", help="with --encoder-cache: after each write, "
                        "vitgraph's own entries are evicted oldest first down to N entries (default: no bound)")
    parser.add_argument("--cache-max-bytes", type=int, metavar="N", help="with --encoder-cache: ... and N bytes "
                        "(default: no bound); other files there are never touched")


def check_cache_bounds(args) -> None:
    bounds = {"--cache-max-items": args.cache_max_items, "--cache-max-bytes": args.cache_max_bytes}
    for name, value in bounds.items():
        if value is not None and value < 1:  # argparse made it an int
            raise ValueError(f"{name} must be a positive int, got {value}")
        if value is not None and args.encoder_cache is None:
            raise ValueError(f"{name} bounds --encoder-cache; give --encoder-cache DIR")


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
    check_cache_bounds(args)


def encode_to_cache_command(args, enc, paths: list[Path]) -> None:
    from .handoff import EncoderCache, encode_to_cache

    cache = EncoderCache(args.encoder_cache, max_bytes=args.cache_max_bytes, max_items=args.cache_max_items)
    ids = encode_to_cache(enc, [str(p) for p in paths], args.encoder_cache, ids=args.id or None,
                          model=model_identity(args.model, args.preset), cache=cache, min_pixels=args.min_pixels,
                          max_pixels=args.max_pixels)
    print("\n".join(ids))
