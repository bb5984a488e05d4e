"""Compile the kernels the graphs need in parallel processes, before capture.

FlashAttention 4's and quack's kernels are CuTe-DSL programs compiled on first use, one after
another, and the DSL keeps compiler state per thread; processes can overlap them, since both
libraries keep compiled kernels in file-locked disk caches any process loads.

:func:`precompile` lists the distinct kernels the buckets' forwards run (the tower's
``jit_kernels``: :class:`vitgraph.engine.contract.Precompiled`), each with its smallest bucket,
and runs the first here. A new kernel file in the caches means they are cold (a file, not a
time: timings overlap): workers compile the rest while this process compiles the Triton
kernels. Where the caches hold no kernel at all, cold is certain before any import, so the
encoder starts the workers as it is constructed (:func:`start_early`). Each worker builds a
one-block tower of the family's shape and runs each of its kernels alone on zeros. Nothing here
changes what runs: a kernel a worker failed to build is compiled by capture. Measurements:
benchmarks/HISTORY.md, "Measurement notes moved out of the code".
"""

from __future__ import annotations

import base64
import getpass
import importlib
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..ops import kernels
from ..ops.attention import FA4_CACHE_SWITCH, _has_fa4
from ..ops.backend_names import ATTENTION
from ..engine.contract import Precompiled, VisionTower
from ..engine.planner import Bucket, padded_batch
from ..ops.gemm import quack_available

logger = logging.getLogger(__name__)

WORKER_TIMEOUT_S = 600.0
# Most workers start_early starts when compile_workers is None: it cannot count the kernels
# before the libraries load, and about ten cover the default buckets' kernels.
EARLY_WORKERS = 10
# Per op: the module whose get_cache_path() holds its compiled kernels (*.o files), the switch
# of that disk cache ("1": on) and the library's default (FA4's is off, quack's on). A worker's
# compile only helps where the kernel persists.
_FA4_CACHE = ("flash_attn.cute.cache_utils", FA4_CACHE_SWITCH, "0")
_QUACK_CACHE = ("quack.cache.jit", "QUACK_CACHE_ENABLED", "1")
_DISK_CACHE = {"attention": _FA4_CACHE, "qkv": _QUACK_CACHE, "qkv_rope": _QUACK_CACHE, "fc1": _QUACK_CACHE}

# Where each library puts its disk cache (its variable, else <tempdir>/<user>/<name>), known
# without importing it: start_early looks there before anything is imported, and precompile
# adopts the early workers only where the imported libraries name the same directories.
_CACHE_DIR_DEFAULTS = {_FA4_CACHE[0]: ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "flash_attention_cute_dsl_cache"),
                       _QUACK_CACHE[0]: ("QUACK_CACHE_DIR", "quack_cache")}


def _cache_of(op: str) -> tuple:
    """The disk cache of ``op``'s library (every attention kind's, "attention_2" ..., is FA4's)."""
    return _DISK_CACHE["attention" if op.startswith("attention") else op]


@dataclass(frozen=True)
class KernelJob:
    op: str  # one of the model's JIT_OPS
    key: tuple  # the kernel: equal keys, one compile
    bucket: Bucket  # the smallest bucket whose forward runs it


@dataclass
class PrecompileReport:
    kernels: int = 0  # distinct kernels the buckets run
    workers: int = 0  # processes started
    cold: bool = False  # caches cold (no kernel on disk as the early workers started, or the first compiled here): the workers ran
    first_kernel_seconds: float = 0.0  # the first kernel here: a load from disk, or a compile (0: early workers ran it)
    early: bool = False  # the workers started with the encoder, before it loaded the kernel libraries (no kernel on disk then)
    triton_seconds: float = 0.0  # the buckets' Triton kernels, compiled here while the workers ran
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # workers that did not finish cleanly


