"""The benchmarks' command lines, without torch: ``vitgraph bench --help`` (and bench-serving's,
bench-images', bench-coalesce's) and their argument errors answer before a benchmark module,
and torch, is imported. Each benchmark module builds its parser here (:data:`PARSERS`)."""

from __future__ import annotations

import argparse

from .. import cli_args
from ..ops.backend_names import BACKENDS, GEMM_BACKENDS, PRECISIONS
from ..images.pixel_defaults import MAX_PIXELS


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


# The first paragraph of each benchmark module's docstring (tests/test_cli_errors.py checks they agree).
DESCRIPTIONS = {
    "bench": "Latency of one ``encode`` call: vitgraph against transformers' eager tower and torch.compile.",
    "bench-serving": "Serving simulation: open-loop Poisson arrivals of realistic image/video requests, or a\n"
                     "closed loop at saturation.",
    "bench-images": "From image bytes to embeddings: what a caller who starts from JPEGs waits for.",
    "bench-coalesce": "Concurrent callers, one JPEG a request: one ``encode_images`` call per request against the\n"
                      "coalescing front (``submit_images``) and the ceiling, the same requests grouped by hand.",
}

# vitgraph bench (vitgraph.bench.latency)
CASES = {
    "1x256": [(1, 16, 16)],
    "1x1024": [(1, 32, 32)],
    "1x4096": [(1, 64, 64)],
    "4x1024": [(1, 32, 32)] * 4,
    "16x256": [(1, 16, 16)] * 16,
    "video-8x16x28": [(8, 16, 28)],
    "1x9604": [(1, 98, 98)],
}
CPU_CASES = ("1x256", "1x1024", "4x1024", "16x256")  # about a minute on 2 cores with the CPU's --iters
LATENCY_SYSTEMS = ("hf_eager", "vitgraph_eager", "vitgraph_graph", "torch_compile")
ITERS, WARMUP = {"gpu": 30, "cpu": 10}, {"gpu": 5, "cpu": 2}


def parse_case(text: str) -> tuple[str, list[tuple[int, int, int]]]:
    """``name=t,h,w+t,h,w`` -> (name, grids)."""
    try:
        name, spec = text.split("=", 1)
        grids = [tuple(int(v) for v in part.split(",")) for part in spec.split("+")]
        if not name or any(len(g) != 3 for g in grids):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case must look like name=t,h,w+t,h,w, got {text!r}") from None
    return name, grids


def latency_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitgraph bench", description=DESCRIPTIONS["bench"])
    cli_args.add_model_args(p)
    p.add_argument("--cases", nargs="*", default=None, choices=list(CASES), metavar="CASE",
                   help=f"case names from {list(CASES)} (default: all on a GPU, {' '.join(CPU_CASES)} on a CPU)")
    p.add_argument("--case", action="append", type=parse_case, default=[], help="an extra case: name=t,h,w+t,h,w (default: none)")
    p.add_argument("--systems", nargs="*", default=None, choices=LATENCY_SYSTEMS, metavar="SYSTEM",
                   help=f"subset of {LATENCY_SYSTEMS} (default: all on a GPU, the two eager ones on a CPU)")
    p.add_argument("--attention", default="auto", choices=("auto",) + BACKENDS,
                   help="the encoders' attention backend (EngineOptions.attention; default auto)")
    p.add_argument("--gemm", default="auto", choices=("auto",) + GEMM_BACKENDS,
                   help="the encoders' fc1/qkv GEMM backend (EngineOptions.gemm; default auto)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS,
                   help="the blocks' GEMMs (EngineOptions.precision; default bf16; fp8 needs the fused forward)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help=f"timed calls per case and system (default {ITERS['gpu']} on a GPU, {ITERS['cpu']} on a CPU)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help=f"untimed calls before them (default {WARMUP['gpu']} on a GPU, {WARMUP['cpu']} on a CPU)")
    p.add_argument("--preheat", type=float, default=0.0,
                   help="seconds of back-to-back calls before each system is timed on each case, so that it "
                        "is timed at the clock a GPU holds under sustained load (default 0: timed in whatever "
                        "state the system before it left)")
    p.add_argument("--max-budget", type=positive_int, default=16384,
                   help="the largest bucket's patch tokens (default 16384)")
    p.add_argument("--json", help="write the full result here (default: none)")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib; default: none)")
    return p


# vitgraph bench-serving (vitgraph.bench.serving)
def serving_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitgraph bench-serving", description=DESCRIPTIONS["bench-serving"])
    cli_args.add_model_args(p)
    p.add_argument("--loads", type=positive_float, nargs="*", default=None,
                   help="offered loads, requests per second")
    p.add_argument("--requests", type=positive_int, default=None, help="requests per load")
    p.add_argument("--systems", nargs="*", default=None, choices=("hf_eager", "vitgraph_eager", "vitgraph_graph"),
                   metavar="SYSTEM", help="subset of hf_eager vitgraph_eager vitgraph_graph")
    p.add_argument("--max-pixels", type=positive_int, default=MAX_PIXELS,
                   help="the largest image area a simulated request asks for")
    p.add_argument("--seed", type=int, default=0, help="the request stream's random seed")
    p.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                   help="run each load on several request streams (instead of --seed) and also report, per "
                        "system and load, the median of each percentile across them: one stream's p99 is set "
                        "by a handful of calls, so A/Bs should compare several")
    p.add_argument("--fit-budgets", type=positive_int, metavar="N",
                   help="give the graph system at most N budgets fitted (vitgraph.engine.fit_budgets) to "
                        "another sample of the mix, one request per step, instead of the default ladder")
    p.add_argument("--closed-loop", type=positive_int, nargs="+", metavar="C",
                   help="instead of the open-loop loads: C concurrent clients with no think time each, "
                        "reporting throughput at saturation (images/s, patch tokens/s) and p50/p99")
    p.add_argument("--target", choices=("process", "serve"), default="process",
                   help="with --closed-loop: the in-process systems, or also the Ray Serve app over HTTP and through its handle "
                        "(needs vitgraph[serve]; started on this machine)")
    p.add_argument("--port", type=positive_int, default=8765, help="the Ray Serve app's port (--target serve)")
    p.add_argument("--replicas", type=positive_int, default=1, help="the Ray Serve app's replicas (--target serve)")
    p.add_argument("--gpus-per-replica", type=positive_float, default=None,
                   help="GPUs each replica takes (--target serve; default 1 on CUDA, 0.5: two replicas per GPU)")
    p.add_argument("--json", help="write the full result here")
    return p


