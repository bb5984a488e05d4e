"""Commands that a test runs to completion and then checks (exit codes, output, files written),
run ahead of the test: one at a time, on a thread of their own from the start of the session,
on the core the session's mostly single-threaded tests leave idle (the suite's two cores).

A test names its commands with the mark ``early_run(commands)`` (a lambda, or
``early_run.with_args(function)``: a named function alone is taken for the test to mark).
``commands(out)`` gives a list of keyword arguments for :class:`subprocess.Popen` (``args`` and
optionally ``env``, ``cwd``; ``timeout``: default 600 s), ``out`` a folder of the run's own for
the files they write. The test's fixture ``early_run`` is ``(out, [CompletedProcess, ...])``,
each with ``seconds`` (its wall time): it waits for the commands, or runs them itself where the
thread has not started them yet. A command that times out or cannot start errors the test.

These tests run after the session's others (conftest orders them last, keeping their order),
so that their commands are done when they come; every selected test is run, whatever it asks.
A session that ends first (-x, Ctrl-C) kills what still runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

_RUNS = pytest.StashKey()
_ROOT = pytest.StashKey()


class EarlyRun:
    """One test's commands: started once, by the thread or by the test, whichever comes first."""

    def __init__(self, nodeid: str, commands, root: Path):
        self.nodeid, self.commands, self.root = nodeid, commands, root
        self.lock, self.done = threading.Lock(), threading.Event()
        self.started, self.result, self.error, self.proc = False, None, None, None
        self.killed = False

    def claim(self) -> bool:
        with self.lock:
            if self.started:
                return False
            self.started = True
            return True

    def run(self) -> None:
        """Run the commands in order (the caller has claimed them)."""
        try:
            out = Path(tempfile.mkdtemp(prefix="run-", dir=self.root))
            done = []
            for options in self.commands(out):
                options = dict(options)
                timeout = options.pop("timeout", 600)
                start = time.perf_counter()
                with self.lock:
                    if self.killed:
                        raise RuntimeError("the session ended before this command ran")
                    self.proc = subprocess.Popen(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                 start_new_session=True, **options)
                try:
                    stdout, stderr = self.proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _kill_group(self.proc)
                    raise
                proc = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, stdout, stderr)
                proc.seconds = time.perf_counter() - start
                done.append(proc)
            self.result = out, done
        except BaseException as err:  # handed to the test
            self.error = err
        finally:
            self.done.set()

    def kill(self) -> None:
        with self.lock:
            self.killed = True
            if self.proc is not None and self.proc.poll() is None:
                _kill_group(self.proc)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _skipped(item) -> bool:
    """Whether a mark already says the item skips (a skipif given a string condition: not known here)."""
    for mark in item.iter_markers():
        if mark.name == "skip":
            return True
        if mark.name == "skipif" and any(c is True for c in mark.args):
            return True
    return False


def order_last(items) -> None:
    """Move the items that ask for early runs to the end, each group keeping its order."""
    early = [item for item in items if item.get_closest_marker("early_run")]
    items[:] = [item for item in items if not item.get_closest_marker("early_run")] + early


def start(session) -> None:
    """Start the thread on the selected items' runs (those not already marked to skip; none where
    the session only collects)."""
    if session.config.option.collectonly:
        return
    root = Path(tempfile.mkdtemp(prefix="vitgraph-early-runs-"))
    runs = {item.nodeid: EarlyRun(item.nodeid, item.get_closest_marker("early_run").args[0], root)
            for item in session.items if item.get_closest_marker("early_run")}
    session.config.stash[_RUNS] = runs
    session.config.stash[_ROOT] = root
    ahead = [run for nodeid, run in runs.items()
             if not _skipped(next(i for i in session.items if i.nodeid == nodeid))]

    def lane():
        for run in ahead:
            if run.claim():
                run.run()

    if ahead:
        threading.Thread(target=lane, name="early-runs", daemon=True).start()


def stop(session) -> None:
    """Kill what still runs (a session cut short) and remove the runs' folders."""
    for run in session.config.stash.get(_RUNS, {}).values():
        run.kill()
    if _ROOT in session.config.stash:
        shutil.rmtree(session.config.stash[_ROOT], ignore_errors=True)


@pytest.fixture
def early_run(request):
    """(out, [CompletedProcess, ...]) of this test's ``early_run`` commands."""
    run = request.config.stash[_RUNS][request.node.nodeid]
    if run.claim():
        run.run()
    run.done.wait()
    if run.error is not None:
        raise run.error
    return run.result


def summary(terminalreporter) -> None:
    runs = terminalreporter.config.stash.get(_RUNS, {})
    timed = [p for run in runs.values() if run.result for p in run.result[1]]
    if timed:
        terminalreporter.write_line(f"early runs: {len(timed)} command(s) of {len(runs)} test(s), "
                                    f"{sum(p.seconds for p in timed):.1f} s (ahead of their tests: not in "
                                    f"their durations)")