def kernel_jobs(tower: VisionTower, buckets: Sequence[Bucket]) -> list[KernelJob]:
    """One job per distinct kernel the forwards of ``buckets`` run, with the smallest bucket
    that runs it; attention first (FlashAttention 4's compiles take longest)."""
    jobs: dict[tuple, KernelJob] = {}
    if not isinstance(tower, Precompiled):  # a tower without such kernels compiles nothing ahead
        return []
    for bucket in sorted(buckets):
        for op, key in tower.jit_kernels(padded_batch(tower, bucket)):
            jobs.setdefault(key, KernelJob(op, key, bucket))
    return sorted(jobs.values(), key=lambda j: (not j.op.startswith("attention"), j.bucket))


def _persists(op: str) -> bool:
    """The op's library keeps compiled kernels on disk (FA4 reads its switch once, at import)."""
    module, switch, default = _cache_of(op)
    loaded = sys.modules.get(module)
    if loaded is not None and hasattr(loaded, "CUTE_DSL_CACHE_ENABLED"):
        return bool(loaded.CUTE_DSL_CACHE_ENABLED)
    return os.environ.get(switch, default) == "1"


def _shares(jobs: Sequence[KernelJob], workers: int) -> list[list[KernelJob]]:
    return [list(jobs[i::workers]) for i in range(workers)]


@dataclass(frozen=True)
class TowerSetup:
    """How the encoder configured its tower (:meth:`VisionTower.configure`): what a worker's
    one-block tower is configured with."""

    attention: str
    fused: bool
    kernel_tuning: object  # vitgraph.ops.tuning.KernelTuning, its GEMM backend resolved
    dtype: torch.dtype


def _base_spec(recipe: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """What every worker's spec holds: how to build a one-block tower of the encoder's shape
    (:meth:`Precompiled.one_block_recipe`), where it runs, and when it was started."""
    return {"started": time.time(),  # the worker reports how long its start and imports took
            "recipe": recipe, "dtype": str(dtype).removeprefix("torch."), "device": str(device)}


def _spec(recipe: dict, setup: TowerSetup, jobs: Sequence[KernelJob], device: torch.device) -> str:
    """A worker's spec for ``jobs``, with the encoder's backends."""
    return json.dumps({
        **_base_spec(recipe, device, setup.dtype),
        "attention": setup.attention, "gemm": setup.kernel_tuning.gemm.backend, "fused": setup.fused,
        "kernel_tuning": base64.b64encode(pickle.dumps(setup.kernel_tuning)).decode(),  # from this process: trusted
        "jobs": [[j.op, j.bucket.tokens, j.bucket.max_segments, j.bucket.max_seqlen] for j in jobs],
    })


def _cache_roots(modules: Sequence[str]) -> dict[str, Path]:
    """The disk-cache directory of each of ``modules`` that loads (see ``_DISK_CACHE``; imports them)."""
    roots = {}
    for name in modules:
        try:
            roots[name] = Path(importlib.import_module(name).get_cache_path())
        except Exception:  # not installed, or a release without it: nothing to count there
            continue
    return roots


def _count_kernel_files(roots) -> int:
    return sum(1 for root in roots for _ in Path(root).rglob("*.o"))


def _kernel_files(modules: Sequence[str]) -> int:
    """Compiled kernels in the disk caches of ``modules`` (imports them)."""
    return _count_kernel_files(_cache_roots(modules).values())


def _default_root(module: str) -> Path | None:
    variable, name = _CACHE_DIR_DEFAULTS[module]
    if os.environ.get(variable):
        return Path(os.environ[variable])
    try:
        return Path(tempfile.gettempdir()) / getpass.getuser() / name
    except Exception:  # no user name to be had: leave the caches to the libraries
        return None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may run on
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _spawn(spec: str):
    env = dict(os.environ)
    # The workers import vitgraph and its kernel libraries from where this process does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", _WORKER_COMMAND, spec], env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def _start(tower: VisionTower, setup: TowerSetup, shares: list[list[KernelJob]], device: torch.device,
           report: PrecompileReport):
    procs = []
    for share in shares:
        try:
            procs.append(_spawn(_spec(tower.one_block_recipe(), setup, share, device)))
        except OSError as err:  # no processes to be had here: capture compiles instead
            report.failures.append(f"could not start a worker: {err}")
            break
    report.workers = len(procs)
    return procs


def _stop(procs) -> None:
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


