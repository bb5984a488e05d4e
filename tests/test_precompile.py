"""Kernel precompilation: which kernels the buckets run, the worker processes, the cold-cache path."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import vitgraph.ops.attention
import vitgraph.runtime.encoder
import vitgraph.runtime.options
import vitgraph.ops.gemm
import vitgraph.models.qwen2_vl
import vitgraph.models.fused_loop
import vitgraph.runtime.precompile
from vitgraph.engine.planner import Bucket
from vitgraph.models import VisionConfig
from vitgraph.ops.gemm import FC1_SMALL_TILE, ROPE_SMALL_TILE, gemm_tuning
from vitgraph.runtime.options import EngineOptions, buckets_for
from vitgraph.models import one_block_recipe, tower_dims
from vitgraph.runtime.tuning import Tuning, tuning_for
from vitgraph.checkpoints.loading import build_tower
from vitgraph.runtime.precompile import (EARLY_WORKERS, EarlyWorkers, KernelJob, TowerSetup, _persists, _spawn, _spec, _tail,
                                 kernel_jobs, precompile,
                                 start_early)
from vitgraph.runtime.precompile_worker import worker_main

H200_SMS = 132


@pytest.fixture(autouse=True)
def fa4_disk_cache(monkeypatch):
    """FlashAttention 4's disk cache on, as a serving process sets it (FA4 reads the variable as
    it is imported, so where it is loaded already its switch is set as well)."""
    set_fa4_cache(monkeypatch, True)


def set_fa4_cache(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1" if on else "0")
    if "flash_attn.cute.cache_utils" in sys.modules:
        monkeypatch.setattr(sys.modules["flash_attn.cute.cache_utils"], "CUTE_DSL_CACHE_ENABLED", on)


def h200(config, gemm="quack") -> Tuning:
    """The tuning an encoder derives on an H200, on any machine, with its GEMM backend."""
    tuning = tuning_for(tower_dims(config), 9, H200_SMS)
    return dataclasses.replace(tuning, gemm=dataclasses.replace(tuning.gemm, backend=gemm))


def tower(attention="fa4", gemm="quack", fused=True, **config):
    t = build_tower(VisionConfig(**{"depth": 1, **config}), torch.device("cpu"), torch.bfloat16)
    t.set_attention_backend(attention)
    t.fused = fused  # as on a GPU; nothing here runs a kernel
    t.set_tuning(h200(t.config, gemm).kernels)
    return t


def setup_of(t):
    """How the encoder would have configured ``t`` (what precompile's workers copy)."""
    return TowerSetup(t.blocks[0].attn.backend, t.fused, t.tuning, t.blocks[0].attn.qkv.weight.dtype)


def default_buckets(t):
    """The buckets an encoder captures by default with FlashAttention 4 on an H200."""
    options = EngineOptions()
    return buckets_for(t, options, "fa4", torch.device("cuda"), h200(t.config))


def layout(t, bucket):
    return t.build_batch([], num_tokens=bucket.tokens, num_segments=bucket.max_segments, max_seqlen=bucket.max_seqlen)


def test_one_job_per_kernel_of_the_default_ladder_each_on_its_smallest_bucket():
    t = tower()
    buckets = default_buckets(t)
    jobs = kernel_jobs(t, buckets)
    runs = {}  # kernel key -> the buckets whose forward runs it
    for bucket in buckets:
        for op, key in t.jit_kernels(layout(t, bucket)):
            runs.setdefault((op, key), []).append(bucket)
    assert len({j.key for j in jobs}) == len(jobs)
    assert {(j.op, j.key) for j in jobs} == set(runs)
    for job in jobs:
        assert job.bucket == min(runs[job.op, job.key])
    ops = [j.op for j in jobs]
    assert ops == sorted(ops, key=lambda op: op != "attention")  # the longest compiles first
    # Every tile the wave models and the attention rules can pick is in use by default, and
    # each is its own kernel.
    tiles = {op: {j.key[2:] if op == "attention" else j.key[2] for j in jobs if j.op == op} for op in set(ops)}
    g, a = t.tuning.gemm, t.tuning.attention
    assert tiles["fc1"] == {FC1_SMALL_TILE} | {tile for tile, _ in g.fc1_tiles}
    assert tiles["qkv_rope"] == {ROPE_SMALL_TILE} | {tile for tile, _ in g.rope_tiles}
    assert tiles["attention"] == {(a.long_tile,), (a.short_tile,), (a.tiny_tile,)}
    assert "qkv" not in tiles  # every default bucket rotates in qkv's epilogue
    # start_early cannot count the kernels before the libraries load: its constant must match.
    assert EARLY_WORKERS == len(jobs)


@pytest.mark.slow
def test_jit_kernels_follow_the_forward_paths():
    packed, dense = Bucket(2304, 16), Bucket(2304, 1)
    ops = lambda t, bucket: [op for op, _ in t.jit_kernels(layout(t, bucket))]
    assert ops(tower(), packed) == ["qkv_rope", "attention", "fc1"]
    # A padded one-frame layout attends through cuDNN and rotates in the Triton kernel.
    assert ops(tower(), dense) == ["qkv", "fc1"]
    assert ops(tower(gemm="cublas"), packed) == ["attention"]
    assert ops(tower(fused=False, gemm="cublas"), packed) == ["attention"]
    assert ops(tower(attention="cudnn"), packed) == ["qkv_rope", "fc1"]
    assert ops(tower(attention="varlen", gemm="cublas"), packed) == []
    assert ops(tower(hidden_act="gelu"), packed) == ["qkv_rope", "attention"]  # no QuickGELU epilogue
    assert ops(tower(), Bucket(256, 16)) == ["qkv_rope", "attention", "fc1"]  # quack's 64-row tiles
    assert ops(tower(), Bucket(288, 16)) == ["attention"]  # below quack's row thresholds: cuBLAS


def record_triton_calls(monkeypatch) -> set:
    """Stand-ins for the Triton kernels (and for the attention and GEMM kernels around them),
    shaped as the real ones, that record each call's variant: what decides a compile."""
    loop = vitgraph.models.fused_loop  # the fused forward calls these through its module
    calls = set()

    def add_layernorm(x, y, weight, bias, eps, y_bias=None, offset=None, rms=False, tuning=None):
        calls.add(("add_layernorm", tuple(x.shape), None if y is None else tuple(y.shape), y_bias is not None,
                   offset is not None))
        return torch.zeros_like(x)

    def rotary_(qkv, cos, sin, num_heads, segment_ids=None, lane_dim=None, zero_padding=False):
        calls.add(("rotary_", tuple(qkv.shape), tuple(cos.shape), segment_ids is not None, lane_dim, zero_padding))
        views = qkv.view(qkv.shape[0], 3, num_heads, -1).unbind(1)
        if lane_dim is None:
            return views
        q = torch.zeros(qkv.shape[0], num_heads, lane_dim, dtype=qkv.dtype)
        return q, q.clone(), views[2]

    def activation_(x, name):
        calls.add(("activation_", tuple(x.shape), name))
        return x

    def prefix_sums(x):
        calls.add(("prefix_sums", tuple(x.shape)))
        return torch.zeros(x.shape)

    for name, fn in [("add_layernorm", add_layernorm), ("rotary_", rotary_), ("activation_", activation_),
                     ("prefix_sums", prefix_sums)]:
        monkeypatch.setattr(vitgraph.ops.kernels, name, fn)
    def jit(name, out):  # a kernel FlashAttention 4 or quack would compile
        calls.add(("jit", name))
        return out.zero_()

    def attend(backend, q, k, v, batch, padding_zeroed, tuning, values_finite=False):
        return jit("attention", torch.zeros_like(v)) if backend == "fa4" else torch.zeros_like(v)

    monkeypatch.setattr(loop, "attend", attend)
    monkeypatch.setattr(loop, "dense_masked", lambda q, k, v, scale: torch.zeros_like(v))
    monkeypatch.setattr(loop.cudnn_attention, "ragged_metadata", lambda *args: None)
    monkeypatch.setattr(loop.cudnn_attention, "ragged_attention", lambda qkv, meta, max_seqlen: qkv[:, 2])
    monkeypatch.setattr(loop, "linear_qkv_rope",
                        lambda x, weight, *args: jit("qkv_rope", torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)))
    monkeypatch.setattr(vitgraph.ops.gemm, "_quack", lambda: (lambda x, w, _, out, *args, **kwargs: jit("fc1", out),
                                                          lambda x, w, out, **kwargs: jit("qkv", out), "quick_gelu",
                                                          lambda x, w, _, out, *args, **kwargs: jit("fc1", out)))
    monkeypatch.setattr(vitgraph.ops.gemm, "_gemm_config", lambda *args: None)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("attention, gemm", [("fa4", "quack"), ("fa4", "cublas"), ("cudnn", "quack"),
                                             ("cudnn", "cublas"), ("varlen", "cublas"), ("sdpa", "cublas")])
