"""The attention and GEMM backends' names, without torch: the benchmarks' ``--help`` and argument
errors list them before torch is imported. :mod:`vitgraph.ops.attention` and
:mod:`vitgraph.ops.gemm` import them from here."""

BACKENDS = ("fa4", "cudnn", "varlen", "flash", "sdpa")
FLASH_BACKENDS = ("fa4", "cudnn", "varlen", "flash")  # fp16/bf16 only
GEMM_BACKENDS = ("quack", "cublas")
