"""The failure detector: a rank not heard from within ``deadline`` seconds is declared dead, and any
wait it could end raises ``PeerLost`` naming it, long before the watchdog's generic ``CommTimeout``.

Design (a heartbeat detector, Chandra & Toueg, "Unreliable failure detectors for reliable
distributed systems", JACM 1996; all-to-all like Hadoop's and etcd's, not gossip like SWIM, Das et
al. 2002, which scales to thousands of ranks but is needless at minipar's handful):

- Every rank runs one daemon thread that sends a 1-word heartbeat to every peer each ``period``
  (``deadline / 5``) on a duplicate of the world communicator (its own message space: heartbeats
  never match the program's receives) and drains the heartbeats it received. A peer unheard for
  ``deadline`` is declared dead (``dead[rank] = (time, silence)``), by this rank alone: every rank
  watches every other, so each survivor detects a death within ``deadline + period`` of it, with
  no second round of messages.
- Why a thread and not a ping answered inside waits: a rank busy computing for longer than the
  deadline enters no wait and could not answer, and would be declared dead; its heartbeat thread
  keeps beating (numpy releases the GIL; Python switches threads every 5 ms). So the detector tells
  a dead *process* from a slow one, with one exception: a single C call that holds the GIL for
  longer than the deadline (``sum(range(2 * 10**8))``, a long pure-C loop without releasing)
  starves the thread and gets its rank declared dead. A live process that never enters an
  operation (a program bug) is still the watchdog's ``CommTimeout``.
- Cost with no fault: the thread wakes once per ``period`` (``deadline / 5``, at most once a second)
  and sends ``p - 1`` 8-byte
  messages (one outstanding per peer at most: a dead peer's queue never fills up); a wait tests one
  dict for emptiness per poll. Nothing on a message's path changes.
- Too short a deadline declares live ranks dead: a heartbeat late by more than the deadline (a
  loaded machine: measured with 0.05 s and two busy cores) looks like a death. Keep it well above
  the scheduling jitter (>= 0.5 s; the tests use 1 s). A peer not heard yet at all (still starting
  its thread) gets twice the deadline; the clocks start when the heartbeat's communicator exists
  (every rank has called ``world()``), so a rank slow to start is not silent.
- A rank that ends normally says goodbye (``stop``, from ``atexit``): its peers mark it as *left*,
  never dead, so ranks finishing at different times raise nothing. It then waits until every peer
  has left or died before ``MPI_Finalize`` (which waits for ever for a rank that died; with one dead,
  the rank exits without it): the last rank to finish decides when all exit.

Policy (``RankState.fail_fast``): synchronous training cannot go on without any rank, so by default
a wait raises ``PeerLost`` as soon as any world rank is dead (a survivor blocked on a survivor that
itself waits for the dead rank does not wait a second deadline); code that tolerates losses (the
parameter server's servers and workers) sets ``fail_fast = False``: then only a wait for the dead
rank itself raises.

Deadline: the ``deadline=`` argument of ``launch``/``world``, else ``MINIPAR_PEER_DEADLINE``
(seconds, or ``off`` for no detector), else the smaller of 10 s and half the watchdog timeout. The
threads backend has the same detector with a shared table instead of messages: ``faults.kill``
stops a rank's heartbeats.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from minipar import trace
from minipar.comm.errors import PeerLost

DEFAULT_DEADLINE = 10.0
BEAT, BYE = 1, 2  # heartbeat message kinds


def heartbeat_period(deadline: float) -> float:
    """Seconds between a rank's heartbeats for ``deadline``: a fifth of it, 10 ms to 1 s."""
    return min(1.0, max(0.01, deadline / 5))


def detection_window(deadline: float) -> tuple[float, float]:
    """Seconds from a peer's death to a survivor declaring it dead: the ``deadline`` of silence, give or
    take a heartbeat period (its last heartbeat left up to a period before it died; the survivor looks
    once a period)."""
    beat = heartbeat_period(deadline)
    return deadline - beat, deadline + beat


def wait_heard(comm: Any, limit: float = 5.0) -> None:
    """``Detector.wait_heard`` of ``comm``'s detector (every peer heard once, so that a detection measured
    after it is the steady state's); at once when ``comm`` has none (no deadline)."""
    if comm.state.detector is not None:
        comm.state.detector.wait_heard(limit)


