"""A doorbell per process: how a rank waiting for a message sleeps and still wakes when it arrives.

MPI moves data only inside MPI calls and MPICH's shared-memory transport has no blocking wait: a
rank blocked in ``MPI_Wait`` busy-polls. When the machine runs more ranks than cores, that takes the
core from the very rank it waits for, so minipar's waits sleep between tests (``watchdog.poll``); but
a sleeping rank notices its data only at its next timeout. The doorbell removes that delay: each rank
binds a datagram socket in Linux's abstract namespace, named after its launcher (the parent process
Hydra's proxy, shared by the ranks of one job on one machine) and its world rank; a sender rings the
receiver when it posts a message, a receiver rings the sender when a large message has been copied
(the sender's request completes only then), and a waiting rank sleeps in ``select`` on its socket
with the watchdog's paced timeout. A ring that nobody hears (a rank on another machine, a socket
that cannot be bound) is dropped silently: the wait then ends at its timeout, as without a doorbell,
so the watchdog's and the failure detector's guarantees are those of the plain sleep.

Rings never block (a full socket buffer already holds a pending ring) and cost one ``sendto`` each;
a wait drains every pending ring before it tests, so a ring between its test and its sleep wakes it.
"""

from __future__ import annotations

import os
import select
import socket
import threading

RENDEZVOUS = 8192  # bytes: MPICH (ch4) copies messages this large straight from the sender (CMA)


class Doorbell:
    """This process's socket; ``ring(world_rank)`` wakes that rank's ``wait``."""

    def __init__(self, world_rank: int, tag: str | None = None) -> None:
        self.tag = tag if tag is not None else f"minipar-{os.getppid()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(self.name(world_rank))
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()

    def name(self, world_rank: int) -> str:
        return f"\0{self.tag}-{world_rank}"

    def ring(self, world_rank: int) -> None:
        """Wake ``world_rank``'s wait (if it runs on this machine); never blocks, never raises."""
        try:
            self.sock.sendto(b"\1", self.name(world_rank))
        except OSError:
            pass

    def drain(self) -> None:
        try:
            while True:
                self.sock.recv(64)
        except OSError:
            pass

    def wait(self, timeout: float) -> None:
        """Sleep until a ring or ``timeout`` seconds, then drop the pending rings."""
        try:
            select.select([self.fd], [], [], timeout)
        except (OSError, ValueError):
            return
        self.drain()

    def close(self) -> None:
        self.sock.close()


_bell: Doorbell | None = None
_failed = False
_lock = threading.Lock()


def process_bell(world_rank: int) -> Doorbell | None:
    """The process's doorbell (made once), or None where abstract sockets are not available."""
    global _bell, _failed
    with _lock:
        if _bell is None and not _failed:
            try:
                _bell = Doorbell(world_rank)
            except (OSError, AttributeError):
                _failed = True
        return _bell
