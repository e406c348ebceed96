"""What concurrent `generate` calls in one process must not do at the same time, and the locks that keep them apart.

Servers (Gradio, FastAPI, any threaded one) call `generate` from several threads on one model. Eager calls (the
dynamic path, and every call on the CPU) interleave freely: each call owns its caches, and CUDA orders the launches.
Three things may not overlap:

- **capturing a CUDA graph.** A capture in the default ("global") mode fails when another thread launches work
  meanwhile ("operation not permitted when stream is capturing", seen with 6 threads on an H100). Captures run in
  "thread_local" mode (other threads' work is legal and stays out of the graph) and one at a time (`CAPTURE_LOCK`).
- **torch.compile compiling a forward** (dynamo is not thread-safe).
- **two calls on captured steps on one model.** With the two rules above, 8 threads x 3 calls on an H100 still hit
  a device-side index assert in some runs; the same calls one at a time never did. (A likely cause, a step kind
  captured after a catch-up forward without its state put home, was found later on the CPU and fixed; the lock
  stays until a GPU run shows that threads no longer need it.)

So a call on the static path of a GPU — captured steps, compiled forwards or both — holds its target model's lock
from building its loop (its static caches) to destroying its graphs (`model_call_lock`): such calls run one at a
time per model, and at most one call's static caches exist per model. Captures also keep the garbage collector off
(`step_graph`), so that no graph of an earlier call is destroyed mid-capture. A call waits for the one before it;
docs/benchmarks.md has the measured throughput.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

#: One CUDA graph capture at a time in the process.
CAPTURE_LOCK = threading.RLock()

_MODEL_LOCKS: weakref.WeakKeyDictionary[object, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def model_lock(model: object) -> threading.RLock:
    """The lock of one model (weakly kept: it goes with the model)."""
    with _GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


@contextlib.contextmanager
def model_call_lock(model: object, hold: bool) -> Iterator[None]:
    """Hold `model`'s lock for the call when `hold` (a call on the static path of a GPU); otherwise nothing."""
    if not hold:
        yield
        return
    with model_lock(model):
        yield
