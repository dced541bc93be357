"""Pipeline schedule IR, generators, lowering and validator (issue 4, points 1-3)."""

import json
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget

from minipar.parallel.pipeline import (
    KINDS,
    Action,
    ScheduleError,
    format_schedule,
    lower,
    make_schedule,
    parse_schedule,
    validate,
)


def words(text: str) -> list[str]:
    return text.split()


# --- canonical orders, written out by hand -------------------------------------------------------

GPIPE_4_8 = {r: [f"{r}F{i}" for i in range(8)] + [f"{r}B{i}" for i in range(8)] for r in range(4)}

ONE_F_ONE_B_4_8 = {
    0: words("0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"),
    1: words("1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7"),
    2: words("2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7"),
    3: words("3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"),
}

# p=2, v=2, m=4: rank 0 holds virtual stages 0 and 2, rank 1 holds 1 and 3. Warm-up on rank r is
# 2(p-r-1) + (v-1)p forwards (4 on rank 0, 2 on rank 1); micro-batches go through a chunk in groups
# of p=2; backwards visit the chunks in reverse.
INTERLEAVED_2_4_2 = {
    0: words("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
    1: words("1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"),
}


def test_gpipe_order_p4_m8():
    assert format_schedule(make_schedule("gpipe", 4, 8)) == GPIPE_4_8


def test_1f1b_order_p4_m8():
    assert format_schedule(make_schedule("1f1b", 4, 8)) == ONE_F_ONE_B_4_8


def test_interleaved_order_p2_v2_m4():
    sched = make_schedule("interleaved", 2, 4, chunks=2)
    assert format_schedule(sched) == INTERLEAVED_2_4_2
    assert (sched.kind, sched.stages, sched.microbatches, sched.chunks, sched.virtual_stages) == \
        ("interleaved", 2, 4, 2, 4)


def test_naive_order_and_interleaved_v1_is_1f1b():
    assert format_schedule(make_schedule("naive", 2, 2)) == {0: words("0F0 0B0 0F1 0B1"),
                                                            1: words("1F0 1B0 1F1 1B1")}
    assert make_schedule("interleaved", 4, 8, 1) == make_schedule("1f1b", 4, 8)


# --- the IR: text form, parse/print round trip ---------------------------------------------------

def test_action_text():
    a = Action.parse("1F3")
    assert (a.stage, a.op, a.microbatch, a.peer, str(a)) == (1, "F", 3, None, "1F3")
    s = Action.parse("12SEND_B30->7")
    assert (s.stage, s.op, s.microbatch, s.peer) == (12, "SEND_B", 30, 7)
    assert s.counterpart(own_rank=2) == Action.parse("11RECV_B30<-2")
    assert Action.parse("2RECV_F3<-1").counterpart(own_rank=2) == Action.parse("1SEND_F3->2")
    assert {Action.parse("0B0"), Action.parse(" 0B0 ")} == {Action(0, "B", 0)}


@pytest.mark.parametrize("bad", ["1X3", "F3", "1F", "1SEND_F3", "1F3->2", "1SEND_F3<-2", "1RECV_B3->2",
                                 "-1F0"])
def test_action_parse_rejects(bad):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad)


ops = st.sampled_from(["F", "B", "SEND_F", "SEND_B", "RECV_F", "RECV_B"])


@budget(25)
@given(stage=st.integers(0, 99), op=ops, mb=st.integers(0, 999), peer=st.integers(0, 63))
def test_action_round_trip(stage, op, mb, peer):
    a = Action(stage, op, mb, None if op in ("F", "B") else peer)
    assert Action.parse(str(a)) == a
    assert str(Action.parse(str(a))) == str(a)


@budget(25)
@given(kind=st.sampled_from(KINDS), p=st.integers(1, 4), k=st.integers(1, 3), lowered=st.booleans())
@example(kind="1f1b", p=4, k=3, lowered=True)  # m = 12 > p: warm-up, steady state and cool-down
@example(kind="interleaved", p=3, k=2, lowered=True)
def test_schedule_round_trip(kind, p, k, lowered):
    sched = make_schedule(kind, p, p * k * (2 if kind == "dualpipev" else 1), chunks=2 if kind == "interleaved" else 1)
    if lowered:
        sched = lower(sched)
    text = format_schedule(sched)
    assert format_schedule(parse_schedule(text)) == text
    assert parse_schedule(text) == sched
    via_json = json.loads(json.dumps(text))  # rank keys become strings
    assert parse_schedule(via_json) == sched
    assert parse_schedule({r: " ".join(a) for r, a in text.items()}) == sched


