"""Disaggregated serving that survives losing a role.

In a disaggregated graph every Maru worker still has the model and the pool, so a worker of
either role can do the other role's work. Each prefill and decode worker therefore keeps a
**stand-in** for the other role (`standby.py`): its own engine behind the other role's Dynamo
endpoint (a decode worker's engine behind `prefill/generate`, a prefill worker's behind
`backend/generate`), registered with the other role's model card but kept out of discovery. A
`RoleGuard` (`guard.py`) follows the live workers of the other role (`peers.py`): when none is
left it puts the stand-in into discovery, and Dynamo's frontend, whose prefill router and decode
router see one more worker of the missing role, keeps serving every request through it; when a
worker of that role is up again (registered and answering), the stand-in leaves discovery and the
graph is disaggregated again. Requests the stand-in already holds finish where they are.

A stand-in decode endpoint on a prefill worker decodes with the prompt's KV in its own prefix
cache (the prefill leg ran on it a moment before) or loads it from the pool; a stand-in prefill
endpoint on a decode worker stores the prompt's chunks in the pool like a prefill worker. Which
mechanism and why, measured against Dynamo's own behaviour: docs/design.md
("Losing a role"). What an operator sees: docs/operations.md.
"""

from maru_vllm.disagg.roles import COMPONENT, DECODE, PREFILL, other_role

__all__ = ["COMPONENT", "DECODE", "PREFILL", "other_role"]