def default_deadline(timeout: float, deadline: float | None = None) -> float | None:
    """Resolve the detection deadline: argument, then ``MINIPAR_PEER_DEADLINE``, then
    ``min(10, timeout / 2)``; it must be below the watchdog ``timeout``: an argument that is not is
    refused, the environment's is lowered to ``timeout / 2`` (one exported value serves launches with
    short timeouts too). None when the variable is ``off`` (no detector: a dead peer is a
    ``CommTimeout`` after ``timeout``)."""
    if deadline is None:
        raw = os.environ.get("MINIPAR_PEER_DEADLINE", "")
        if raw.strip().lower() == "off":
            return None
        try:
            deadline = float(raw) if raw else min(DEFAULT_DEADLINE, timeout / 2)
        except ValueError:
            raise ValueError(f"MINIPAR_PEER_DEADLINE={raw!r} is not a number of seconds (or off)") from None
        if deadline >= timeout:
            deadline = timeout / 2
    deadline = float(deadline)
    if not 0 < deadline < timeout:
        raise ValueError(f"the peer deadline must be > 0 and below the communication timeout ({timeout} s), "
                         f"got {deadline}; a wait would time out before a dead peer is detected")
    return deadline


class Detector:
    """One rank's view of its peers (world ranks): when each was last heard, who is dead or left.

    The transport (MPI messages, or the threads backend's shared table) calls ``heard`` and
    ``check``; waits call ``raise_if_lost``. ``dead`` is empty until a fault, so a wait's check is
    one emptiness test.
    """

    def __init__(self, world_rank: int, peers: Iterable[int], deadline: float) -> None:
        self.world_rank = world_rank
        self.deadline = deadline
        self.last = dict.fromkeys(peers, time.monotonic())
        self.met: set[int] = set()  # peers heard at least once; the others may still be starting: 2x deadline
        self.dead: dict[int, tuple[float, float, float]] = {}  # rank -> (monotonic, perf_counter, silence)
        self.left: set[int] = set()
        self.lock = threading.Lock()
        self.on_death: Callable[[], None] = lambda: None  # wake waits (threads backend)
        self._marked: dict[int, set[int]] = {}  # id(recorder) -> ranks marked in that trace

    def restart(self) -> None:
        """Every peer heard now: the transport is up (peers that started late were not silent)."""
        with self.lock:
            now = time.monotonic()
            self.last = dict.fromkeys(self.last, now)

    @property
    def period(self) -> float:
        """Seconds between heartbeats (``heartbeat_period``)."""
        return heartbeat_period(self.deadline)

    def wait_heard(self, limit: float = 5.0) -> bool:
        """Wait (at most ``limit`` s) until every peer has been heard once: a peer never heard gets twice
        the deadline (it may still be starting), so a detection measured after this is the steady state's.
        Whether every peer was heard."""
        end = time.monotonic() + limit
        while len(self.met) < len(self.last) and time.monotonic() < end:
            time.sleep(0.01)
        return len(self.met) >= len(self.last)

    def heard(self, peer: int, when: float | None = None) -> None:
        when = time.monotonic() if when is None else when
        if peer in self.last and when > self.last[peer]:
            self.last[peer] = when
            self.met.add(peer)

    def bye(self, peer: int) -> None:
        self.left.add(peer)

    def check(self, now: float | None = None) -> list[int]:
        """Declare dead the peers unheard for longer than the deadline; returns the new ones."""
        now = time.monotonic() if now is None else now
        new = []
        with self.lock:
            for peer, t in self.last.items():
                limit = self.deadline if peer in self.met else 2 * self.deadline
                if peer not in self.dead and peer not in self.left and now - t > limit:
                    self.dead[peer] = (now, trace.now(), now - t)
                    new.append(peer)
        if new:
            self.on_death()
        return new

    def first_dead(self, peers: Iterable[int] | None = None) -> int | None:
        """The earliest declared dead rank (among ``peers`` if given), or None."""
        dead = self.dead
        if not dead:
            return None
        cands = list(dead) if peers is None else [p for p in set(peers) if p in dead]
        return min(cands, key=lambda p: dead[p][0]) if cands else None

    def mark(self) -> None:
        """Add a "peer declared dead" mark per declaration to this thread's trace (once each)."""
        rec = trace.current()
        if rec is None:
            return
        done = self._marked.setdefault(id(rec), set())
        for peer, (_, t, silence) in sorted(self.dead.items()):
            if peer not in done:
                done.add(peer)
                rec.add("mark", "peer declared dead", t, t,
                        args={"dead": peer, "by": self.world_rank, "silence": round(silence, 3),
                              "deadline": self.deadline})

    def raise_if_lost(self, what: str, peers: Iterable[int], fail_fast: bool) -> None:
        """``PeerLost`` if a rank this wait depends on is dead (any dead rank when ``fail_fast``)."""
        if not self.dead:
            return
        dead = self.first_dead(None if fail_fast else list(peers))
        if dead is None:
            return
        self.mark()
        _, _, silence = self.dead[dead]
        err = PeerLost(f"rank {self.world_rank}: {what}: rank {dead} (world) is dead: no heartbeat for "
                       f"{silence:.2f} s (peer deadline {self.deadline} s, MINIPAR_PEER_DEADLINE); "
                       f"declared by rank {self.world_rank}")
        err.rank, err.operation, err.declared_by, err.silence = dead, what, self.world_rank, silence
        raise err