# vitgraph bench-images (vitgraph.bench.images)
IMAGES_SYSTEMS = ["hf_pil", "hf_torchvision", "vitgraph_host", "vitgraph_device", "vitgraph_gpu_decode"]
# On a CPU (eager, no graphs) the full defaults take many minutes: these finish in about a minute.
GPU_DEFAULTS = {"repeats": 5, "concurrency": [1, 8], "saturation_images": 64, "max_pixels": None}
CPU_DEFAULTS = {"repeats": 1, "concurrency": [1, 2], "saturation_images": 14, "max_pixels": 1280 * 28 * 28}


def images_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitgraph bench-images", description=DESCRIPTIONS["bench-images"])
    cli_args.add_model_args(parser)

    def default(key: str) -> str:
        gpu, cpu = (" ".join(map(str, d[key])) if isinstance(d[key], list) else d[key]
                    for d in (GPU_DEFAULTS, CPU_DEFAULTS))
        return f"default {gpu or 'the processor limit'} on a GPU, {cpu} on a CPU"

    parser.add_argument("--systems", nargs="+", default=IMAGES_SYSTEMS, choices=IMAGES_SYSTEMS, metavar="SYSTEM",
                        help=f"systems to run (default: all that can run here): {', '.join(IMAGES_SYSTEMS)}")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help=f"passes over the image set for the per-image times ({default('repeats')})")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=None,
                        help=f"caller threads for the saturation runs ({default('concurrency')})")
    parser.add_argument("--saturation-images", type=positive_int, default=None,
                        help=f"images per saturation run ({default('saturation_images')})")
    parser.add_argument("--max-pixels", type=positive_int, default=None,
                        help=f"resize images to at most this many pixels ({default('max_pixels')})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the image set (default 0)")
    parser.add_argument("--serve", action="store_true",
                        help="also start vitgraph serve (Ray Serve, one replica; needs vitgraph[serve]) and measure "
                             "it at saturation with the JPEGs and with the same images as rows")
    parser.add_argument("--port", type=positive_int, default=8765,
                        help="the Ray Serve app's port, with --serve (default 8765)")
    parser.add_argument("--formats", action="store_true",
                        help="instead: per format (JPEG qualities and subsamplings, PNG with and without alpha, a "
                             "clip array), one item per call, 4 x --repeats calls each, host and GPU decoding, "
                             "against the encode alone")
    parser.add_argument("--json", default=None, help="write the results to this JSON file (default: none)")
    return parser


# vitgraph bench-coalesce (vitgraph.bench.coalesce)
TRAFFIC = {"thumbs": ((112, 256), (112, 256)), "small": ((112, 640), (112, 480)),
           "large": ((1280, 1920), (720, 1080))}  # (width range, height range)
MODES = ("per_call", "coalesced", "grouped")


def coalesce_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitgraph bench-coalesce", description=DESCRIPTIONS["bench-coalesce"])
    parser.add_argument("--presets", nargs="+", default=None,
                        help="random-weight presets (default: qwen2-vl-2b qwen3-vl-8b on CUDA, tiny elsewhere)")
    parser.add_argument("--traffic", nargs="+", default=list(TRAFFIC), choices=list(TRAFFIC))
    parser.add_argument("--callers", type=positive_int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--images", type=positive_int, default=48, help="distinct JPEGs per traffic")
    parser.add_argument("--scale", type=positive_float, default=1.0, help="requests per case, scaled")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="the front's max_wait_ms (default 2)")
    parser.add_argument("--front-threads", type=positive_int, default=None,
                        help="the front's preprocessing threads (default: the encoder's)")
    parser.add_argument("--wait-sweep", type=float, nargs="*", default=[],
                        help="also run thumbs through fronts with these max_wait_ms (first preset)")
    parser.add_argument("--serve", action="store_true", help="also vitgraph serve (Ray Serve, one replica)")
    parser.add_argument("--port", type=positive_int, default=8765, help="the Ray Serve app's port (--serve)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write {gpu, cases, ...} here")
    parser.add_argument("--plot", default=None, help="write a PNG plot of images/s against callers here")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                        help="run nothing: print (and --plot) the cases of these result files")
    return parser


# Each bench command's parser, by command name (vitgraph.cli parses with it before importing the benchmark).
PARSERS = {"bench": latency_parser, "bench-serving": serving_parser, "bench-images": images_parser,
           "bench-coalesce": coalesce_parser}
