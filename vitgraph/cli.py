"""The ``vitgraph`` command: demo, encode, info, serve, bench, bench-serving."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import statistics
import time
from pathlib import Path

from . import __version__  # torch is imported inside the commands: --help and argument errors stay instant
from .cli_args import add_model_args, describe, make_encoder, resolve_model_args, status
from .cli_handoff import add_cache_bounds, check_cache_bounds
from .cli_output import check_out, check_out_is_not_the_checkpoint, write_atomically


def _load(args, **options):
    return make_encoder(args, **options)  # main() has resolved the model arguments


def _timed_calls_ms(fn, device, calls: int) -> list[float]:
    """Wall ms of each of ``calls`` synchronised calls of ``fn``, under a progress bar."""
    import torch
    from tqdm.auto import tqdm

    times = []
    for _ in tqdm(range(calls), desc="timing", unit="call", leave=False, disable=None):  # None: a terminal only
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def cmd_demo(args) -> None:
    """Encode a mixed batch (images and a clip) and print shapes, timing and engine stats."""
    import torch

    enc = _load(args)
    grids = [(1, 16, 16), (1, 32, 44), (4, 16, 28), (1, 64, 64)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), enc.shape.patch_width)
    pixels = pixels.to(enc.device, enc.dtype)
    with status(f"encoding {len(grids)} items ({pixels.shape[0]} patches), the first call"):
        start = time.perf_counter()
        out = enc.encode(pixels, grids)
        first_ms = (time.perf_counter() - start) * 1e3
    calls = 5 if first_ms < 10_000 else 1  # a large tower on a CPU (~90 s a call): its first call is the answer
    times = _timed_calls_ms(lambda: enc.encode(pixels, grids), enc.device, calls) if calls > 1 else [first_ms]
    median = statistics.median(times)
    stats = enc.stats()
    gemm = f", gemm {stats['gemm']}" if enc.device.type == "cuda" else ""  # a GPU choice
    print(f"vitgraph {__version__}: {describe(args)} on {enc.device} ({stats['dtype']}), "
          f"mode {stats['mode']}, attention {stats['attention']}, fused {stats['fused']}{gemm}")
    print(f"input  pixels {list(pixels.shape)}, grid_thw {grids}")
    print(f"output {list(out.shape)}; " + (f"median {median:.2f} ms per call (of {calls})" if calls > 1
                                            else f"one call took {median / 1e3:.1f} s"))
    if stats["mode"] == "graph":
        used = {k: v["replays"] for k, v in stats["buckets"].items() if v["replays"]}
        print(f"{len(stats['buckets'])} graphs captured in {stats['capture_seconds']:.1f} s, "
              f"pool {stats['pool_bytes'] / 2**20:.0f} MiB; replays per bucket {used}")


def _check_pixel_args(args) -> None:
    """``--min-pixels`` and ``--max-pixels`` (each, and against each other or the model's
    preprocessing), before anything loads."""
    from .images.preprocess import check_pixel_limits

    given = {"--min-pixels": args.min_pixels, "--max-pixels": args.max_pixels}
    for flag, value in given.items():
        if value is not None:
            try:
                check_pixel_limits(value, value)
            except ValueError as err:
                raise ValueError(f"{flag} {str(err).split(' ', 1)[1]}") from None
    low, high = args.min_pixels, args.max_pixels
    if low is None and high is None:
        return
    if low is None or high is None:
        processor = _processor_of(args)
        if low is None and high < processor.min_pixels:
            raise ValueError(f"--max-pixels {high} is below the model's min_pixels ({processor.min_pixels}); "
                             "pass a smaller --min-pixels too")
        if high is None and low > processor.max_pixels:
            raise ValueError(f"--min-pixels {low} exceeds the model's max_pixels ({processor.max_pixels}); "
                             "pass a larger --max-pixels too")
    elif low > high:
        raise ValueError(f"--min-pixels {low} exceeds --max-pixels {high}; the smaller area goes to --min-pixels")


def _processor_of(args):
    """The image preprocessing ``args`` would load, read from configs alone (no weights)."""
    from .checkpoints.loading import find_checkpoint, read_config
    from .images.processor_files import read_processor
    from .models import PRESETS, family_of

    if args.model:
        files = find_checkpoint(args.model)
        return read_processor(files, read_config(files))
    return family_of(PRESETS[args.preset]).processor


def cmd_encode(args) -> None:
    """Encode image files; write one tensor per file, keyed by file name, to a safetensors file
    whose metadata records the model source and each file's grid_thw."""
    from tqdm.auto import tqdm

    from .images.decode import open_encoded, read_file

    from .cli_handoff import check_targets, encode_to_cache_command

    check_targets(args)
    paths = [Path(name) for name in args.files]
    keys = [p.name for p in paths]
    if not args.encoder_cache:
        _check_keys_are_unique(paths)
    out = check_out(args.out, paths, args.force) if args.out else None
    for path in paths:  # every input is an image (header only) before the model is looked up or loaded
        open_encoded(read_file(path, "input"), str(path)).close()
    if args.model and out:
        check_out_is_not_the_checkpoint(out, args.model)
    _check_pixel_args(args)
    if not args.model:
        print(f"vitgraph encode: no --model given: random weights of the {args.preset} preset; "
              "the embeddings mean nothing", file=sys.stderr)
    enc = _load(args, progress=False)
    if args.encoder_cache:
        return encode_to_cache_command(args, enc, paths)
    source = args.model or f"random weights, preset {args.preset}"
    tensors, grids = {}, {}
    chunk = 16  # images per encode call
    shown = sys.stderr.isatty() or len(paths) > chunk  # a bar on a terminal, or in a log for a long run
    with tqdm(total=len(paths), desc="encoding", unit="image", disable=not shown) as bar:
        for start in range(0, len(paths), chunk):
            batch_keys = keys[start:start + chunk]
            rows, grid = enc.image_rows(paths[start:start + chunk], min_pixels=args.min_pixels,
                                        max_pixels=args.max_pixels)
            merged = enc.encode(rows, grid)
            for key, embedding, thw in zip(batch_keys, enc.per_item(merged, grid), grid.tolist()):
                tensors[key] = embedding.to("cpu").contiguous()
                grids[key] = thw
            bar.update(len(batch_keys))
    write_atomically(tensors, out, {"vitgraph_model": source, "grid_thw": json.dumps(grids)})
    print(f"wrote {len(tensors)} embedding(s) to {out}: " +
          ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items()))


