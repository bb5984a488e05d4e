"""Every skip a newcomer sees on a machine without a GPU says why in words (not pytest's "got
empty parameter set" for a parameter list that came out empty)."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CUDA suites run rather than skip")
@pytest.mark.early_run(lambda out: [dict(
    args=[sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-rs", "-p", "no:cacheprovider"], cwd=ROOT,
    env={**os.environ, "PYTHONPATH": str(ROOT)})])
def test_every_cuda_test_skips_with_a_sentence(early_run):
    """(The suite's CUDA tests in a pytest of their own, run ahead of this test: tests/early_runs.py.)"""
    _, (proc,) = early_run
    assert proc.returncode == 0, proc.stdout[-3000:]
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+(?::\d+)?: (.*)$", proc.stdout, flags=re.M)
    assert reasons and "passed" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]
    for reason in reasons:
        assert "empty parameter set" not in reason and re.fullmatch(r"[a-z][\w+.-]*( \S+){2,}", reason), reason
