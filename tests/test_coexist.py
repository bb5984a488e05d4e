"""vitgraph inside someone else's serving process: beside torch.compile (default and
reduce-overhead mode, whose CUDA-graph trees free every cuBLAS workspace in the process
around each recording), the caller's own CUDA graphs and a second encoder.

Run on a CUDA machine with ``python -m pytest -m cuda -s tests/test_coexist.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coexist_workload import encoder, pixels_for, schedule

pytestmark = pytest.mark.cuda
HERE = Path(__file__).parent
ROOT = HERE.parent


def run_script(args, timeout, cwd=HERE):
    # The scripts import vitgraph from this checkout, installed or not.
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"{args[0]} {args[1:3]} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Each side's outputs, every call made alone in a fresh process."""
    out = tmp_path_factory.mktemp("coexist")
    for role in ("vitgraph", "others"):
        run_script(["coexist_workload.py", role, str(out / f"{role}.pt")], timeout=900)
    return {role: torch.load(out / f"{role}.pt") for role in ("vitgraph", "others")}, out


def test_every_call_together_equals_the_same_call_alone(alone):
    expected, out = alone
    run_script(["coexist_workload.py", "together", str(out / "together.pt")], timeout=900)
    together = torch.load(out / "together.pt")
    steps = schedule(320)
    assert len(together) >= 300 and set(together) == set(expected["vitgraph"]) | set(expected["others"])
    kinds = {kind for kind, _ in steps}
    assert {"encode_a", "encode_b", "compiled", "compiled_ro", "user_graph", "capture_user", "start_a"} <= kinds
    differ = []
    for index, result in together.items():
        want = expected["vitgraph"].get(index, expected["others"].get(index))
        if not torch.equal(result, want):
            differ.append((index, steps[index][0], (result.float() - want.float()).abs().max().item()))
    print(f"\n[coexist] {len(together)} calls compared bitwise with the same calls alone: {len(differ)} differ"
          f" {sorted({kind for _, kind, _ in differ})}")
    assert not differ, differ[:10]


def test_each_bank_captures_on_a_non_blocking_stream_of_its_own():
    """Not one of torch's pooled streams (they come with whatever workspace their last user left)
    and not one another's; non-blocking, as torch's own (a capture on a blocking stream would
    make any use of the legacy stream invalid)."""
    import ctypes

    from vitgraph.engine.streams import CU_STREAM_NON_BLOCKING, _driver, own_stream

    pooled = {torch.cuda.Stream().cuda_stream for _ in range(64)} | {torch.cuda.Stream(priority=-1).cuda_stream
                                                                      for _ in range(64)}
    own = [own_stream(torch.device("cuda")) for _ in range(3)]
    handles = {s.cuda_stream for s in own}
    assert len(handles) == 3 and not handles & pooled
    driver = _driver()
    assert driver is not None, "libcuda.so.1 did not load"
    for stream in own:
        flags = ctypes.c_uint(0)
        assert driver.cuStreamGetFlags(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(flags)) == 0
        assert flags.value & CU_STREAM_NON_BLOCKING
    x = torch.ones(64, 64, device="cuda")
    x @ x  # cuBLAS's handle is made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=own[0]):
        y = x @ x
    x.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 256.0))


def test_graphs_survive_a_process_wide_cublas_workspace_clear():
    """torch.compile's CUDA-graph trees call torch._C._cuda_clearCublasWorkspaces around every
    recording. The graphs' cuBLAS workspaces must not be among what that frees: memory handed
    out afterwards (filled with a sentinel here) stays untouched by replays, and replays stay exact.
    Every stream of torch's pool has a workspace outside any graph pool first (torch.cuda.Stream()
    hands its 32 out again and again): the bank's capture stream must be none of them."""
    x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(40):
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.mm(x, x)
            torch.addmm(x[0], x, x)  # cuBLASLt's workspace too
    torch.cuda.synchronize()
    enc = encoder("a")
    assert isinstance(enc.bank._capture_stream, torch.cuda.ExternalStream)  # not a pooled one
    calls = [[(1, 16, 16)], [(1, 32, 32)], [(1, 64, 64)], [(2, 16, 28), (1, 8, 12)]]
    inputs = [pixels_for(grids, i) for i, grids in enumerate(calls)]
    before = [enc.encode(x, grids).clone() for x, grids in zip(inputs, calls)]
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    # Take whatever was just freed: 64 blocks of 32 MiB (cuBLAS's workspace size on Hopper).
    sentinels = [torch.full((16 << 20,), 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(64)]
    for _ in range(3):
        after = [enc.encode(x, grids) for x, grids in zip(inputs, calls)]
    torch.cuda.synchronize()
    replays = sum(b["replays"] for b in enc.stats()["buckets"].values())
    assert replays >= 12
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(bool((s == 7.0).all()) for s in sentinels), "a replay wrote into memory vitgraph does not own"
    assert enc.stats()["pool_workspace_bytes"] > 0  # the capture stream's workspaces live in the pool


def test_the_latency_suite_beside_torch_compile():
    """The command that faulted on `h5s1l` (5 x 256 + 4096 tokens) once torch.compile had
    recorded CUDA graphs for the cases before it, in one process."""
    cases = ["h1872=1,36,52", "hmixed=1,20,28+1,44,30+3,22,40", "hvid16=16,16,16", "h576=1,8,72",
             "h5s1l=1,16,16+1,16,16+1,16,16+1,16,16+1,16,16+1,64,64"]
    args = ["-m", "vitgraph.bench.latency", "--cases", "1x256", *(f"--case={c}" for c in cases),
            "--systems", "vitgraph_graph", "torch_compile", "--iters", "3", "--warmup", "1"]
    proc = run_script(args, timeout=1200, cwd=ROOT)
    assert "h5s1l" in proc.stdout