@dataclass
class EarlyWorkers:
    """Workers :func:`start_early` started; :func:`precompile` adopts them, or stops them."""

    procs: list  # (Popen, log file); worker i of n takes every n-th kernel, from the i-th
    roots: dict[str, Path]  # per cache module, the directory that held no kernel at the start
    failures: list[str] = field(default_factory=list)

    def adopt(self, roots: dict[str, Path]) -> list | None:
        """The processes, if the libraries, now imported, keep the kernels of ``roots`` where
        these workers judged the caches empty; else stop them (None)."""
        if all(m in self.roots and self.roots[m].resolve() == Path(r).resolve() for m, r in roots.items()):
            return self.procs
        self.stop()
        return None

    def stop(self) -> None:
        _stop(self.procs)


def _early_caches(device: torch.device, dtype: torch.dtype, options: dict) -> list[str]:
    """The cache modules whose kernels an encoder with ``options`` may compile, judged without
    importing the libraries (as the encoder's backend choice will be, barring a broken install)."""
    caches = []
    named = ATTENTION.get(options["attention"])  # None: "auto" (or a name the encoder refuses later)
    if ((options["attention"] == "auto" or (named is not None and named.compiles)) and dtype in (torch.float16, torch.bfloat16) and _persists("attention")
            and _has_fa4(device)):
        caches.append(_FA4_CACHE[0])
    if (options["gemm"] in ("auto", "quack") and options.get("precision") != "fp8" and dtype == torch.bfloat16
            and options["fuse"] is not False
            and _persists("fc1") and quack_available(device)):
        caches.append(_QUACK_CACHE[0])
    return caches


def start_early(recipe: dict, device: torch.device, dtype: torch.dtype, options: dict) -> EarlyWorkers | None:
    """Where no compiled kernel of FlashAttention 4's or quack's is on disk, start the workers
    now, before the encoder loads those libraries (seconds of imports each process spends,
    workers included): each works out the encoder's kernels from ``options`` (the encoder's,
    as a dict) and compiles its share. None where the caches hold kernels (or none can be
    used here): then :func:`precompile` decides, after one kernel."""
    workers = options["compile_workers"]
    if workers == 0 or device.type != "cuda":
        return None
    roots = {m: _default_root(m) for m in _early_caches(device, dtype, options)}
    if not roots or None in roots.values() or _count_kernel_files(roots.values()) > 0:
        return None
    count = workers if workers is not None else min(EARLY_WORKERS, max(0, _usable_cpus() - 1))
    if count == 0:
        return None
    early = EarlyWorkers([], roots)
    spec = {**_base_spec(recipe, device, dtype), "options": options}
    for index in range(count):
        try:
            early.procs.append(_spawn(json.dumps({**spec, "share": [index, count]})))
        except OSError as err:  # capture compiles the kernels of the workers that did not start
            early.failures.append(f"could not start a worker: {err}")
            break
    return early


def _tail(log) -> str:
    log.seek(0)
    lines = log.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


def _compile_triton(tower: VisionTower, buckets: Sequence[Bucket], device: torch.device) -> float:
    """Seconds spent compiling the buckets' Triton kernels here (those capture would compile)."""
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for bucket in sorted(buckets):
                tower.run_triton_kernels(padded_batch(tower, bucket).to(device))
        _synchronize(device)
    except torch.OutOfMemoryError:  # the workers' contexts took the room: capture compiles the rest
        logger.warning("vitgraph: out of GPU memory compiling the Triton kernels of bucket %s before "
                       "capture; capture compiles the rest", bucket.name)
    return time.perf_counter() - t0


def _wait(proc, log, report: PrecompileReport, timeout_s: float) -> None:
    """Wait for one worker (up to ``timeout_s``), recording how it ended."""
    try:
        if proc.wait(timeout=timeout_s) != 0:
            report.failures.append(f"exit {proc.returncode}: {_tail(log)}")
        else:
            logger.debug("vitgraph: kernel-compiling worker: %s", _tail(log))
    except subprocess.TimeoutExpired:
        report.failures.append(f"timed out after {WORKER_TIMEOUT_S:.0f} s")


