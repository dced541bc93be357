"""``viz.layers`` counts the bytes a rank sent inside each layer's F and B span, by hand: two ranks,
two layers; each rank sends 10 bytes of ``all_to_all`` in every forward span and 20 in every backward
span, rank 1 one more ``ring_kv`` message of 5 bytes in layer 1's forward; a message of another op
counts for nothing."""

from __future__ import annotations

from minipar.trace import Event, Trace
from viz.layers import layer_table, layer_traffic, per_rank

OPS = ("all_to_all", "ring_kv")


def send(rank: int, t: float, nbytes: int, op: str) -> Event:
    return Event(rank, "comm", "send", t, t + 0.1, src=rank, dst=1 - rank, nbytes=nbytes, op=op)


def hand_trace() -> Trace:
    events = []
    for r in range(2):
        for layer in range(2):
            f0, b0 = 2.0 * layer, 10.0 + 2.0 * layer
            events += [Event(r, "compute", "F", f0, f0 + 1, args={"layer": layer}), send(r, f0 + 0.5, 10, "all_to_all"),
                       Event(r, "compute", "B", b0, b0 + 1, args={"layer": layer}), send(r, b0 + 0.5, 20, "all_to_all"),
                       send(r, b0 + 0.2, 99, "allreduce")]
    events.append(send(1, 2.6, 5, "ring_kv"))
    return Trace({"world_size": 2}, events)


def test_bytes_inside_each_layer_span() -> None:
    t = hand_trace()
    assert layer_traffic(t, 0, OPS) == {(0, "F"): 10, (1, "F"): 10, (0, "B"): 20, (1, "B"): 20}
    assert layer_traffic(t, 1, OPS)[(1, "F")] == 15
    assert per_rank([10, 10]) == "10" and per_rank([10, 15]) == "10 / 15"
    table = layer_table({"run": t}, {"run": (10, 20)}, "title", OPS)
    assert [list(c.cells)[0] for c in table.columns] == ["run", "all_to_all, ring_kv", "10 (layers differ!)", "10",
                                                         "20", "20"]
