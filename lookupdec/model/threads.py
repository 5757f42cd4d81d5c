"""Handing torch's CPU threads from the thread that loaded a model to the one that runs it.

torch runs a CPU operator's parallel part on OpenMP worker threads, one team per Python thread
that ran such an operator. GNU OpenMP (the ``libgomp`` torch's Linux wheels carry) keeps a
team's workers spinning between operators only while it manages no more threads than there are
CPUs; past that it lets them sleep at once, and each small operator then waits for sleeping
workers to wake. A server loads its model on the main thread (which keeps its team) and decodes
on an engine thread (a second team): on 2 CPUs and 2 torch threads, that is 4 managed threads,
and every small operator of decoding slowed down, and with them every verify forward of a few
nodes: a client alone on ``serve`` waited far longer than ``Engine.generate`` takes in the main
thread.

``release_openmp_threads`` lets the calling thread's team go (OpenMP 5.0's
``omp_pause_resource_all``): the thread that loaded a model calls it as it hands the model to
the thread that will run it (``server.worker``, ``pipelines.cluster``). A later operator on the
calling thread makes a new team (and the throttling comes back while it lives).
"""
from __future__ import annotations

import ctypes
import glob
import os

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: let the threads go, not only idle them
RUNTIMES = ("libgomp*.so*", "libomp*.so*", "libiomp5*.so*", "libomp*.dylib", "libiomp5*.dylib")

_pause = None  # omp_pause_resource_all of the runtime torch runs, once found (False: none)


def _pause_function():
    global _pause
    if _pause is None:
        _pause = False
        import torch

        folder = os.path.join(os.path.dirname(torch.__file__), "lib")
        paths = [p for pattern in RUNTIMES for p in sorted(glob.glob(os.path.join(folder, pattern)))]
        for path in paths + [None]:  # (None: the symbols already loaded in the process)
            try:
                function = getattr(ctypes.CDLL(path), "omp_pause_resource_all")
            except (OSError, AttributeError, TypeError):  # (TypeError: no process handle on Windows)
                continue
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            _pause = function
            break
    return _pause


def release_openmp_threads() -> bool:
    """Let the calling thread's OpenMP worker threads go, so that another thread's team is not
    throttled by them (see the module). True if the OpenMP runtime did; False where torch runs
    no OpenMP runtime that has ``omp_pause_resource_all`` (nothing to do)."""
    pause = _pause_function()
    return bool(pause) and pause(OMP_PAUSE_HARD) == 0
