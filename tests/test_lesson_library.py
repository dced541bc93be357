"""What lessons 9 and 10 moved into the library (issue 28, item 7): a Megatron block's parameters per
rank (``cost.tensor.block_parameters``), ``viz.width.Table.of``, the delays and waits
``viz.faults`` reads from a trace that lost a rank, ``elastic.threads_launcher`` (the elastic loop
on threads) and ``startup.outside_mpiexec_env`` (lesson 10 starting its own mpiexec from a rank)."""

from __future__ import annotations

import io

from rich.console import Console

from minipar import elastic, nn
from minipar.comm import faults, startup
from minipar.cost.tensor import block_parameters
from minipar.trace import Event, Trace
from viz import faults as vf
from viz.width import Table


def test_a_megatron_block_holds_its_split_parameters_and_the_whole_rest() -> None:
    whole = sum(p.data.size for p in nn.Block(16, 8, 32).init_parameters(0, "b.").parameters())
    assert block_parameters(1, 16, 32) == whole == 2224
    # by hand, t = 8: layer norms 64 whole; q, k, v 3 x (32 + 2); proj 32 + its bias 16; fc 64 + 4; proj 64 + 16
    assert block_parameters(8, 16, 32) == 64 + 3 * 34 + 48 + 68 + 80 == 362


def test_table_of_lays_text_left_and_numbers_right() -> None:
    table = Table.of("title", ("name", "kind", "bytes"), [("a", "x", "1"), ("bb", "yy", "100")], text=2)
    assert [c.justify for c in table.columns] == ["left", "left", "right"]
    buf = io.StringIO()
    Console(file=buf, width=40, color_system=None).print(table)
    assert "│ bb   │ yy   │   100 │" in buf.getvalue() and "│ a    │ x    │     1 │" in buf.getvalue()


def _ps_trace() -> Trace:
    """Worker 2 killed at 0.65 s; the server (0) declares it dead at 1.2 and drops it at 1.3; worker 1's
    forward passes at 0-0.1, 0.5-0.6 (step 1) and 1.4-1.5 (step 2)."""
    ev = [Event(1, "compute", "F", t, t + 0.1, step=s) for s, t in enumerate((0.0, 0.5, 1.4))]
    ev += [Event(2, "mark", "killed", 0.65, 0.65), Event(0, "mark", "peer declared dead", 1.2, 1.2,
                                                            args={"dead": 2, "deadline": 0.5}),
           Event(0, "mark", "peer declared dead", 1.25, 1.25, args={"dead": 2}),
           Event(0, "mark", "worker dropped", 1.3, 1.3, args={"worker": 2})]
    return Trace({"world_size": 3, "lost_ranks": [2]}, ev)


def test_delays_after_the_kill_and_the_longest_wait() -> None:
    t = _ps_trace()
    (rank, (delay, args)), = vf.after_kill(t, "peer declared dead").items()
    assert rank == 0 and abs(delay - 0.55) < 1e-12 and args == {"dead": 2, "deadline": 0.5}  # the first mark
    assert abs(vf.after_kill(t, "worker dropped")[0][0] - 0.65) < 1e-12
    wait, step = vf.longest_wait(t, 1)
    assert abs(wait - 0.8) < 1e-12 and step == 2
    assert vf.longest_wait(t, 2) == (0.0, None)


def _job(comm, info: elastic.Restart, seen: list) -> dict:
    """Run 0 loses rank 1 at once; a later run succeeds. Returns the world size and the restart count."""
    if info.count == 0 and comm.rank == 1:
        faults.kill(comm)
    seen.append((info.count, comm.size, comm.rank))
    return {"status": 0, "run": info.count, "size": comm.size}


def test_the_elastic_loop_on_threads_restarts_without_the_killed_rank() -> None:
    results: list[dict] = []
    seen: list[tuple[int, int, int]] = []
    status, runs = elastic.elastic_loop(3, elastic.threads_launcher(_job, results, deadline=0.3, seen=seen),
                                        max_restarts=1, log=lambda line: None)
    assert status == 0 and [r.ranks for r in runs] == [3, 2]
    assert runs[0].statuses == {0: 0, 1: 137, 2: 0} and runs[0].lost == [1] and runs[1].ok
    assert results == [{"status": 0, "run": 0, "size": 3}, {"status": 0, "run": 1, "size": 2}]
    assert sorted(seen) == [(0, 3, 0), (0, 3, 2), (1, 2, 0), (1, 2, 1)]


def test_outside_mpiexec_env_drops_the_enclosing_jobs_variables_only() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "4", "PMIX_RANK": "0", "HYDI_CONTROL_FD": "7", "HYDRA_PROXY": "x",
           "PATH": "/bin", "MINIPAR_PEER_DEADLINE": "2"}
    assert startup.outside_mpiexec_env(env) == {"PATH": "/bin", "MINIPAR_PEER_DEADLINE": "2"}