def test_run_triton_kernels_compiles_what_the_forward_runs(monkeypatch, attention, gemm):
    """What precompile runs while the workers compile: every Triton kernel variant the fused
    forward runs for a layout, and only those."""
    calls = record_triton_calls(monkeypatch)
    t = tower(attention, gemm, embed_dim=160, num_heads=2, hidden_size=64, patch_size=2)  # small: CPU GEMMs
    # The 2B's GEMM rows (a 160-wide tower would split K up to 4608 rows and take quack from
    # 4224): the buckets run every path.
    t.set_tuning(dataclasses.replace(t.tuning, gemm=gemm_tuning(gemm, 9, H200_SMS, 1280, 5120)))
    seen = set()
    for bucket in [Bucket(256, 16), Bucket(384, 16), Bucket(512, 16), Bucket(1024, 16), Bucket(1152, 16, 1024), Bucket(2304, 16),
                   Bucket(256, 1), Bucket(2304, 1), Bucket(4096, 16)]:
        batch = layout(t, bucket)
        calls.clear()
        t.warm_up(torch.zeros(bucket.tokens, t.input_width, dtype=torch.bfloat16), batch)
        forward = set(calls)
        calls.clear()
        t.run_triton_kernels(batch)
        assert calls == {call for call in forward if call[0] != "jit"}, bucket
        seen |= forward
    # Each kind of kernel ran (QuickGELU's pass and the rotary at 384 rows at least; the biases'
    # running sums above the split-K rows, at one shape whatever the blocks warmed up), and
    # add+LayerNorm summed split-K partials.
    kinds = {"add_layernorm", "rotary_", "activation_", "prefix_sums"}
    assert {call[0] for call in seen} == kinds | ({"jit"} if gemm == "quack" or attention == "fa4" else set())
    assert any(call[0] == "add_layernorm" and call[2] is not None and len(call[2]) == 3 for call in seen)
    # and above the split-K rows, the stream's biases kept aside, it normalized with an offset
    assert any(call[0] == "add_layernorm" and call[-1] for call in seen)


