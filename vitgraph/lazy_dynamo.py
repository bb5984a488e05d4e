"""Import quack without importing ``torch._dynamo``.

quack's package import decorates a method with ``torch.compiler.disable``, and that call
imports ``torch._dynamo``: 3-5 s of every start on an H200 host (an encoder's build with warm
kernel caches took 5.3-8.0 s with it, 2.2-2.6 s without), in every process that loads quack
(FlashAttention 4 imports quack too). vitgraph never runs
``torch.compile``, and where nothing has imported dynamo yet no compiled code can be running,
so there is nothing to disable yet. :func:`import_quack` imports quack with a
``torch.compiler.disable`` (:func:`lazy_disable`) that marks the function the way the real
one does, so dynamo still calls it untraced, and that wraps it in the real one the first
time it is called after something has loaded dynamo. The real ``torch.compiler.disable`` is
put back as soon as the import is done.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading

import torch

_lock = threading.Lock()


def _real_disable(fn, recursive: bool, reason: str | None):
    import torch._dynamo

    kwargs = {} if reason is None else {"reason": reason}  # torch < 2.6 takes no reason
    return torch._dynamo.disable(fn, recursive, **kwargs)


def lazy_disable(fn=None, recursive: bool = True, *, reason: str | None = None):
    """``torch.compiler.disable`` that imports ``torch._dynamo`` only once the function runs
    with dynamo loaded (recursive disables; a non-recursive one is the real thing at once)."""
    if fn is None:
        return functools.partial(lazy_disable, recursive=recursive, reason=reason)
    if not recursive:
        return _real_disable(fn, recursive, reason)
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:  # then no torch.compile can be running
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = _real_disable(fn, recursive, reason)
        return disabled(*args, **kwargs)

    # What dynamo reads on a function the real decorator returns: it then calls the function
    # untraced (a graph break) instead of inlining it.
    call._torchdynamo_disable = True
    call._torchdynamo_disable_msg = reason
    call._torchdynamo_orig_callable = fn
    return call


@contextlib.contextmanager
def _lazy_compiler_disable():
    real = torch.compiler.disable
    torch.compiler.disable = lazy_disable
    try:
        yield
    finally:
        torch.compiler.disable = real


def import_quack() -> None:
    """Import quack once, deferring ``torch._dynamo`` where nothing has imported it yet. Call
    it before any import from quack or FlashAttention 4's CuTe package (cheap after the first)."""
    if "quack" in sys.modules:
        return
    with _lock:
        if "quack" in sys.modules:
            return
        if "torch._dynamo" in sys.modules:  # already paid for: nothing to defer
            importlib.import_module("quack")
            return
        with _lazy_compiler_disable():
            importlib.import_module("quack")
