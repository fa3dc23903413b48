"""When a worker stands in for the other role (no worker of that role is live) and when it stops.

Pure decisions over the number of live workers of the other role (`peers.PeerWatch`) and a
monotonic clock the caller passes in, so they are tested without processes:

* **promote** once no worker of the other role is live - but not within `startup_grace_s` of the
  guard's start, so that peers already running are seen first (their liveness streams open within
  a round trip);
* **withdraw** once a worker of the other role has been live without a break for
  `restore_hold_s`: it is registered and answering, so a worker that dies again at once does not
  make the state flap.

The stand-in is in discovery and forwards either way (`standby.py`); these decide what its
worker logs and its `maru_disagg_standing_in` gauge.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Transition = Literal["promote", "withdraw"]


@dataclasses.dataclass
class StandbyPolicy:
    startup_grace_s: float = 1.0
    restore_hold_s: float = 1.0

    def __post_init__(self) -> None:
        if not (self.startup_grace_s >= 0 and self.restore_hold_s >= 0):
            raise ValueError(
                f"startup_grace_s={self.startup_grace_s!r}, restore_hold_s={self.restore_hold_s!r}: use seconds >= 0"
            )
        self.promoted = False
        self._started: float | None = None
        self._live_since: float | None = None

    def update(self, now: float, live_peers: int) -> Transition | None:
        """Record how many peers are live at `now`; say whether the stand-in changes state."""
        if self._started is None:
            self._started = now
        if live_peers > 0:
            if self._live_since is None:
                self._live_since = now
            if self.promoted and now - self._live_since >= self.restore_hold_s:
                self.promoted = False
                return "withdraw"
            return None
        self._live_since = None
        if not self.promoted and now - self._started >= self.startup_grace_s:
            self.promoted = True
            return "promote"
        return None

    def next_check(self, now: float) -> float | None:
        """Seconds until `update` could decide differently with the same peer count (None: only a
        change in the peers can)."""
        if self._started is None:
            return 0.0
        if self._live_since is not None:
            return max(0.0, self._live_since + self.restore_hold_s - now) if self.promoted else None
        return None if self.promoted else max(0.0, self._started + self.startup_grace_s - now)