def test_run_triton_kernels_runs_nothing_for_the_plain_forward(monkeypatch):
    calls = record_triton_calls(monkeypatch)
    t = tower("sdpa", "cublas", fused=False)
    t.run_triton_kernels(layout(t, Bucket(256, 16)))
    assert calls == set()


def test_precompile_with_no_workers_or_no_kernels_does_nothing():
    t = tower()
    report = precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), workers=0)
    assert (report.kernels, report.workers, report.cold) == (EARLY_WORKERS, 0, False)
    plain = tower(attention="varlen", gemm="cublas")
    report = precompile(plain, setup_of(plain), [Bucket(256, 16)], torch.device("cpu"))
    assert (report.kernels, report.workers) == (0, 0)


@pytest.mark.parametrize("files, started", [(7, 0), (0, 2)], ids=["kernels-on-disk", "empty-caches"])
def test_warm_caches_leave_every_kernel_to_capture(monkeypatch, files, started):
    t = tower()
    monkeypatch.setattr(t, "run_jit_kernel", lambda op, batch: None)  # a kernel loaded from disk
    monkeypatch.setattr(vitgraph.runtime.precompile, "_kernel_files", lambda caches: files)  # and no new file
    report = precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), workers=2)
    # With no kernel on disk the workers start before the first kernel, and are stopped after it.
    assert (report.kernels, report.workers, report.cold, report.failures) == (EARLY_WORKERS, started,
                                                                             False, [])


