"""``viz.ring`` reads Ring Attention's pass from a real trace: at ring step s, ring rank i holds K/V
block (i - s) mod P_r, sends it to the next rank of its ring, and computes the score blocks the causal
mask leaves, counted by hand below (contiguous: the whole block when (i - s) mod P_r <= i, else
nothing; zigzag: 3 pieces at step 0 (chunk i with itself, chunk 2P-1-i with chunks i and itself),
2 at every other step). The figure draws one cell per (rank, step) and one arrow per message."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import trace
from minipar.comm import Communicator, launch
from minipar.cost.presets import CLUSTERS
from minipar.parallel.sequence import SequenceParallelGPT
from viz.report import figures_for, render
from viz.ring import (
    compute_time,
    exposed_wait,
    is_ring,
    overlap_summary,
    ring_figure,
    ring_size,
    ring_steps,
    score_spans,
    step_table,
)

VOCAB, SEQ, D, HEADS = 16, 24, 8, 2


def traced_step(comm: Communicator, method: str, zigzag: bool, path: str) -> None:
    model = SequenceParallelGPT(VOCAB, SEQ, D, HEADS, 2, comm, method=method, zigzag=zigzag,
                                ulysses=2 if method == "hybrid" else None)
    tokens = np.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    with trace.record(path, comm):
        model.loss(model.shard(tokens), model.shard(np.roll(tokens, -1, axis=1))).backward()


def expected_spans(i: int, s: int, p: int, zigzag: bool) -> int:
    if zigzag:
        return 3 if s == 0 else 2
    return 1 if (i - s) % p <= i else 0


@pytest.mark.parametrize("method,p,zigzag", [("ring", 2, False), ("ring", 3, False), ("ring", 4, True),
                                             ("ring", 3, True), ("hybrid", 4, True)])
def test_ring_steps_follow_the_ring(tmp_path, method: str, p: int, zigzag: bool) -> None:
    path = str(tmp_path / "t.json")
    launch(traced_step, p, "threads", method=method, zigzag=zigzag, path=path)
    t = trace.load(path)
    u = 2 if method == "hybrid" else 1  # Ulysses degree: ring index of rank r is r // u
    pr = p // u
    assert is_ring(t) and ring_size(t) == pr
    for index in (0, 1):  # both layers' forward passes
        steps = ring_steps(t, index)
        assert sorted(steps) == list(range(p))
        for r, row in steps.items():
            i = r // u
            assert [st.block for st in row] == [(i - s) % pr for s in range(pr)]
            assert [st.outgoing.dst for st in row[:-1]] == [((i + 1) % pr) * u + r % u] * (pr - 1)
            assert [st.incoming.src for st in row[:-1]] == [((i - 1) % pr) * u + r % u] * (pr - 1)
            assert row[-1].incoming is None and row[-1].outgoing is None
            assert [len(st.spans) for st in row] == [expected_spans(i, s, pr, zigzag) for s in range(pr)]
            assert exposed_wait(row[-1]) is None and all(exposed_wait(st) >= 0 for st in row[:-1])
            assert [compute_time(st) for st in row] == [sum(e.t1 - e.t0 for e in st.spans) for st in row]
    with pytest.raises(ValueError, match="no pass 4"):
        ring_steps(t, 4)  # 2 forward + 2 backward passes
    table = step_table(t)
    assert len(table.columns) == 1 + pr and table.row_count == p
    for r in range(p):  # every score block of both layers' forward passes, and no other span
        assert len(score_spans(t, r)) == sum(len(st.spans) for i in (0, 1) for st in ring_steps(t, i)[r])
    n = max(e.nbytes for e in t.events if e.op == "ring_kv")
    link = CLUSTERS["a100-selene"].intra
    text = overlap_summary(t, link.seconds, "a100-selene", "wall clock")
    assert text.startswith(f"A K/V block ({n:,} B) crosses a a100-selene link in alpha + n beta = "
                           f"{link.seconds(n) * 1e6:.0f} us") and "; wall clock, no rank waited more than" in text
    fig = ring_figure(t)
    assert len(fig.layout.shapes) == p * pr  # one cell per (rank, step)
    assert len([a for a in fig.layout.annotations if a.showarrow]) == p * (pr - 1)  # one arrow per message
    assert "ring" in [kind for kind, _, _ in figures_for(t, "t")]


def test_no_ring_no_ring_figure(tmp_path) -> None:
    path = str(tmp_path / "u.json")
    launch(traced_step, 2, "threads", method="ulysses", zigzag=False, path=path)
    t = trace.load(path)
    assert not is_ring(t) and "ring" not in [kind for kind, _, _ in figures_for(t, "u")]


def test_the_report_draws_the_first_ring_on_top(tmp_path) -> None:
    paths = []
    for name, method in (("u", "ulysses"), ("r", "ring"), ("z", "ring")):
        paths.append(str(tmp_path / f"{name}.json"))
        launch(traced_step, 2, "threads", method=method, zigzag=name == "z", path=paths[-1])
    page = render([trace.load(p) for p in paths], ["U", "R", "Z"])
    assert page.count('id="fig-ring"') == 1 and page.count('id="fig-2-ring"') == 1  # Z's in its section
    assert "fig-1-ring" not in page  # R's is the one on top
    assert page.index('id="fig-ring"') < page.index('id="fig-compare"') < page.index('id="fig-2-ring"')
