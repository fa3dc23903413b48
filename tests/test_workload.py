"""maru_vllm.fixtures.workload: the prefix-sharing chat workload is deterministic and shaped as documented."""

from __future__ import annotations

import pytest

from maru_vllm.fixtures.workload import TOKEN_HI, TOKEN_LO, WorkloadSpec, build_workload


def test_same_spec_same_requests_and_seed_changes_them() -> None:
    spec = WorkloadSpec(systems=2, sessions=4, turns=3, seed=7)
    assert build_workload(spec) == build_workload(spec)
    other = build_workload(WorkloadSpec(systems=2, sessions=4, turns=3, seed=8))
    assert [r.prompt for r in other] != [r.prompt for r in build_workload(spec)]


def test_order_is_turn_by_turn_across_sessions() -> None:
    w = build_workload(WorkloadSpec(systems=2, sessions=3, turns=2))
    assert [(r.index, r.session, r.turn) for r in w] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 2, 0),
        (3, 0, 1),
        (4, 1, 1),
        (5, 2, 1),
    ]
    assert [r.system for r in w] == [0, 1, 0, 0, 1, 0]


def test_lengths_are_exact_and_tokens_printable_bytes() -> None:
    spec = WorkloadSpec(systems=2, sessions=4, turns=4, system_tokens=300, user_tokens=50, assistant_tokens=20)
    w = build_workload(spec)
    for r in w:
        assert len(r) == spec.prompt_tokens(r.turn) == 300 + r.turn * 70 + 50
        assert all(TOKEN_LO <= t < TOKEN_HI for t in r.prompt)
    assert w.total_prompt_tokens == sum(len(r) for r in w)


def test_prompts_share_system_prompt_and_extend_the_session() -> None:
    spec = WorkloadSpec(systems=2, sessions=4, turns=3, system_tokens=128, user_tokens=16, assistant_tokens=8)
    w = build_workload(spec)
    by = {(r.session, r.turn): r for r in w}
    for r in w:
        assert r.prompt[:128] == w.system_prompts[r.session % 2]
        if r.turn:
            prev = by[(r.session, r.turn - 1)].prompt
            assert r.prompt[: len(prev)] == prev  # previous prompt, then reply and new user turn
    # Sessions on different system prompts share nothing; on the same one, exactly the system prompt.
    assert w.system_prompts[0] != w.system_prompts[1]
    a, b = by[(0, 1)].prompt, by[(2, 1)].prompt
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 128 and a[:128] == b[:128]


def test_more_sessions_do_not_change_existing_ones() -> None:
    small = build_workload(WorkloadSpec(sessions=2, turns=2))
    big = build_workload(WorkloadSpec(sessions=5, turns=2))
    small_by = {(r.session, r.turn): r.prompt for r in small}
    for r in big:
        if (r.session, r.turn) in small_by:
            assert r.prompt == small_by[(r.session, r.turn)]


def test_unique_prefix_tokens_counts_the_prefix_tree() -> None:
    spec = WorkloadSpec(systems=2, sessions=4, turns=2, system_tokens=100, user_tokens=10, assistant_tokens=5)
    w = build_workload(spec)
    # Two system prompts once, every user turn once, every reply that a later turn carries once.
    expected = 2 * 100 + 4 * 2 * 10 + 4 * 5
    assert w.unique_prefix_tokens() == expected


def test_hot_sessions_share_the_popular_system_prompt() -> None:
    spec = WorkloadSpec(systems=2, sessions=7, hot_sessions=4, turns=2, system_tokens=64, user_tokens=8)
    w = build_workload(spec)
    assert [spec.system_of(s) for s in range(7)] == [0, 0, 0, 0, 0, 1, 0]
    for r in w:
        assert r.system == spec.system_of(r.session)
        assert r.prompt[:64] == w.system_prompts[r.system]
    # Without hot sessions the binding is the plain cycle.
    assert [WorkloadSpec(systems=2, sessions=4).system_of(s) for s in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(systems=0), "systems must be >= 1, got 0"),
        (dict(turns=0), "turns must be >= 1, got 0"),
        (dict(sessions=1, systems=2), "cannot cover 2 system prompts"),
        (dict(assistant_tokens=-1), "assistant_tokens must be >= 0, got -1"),
        (dict(user_tokens=0), "user_tokens must be >= 1, got 0"),
        (dict(sessions=3, hot_sessions=4), "hot_sessions must be between 0 and sessions (3), got 4"),
        (dict(sessions=3, systems=3, hot_sessions=2), "3 sessions (2 of them hot) cannot cover 3 system prompts"),
    ],
)
def test_invalid_specs_are_rejected(bad: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as err:
        WorkloadSpec(**bad)
    assert message in str(err.value)