@pytest.mark.slow
@pytest.mark.parametrize("files_before", [0, 5], ids=["empty-caches", "kernels-on-disk"])
def test_failed_or_missing_workers_leave_the_kernels_to_capture(monkeypatch, caplog, files_before):
    t = tower()
    monkeypatch.setattr(t, "run_jit_kernel", lambda op, batch: None)
    files = iter(range(files_before, 100))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_kernel_files", lambda caches: next(files))  # each call finds one more
    # The workers run FlashAttention 4 and quack on this machine's CPU: each fails, and says so.
    report = precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), workers=2)
    assert report.cold and report.workers == 2
    assert len(report.failures) == 2 and all(f.startswith("exit 1: ") for f in report.failures)
    assert "capture compiles its kernels" in caplog.text
    assert report.triton_seconds == 0  # no Triton kernel runs on this CPU

    def no_processes(*args, **kwargs):
        raise OSError("fork refused")

    monkeypatch.setattr(vitgraph.runtime.precompile.subprocess, "Popen", no_processes)
    report = precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), workers=2)
    assert report.workers == 0 and report.failures == ["could not start a worker: fork refused"]


@pytest.mark.slow
def test_while_the_workers_compile_the_triton_kernels_of_every_bucket_compile_here(monkeypatch, caplog):
    t = tower()
    buckets = default_buckets(t)
    order = []
    monkeypatch.setattr(t, "run_jit_kernel", lambda op, batch: order.append(op))
    monkeypatch.setattr(t, "run_triton_kernels", lambda batch: order.append(batch.positions.shape[0]))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_triton_compiles", lambda device: True)  # as on a GPU
    files = iter(range(5, 100))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_kernel_files", lambda caches: next(files))  # cold
    monkeypatch.setattr(vitgraph.runtime.precompile, "_spawn", lambda spec: (subprocess.Popen([sys.executable, "-c", ""]),
                                                                     open(os.devnull, "rb")))
    report = precompile(t, setup_of(t), buckets, torch.device("cpu"), workers=2)
    assert report.cold and report.workers == 2 and report.failures == [] and report.triton_seconds > 0
    # The first JIT kernel, then each bucket's Triton kernels, smallest first.
    assert order == [kernel_jobs(t, buckets)[0].op] + sorted(b.tokens for b in buckets)
    # Out of GPU memory for a large bucket: the rest is left to capture, and precompile goes on.
    order.clear()

    def out_of_memory_above_1024(batch):
        if batch.positions.shape[0] > 1024:
            raise torch.OutOfMemoryError("CUDA out of memory")
        order.append(batch.positions.shape[0])

    monkeypatch.setattr(t, "run_triton_kernels", out_of_memory_above_1024)
    report = precompile(t, setup_of(t), buckets, torch.device("cpu"), workers=2)
    assert report.cold and report.failures == [] and order[1:] == sorted(b.tokens for b in buckets if b.tokens <= 1024)
    assert "out of GPU memory compiling the Triton kernels of bucket 1152x16" in caplog.text
    # Warm caches: no workers to wait for, so capture loads them as it goes.
    order.clear()
    monkeypatch.setattr(vitgraph.runtime.precompile, "_kernel_files", lambda caches: 5)
    report = precompile(t, setup_of(t), buckets, torch.device("cpu"), workers=2)
    assert order == [kernel_jobs(t, buckets)[0].op] and report.triton_seconds == 0


@pytest.mark.parametrize("switch, kept", [("QUACK_CACHE_ENABLED", {"attention"}),
                                          ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", {"fc1", "qkv_rope"})])
def test_workers_only_compile_kernels_whose_cache_is_on(monkeypatch, switch, kept):
    t = tower()
    monkeypatch.setattr(t, "run_jit_kernel", lambda op, batch: None)
    files = iter(range(100))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_kernel_files", lambda caches: next(files))  # cold
    started = []
    monkeypatch.setattr(vitgraph.runtime.precompile, "_start", lambda tower, setup, shares, device, report: started.extend(shares) or [])
    if switch == "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED":
        set_fa4_cache(monkeypatch, False)  # FA4's default
    else:
        monkeypatch.setenv(switch, "0")
    jobs = kernel_jobs(t, default_buckets(t))
    precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), workers=16)
    # The first kept kernel runs here; a kernel whose cache is off compiles at capture.
    assert [job for share in started for job in share] == [j for j in jobs if j.op in kept][1:]


