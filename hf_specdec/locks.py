"""What concurrent `generate` calls in one process must not do at the same time, and the locks that keep them apart.

Servers (Gradio, FastAPI, any threaded one) call `generate` from several threads on one model. Eager and replayed
work of different calls may interleave freely: each call owns its caches and its graphs, and CUDA orders the launches.
Two things may not overlap:

- **capturing a CUDA graph.** A capture in the default ("global") mode fails when another thread launches work
  meanwhile ("operation not permitted when stream is capturing", seen with 6 threads on an H100). Captures run in
  "thread_local" mode (other threads' work is legal and stays out of the graph) and one at a time (`CAPTURE_LOCK`).
- **torch.compile compiling a forward** (dynamo is not thread-safe): calls whose forwards are compiled
  (`cache_implementation="static"` or a `compile_config`) hold their target model's lock for the whole call
  (`compiled_call_lock`), so they run one at a time per model; the default captured path compiles nothing.
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
def compiled_call_lock(model: object, compiled: bool) -> Iterator[None]:
    """Hold `model`'s lock for a call whose forwards are compiled (`compiled`); otherwise nothing."""
    if not compiled:
        yield
        return
    with model_lock(model):
        yield