def test_parse_schedule_rejects_gaps_in_ranks():
    with pytest.raises(ScheduleError, match="every rank 0..2"):
        parse_schedule({0: ["0F0"], 2: ["1F0"]})


# --- configuration errors -------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("args", "message"),
    [
        # every kind of the registry, in its order: a kind added to GENERATORS (KINDS) is listed without a change here
        (("no-such-kind", 4, 8), re.escape(f"use one of {', '.join(KINDS)}")),
        (("gpipe", 0, 8), "stages must be >= 1"),
        (("1f1b", 4, 0), "microbatches must be >= 1"),
        (("interleaved", 4, 8, 0), "chunks must be >= 1"),
        (("gpipe", 4, 8, 2), "only applies to the 'interleaved'"),
        (("interleaved", 4, 6, 2), "use microbatches=4 or 8"),
        (("interleaved", 4, 3, 2), "use microbatches=4"),
        (("1f1b", 4.0, 8), "stages must be an int"),
    ],
)
def test_bad_configurations(args, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(*args)


# --- lowering --------------------------------------------------------------------------------------

def test_lowering_1f1b_p2_m2():
    assert format_schedule(lower(make_schedule("1f1b", 2, 2))) == {
        0: words("0F0 0SEND_F0->1 0F1 0SEND_F1->1 0RECV_B0<-1 0B0 0RECV_B1<-1 0B1"),
        1: words("1RECV_F0<-0 1F0 1B0 1SEND_B0->0 1RECV_F1<-0 1F1 1B1 1SEND_B1->0"),
    }


def test_lowering_interleaved_wraps_from_last_rank_to_first():
    low = format_schedule(lower(make_schedule("interleaved", 2, 2, 2)))
    # stage 1 (rank 1, chunk 0) feeds stage 2 (rank 0, chunk 1); stage 3 is last and sends nothing on.
    assert low[1][:2] == ["1RECV_F0<-0", "1F0"] and "1SEND_F0->0" in low[1]
    assert "2RECV_F0<-1" in low[0] and "2SEND_B0->1" in low[0]
    assert not any(a.startswith("3SEND_F") or a.startswith("0SEND_B") for r in low for a in low[r])
    assert sum(len(a) for a in low.values()) == 2 * 4 * 2 + 2 * 2 * (4 - 1) * 2  # compute + send/recv


def test_single_rank_needs_no_messages():
    sched = make_schedule("interleaved", 1, 2, 3)
    assert lower(sched) == sched
    validate(sched)


# --- validator -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,p,m,v", [("naive", 3, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                         ("interleaved", 4, 8, 2), ("interleaved", 3, 3, 3)])
def test_generated_schedules_validate(kind, p, m, v):
    sched = make_schedule(kind, p, m, v)
    assert validate(sched) == lower(sched)


def test_rejects_backward_before_forward():
    with pytest.raises(ScheduleError) as err:
        validate({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]})
    msg = str(err.value)
    assert "0B0 comes before its forward 0F0" in msg
    assert "step | rank 0" in msg
    assert "XX 0RECV_B0<-1" in msg and "XX 1RECV_F0<-0" in msg and "!! 0B0" in msg
    assert "waits for 1SEND_B0->0 from rank 1" in msg