@pytest.mark.parametrize("attention, caches", [("fa4", ["flash_attn.cute.cache_utils", "quack.cache.jit"]),
                                               ("cudnn", ["quack.cache.jit"])])
def test_only_the_caches_of_the_kernels_in_use_are_read(monkeypatch, attention, caches):
    t = tower(attention=attention)
    monkeypatch.setattr(t, "run_jit_kernel", lambda op, batch: None)
    read = []
    monkeypatch.setattr(vitgraph.runtime.precompile, "_kernel_files", lambda names: read.append(names) or 1)  # warm
    precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), workers=2)
    assert read == [caches, caches]


def test_kernel_files_are_counted_in_each_cache_that_loads(tmp_path, monkeypatch):
    import types

    for name, files in (("fake_fa4_cache", ["a/x.o", "a/b/y.o", "a/y.lock"]), ("fake_quack_cache", ["z.o"])):
        root = tmp_path / name
        for f in files:
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).touch()
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(get_cache_path=lambda root=root: root))
    assert vitgraph.runtime.precompile._kernel_files(["fake_fa4_cache", "no_such_module", "fake_quack_cache"]) == 3
    assert vitgraph.runtime.precompile._kernel_files(["fake_quack_cache"]) == 1


@pytest.mark.slow
def test_a_worker_runs_its_jobs_and_reports_what_failed():
    t = tower(attention="sdpa", gemm="cublas", fused=False)  # attention runs on the CPU
    proc, log = _spawn(_spec(t.one_block_recipe(), setup_of(t), [KernelJob("attention", (), Bucket(64, 4)), KernelJob("attention", (), Bucket(128, 1))],
                             torch.device("cpu")))
    assert proc.wait(timeout=120) == 0, _tail(log)
    assert json.loads(_tail(log))["dynamo_imported"] is False
    proc, log = _spawn(_spec(t.one_block_recipe(), setup_of(t), [KernelJob("attention", (), Bucket(64, 4)), KernelJob("fc2", (), Bucket(64, 4))],
                             torch.device("cpu")))
    assert proc.wait(timeout=120) == 1
    assert "op must be one of" in _tail(log) and "'fc2'" in _tail(log)


