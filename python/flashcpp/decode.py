"""Decode against a KV cache (flash-attn's ``flash_attn_with_kvcache``, FlashInfer's paged
plan/run wrapper). The API names exist so callers can be written against them; the kernels
(split-KV decode, paged KV, planner: src/cuda/decode/) have not landed, so each raises
NotImplementedError naming the feature rather than falling back to something slow.
"""
from __future__ import annotations

from typing import Any


def _missing(feature: str) -> NotImplementedError:
    return NotImplementedError(f"{feature} is not implemented in flashcpp yet "
                               "(the decode kernels have not landed)")


def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, *args: Any, **kwargs: Any) -> Any:
    """flash-attn's ``flash_attn_with_kvcache`` (decode / append against a KV cache)."""
    raise _missing("flash_attn_with_kvcache (decode against a KV cache)")


class BatchDecodeWithPagedKVCache:
    """Plan/run decode over a paged KV cache (FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``).

    ``plan()`` decides split counts and the work list on the host into caller-owned workspaces;
    ``run()`` only launches, so it can be captured in a CUDA graph.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args, self._kwargs = args, kwargs

    def plan(self, *args: Any, **kwargs: Any) -> None:
        raise _missing("BatchDecodeWithPagedKVCache.plan (paged-KV decode planning)")

    def run(self, *args: Any, **kwargs: Any) -> Any:
        raise _missing("BatchDecodeWithPagedKVCache.run (paged-KV split-KV decode)")