def _check_keys_are_unique(paths: list[Path]) -> None:
    """Each input's file name is its output key: two inputs of one name are refused, both named."""
    first = {}
    for path in paths:
        if path.name in first:
            raise ValueError(f"two inputs share the file name {path.name} ({first[path.name]} and {path}); "
                             "rename one so each output key is unique")
        first[path.name] = path


def _bucket_names(buckets) -> str:
    """``N buckets (tokens x frames; sN: frames of at most N tokens):`` then the names, wrapped
    and indented (78 of them on one line were unreadable)."""
    import textwrap

    key = "tokens x frames" + ("; sN: frames of at most N tokens" if any("s" in b.name for b in buckets) else "")
    names = textwrap.fill(", ".join(b.name for b in buckets), width=96, initial_indent="  ", subsequent_indent="  ")
    return f"{len(buckets)} buckets ({key}):\n{names}"


def cmd_info(args) -> None:
    """Device, torch, attention backends, buckets and pool bytes."""
    import torch

    from .ops.attention import available_backends

    enc = _load(args, progress=False)
    device = enc.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"vitgraph {__version__}, torch {torch.__version__}, device {device} ({name})")
    print(f"model: {describe(args)}, dtype {str(enc.dtype).replace('torch.', '')}")
    print(f"attention backends: {', '.join(available_backends(device))}")
    stats = enc.stats()
    if stats["mode"] == "graph":
        print(_bucket_names(enc.buckets))
        print(f"pool bytes: {stats['pool_bytes']}, capture seconds: {stats['capture_seconds']:.2f}")
    else:
        print(f"eager mode on {device}: no graphs; planned: {_bucket_names(enc.requested_buckets)}")
    front = stats["front"]
    print(f"front (submit): batches of up to {front['max_tokens']} tokens and {front['max_frames']} frames, "
          f"max_wait_ms {front['max_wait_ms']:g}, {front['max_in_flight']} batches in flight, "
          f"{front['front_threads']} preprocessing threads")