@pytest.mark.parametrize("value", [-1, True, 1.5, "4"])
def test_compile_workers_option_is_checked(value):
    with pytest.raises(ValueError, match="compile_workers"):
        EngineOptions(compile_workers=value)


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    """Both libraries usable here, as on an H200, their disk caches in empty directories, and
    worker starts recorded instead of run."""
    roots = {}
    for module, variable in (("flash_attn.cute.cache_utils", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"),
                             ("quack.cache.jit", "QUACK_CACHE_DIR")):
        roots[module] = tmp_path / variable
        monkeypatch.setenv(variable, str(roots[module]))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_has_fa4", lambda device: True)
    monkeypatch.setattr(vitgraph.runtime.precompile, "quack_available", lambda device: True)
    specs = []
    monkeypatch.setattr(vitgraph.runtime.precompile, "_spawn", lambda spec: specs.append(json.loads(spec)) or (None, None))
    return roots, specs


def start(workers=None, device="cuda", dtype=torch.bfloat16, **options):
    return start_early(one_block_recipe(VisionConfig()), torch.device(device), dtype,
                       dataclasses.asdict(EngineOptions(compile_workers=workers, **options)))


def test_workers_start_with_the_encoder_only_where_no_kernel_is_on_disk(empty_caches, monkeypatch):
    roots, specs = empty_caches
    early = start(workers=3)
    assert len(early.procs) == 3 and early.roots == roots
    assert [spec["share"] for spec in specs] == [[0, 3], [1, 3], [2, 3]]
    assert specs[0]["recipe"]["kwargs"]["config"]["depth"] == 1 and specs[0]["dtype"] == "bfloat16" and specs[0]["device"] == "cuda"
    assert specs[0]["options"] == dataclasses.asdict(EngineOptions(compile_workers=3))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_usable_cpus", lambda: 64)
    assert len(start().procs) == EARLY_WORKERS
    monkeypatch.setattr(vitgraph.runtime.precompile, "_usable_cpus", lambda: 3)
    assert len(start().procs) == 2
    specs.clear()
    # None started: no workers asked for, no GPU, no kernel library in use, or a kernel on disk.
    assert start(workers=0) is None and start(device="cpu") is None
    assert start(attention="cudnn", gemm="cublas") is None and start(dtype=torch.float32) is None
    monkeypatch.setenv("QUACK_CACHE_ENABLED", "0")
    assert start(attention="cudnn") is None  # quack's kernels would not persist: nothing to compile ahead
    monkeypatch.delenv("QUACK_CACHE_ENABLED")
    (roots["quack.cache.jit"] / "k").mkdir(parents=True)
    (roots["quack.cache.jit"] / "k" / "gemm.o").touch()
    assert start() is None
    assert specs == []


def test_early_workers_are_adopted_only_where_the_libraries_keep_their_kernels(empty_caches, monkeypatch):
    roots, _ = empty_caches
    t = tower()
    ran = []
    monkeypatch.setattr(t, "run_jit_kernel", lambda op, batch: ran.append(op))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_kernel_files", lambda caches: 3)  # the workers wrote some already
    started = []
    monkeypatch.setattr(vitgraph.runtime.precompile, "_start", lambda tower, setup, shares, device, report: started.extend(shares) or [])
    stopped = []
    procs = [("proc", "log")] * 0  # nothing to wait for here
    early = EarlyWorkers(procs, dict(roots))
    monkeypatch.setattr(early, "stop", lambda: stopped.append(True))
    monkeypatch.setattr(vitgraph.runtime.precompile, "_cache_roots", lambda caches: dict(roots))
    report = precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), early=early)
    assert report.early and report.cold and report.workers == 0 and stopped == [] and started == []
    assert ran == [] and report.first_kernel_seconds == 0  # the early workers compile every kernel
    # The libraries, imported, keep their kernels elsewhere: those workers looked at the wrong
    # directories, so they are stopped and the usual check runs (here: warm).
    monkeypatch.setattr(vitgraph.runtime.precompile, "_cache_roots",
                        lambda caches: {**roots, "quack.cache.jit": roots["quack.cache.jit"].parent / "other"})
    report = precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), early=early)
    assert not report.early and not report.cold and stopped == [True] and started == [] and len(ran) == 1
    report = precompile(t, setup_of(t), default_buckets(t), torch.device("cpu"), workers=0, early=early)
    assert stopped == [True, True]  # no precompiling at all: stopped too


def test_an_early_worker_compiles_its_share_of_the_kernels_the_encoder_will_run(monkeypatch, capsys):
    t = tower()
    options = EngineOptions(compile_workers=3)
    every = [j for j in kernel_jobs(t, default_buckets(t)) if _persists(j.op)]
    assert len(every) >= 7

    def as_on_a_gpu(tower, options, tuning, device, dtype):  # the backends and tuning an H200 resolves to
        tower.set_attention_backend("fa4")
        tower.fused = True
        tuning = h200(tower.config)
        tower.set_tuning(tuning.kernels)
        return "fa4", tuning

    monkeypatch.setattr(vitgraph.runtime.options, "buckets_for",
                        lambda tower, options, attention, device, tuning: default_buckets(tower))
    monkeypatch.setattr(vitgraph.runtime.options, "configure_tower", as_on_a_gpu)
    ran = []
    monkeypatch.setattr(vitgraph.models.qwen2_vl.Qwen2VisionTower, "run_jit_kernel",
                        lambda self, op, batch: ran.append((op, batch.positions.shape[0])))
    spec = {"started": 0.0, "recipe": one_block_recipe(VisionConfig()), "dtype": "bfloat16", "device": "cpu",
            "options": dataclasses.asdict(options)}
    for index in range(3):
        ran.clear()
        worker_main(json.dumps({**spec, "share": [index, 3]}))
        # Cold is certain: the workers compile every kernel, the first too.
        assert ran == [(j.op, j.bucket.tokens) for j in every[index::3]]
        assert json.loads(capsys.readouterr().out.splitlines()[-1]).keys() >= {f"{j.op}@{j.bucket.name}_s"
                                                                                for j in every[index::3]}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", [dict(budgets=[30]), dict(budgets=[256, 256]), dict(attention="no-such")])
