"""Memory tiers: a budgeted device, host (CPU) memory and NVMe files, and every move between them.

minipar has no accelerator, so the device is modelled, strictly: a pool with a byte budget. Placing
an array there (``to_device``, ``adopt``, ``empty``) charges its bytes under a name; going past the
budget raises ``DeviceOutOfMemory`` before anything is copied, naming the budget, what is resident
and the smallest budget that would have worked. Compute may only touch device-resident arrays, and
``require_device`` enforces it: the pool keeps the ids of its arrays (a view of one counts).
``cpu`` is ordinary numpy memory. ``nvme`` is real files, one preallocated, page-aligned ``.npy`` per
name under a directory, read and written with ``O_DIRECT`` where the filesystem allows, by a thread
pool with several requests in flight so that disk reads and writes overlap compute (ZeRO-Infinity's
prefetch and write-back, DeepNVMe; Rajbhandari et al. 2021, Sec. 6); a write is atomic (a new file,
flushed, renamed into place: a crash mid-write leaves the previous file; ``Tiers(..., reopen=True)``
opens the files a killed process left) unless ``in_place``, for state a later atomic write commits.

Every move is a copy, recorded in the trace (when one is recording) as a ``transfer`` event: the
tensor's name, ``nbytes``, measured ``t0``/``t1`` and ``args = {"src", "dst", "modelled_s"}`` with
the time of the ``Bandwidth`` model (``minipar.cost.offload.transfer_seconds``: latency + bytes /
bandwidth, typical figures or measured by ``minipar.tiers.rates.measure``) beside it. Each
allocation or release on the device samples ``memory("device", bytes resident)``; each NVMe write
or delete samples ``memory("nvme", bytes in files)`` (array bytes; the ``.npy`` header page and the padding
are not counted).

Modules: ``core.py`` (``Tiers``, ``DeviceOutOfMemory``, ``Bandwidth``), ``nvme.py`` (the thread pool,
atomic and in-place writes, sync, cleanup), ``files.py`` (file names, the page-aligned layout,
``O_DIRECT``), ``rates.py`` (the disk's and the copies' rates measured; imported on demand).
"""

from minipar.tiers.core import Bandwidth, DeviceOutOfMemory, NotOnDevice, Tiers
from minipar.tiers.nvme import NvmeFiles

__all__ = ["Bandwidth", "DeviceOutOfMemory", "NotOnDevice", "NvmeFiles", "Tiers"]