class MpiHeartbeat:
    """The MPI transport of a ``Detector``: a daemon thread beating on its own duplicate communicator."""

    def __init__(self, mpicomm: Any, detector: Detector, wait: Callable[[Callable[[], bool]], None],
                 note: Callable[[list[int]], None] = lambda dead: None) -> None:
        import numpy as np
        from mpi4py import MPI

        self.MPI, self.np = MPI, np
        self.comm, req = mpicomm.Idup()  # collective: every rank builds its heartbeat at world() time;
        wait(req.Test)  # waited under the watchdog (a rank dead before it joins: CommTimeout, not a hang)
        detector.restart()  # the clocks start once every peer is here (a late peer is not silent)
        self.detector, self.note = detector, note  # note: tell the launcher whom this rank declared dead
        self.peers = [r for r in range(self.comm.Get_size()) if r != self.comm.Get_rank()]
        self.beat, self.bye = np.array([BEAT], dtype=np.int64), np.array([BYE], dtype=np.int64)
        self.sends: dict[int, Any] = {}
        self.bye_sent: set[int] = set()
        self.inbox = np.zeros(1, dtype=np.int64)
        self.status = MPI.Status()
        self.recv = self.comm.Irecv([self.inbox, MPI.INT64_T], MPI.ANY_SOURCE, 0)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="minipar-heartbeat", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while self.recv.Test(self.status):
            src = self.status.Get_source()
            if int(self.inbox[0]) == BYE:
                self.detector.bye(src)
            else:
                self.detector.heard(src)
            self.recv = self.comm.Irecv([self.inbox, self.MPI.INT64_T], self.MPI.ANY_SOURCE, 0)

    def _send(self, kind: int) -> None:
        msg = self.beat if kind == BEAT else self.bye
        for p in self.peers:
            req = self.sends.get(p)
            if p in self.detector.dead or p in self.bye_sent or (req is not None and not req.Test()):
                continue  # at most one message in flight per peer (a dead peer's queue fills up)
            self.sends[p] = self.comm.Isend([msg, self.MPI.INT64_T], p, 0)
            if kind == BYE:
                self.bye_sent.add(p)

    def _settled(self) -> bool:
        """Leaving: every peer has had our goodbye and has left or died (MPI_Finalize with a peer that
        dies meanwhile would wait for it for ever; one already dead is ``_at_exit``'s ``os._exit``)."""
        det = self.detector
        return all(p in det.dead or (p in self.bye_sent and p in det.left) for p in self.peers)

    def _loop(self) -> None:
        try:
            while True:  # the first heartbeat at once: a peer killed right after start-up is met already
                leaving = self.stopping.is_set()
                self._send(BYE if leaving else BEAT)
                self._drain()
                dead = self.detector.check()
                if dead:
                    self.note(dead)
                if leaving and self._settled():
                    return
                if leaving:
                    time.sleep(self.detector.period / 4)
                else:
                    self.stopping.wait(self.detector.period)
        except Exception as err:  # noqa: BLE001 -- the MPI library is going away under us: stop beating
            if not self.stopping.is_set():  # mid-run: peers will declare this rank dead; say why
                sys.stderr.write(f"[minipar] rank {self.detector.world_rank}: heartbeat stopped: {err!r}\n")
            return

    def stop(self) -> None:
        """Leave: say goodbye to the peers (they will not declare this rank dead), and wait until each
        peer has left or died (as long as ``MPI_Finalize`` would wait for a live one); then end the
        thread, which must not call MPI once ``MPI_Finalize`` runs."""
        self.stopping.set()
        self.thread.join()
        try:
            end = time.monotonic() + 0.2
            live = [r for p, r in self.sends.items() if p not in self.detector.dead]
            while not all(r.Test() for r in live) and time.monotonic() < end:
                time.sleep(1e-3)
            self.recv.Cancel()
            self.recv.Wait()
        except Exception:  # noqa: BLE001 -- best effort at exit
            pass


class TableHeartbeat:
    """The threads backend's transport: one daemon thread per ``World`` writes every beating rank's
    time into a shared table and lets each rank's ``Detector`` read it. ``silence(rank)`` stops a
    rank's heartbeats (``faults.kill`` on threads)."""

    def __init__(self, detectors: list[Detector]) -> None:
        self.detectors = detectors
        self.silenced: set[int] = set()
        self.stopping = threading.Event()
        period = detectors[0].period if detectors else 1.0
        self.thread = threading.Thread(target=self._loop, args=(period,), name="minipar-heartbeat", daemon=True)
        self.thread.start()

    def _loop(self, period: float) -> None:
        while not self.stopping.wait(period):
            now = time.monotonic()
            for det in self.detectors:
                if det.world_rank in self.silenced:
                    continue
                for r in range(len(self.detectors)):
                    if r not in self.silenced:
                        det.heard(r, now)
                det.check(now)

    def silence(self, rank: int) -> None:
        self.silenced.add(rank)

    def stop(self) -> None:
        self.stopping.set()
