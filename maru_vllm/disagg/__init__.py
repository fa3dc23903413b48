"""Disaggregated serving that survives losing a role.

In a disaggregated graph every Maru worker still has the model and the pool, so a worker of
either role can do the other role's work. Each prefill and decode worker therefore serves a
**stand-in** for the other role (`standby.py`): its own engine behind the other role's Dynamo
endpoint, with that role's model card. A `RoleGuard` (`guard.py`) follows the live workers of the
other role through a liveness stream to each (`peers.py`) and decides, by `policy.py`, when the
worker stands in:

* a decode worker's prefill stand-in is in discovery all along and passes each prefill request
  it gets on to a live prefill worker; with none live, or when the one it tried does not answer,
  it prefills on its own engine (its chunks go to the pool). The frontend retries a prefill that
  failed on a dead worker at once and never on that worker, so this endpoint is what takes the
  retry;
* a prefill worker's decode stand-in stays out of discovery until no decode worker is live, then
  joins the frontend's decode workers and decodes on the prefill worker's engine (the prompt's
  KV is in its prefix cache, or in the pool); it leaves when a decode worker is back.

Both workers and the frontend (`frontend_log.py`, from the frontend's `/health` read by
`view.py`) log once when a role is degraded and once when it is restored. Which mechanism and
why, measured against Dynamo's own behaviour: docs/design.md ("Losing a role"). What an
operator sees: docs/operations.md.
"""

from maru_vllm.disagg.roles import COMPONENT, DECODE, PREFILL, other_role

__all__ = ["COMPONENT", "DECODE", "PREFILL", "other_role"]