def test_early_workers_are_stopped_when_the_encoder_cannot_be_built(monkeypatch, options):
    from vitgraph import GraphedVisionEncoder

    stopped = []
    early = EarlyWorkers([], {})
    monkeypatch.setattr(early, "stop", lambda: stopped.append(True))
    monkeypatch.setattr(vitgraph.runtime.encoder, "start_early", lambda *args: early)
    with pytest.raises(ValueError):
        GraphedVisionEncoder.from_config(VisionConfig(depth=1), device="cuda", progress=False, **options)
    assert stopped == [True]


COLD_START = textwrap.dedent("""
    import json, os, pathlib, sys, time
    import torch
    import vitgraph.runtime.encoder
    from vitgraph import GraphedVisionEncoder
    from vitgraph.models import VisionConfig
    roots = [pathlib.Path(p) for p in sys.argv[1:]]
    objects = lambda: sorted(str(p.relative_to(r)) for r in roots for p in r.rglob("*.o"))
    triton_root = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
    triton = lambda: sorted(str(p.relative_to(triton_root)) for p in triton_root.rglob("*.cubin"))
    compiled, compiled_triton = [], []  # the kernel files on disk once precompile returns, before capture starts
    precompile = vitgraph.runtime.encoder.precompile
    vitgraph.runtime.encoder.precompile = lambda *args, **kwargs: (precompile(*args, **kwargs), compiled.extend(objects()),
                                                           compiled_triton.extend(triton()))[0]
    start = time.perf_counter()
    enc = GraphedVisionEncoder.from_config(VisionConfig(depth=1), device="cuda", dtype=torch.bfloat16,
                                           budgets=[256, 1024, 2304], progress=False)
    print(json.dumps({"first": enc.stats()["precompile"], "compiled": compiled, "after_capture": objects(),
                      "triton_compiled": compiled_triton, "triton_after_capture": triton(),
                      "seconds": time.perf_counter() - start, "dynamo_imported": "torch._dynamo" in sys.modules}))
""")


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and vitgraph.ops.gemm.quack_available("cuda")
                         and "fa4" in vitgraph.ops.attention.available_backends("cuda")),
                    reason="needs flash-attn-4 and quack-kernels on a Hopper GPU")
