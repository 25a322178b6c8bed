"""Schedules as data: the generators, the action IR and the static verifier."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopart.errors import AutopartError
from autopart.layout import Mesh, Plan
from autopart.schedule import GENERATORS, Action, check_schedule, generate, table, verify
from autopart.schedule.tags import TAG_BITS, Tags

Schedule = dict[int, list[Action]]
FLAT = sorted(n for n in GENERATORS if "interleaved" not in n)  # one stage per pipeline rank


def _build(name: str, p: int, m: int, dp: int = 1) -> Schedule:
    peers = list(range(p))
    return {r: generate(name, r, m, peers, dp) for r in peers}


def _units(p: int, m: int) -> set[tuple[int, int, int]]:
    return {(s, mb, 0) for s in range(p) for mb in range(m)}


@settings(max_examples=60, deadline=None, database=None)
@given(
    name=st.sampled_from(FLAT),
    p=st.integers(1, 4),
    m=st.integers(1, 8),
    dp=st.sampled_from([1, 2]),
)
def test_generated_schedules_verify(name: str, p: int, m: int, dp: int) -> None:
    actions = _build(name, p, m, dp)
    verify(actions, _units(p, m))
    for r, acts in actions.items():
        assert [a for a in acts if a.kind == "F"] == [Action("F", r, mb) for mb in range(m)]
        assert sorted(a.mb for a in acts if a.kind == "B") == list(range(m))
        assert (acts[-1].kind == "DP_REDUCE") == (dp > 1)
        assert sum(a.kind == "DP_REDUCE" for a in acts) == (dp > 1)
        for a in acts:
            if a.kind.startswith(("SEND", "RECV")):
                assert a.peer in (r - 1, r + 1)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_1f1b_warmup(p: int, m: int) -> None:
    for r, acts in _build("1f1b", p, m).items():
        computes = [a.kind for a in acts if a.kind in ("F", "B")]
        first_b = computes.index("B")
        warmup = min(p - r - 1, m)
        # warmup forwards, then the steady state opens with one more forward (if any is left)
        assert computes[:first_b] == ["F"] * (warmup + (1 if m > warmup else 0))
        # at most min(p - r, m) micro-batches are in flight at any time (the 1F1B memory bound)
        live = peak = 0
        for k in computes:
            live += 1 if k == "F" else -1
            peak = max(peak, live)
        assert peak == min(p - r, m)
        if m > warmup:  # steady state strictly alternates F, B
            steady = computes[warmup : warmup + 2 * (m - warmup)]
            assert steady == ["F", "B"] * (m - warmup)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_gpipe_all_forwards_then_all_backwards(p: int) -> None:
    m = 3
    for acts in _build("gpipe", p, m).values():
        computes = [(a.kind, a.mb) for a in acts if a.kind in ("F", "B")]
        assert computes == [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def test_single_stage_schedules_are_the_accumulation_loop() -> None:
    from autopart.schedule.generators import SPLIT_BACKWARD

    for name in FLAT:
        w = (lambda mb: [f"W(s0,m{mb})"]) if name in SPLIT_BACKWARD else (lambda mb: [])
        assert [str(a) for a in generate(name, 0, 2, [0], dp=2)] == [
            "F(s0,m0)",
            "B(s0,m0)",
            *w(0),
            "F(s0,m1)",
            "B(s0,m1)",
            *w(1),
            "DP_REDUCE",
        ]


def test_sends_and_receives_name_global_peers() -> None:
    acts = generate("1f1b", 1, 2, [3, 7, 11])  # pipeline rank 1 is global rank 7
    assert Action("RECV_F", 1, 0, peer=3) in acts and Action("SEND_F", 1, 0, peer=11) in acts
    assert Action("RECV_B", 1, 0, peer=11) in acts and Action("SEND_B", 1, 0, peer=3) in acts


def test_unknown_generator() -> None:
    with pytest.raises(AutopartError) as err:
        generate("zero-bubble", 0, 2, [0])
    assert "has no generator" in err.value.message and "1f1b" in err.value.hint


def test_action_str() -> None:
    assert str(Action("F", 1, 2)) == "F(s1,m2)"
    assert str(Action("SEND_F", 0, 1, peer=3)) == "SEND_F(s0,m1)→r3"
    assert str(Action("RECV_B", 0, 1, chunk=2, peer=1)) == "RECV_B(s0,m1,c2)←r1"
    assert str(Action("DP_REDUCE", 3)) == "DP_REDUCE"
    text = table({0: [Action("F"), Action("B")], 1: [Action("F", 1)]})
    assert text.splitlines()[0].split() == ["step", "rank", "0", "rank", "1"]
    assert "F(s1,m0)" in text and len(text.splitlines()) == 3


def test_actions_json_round_trip_without_peer_zero() -> None:
    acts = [
        Action("F", 2, 3, chunk=1),
        Action("DP_REDUCE"),
        Action("B"),
        Action("SEND_F", 0, 1, peer=2),
    ]
    acts += generate("1f1b", 0, 4, [0, 1, 2])  # peers 1: never rank 0
    for a in acts:
        back = Action.from_json(json.loads(json.dumps(a.to_json())))
        assert back == a
    with pytest.raises(ValueError, match="unknown action kind"):
        Action.from_json({"kind": "FWD"})


@pytest.mark.parametrize("name", FLAT)
def test_actions_json_round_trip_all_ranks(name: str) -> None:
    for acts in _build(name, 3, 4).values():
        for a in acts:
            assert Action.from_json(json.loads(json.dumps(a.to_json()))) == a


# --- the verifier rejects broken schedules, naming the rank -------------------------------


def _reject(actions: Schedule, units: set, *needles: str) -> str:
    with pytest.raises(AutopartError) as err:
        verify(actions, units)
    msg = str(err.value)
    for needle in needles:
        assert needle in msg, msg
    return msg


@pytest.mark.parametrize("kind", ["RECV_F", "RECV_B"])
def test_verify_rejects_a_removed_receive(kind: str) -> None:
    actions = _build("1f1b", 2, 2)
    receiver = 1 if kind == "RECV_F" else 0
    sender = 1 - receiver
    actions[receiver] = [a for a in actions[receiver] if not (a.kind == kind and a.mb == 1)]
    send = "SEND_F(s0,m1)" if kind == "RECV_F" else "SEND_B(s1,m1)"
    _reject(actions, _units(2, 2), f"rank {sender}:", send, f"to rank {receiver}", "never received")


def test_verify_rejects_backward_before_forward() -> None:
    actions = _build("1f1b", 1, 2)
    acts = actions[0]
    i, j = acts.index(Action("F", 0, 1)), acts.index(Action("B", 0, 1))
    acts[i], acts[j] = acts[j], acts[i]
    _reject(actions, _units(1, 2), "rank 0:", "B(s0,m1)", "before its forward")


def test_verify_rejects_backward_before_forward_on_a_later_rank() -> None:
    actions = _build("gpipe", 3, 2)
    acts = actions[2]
    i, j = acts.index(Action("F", 2, 0)), acts.index(Action("B", 2, 0))
    acts[i], acts[j] = acts[j], acts[i]
    _reject(actions, _units(3, 2), "rank 2:", "B(s2,m0)", "before its forward")


def test_verify_rejects_a_duplicated_forward() -> None:
    actions = _build("1f1b", 2, 2)
    actions[0].insert(2, Action("F", 0, 1))
    _reject(actions, _units(2, 2), "F(s0,m1,c0) runs 2 times, not once")


def test_verify_duplicated_forward_names_the_rank() -> None:
    actions = _build("1f1b", 2, 2)
    actions[0].insert(2, Action("F", 0, 1))
    _reject(actions, _units(2, 2), "rank 0")


def test_verify_rejects_a_missing_backward() -> None:
    actions = _build("gpipe", 1, 3)
    actions[0].remove(Action("B", 0, 2))
    _reject(actions, _units(1, 3), "B(s0,m2,c0) runs 0 times")


def test_verify_rejects_a_unit_outside_the_plan() -> None:
    actions = _build("gpipe", 1, 2)
    _reject(actions, _units(1, 1), "rank 0:", "F(s0,m1)", "outside the plan")


def test_verify_rejects_a_deadlock() -> None:
    actions = _build("gpipe", 2, 1)
    # rank 0 waits for the gradient before it ever sends its activation; rank 1 waits for that
    recv = next(a for a in actions[0] if a.kind == "RECV_B")
    actions[0].remove(recv)
    actions[0].insert(0, recv)
    assert actions[1][0].kind == "RECV_F"
    msg = _reject(actions, _units(2, 1), "deadlock", "rank 0 at step 0", "rank 1 at step 0")
    assert "RECV_B(s0,m0)←r1" in msg and "RECV_F(s1,m0)←r0" in msg


def test_verify_rejects_a_send_to_a_rank_without_schedule() -> None:
    actions = _build("gpipe", 2, 1)
    actions[0] = [Action("SEND_F", 0, 0, peer=5) if a.kind == "SEND_F" else a for a in actions[0]]
    _reject(actions, _units(2, 1), "rank 0:", "rank 5, which has no schedule")


# --- interleaved 1F1B: p·v model chunks, chunk k on pipeline rank k mod p ------------------


@settings(max_examples=40, deadline=None, database=None)
@given(
    p=st.integers(2, 4), groups=st.integers(1, 3), v=st.integers(2, 3), dp=st.sampled_from([1, 2])
)
def test_interleaved_schedules_verify(p: int, groups: int, v: int, dp: int) -> None:
    m = p * groups
    peers = list(range(p))
    actions = {r: generate("interleaved-1f1b", r, m, peers, dp, v) for r in peers}
    verify(actions, {(s, mb, 0) for s in range(p * v) for mb in range(m)})
    for r, acts in actions.items():
        chunks = {a.stage for a in acts if a.kind == "F"}
        assert chunks == {c * p + r for c in range(v)}
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        warm = sum(a.kind == "F" for a in acts[:first_b])
        w = min(2 * (p - r - 1) + (v - 1) * p, m * v)  # warmup, then the first steady forward
        assert warm == w + (1 if w < m * v else 0)
        for a in acts:
            if a.kind.startswith(("SEND", "RECV")):
                assert a.peer in ((r - 1) % p, (r + 1) % p)
        for a in acts:
            assert Action.from_json(json.loads(json.dumps(a.to_json()))) == a


def test_interleaved_needs_virtual_stages_and_divisible_microbatches() -> None:
    with pytest.raises(AutopartError, match="divisible by pp: 3 % 2 = 1"):
        check_schedule("interleaved-1f1b", 2, 3, v=2)
    with pytest.raises(AutopartError, match="virtual stages"):
        check_schedule("interleaved-1f1b", 2, 4, v=1)
    with pytest.raises(AutopartError, match="virtual stages"):
        check_schedule("1f1b", 2, 4, v=2)
    check_schedule("interleaved-1f1b", 2, 4, v=2)  # and a valid one passes


def test_tied_ranks_end_with_tie_reduce() -> None:
    acts = generate("1f1b", 0, 2, [0, 1], dp=2, tied=True)
    assert [a.kind for a in acts[-2:]] == ["DP_REDUCE", "TIE_REDUCE"]


# --- Seq1F1B: (micro-batch, sequence chunk) units ------------------------------------------


@settings(max_examples=60, deadline=None, database=None)
@given(p=st.integers(1, 4), m=st.integers(1, 6), k=st.integers(1, 4))
def test_seq1f1b_schedules_verify(p: int, m: int, k: int) -> None:
    peers = list(range(p))
    actions = {r: generate("seq1f1b", r, m, peers, k=k) for r in peers}
    verify(actions, {(s, mb, c) for s in range(p) for mb in range(m) for c in range(k)})
    for r, acts in actions.items():
        fwd = [(a.mb, a.chunk) for a in acts if a.kind == "F"]
        bwd = [(a.mb, a.chunk) for a in acts if a.kind == "B"]
        assert fwd == [(mb, c) for mb in range(m) for c in range(k)]  # chunk order
        assert bwd == [(mb, c) for mb in range(m) for c in reversed(range(k))]  # reverse within mb
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        w = min(p - r - 1 + k - 1, m * k)
        assert sum(a.kind == "F" for a in acts[:first_b]) == w + (1 if w < m * k else 0)


@settings(max_examples=30, deadline=None, database=None)
@given(p=st.integers(2, 4), groups=st.integers(1, 2), v=st.integers(2, 3), k=st.integers(1, 3))
def test_seq1f1b_interleaved_schedules_verify(p: int, groups: int, v: int, k: int) -> None:
    m, peers = p * groups, list(range(p))
    actions = {r: generate("seq1f1b-interleaved", r, m, peers, v=v, k=k) for r in peers}
    verify(actions, {(s, mb, c) for s in range(p * v) for mb in range(m) for c in range(k)})
    for acts in actions.values():
        for stage in {a.stage for a in acts if a.kind == "B"}:
            for mb in range(m):
                order = [a.chunk for a in acts if a.kind == "B" and (a.stage, a.mb) == (stage, mb)]
                assert order == list(reversed(range(k)))


def test_sequence_chunks_need_seq1f1b() -> None:
    with pytest.raises(AutopartError, match="needs a Seq1F1B schedule, not 1f1b"):
        check_schedule("1f1b", 2, 2, k=2)


# --- zero-bubble schedules: every backward split into B and W --------------------------------


@pytest.mark.parametrize("name,k", [("zb-h1", 1), ("seq1f1b-zb", 1), ("seq1f1b-zb", 3)])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 4), (4, 4), (4, 9)])
def test_zero_bubble_schedules_run_one_w_per_unit_after_its_b(name, k, p, m) -> None:
    peers = list(range(p))
    actions = {r: generate(name, r, m, peers, k=k) for r in peers}
    units = {(s, mb, c) for s in range(p) for mb in range(m) for c in range(k)}
    verify(actions, units)
    for acts in actions.values():
        done_b = set()
        for a in acts:
            unit = (a.stage, a.mb, a.chunk)
            if a.kind == "B":
                done_b.add(unit)
            elif a.kind == "W":
                assert unit in done_b
        assert sorted((a.mb, a.chunk) for a in acts if a.kind == "W") == sorted(
            (mb, c) for mb in range(m) for c in range(k)
        )
        # rank r holds back at most r weight gradients in its steady phase: p units at most
        held = peak = 0
        for a in acts:
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak <= p + k - 1


def test_verify_rejects_a_missing_or_early_w() -> None:
    peers = [0, 1]
    actions = {r: generate("zb-h1", r, 2, peers) for r in peers}
    units = {(s, mb, 0) for s in range(2) for mb in range(2)}
    dropped = {0: [a for a in actions[0] if a != Action("W", 0, 1)], 1: actions[1]}
    _reject(dropped, units, "W(s0,m1,c0) runs 0 times")
    early = list(actions[1])
    w = early.pop(early.index(Action("W", 1, 0)))
    early.insert(early.index(Action("B", 1, 0)), w)
    _reject({0: actions[0], 1: early}, units, "rank 1", "before its B")


def test_the_planner_tries_zero_bubble_schedules(gpt_sdpa) -> None:
    from autopart.planning.planner import search
    from autopart.planning.simulate import shape_from_captured

    shape = shape_from_captured(gpt_sdpa.captured)
    ranked = search(shape, "dgx-a100-80gb", 2, 8, top=200, seq_chunks=[2]).ranked
    tried = {r.plan.schedule for r in ranked}
    assert {"zb-h1", "seq1f1b-zb"} <= tried


def test_message_tags_are_sized_by_the_plan_and_refused_when_they_cannot_be() -> None:
    """Tags had fixed fields (< 64 stages, < 16 chunks): an interleaved pp=2 × v=33 plan or a
    Seq1F1B plan of 64 chunks compiled, then failed at its first step. Each field is now as
    wide as the plan needs; every tag of a plan is distinct and within 31 bits, and a plan
    whose pipeline cannot be numbered is refused when it is made."""
    for tags in (Tags(66, 4, 1), Tags(128, 4096, 1), Tags(2, 4, 64), Tags(4, 8, 3)):
        seen = set()
        for stage in range(tags.stages):
            for mb in (0, tags.microbatches - 1):
                for chunk in range(tags.chunks):
                    for bits in ((0, 0, 0), (1, 2, 1), (1, 1, 0)):
                        backward, index, part = bits
                        t = tags.tag(stage, mb, chunk, bool(backward), index, part)
                        assert 0 <= t < 1 << TAG_BITS
                        seen.add(t)
        assert len(seen) == tags.stages * 2 * tags.chunks * 3, tags
    with pytest.raises(AutopartError, match="outside the plan's tags"):
        Tags(2, 4, 1).tag(2, 0, 0, False, 0, 0)
    Plan(Mesh(pp=2), schedule="interleaved-1f1b", virtual_stages=33, microbatches=4)
    Plan(Mesh(pp=2), schedule="seq1f1b", seq_chunks=64, microbatches=4)
    with pytest.raises(AutopartError, match="cannot number"):
        Plan(Mesh(pp=4), schedule="seq1f1b", seq_chunks=1 << 14, microbatches=1 << 14)
    with pytest.raises(AutopartError, match="3 tensors per hand-over"):
        Tags(4, 1 << 13, 1 << 13).check(3)
