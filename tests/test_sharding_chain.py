"""Whole-chain propagation (``minipar.sharding.chain``): the dynamic program's plan costs the least.

Exhaustive search, written here: every sequence of strategies ``propagate.strategies`` offers each op
from where the previous one left the running tensor, costed as the sum of the ops' bytes; the
dynamic program's total equals its least for drawn chains of 2 to 4 ops (matmul by a weight, add of
a bias or a tensor, mul, gelu, scale, softmax; every tensor's placements drawn from S(0), S(1), B, P
per axis) on 1-D meshes of 2, 3 and 4 ranks and on a 2 x 2 mesh; it never exceeds the greedy
chooser's, and is the greedy's plan whenever that one is cheapest. Run (threads, and drawn chains
under mpiexec): the output of the plan, of the greedy plan and of the plain ops equals numpy's; the
bytes every rank sends (trace) equal ``chain.sent``'s for the plan, and the plain ops send what the
greedy plan says. The issue's case by hand: ``X[S(1)] @ W[B]`` then gelu, 16,384 B against 1,024 B.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_sharding_propagate import make

from minipar import trace
from minipar.comm import launch
from minipar.functional import _gelu
from minipar.mesh import DeviceMesh, MeshShape
from minipar.sharding import GlobalTensor, Partial, Replicate, Shard, chain, propagate, redistribute
from minipar.sharding.plan import cheapest, plan_bytes
from minipar.sharding.tensor import check_layout
from minipar.testing import run_each

S0, S1, B, P = Shard(0), Shard(1), Replicate(), Partial()
MESHES = {"2": ({"tp": 2}, ("tp",)), "3": ({"tp": 3}, ("tp",)), "4": ({"tp": 4}, ("tp",)),
          "2x2": ({"dp": 2, "tp": 2}, ("dp", "tp"))}
NAMES = ("matmul", "add", "mul", "gelu", "scale", "softmax")
ISSUE = {"mesh": "2", "x": ((32, 16), (S1,)), "ops": [("matmul", ((16, 128), (B,))), ("gelu", None)], "final": None,
         "seed": 0}


# ---- chains as plain data (picklable for mpiexec): {"mesh", "x": (shape, placements), "ops": [(name, other)]}
def legal(shape: tuple, case: str, placements: tuple) -> bool:
    _, axes = MESHES[case]
    try:
        check_layout(shape, axes, placements)
    except ValueError:
        return False
    return True


@st.composite
def chains(draw: st.DrawFn, case: str | None = None) -> dict:
    case = case or draw(st.sampled_from(sorted(MESHES)))
    kw, axes = MESHES[case]
    q = int(np.prod(list(kw.values())))
    side = st.sampled_from([q, 2 * q])

    def placed(shape: tuple) -> tuple:
        each = [Shard(d) for d in range(len(shape))] + [B, P]
        return draw(st.sampled_from([p for p in itertools.product(each, repeat=len(axes)) if legal(shape, case, p)]))

    shape = (draw(side), draw(side))
    x, ops = (shape, placed(shape)), []
    for name in draw(st.lists(st.sampled_from(NAMES), min_size=2, max_size=4)):
        other = None
        if name == "matmul":
            w = (shape[1], draw(side))
            other, shape = (w, placed(w)), (shape[0], w[1])
        elif name in ("add", "mul"):
            o = draw(st.sampled_from([shape, shape[1:]]))
            other = (o, placed(o))
        ops.append((name, other))
    final = draw(st.none() | st.just(shape).map(placed))
    return {"mesh": case, "x": x, "ops": ops, "final": final, "seed": draw(st.integers(0, 10 ** 6))}


def rich(case: str) -> dict:
    """A chain of four kinds of op on mesh ``case``, from partial sums: a must-run example."""
    kw, axes = MESHES[case]
    q, n = int(np.prod(list(kw.values()))), len(axes)
    return {"mesh": case, "x": ((2 * q, q), (P,) * n), "ops": [
        ("matmul", ((q, 2 * q), (S1,) * n)), ("add", ((2 * q,), (S0,) * n)), ("gelu", None),
        ("mul", ((2 * q, 2 * q), (B,) * n)), ("softmax", None)][:4 if n > 1 else 5], "final": (B,) * n, "seed": 7}


def specs(c: dict) -> tuple[chain.Spec, list[chain.Link]]:
    """The chain's layouts alone, to plan in this process."""
    kw, axes = MESHES[c["mesh"]]
    mesh = chain.Abstract(MeshShape(**kw))
    x = chain.Spec(c["x"][0], mesh, axes, c["x"][1])
    return x, [link(name, chain.Spec(o[0], mesh, axes, o[1]) if o else None) for name, o in c["ops"]]


