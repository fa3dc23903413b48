"""Disaggregated serving that survives losing a role.

In a disaggregated graph every Maru worker still has the model and the pool, so a worker of
either role can do the other role's work. Each prefill and decode worker therefore serves a
**stand-in** for the other role (`standby.py`): its own engine behind the other role's Dynamo
endpoint, with that role's model card. A `RoleGuard` (`guard.py`) follows the live workers of the
other role through a liveness stream to each (`peers.py`) and decides, by `policy.py`, when the
worker counts as standing in (its log and its gauge say so). How requests reach it:

* the stand-in is in discovery all along and passes each request it gets on to a live worker of
  its role (`relay.py`), so the work still runs on a worker of that role; with none live, or
  when the one it tried does not answer, this worker's engine serves it - a decode worker
  prefills (its chunks go to the pool), a prefill worker decodes (the prompt's KV is in its
  prefix cache, or in the pool) - and a decode stream that broke because its worker died is
  finished from where it broke;
* the frontend retries a request that failed on a dead worker at once and never on that worker,
  so these endpoints, already listed, are what take the retry.

Both workers and the frontend (`frontend_log.py`, from the frontend's `/health` read by
`view.py`) log once when a role is degraded and once when it is restored. Which mechanism and
why, measured against Dynamo's own behaviour: docs/design.md ("Losing a role"). What an
operator sees: docs/operations.md.
"""

from maru_dynamo.components.disagg.roles import COMPONENT, DECODE, PREFILL, other_role

__all__ = ["COMPONENT", "DECODE", "PREFILL", "other_role"]
