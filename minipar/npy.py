"""numpy's ``.npy`` / ``.npz`` headers parsed by many threads at once: one lock for all of minipar.

numpy reads a header with ``ast.literal_eval``. In CPython 3.11 the AST constructor keeps its recursion
depth in state that every thread shares, so two threads parsing at once can fail with ``SystemError: AST
constructor recursion depth mismatch`` (python/cpython gh-106905): seen with four rank threads loading a
ZeRO checkpoint. The threads backend's ranks and the NVMe tier's I/O threads parse headers only under
``HEADER``; the data itself is read outside it where the reader allows.
"""

from __future__ import annotations

import threading

HEADER = threading.Lock()
