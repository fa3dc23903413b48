"""Chunk metadata for tests that store chunks by hand (as the scheduler side builds it)."""

from __future__ import annotations

from maru_vllm.connector.chunks import placeholder_meta as chunk_meta

__all__ = ["chunk_meta"]
