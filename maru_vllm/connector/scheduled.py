"""The requests one vLLM scheduler step scheduled, read the same way by both scheduler sides.

vLLM's `SchedulerOutput` lists new requests (with their whole block tables) and cached ones:
running requests (with the blocks added this step) and resumed ones (with their whole new block
tables). `scheduled_requests` walks both lists in vLLM's order and yields one
`ScheduledRequest` per request, so `MaruSchedulerSide` (one KV cache group) and
`GroupedSchedulerSide` (several) differ only in what they do with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    req_id: str
    num_computed: int  # tokens computed before this step
    num_scheduled: int  # tokens this step computes
    # Per KV cache group, fresh lists: the whole block table when `replaces`, else the blocks
    # added this step; None where vLLM sent none.
    block_ids: tuple[list[int], ...] | None
    # True for new and resumed requests (their block tables start over); False for running ones,
    # whose `num_computed` below what the side expected means vLLM rolled the request back.
    replaces: bool

    def whole_table(self) -> list[list[int]]:
        """The block table of a new or resumed request, per group (empty when vLLM sent none)."""
        return list(self.block_ids) if self.block_ids is not None else []


def scheduled_requests(out: SchedulerOutput) -> Iterator[ScheduledRequest]:
    for new_req in out.scheduled_new_reqs:
        yield ScheduledRequest(
            new_req.req_id,
            new_req.num_computed_tokens,
            out.num_scheduled_tokens[new_req.req_id],
            tuple(list(group_ids) for group_ids in new_req.block_ids),
            True,
        )
    cached = out.scheduled_cached_reqs
    resumed = resumed_req_ids(cached)
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        yield ScheduledRequest(
            req_id,
            cached.num_computed_tokens[i],
            out.num_scheduled_tokens[req_id],
            None if new_ids is None else tuple(list(group_ids) for group_ids in new_ids),
            req_id in resumed,
        )


def resumed_req_ids(cached: Any) -> frozenset[str]:
    """The ids of `scheduled_cached_reqs` that resume after a preemption (their whole block table
    comes again). vLLM 0.34 dropped `CachedRequestData.resumed_req_ids`: it sends a resumed request
    in `scheduled_new_reqs`, as a new one, so no cached request resumes there."""
    return frozenset(getattr(cached, "resumed_req_ids", None) or ())
