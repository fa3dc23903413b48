"""When a worker's stand-in for the other role goes into discovery and leaves it (no processes)."""

from __future__ import annotations

import pytest

from maru_dynamo.components.disagg.policy import StandbyPolicy
from maru_dynamo.components.disagg.roles import COMPONENT, endpoint_path, other_role


def test_no_peer_after_the_start_grace_promotes_once() -> None:
    p = StandbyPolicy(startup_grace_s=1.0, restore_hold_s=1.0)
    assert p.update(100.0, 0) is None  # peers already running get the grace to be seen
    assert p.next_check(100.2) == pytest.approx(0.8)
    assert p.update(100.9, 0) is None
    assert p.update(101.0, 0) == "promote"
    assert p.promoted and p.next_check(101.5) is None  # only a peer coming back changes it now
    assert [p.update(t, 0) for t in (102.0, 150.0)] == [None, None]


def test_a_peer_seen_within_the_grace_means_no_promotion() -> None:
    p = StandbyPolicy()
    assert p.update(0.0, 0) is None
    assert p.update(0.3, 1) is None
    assert [p.update(t, 1) for t in (5.0, 50.0)] == [None, None]
    assert not p.promoted


def test_a_returning_peer_is_held_before_the_stand_in_withdraws() -> None:
    p = StandbyPolicy(startup_grace_s=0.0, restore_hold_s=1.0)
    assert p.update(0.0, 0) == "promote"
    assert p.update(10.0, 1) is None  # live, not yet for restore_hold_s
    assert p.next_check(10.4) == pytest.approx(0.6)
    assert p.update(10.5, 0) is None  # it went again: the hold starts over
    assert p.update(11.2, 1) is None
    assert p.update(12.1, 1) is None
    assert p.update(12.2, 2) == "withdraw"
    assert not p.promoted
    assert p.update(20.0, 0) == "promote"  # lost again: at once, no grace after the start


def test_bad_settings_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"restore_hold_s=-1: use seconds >= 0"):
        StandbyPolicy(restore_hold_s=-1)


def test_roles_and_their_endpoints() -> None:
    assert other_role("prefill") == "decode" and other_role("decode") == "prefill"
    assert COMPONENT == {"prefill": "prefill", "decode": "backend"}  # dynamo.vllm's components
    assert endpoint_path("dynamo", "decode", "generate") == "dynamo.backend.generate"
    with pytest.raises(ValueError, match="unknown role 'agg': use one of prefill, decode"):
        other_role("agg")