def test_cold_caches_are_filled_by_workers_and_capture_compiles_nothing(tmp_path):
    caches = {"FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": tmp_path / "fa4", "QUACK_CACHE_DIR": tmp_path / "quack"}
    env = {**os.environ, **{k: str(v) for k, v in caches.items()}, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"  # FA4's disk cache is off unless the process asks
    env.pop("QUACK_CACHE_ENABLED", None)

    def run():
        done = subprocess.run([sys.executable, "-c", COLD_START, *map(str, caches.values())], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    print(f"\n[precompile] cold: {cold['first']} then {cold['seconds']:.1f} s with build and capture; "
          f"warm: {warm['first']} then {warm['seconds']:.1f} s")
    first = cold["first"]
    # No kernel on disk: the workers started with the encoder, before its build.
    assert first["cold"] and first["early"] and first["workers"] >= 1 and first["failures"] == []
    assert len(cold["compiled"]) >= first["kernels"] >= 5
    assert cold["after_capture"] == cold["compiled"]  # capture loaded every kernel, compiled none
    # The Triton kernels too: this process compiled them while the workers ran.
    assert first["triton_seconds"] > 0 and len(cold["triton_compiled"]) >= 3
    assert cold["triton_after_capture"] == cold["triton_compiled"]
    # A later process on the same caches: one kernel load tells it so, and it compiles nothing.
    assert not warm["first"]["cold"] and not warm["first"]["early"]
    assert warm["first"]["failures"] == [] and warm["first"]["workers"] == 0
    assert warm["after_capture"] == cold["compiled"]


class _Sentinel(Exception):
    pass


def test_from_pretrained_starts_the_workers_before_the_weights_load_and_stops_them_on_failure(
        checkpoint, monkeypatch):
    """Cold caches: the workers need only the checkpoint's shapes, so they start before its
    weights load; a load that fails stops them."""
    events, early = [], EarlyWorkers([], {})
    monkeypatch.setattr(early, "stop", lambda: events.append("stop"))
    monkeypatch.setattr(vitgraph.runtime.encoder, "uses_graphs", lambda options, device: True)
    monkeypatch.setattr(vitgraph.runtime.encoder, "start_early",
                        lambda recipe, *args: events.append(("start_early", recipe["kwargs"]["config"]["depth"]))
                        or early)

    def failing_load(files, config, device, dtype, *rest):
        events.append("load_tower")
        raise _Sentinel

    monkeypatch.setattr(vitgraph.runtime.encoder, "load_tower", failing_load)
    with pytest.raises(_Sentinel):
        vitgraph.runtime.encoder.GraphedVisionEncoder.from_pretrained(checkpoint, device="cpu")
    assert events == [("start_early", 1), "load_tower", "stop"]  # a one-block tower of its shape


def test_workers_handed_to_an_eager_encoder_are_stopped(checkpoint, monkeypatch):
    stopped, early = [], EarlyWorkers([], {})
    monkeypatch.setattr(early, "stop", lambda: stopped.append(True))
    tower = vitgraph.runtime.encoder.GraphedVisionEncoder.from_pretrained(checkpoint, device="cpu").tower
    enc = vitgraph.runtime.encoder.GraphedVisionEncoder(tower, device="cpu", _early_workers=early)
    assert stopped == [True] and enc._early_workers is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_from_pretrained_hands_its_early_workers_to_precompile(checkpoint, monkeypatch):
    early, waited_for = EarlyWorkers([], {}), []
    monkeypatch.setattr(vitgraph.runtime.encoder, "start_early", lambda *args: early)
    precompile_ = vitgraph.runtime.encoder.precompile
    monkeypatch.setattr(vitgraph.runtime.encoder, "precompile",
                        lambda *args, early=None, **kwargs: waited_for.append(early) or precompile_(*args, **kwargs))
    enc = vitgraph.runtime.encoder.GraphedVisionEncoder.from_pretrained(checkpoint, device="cuda", budgets=[64],
                                                                 progress=False)
    assert waited_for == [early] and enc._early_workers is None


@pytest.mark.parametrize("preset", ["qwen2-vl-2b", "qwen2.5-vl-7b", "qwen3-vl-8b", "qwen3.5-768"])
def test_every_family_precompiles_what_its_forward_compiles(preset):
    """Every family's kernels compiled on first use, at its released widths on an H200: the jobs
    of the default ladder, each op's disk cache known, Qwen2.5-VL's two attention kinds (windows,
    frames) each compiled; the tower a worker builds from the recipe (one block of each kind)
    finds the same kernels on the same buckets, so its share of the jobs is the encoder's."""
    from vitgraph.models import PRESETS, one_block_tower
    from vitgraph.runtime.precompile import _cache_of

    def configured(t):
        t.set_attention_backend("fa4")
        t.fused = True
        t.set_tuning(h200(t.config).kernels)
        return t

    full = configured(build_tower(PRESETS[preset], torch.device("meta"), torch.bfloat16))
    recipe = full.one_block_recipe()
    worker = configured(one_block_tower(**recipe["kwargs"], device="meta", dtype=torch.bfloat16))
    assert len(worker.blocks) in (1, 2) and worker.warm_up_blocks() == list(range(len(worker.blocks)))
    buckets = buckets_for(full, EngineOptions(), "fa4", torch.device("cuda"), h200(full.config))
    jobs = kernel_jobs(full, buckets)
    assert [(j.op, j.key, j.bucket) for j in jobs] == [(j.op, j.key, j.bucket) for j in kernel_jobs(worker, buckets)]
    ops = {j.op for j in jobs}
    assert {"qkv_rope", "fc1", "attention"} <= ops and all(_cache_of(op) for op in ops)
    assert ("attention_2" in ops) == preset.startswith("qwen2.5")
    fc1 = {j.key[3:] for j in jobs if j.op == "fc1"}  # the activation in the epilogue, gated or not
    assert fc1 == {{"qwen2-vl-2b": ("quick_gelu", False), "qwen2.5-vl-7b": ("silu", True)}.get(
        preset, ("gelu_pytorch_tanh", False))}