def link(name: str, other) -> chain.Link:
    return chain.Link(name, (other,) if other is not None else (), 0.5 if name == "scale" else -1)


def values(c: dict) -> list[np.ndarray]:
    rng = np.random.default_rng(c["seed"])
    return [rng.normal(size=c["x"][0])] + [rng.normal(size=o[0]) for _, o in c["ops"] if o]


def reference(c: dict) -> np.ndarray:
    vals = values(c)
    y, rest = vals[0], iter(vals[1:])
    for name, _ in c["ops"]:
        if name == "matmul":
            y = y @ next(rest)
        elif name in ("add", "mul"):
            y = y + next(rest) if name == "add" else y * next(rest)
        elif name == "softmax":
            e = np.exp(y - y.max(axis=-1, keepdims=True))
            y = e / e.sum(axis=-1, keepdims=True)
        else:
            y = _gelu(y) if name == "gelu" else 0.5 * y
    return y


# ---- exhaustive search ----------------------------------------------------------------------------------------
def exhaustive(x: chain.Spec, links: list[chain.Link], final: tuple | None) -> tuple[int, int]:
    """The least total bytes over every sequence of strategies (then the output moved to ``final``, by
    the cheapest redistribution, its busiest rank's bytes), and how many sequences there are."""
    shapes = [x.shape]
    for lk in links:
        shapes.append(lk.out_shape(shapes[-1]))
    memo: dict = {}

    def walk(i: int, placements: tuple, spent: int) -> tuple[int, int]:
        if i == len(links):
            if final is not None and placements not in memo:
                here = x.placed(shapes[i], placements)
                moves = cheapest(here.shape, 8, here.degrees, placements, final)[0]
                memo[placements] = max(plan_bytes(here.shape, 8, here.degrees, placements, moves))
            return spent + (0 if final is None else memo[placements]), 1
        if (i, placements) not in memo:
            here = x.placed(shapes[i], placements)
            memo[i, placements] = propagate.strategies([here, *links[i].others], shapes[i + 1],
                                                       links[i].rules(here, shapes[i + 1]))
        found = [walk(i + 1, placed, spent + n) for _, placed, n in memo[i, placements]]
        return min(f[0] for f in found), sum(f[1] for f in found)

    return walk(0, x.placements, 0)


@budget(20)
@given(c=chains())
@example(c=ISSUE)
@example(c=rich("3"))
def test_the_plan_costs_the_least_of_every_sequence(c: dict) -> None:
    x, links = specs(c)
    best, count = exhaustive(x, links, c["final"])
    found, first = chain.plan(x, links, c["final"]), chain.greedy(x, links, c["final"])
    assert count >= 1 and found.total == best <= first.total, (c, found, first)
    if first.total == best:
        assert found == first  # the greedy's choices whenever they are among the cheapest
    assert max(chain.sent(x, links, found)) <= found.total  # the busiest rank per op, summed over the ops


def test_the_issue_case_16384_against_1024_bytes() -> None:
    """On 2 ranks: the greedy leaves C partial and reduce-scatters it for gelu (half of C's 32,768 B);
    the plan moves X to rows (an all-to-all of half of its 2,048 B piece) and nothing after."""
    x, links = specs(ISSUE)
    first, found = chain.greedy(x, links), chain.plan(x, links)
    steps = [[(c.needed, c.placed, c.cost) for c in p.choices] for p in (first, found)]
    assert steps[0] == [(((S1,), (S0,)), (P,), 0), (((S0,),), (S0,), 16384)]  # slice W, C partial; reduce-scatter C
    assert steps[1] == [(((S0,), (B,)), (S0,), 1024), (((S0,),), (S0,), 0)]  # all-to-all X; C rows; gelu free
    res = launch(run_chain, 2, "threads", ISSUE)
    assert [r["sent"] for r in res] == [{"plan": 1024, "greedy": 16384, "ops": 16384}] * 2


def megatron_mlp(x: tuple, final: tuple) -> dict:
    """The tiny GPT's MLP on 4 ranks with Megatron's weights: fc by columns (its bias too), proj by rows."""
    return {"mesh": "4", "x": ((8, 16), x), "ops": [("matmul", ((16, 32), (S1,))), ("add", ((32,), (S0,))),
            ("gelu", None), ("matmul", ((32, 16), (S0,))), ("add", ((16,), (B,)))], "final": final, "seed": 3}


