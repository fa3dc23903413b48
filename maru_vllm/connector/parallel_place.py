"""Where one worker sits in its engine's parallel layout, and which pool slices that makes it read and write.

The scheduler and every worker compute this from the same `VllmConfig` (the scheduler has no
ranks: it sees rank 0), so both sides agree on the slices of a chunk (chunks.py) without talking
to each other: the splits a lookup tries, the slice a rank stores, the slices it reads for each
split. Objects in LMCache's block format hold one rank's pages in LMCache's order, with no
trailer to read a head range by, so such engines read only their own TP size's split.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maru_vllm.connector.chunks import Slice, Split, own_slice, rank_split, splits_for
from maru_vllm.connector.object_format import HeadRange


@dataclasses.dataclass(frozen=True)
class ParallelPlace:
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    total_heads: int  # the model's KV heads; 0 when unknown (rank-named slices)
    mla: bool

    @classmethod
    def of_engine(cls, vllm_config: Any) -> ParallelPlace:
        parallel = vllm_config.parallel_config
        model = vllm_config.model_config
        tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
        tp_rank = pp_rank = 0
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp_rank, pp_rank = int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
        except (AssertionError, ImportError, AttributeError):
            pass  # no distributed state (the scheduler, tests): rank 0
        try:
            total = int(model.get_total_num_kv_heads())
        except (AttributeError, TypeError, ValueError):
            total = 0
        return cls(tp, pp, tp_rank, pp_rank, max(0, total), bool(getattr(model, "use_mla", False)))

    @property
    def rank(self) -> int:
        """The rank in the TP x PP world."""
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def heads(self) -> HeadRange:
        """The KV heads this rank's pages hold (what its objects state, object_format.py)."""
        if self.total_heads <= 0:
            return HeadRange(0, 0, 0)  # unknown: its objects are read only by engines of its own format
        return HeadRange.for_rank(self.total_heads, self.tp, self.tp_rank, self.mla)

    @property
    def slice(self) -> Slice:
        return own_slice(self.total_heads, self.tp, self.tp_rank, self.pp_rank, self.mla)

    def splits(self) -> tuple[Split, ...]:
        """The splits this engine reads, its own first (only its own when the head count is unknown)."""
        if self.total_heads <= 0:
            return (rank_split(self.tp * self.pp),)
        return splits_for(self.total_heads, self.tp, self.pp, self.mla)