def test_rejects_missing_microbatch():
    with pytest.raises(ScheduleError) as err:
        validate({0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0"]})
    e = err.value
    assert "missing 1F1, 1B1" in e.problems[0]
    assert e.problems[1] == ("rank 0 step 6: 0RECV_B1<-1 can never proceed: waits for 1SEND_B1->0 on rank 1, "
                             "which rank 1 never runs")
    assert "XX 0RECV_B1<-1" in e.table


def test_rejects_deadlocking_send_recv_order():
    # Each rank receives before it sends what the other one waits for.
    bad = {0: ["0F0", "0RECV_B0<-1", "0SEND_F0->1", "0B0"], 1: ["1RECV_F0<-0", "1F0", "1B0", "1SEND_B0->0"]}
    with pytest.raises(ScheduleError) as err:
        validate(bad)
    assert [p.split(":")[0] for p in err.value.problems] == ["rank 0 step 1", "rank 1 step 0"]
    rows = err.value.table.splitlines()
    assert rows[2].split("|")[2].strip() == "XX 1RECV_F0<-0"
    assert rows[3].split("|")[1].strip() == "XX 0RECV_B0<-1"
    # the same order with the send first is fine
    good = {0: ["0F0", "0SEND_F0->1", "0RECV_B0<-1", "0B0"], 1: bad[1]}
    assert format_schedule(validate(good)) == good


def test_rejects_duplicates_wrong_peers_and_split_stages():
    with pytest.raises(ScheduleError, match="0F0 appears twice"):
        validate({0: ["0F0", "0F0", "0B0"], 1: ["1F0", "1B0"]})
    with pytest.raises(ScheduleError, match="names rank 0, but stage 1 runs on rank 1"):
        validate({0: ["0F0", "0SEND_F0->0", "0RECV_B0<-1", "0B0"],
                  1: ["1RECV_F0<-0", "1F0", "1B0", "1SEND_B0->0"]})
    with pytest.raises(ScheduleError, match=r"stage 1 runs on ranks \[0, 1\]"):
        validate({0: ["0F0", "0B0", "1F0"], 1: ["1F0", "1B0"]})
    with pytest.raises(ScheduleError, match="which comes later"):
        validate({0: ["1F0", "0F0", "1B0", "0B0"]})
    with pytest.raises(ScheduleError, match="no actions"):
        validate({0: [], 1: []})


def test_blocking_sends_deadlock_1f1b_but_not_gpipe():
    # Unbuffered blocking sends: 1F1B's steady state needs the fused send/recv exchange Megatron uses.
    with pytest.raises(ScheduleError) as err:
        validate(make_schedule("1f1b", 2, 2), sends="rendezvous")
    assert err.value.problems == [
        "rank 0 step 3: 0SEND_F1->1 can never proceed: waits for rank 1 to reach 1RECV_F1<-0 (step 4), "
        "but rank 1 is stuck at step 3 (1SEND_B0->0)",
        "rank 1 step 3: 1SEND_B0->0 can never proceed: waits for rank 0 to reach 0RECV_B0<-1 (step 4), "
        "but rank 0 is stuck at step 3 (0SEND_F1->1)",
    ]
    validate(make_schedule("gpipe", 3, 4), sends="rendezvous")


# --- zero bubble: the backward split into I and W ---------------------------------------------------
# Qi et al. 2024, Figure 3 top (ZB-H1), p = 4, m = 6, written out: rank r runs F_x, I_{x-(3-r)}, W_{x-3}.
ZB_H1_4_6 = {
    0: words("0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5"),
    1: words("1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5"),
    2: words("2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5"),
    3: words("3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5"),
}


def test_zb_h1_order_p4_m6():
    assert format_schedule(make_schedule("zb-h1", 4, 6)) == ZB_H1_4_6


def test_lowering_sends_the_gradient_after_i_and_nothing_after_w():
    assert format_schedule(lower(make_schedule("zb-h1", 2, 1))) == {
        0: ["0F0", "0SEND_F0->1", "0RECV_B0<-1", "0I0", "0W0"],
        1: ["1RECV_F0<-0", "1F0", "1I0", "1SEND_B0->0", "1W0"]}


@pytest.mark.parametrize(("spec", "needle"), [
    ({0: ["0F0", "0W0", "0I0"]}, "0W0 comes before 0I0"),
    ({0: ["0F0", "0I0"]}, "missing 0W0"),
    ({0: ["0F0", "0W0"]}, "missing 0I0"),
    ({0: ["0F0", "0I0", "0W0", "0B0"]}, "has both a B and an I/W pair"),
])
def test_rejects_bad_split_backwards(spec, needle):
    with pytest.raises(ScheduleError, match=needle):
        validate(spec)