def precompile(tower: VisionTower, setup: TowerSetup, buckets: Sequence[Bucket], device: torch.device,
               workers: int | None = None, early: EarlyWorkers | None = None) -> PrecompileReport:
    """Compile, in parallel processes when the disk caches are cold, the kernels the forwards of
    ``buckets`` run (see the module). ``workers``: most processes (None: one per kernel after
    the first, up to the CPU count less one; 0: none, kernels compile at capture as they are
    met). ``early``: workers :func:`start_early` started for these buckets, to wait for instead
    of starting others (or to stop). Never raises for a worker's failure: capture compiles
    what is missing."""
    start = time.perf_counter()
    jobs = kernel_jobs(tower, buckets)
    report = PrecompileReport(kernels=len(jobs))
    jobs = [j for j in jobs if _persists(j.op)]  # the others compile at capture: a worker's would be lost
    if workers == 0 or not jobs:
        if early is not None:
            early.stop()
        report.seconds = time.perf_counter() - start
        return report
    first, rest = jobs[0], jobs[1:]
    if workers is None:
        workers = max(0, _usable_cpus() - 1)
    shares = _shares(rest, min(workers, len(rest)))
    procs = None  # not started
    try:
        caches = sorted({_cache_of(job.op)[0] for job in jobs})
        if early is not None:  # no kernel was on disk when they started: cold for certain
            procs = early.adopt(_cache_roots(caches))
            if procs is not None:
                report.early, report.workers = True, len(procs)
                report.failures.extend(early.failures)
        before = _kernel_files(caches)  # imports FA4 and quack: the first kernel's time is then its own
        if procs is None and before == 0:  # no kernel on disk at all: cold for certain, so start at once
            procs = _start(tower, setup, shares, device, report)
        if not report.early:  # early workers compile the first kernel too
            t0 = time.perf_counter()
            with torch.inference_mode():
                tower.run_jit_kernel(first.op, padded_batch(tower, first.bucket).to(device))
            _synchronize(device)
            report.first_kernel_seconds = time.perf_counter() - t0
        # It compiled, and wrote the kernel to disk (with early workers writing too, cold is known).
        report.cold = report.early or _kernel_files(caches) > before
        if not report.cold:  # warm: capture loads every kernel itself
            for proc, _ in procs or ():
                proc.kill()
        elif procs is None:  # kernels on disk, but not this one (another release, other buckets)
            procs = _start(tower, setup, shares, device, report)
        if report.cold and procs and _triton_compiles(device):
            report.triton_seconds = _compile_triton(tower, buckets, device)  # idle here until the workers finish
        deadline = time.monotonic() + WORKER_TIMEOUT_S  # one deadline for all of them
        for proc, log in procs if report.cold else ():
            _wait(proc, log, report, max(0.0, deadline - time.monotonic()))
    finally:
        _stop(procs or ())
    report.seconds = time.perf_counter() - start
    _log(report)
    return report


def _log(report: PrecompileReport) -> None:
    for failure in report.failures:
        logger.warning("vitgraph: a kernel-compiling worker failed (%s); capture compiles its kernels", failure)
    how = (f"none on disk when the encoder started (cold caches): {report.workers} worker(s) started with it"
           if report.early else f"the first took {report.first_kernel_seconds:.2f} s here, so "
           f"{'cold' if report.cold else 'warm'} caches; {report.workers} worker(s)")
    logger.info("vitgraph: %d JIT kernels; %s%s; %.1f s", report.kernels, how,
                f"; Triton kernels {report.triton_seconds:.1f} s here meanwhile" if report.triton_seconds else "",
                report.seconds)


# Not ``-m vitgraph.runtime.precompile``: importing the package imports this module first, and runpy
# would then run a second copy of it.
_WORKER_COMMAND = "import sys; from vitgraph.runtime.precompile_worker import worker_main; worker_main(sys.argv[1])"


def _triton_compiles(device: torch.device) -> bool:
    """The Triton kernels compile for ``device`` (a GPU; the interpreter runs them uncompiled)."""
    return device.type == "cuda" and kernels.usable(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
