"""Kernels: flat token buffers in, labels (or 0/1 masks) and per-row statistics out.

Every backend module exposes one function with the same contract::

    label_rows(values, starts, ends, markers, *, last_turn_only, ignore_index, out, write_mask)
        -> (trained_tokens int64[n_rows], outcomes int8[n_rows], first_bad int64[n_rows])

- ``values``: 1-D integer array of token ids; row ``r`` is ``values[starts[r]:ends[r]]``.
- ``out``: array shaped like ``values``, written at every position of every row: the label
  (the token id, or ``ignore_index``) or, with ``write_mask``, 1/0. Positions outside rows are left alone.
- ``outcomes``: ``lossmask.Outcome`` codes; ``first_bad``: index into ``values`` of the row's first
  negative id, or -1. Kernels never raise on data; the caller turns these into errors.

Backends are imported lazily, by name, in this one place. The package ships as
``lossmask.engine.kernels`` (setup.py): the engine is the stage that calls it, and everything else
asks ``lossmask.engine.get_backend``.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from contextlib import contextmanager
from types import ModuleType


def _hand_over_to_the_kernels_package() -> None:
    """Put the ``kernels`` distribution in this module's place in ``sys.modules``.

    With a checkout's root on ``sys.path`` (``python -m pytest``, a REPL opened there), this folder is found
    first as the top-level package ``kernels``: the name of Hugging Face's kernel hub package, which
    transformers (5.25 and later) installs and imports whenever it is present. Shadowing it breaks every
    processor and trainer import, so the import is passed on to the first ``kernels`` found elsewhere on
    the path; the import statement then returns what ``sys.modules`` holds.
    """
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout]
    spec = PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels' (this checkout's kernels/ folder is lossmask's, imported "
                                  "as lossmask.engine.kernels)", name="kernels")
    module = module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_to_the_kernels_package()

# name -> (module inside lossmask.engine.kernels, pip extra that brings its dependency)
BACKENDS: dict[str, tuple[str, str | None]] = {
    "numba": ("numba_kernel", None),
    "numpy": ("reference", None),
    "torch": ("torch_kernel", "torch"),
    "mlx": ("mlx_kernel", "mlx"),
}

DEFAULT_BACKEND = "numba"


def get_backend(name: str | None) -> ModuleType:
    """The kernel module of a backend, importing it (and its library) on first use."""
    name = DEFAULT_BACKEND if name is None else name
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; pass one of {sorted(BACKENDS)} (or None for {DEFAULT_BACKEND!r})")
    module, extra = BACKENDS[name]
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        hint = f"pip install 'lossmask[{extra}]'" if extra else "pip install lossmask"
        raise ImportError(f"backend {name!r} needs {exc.name or 'a missing package'}: {hint}") from exc


_calling_thread = threading.local()


def serial_here() -> bool:
    """True inside ``one_thread()`` on this thread: a kernel loaded there runs its serial driver."""
    return getattr(_calling_thread, "serial", 0) > 0


@contextmanager
def one_thread():
    """Label on the calling thread alone, for a job whose other threads already keep every core busy.

    There, numba's thread pool waits on threads the OS has parked behind the tokeniser's: over the eight
    batches of a 20,000-chat job, labelling took a median 0.40 s with the pool and 0.26 s on one thread
    (most of what is left is waiting for the GIL; alone, the kernel takes 0.03 s). numba's thread count
    is per calling thread, so other threads keep theirs. numba is loaded only once something is labelled with it
    (``lossmask.engine.labels``, "Tiers"): until then a flag on this thread asks for the serial driver, and numba's
    thread count is set only where numba is loaded.
    """
    _calling_thread.serial = getattr(_calling_thread, "serial", 0) + 1
    numba = sys.modules.get("numba")
    before = numba.get_num_threads() if numba is not None else None
    if numba is not None:
        numba.set_num_threads(1)
    try:
        yield
    finally:
        _calling_thread.serial -= 1
        if numba is not None:
            numba.set_num_threads(before)
