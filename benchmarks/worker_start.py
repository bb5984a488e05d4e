"""Where a compiling worker's start goes, one process alone and eleven at once (as a cold
start launches them): starting Python, importing torch and vitgraph, creating a CUDA context
(before or after the kernel libraries: ``ctx_first``, ``ctx_last``; ``none``: no context), and
importing quack and FlashAttention 4's CuTe DSL.

Each row is one round of N fresh processes started together: the range over them, in s.
The first round (one process, no context) reads the files from disk; the rest from the page
cache. Needs the ``fa4`` extra. Usage: worker_start.py
"""
import json
import os
import subprocess
import sys
import time

CHILD = r'''
import json, sys, time
t0 = float(sys.argv[1]); r = {"spawn_to_main": time.time() - t0}
a = time.perf_counter(); import torch; r["import_torch"] = time.perf_counter() - a
a = time.perf_counter(); import vitgraph.loading, vitgraph.encoder; r["import_vitgraph"] = time.perf_counter() - a
mode = sys.argv[2]
if mode == "ctx_first":
    a = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize(); r["cuda_ctx"] = time.perf_counter() - a
a = time.perf_counter()
from vitgraph.lazy_dynamo import import_quack; import_quack()
import flash_attn.cute.interface
r["import_cute"] = time.perf_counter() - a
if mode == "ctx_last":
    a = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize(); r["cuda_ctx"] = time.perf_counter() - a
r["total_since_spawn"] = time.time() - t0
print(json.dumps({k: round(v, 2) for k, v in r.items()}))
'''


def run(n: int, mode: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(t0), mode], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    print(f"n={n} mode={mode}: "
          + " | ".join(f"{k} {min(r[k] for r in rows):.2f}-{max(r[k] for r in rows):.2f}" for k in rows[0]), flush=True)


if __name__ == "__main__":
    for n, mode in [(1, "none"), (1, "ctx_first"), (11, "ctx_first"), (1, "ctx_last"), (11, "ctx_last"), (11, "none")]:
        run(n, mode)