@pytest.mark.parametrize("x,final,moves", [((B,), (B,), [0, 0, 0, 0, 0, 1536]), ((S0,), (S0,), [768, 0, 0, 0, 0, 768])])
def test_megatrons_mlp_is_the_plan_and_the_greedy_choice(x: tuple, final: tuple, moves: list[int]) -> None:
    """x (8, 16) float64, N = 1,024 B, t = 4: whole in and out, nothing inside the chain, then Megatron's
    all-reduce of the output, 2 (t-1)/t N = 1,536 B; split by rows (sequence parallel, Korthikanti et
    al. 2022) an all-gather of x before fc and a reduce-scatter after, (t-1)/t N = 768 B each."""
    c = megatron_mlp(x, final)
    xs, links = specs(c)
    found = chain.plan(xs, links, final)
    assert found == chain.greedy(xs, links, final)
    assert [ch.cost for ch in found.choices] + [found.final_cost] == moves
    check(c, launch(run_chain, 4, "threads", c))


# ---- run ------------------------------------------------------------------------------------------------------
def run_chain(comm, c: dict) -> dict:
    """The chain on global tensors three ways: the plan, the greedy plan, the plain ops; each one's
    output (whole) and the bytes this rank sends."""
    kw, axes = MESHES[c["mesh"]]
    mesh = DeviceMesh(comm, **kw)
    vals = values(c)
    x = make(vals[0], mesh, axes, c["x"][1], c["seed"])
    rest = iter(vals[1:])
    links = [link(name, make(next(rest), mesh, axes, o[1], c["seed"] + i) if o else None)
             for i, (name, o) in enumerate(c["ops"])]
    out: dict = {"coords": tuple(mesh.coords[a] for a in axes), "sent": {}, "y": {}, "placements": {}}
    plans = {"plan": chain.plan(x, links, c["final"]), "greedy": chain.greedy(x, links, c["final"])}
    for how in ("plan", "greedy", "ops"):
        with trace.recording(comm.world_rank) as rec:
            y = chain.run(x, links, plans[how]) if how in plans else plain(x, links, c["final"])
        out["sent"][how] = sum(e.nbytes for e in rec.events if e.kind == "comm" and e.src == mesh.rank)
        out["y"][how], out["placements"][how] = y.to_global(), y.placements
    out["predicted"] = {how: chain.sent(x, links, p) for how, p in plans.items()}
    return out


def plain(x: GlobalTensor, links: list[chain.Link], final: tuple | None) -> GlobalTensor:
    """The ops called one after another, each choosing for itself; then the output moved to ``final``."""
    for lk in links:
        x = lk.apply(x, *lk.others)
    return x if final is None else redistribute(x, final)


def check(c: dict, results: list[dict]) -> None:
    kw, axes = MESHES[c["mesh"]]
    grid = list(itertools.product(*[range(kw[a]) for a in axes]))
    want = reference(c)
    for r in results:
        for how in ("plan", "greedy", "ops"):
            assert np.allclose(r["y"][how], want, rtol=1e-9, atol=1e-9), (c, how)
            assert c["final"] is None or r["placements"][how] == c["final"], (c, how)
        assert r["sent"]["plan"] == r["predicted"]["plan"][grid.index(r["coords"])], c
        assert r["sent"]["greedy"] == r["sent"]["ops"] == r["predicted"]["greedy"][grid.index(r["coords"])], c


def ranks(c: dict) -> int:
    return int(np.prod(list(MESHES[c["mesh"]][0].values())))


@budget(8)
@given(c=chains())
@example(c=ISSUE)
@example(c=rich("2x2"))
def test_drawn_chains_run_as_planned_on_threads(c: dict) -> None:
    check(c, launch(run_chain, ranks(c), "threads", c))


@pytest.mark.mpi
@budget(1)
@given(drawn=st.fixed_dictionaries({case: st.lists(chains(case), min_size=2, max_size=3) for case in MESHES}))
@example(drawn={case: [rich(case)] for case in MESHES})
def test_drawn_chains_run_as_planned_under_mpiexec(drawn: dict[str, list[dict]]) -> None:
    """One job per mesh, the issue's case with those on 2 ranks."""
    for case, group in drawn.items():
        group = group + [ISSUE] if case == ISSUE["mesh"] else group
        results = run_each(run_chain, ranks(group[0]), [{"c": c} for c in group], timeout=240, comm_timeout=60)
        for c, res in zip(group, results, strict=True):
            check(c, res)


def test_a_chain_that_does_not_fit_is_refused_before_planning() -> None:
    x, _ = specs(ISSUE)
    w = chain.Spec((8, 4), x.mesh, x.axes, (B,))
    with pytest.raises(ValueError, match=r"chain: matmul takes \(\.\.\., m, k\) @ \(k, n\), got \(32, 16\) @ \(8, 4\)"):
        chain.plan(x, [chain.Link("matmul", (w,))])
    with pytest.raises(ValueError, match="chain: unknown op 'relu'"):
        chain.Link("relu")
    with pytest.raises(ValueError, match="chain: gelu takes the running tensor and 0 other input"):
        chain.Link("gelu", (w,))