def _check_serve_args(args) -> None:
    """Everything ``serve`` can check before Ray starts: the options, the device and the model
    (a local folder with a config.json, or a Hub id that resolves; its configs read)."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if not 0 < args.request_timeout < float("inf"):
        raise ValueError(f"--request-timeout must be a positive number of seconds, got {args.request_timeout:g}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            raise ValueError(f"--device must be cpu or cuda[:index], got {args.device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda[:index], got {args.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA GPU is available")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {args.device}: only {torch.cuda.device_count()} CUDA GPU(s)")
    if args.encoder_cache is not None and not os.path.isdir(args.encoder_cache):
        raise ValueError(f"--encoder-cache {args.encoder_cache}: is not an existing directory")
    check_cache_bounds(args)
    if args.model:
        from .checkpoints.loading import find_checkpoint, read_config
        from .images.processor_files import read_processor

        files = find_checkpoint(args.model)
        read_processor(files, read_config(files))


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt  # SIGTERM shuts down as Ctrl-C does


def cmd_serve(args) -> None:
    """Start a local Ray instance (or join the cluster RAY_ADDRESS names) and deploy the app
    (POST /encode) under its own name; Ctrl-C or SIGTERM deletes that application alone and
    leaves Ray (:mod:`vitgraph.serve_cluster`). Bad arguments are refused before Ray is imported."""
    import signal
    import time

    _check_serve_args(args)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("vitgraph serve needs Ray Serve: pip install 'vitgraph[serve]'") from None
    from .serve import build_app
    from .serve_cluster import check_app_name, start_http, url

    app = build_app(args.model, preset=args.preset, device=args.device, dtype=args.dtype, num_replicas=args.replicas,
                    encoder_cache=args.encoder_cache, encoder_cache_max_items=args.cache_max_items,
                    encoder_cache_max_bytes=args.cache_max_bytes, max_items_per_request=args.max_items_per_request,
                    max_body_bytes=args.max_body_bytes)
    previous, deployed, started = None, False, False
    try:
        with status(f"starting Ray and {args.replicas} replica(s) of {describe(args)}"):
            # Ray's and Serve's start-up logs (a dozen lines) stay out of the terminal; errors still show.
            ray.init(logging_level=logging.ERROR, log_to_driver=False,
                     **({} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}))
            started = True
            previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)  # after ray.init, which sets its own
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
            http, warnings, shared = start_http(ray, serve, args.host, args.port, args.request_timeout)
            check_app_name(serve, args.app_name)
            prefix = f"/{args.app_name}" if shared else "/"  # a Serve instance of others': a prefix of its own
            deployed = True
            serve.run(app, name=args.app_name, route_prefix=prefix)
        for warning in warnings:
            print(f"vitgraph serve: warning: {warning}", file=sys.stderr)
        timeout = http["request_timeout_s"]
        print(f"vitgraph serving {describe(args)} on {url(http, prefix)} as application {args.app_name} "
              f"({args.replicas} replica(s), requests time out after "
              f"{'no limit' if timeout is None else f'{timeout:g} s'}); Ctrl-C stops", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
        try:
            if deployed:  # its own application only; serve.shutdown() would end every one on the cluster
                serve.delete(args.app_name)
        finally:
            if started:
                ray.shutdown()  # leaves the cluster; a local instance it started ends with it
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitgraph", description="The Qwen VL vision encoders from CUDA graphs.")
    parser.add_argument("--version", action="version", version=f"vitgraph {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="encode a sample batch and print shapes and timing")
    add_model_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("encode", help="encode image files to a safetensors file")
    p.add_argument("files", nargs="+", help="image files (PNG, JPEG, ...)")
    p.add_argument("--out", help="output .safetensors path (never one of the inputs)")
    p.add_argument("--encoder-cache", metavar="DIR", help="instead of --out: DIR/ID/encoder_cache.safetensors "
                   "per image (vLLM's ECExampleConnector); prints the ids")
    p.add_argument("--id", action="append", help="an image's id in --encoder-cache (one per file; "
                   "default: vitgraph.handoff.item_id of its bytes)")
    add_cache_bounds(p)
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--min-pixels", type=int, default=None,
                   help="resize smaller images up to this area (default: the model's preprocessor_config.json)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="resize larger images down to this area (default: the model's preprocessor_config.json)")
    add_model_args(p)
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("info", help="device, torch, attention backends, buckets, pool bytes")
    add_model_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("serve", help="a Ray Serve deployment on a local Ray instance (needs vitgraph[serve])")
    add_model_args(p)
    p.add_argument("--replicas", type=int, default=1, help="replicas (each takes a GPU where there is one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--request-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="the server answers 408 to a request not done in this time (default 60)")
    p.add_argument("--encoder-cache", metavar="DIR", help="POST /encode?store=1 writes images' embeddings here "
                   "(vLLM's ECExampleConnector layout) and answers their ids")
    add_cache_bounds(p)
    p.add_argument("--app-name", default="vitgraph", help="the Serve application's name; on exit only it is "
                   "deleted (with RAY_ADDRESS, on that cluster) (default vitgraph)")
    p.add_argument("--max-items-per-request", type=int, default=4096,
                   help="images (or grid rows) in one request, counted before decoding; more: 400 (default 4096)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 27, help="the largest request body; "
                   "larger: 413 (default 134217728, 128 MiB)")
    p.set_defaults(func=cmd_serve)

    for name, what in (("bench", "latency suite"), ("bench-serving", "serving simulation"),
                       ("bench-images", "image bytes to embeddings, per stage and at saturation"),
                       ("bench-coalesce", "concurrent callers: per call, the coalescing front, grouped by hand")):
        sub.add_parser(name, help=f"{what} (see vitgraph {name} --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    benches = {"bench": "latency", "bench-serving": "serving", "bench-images": "images", "bench-coalesce": "coalesce"}
    if argv and argv[0] in benches:  # the benchmarks own their arguments
        import importlib

        from .bench.args import PARSERS

        PARSERS[argv[0]]().parse_args(argv[1:])  # --help and argument errors exit here, before torch is imported
        module = benches[argv[0]]
        _quiet_libraries(verbose=False)
        return _run(argv[0], lambda: importlib.import_module(f".bench.{module}", __package__).main(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    _quiet_libraries(args.verbose)

    def command() -> None:
        resolve_model_args(args)  # a preset given to --model is refused before anything is looked up
        args.func(args)

    return _run(args.command, command)


def _quiet_libraries(verbose: bool) -> None:
    from huggingface_hub.utils import logging as hub_logging

    if verbose:
        hub_logging.disable_propagation()  # its own handler prints each line; the root's would repeat it
    else:
        hub_logging.set_verbosity_error()  # its retries and warnings; the one error that follows says it all


def _run(command: str, fn) -> int:
    """Run a command: bad input or a missing file is one line on stderr and exit code 2."""
    try:
        fn()
    except KeyboardInterrupt:
        print(f"vitgraph {command}: interrupted", file=sys.stderr)
        return 130  # as a shell reports a process ended by Ctrl-C
    except (ValueError, TypeError, OSError) as err:
        print(f"vitgraph {command}: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    except Exception as err:  # e.g. huggingface_hub's not-found and offline errors
        if type(err).__module__.startswith("huggingface_hub"):
            print(f"vitgraph {command}: error: {type(err).__name__}: {err}".splitlines()[0], file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
