"""Fused LLM kernels: RMSNorm (+ residual), SwiGLU, rotary embedding. The names exist so callers
can be written against them; the kernels (src/cuda/fused/) have not landed, so each raises
NotImplementedError naming the feature.
"""
from __future__ import annotations

from typing import Any


def _missing(feature: str) -> NotImplementedError:
    return NotImplementedError(f"{feature} is not implemented in flashcpp yet "
                               "(the fused kernels have not landed)")


def rms_norm(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    raise _missing("rms_norm")


def fused_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float = 1e-6) -> Any:
    """residual += x; x = rms_norm(residual) * weight, in place."""
    raise _missing("fused_add_rms_norm (RMSNorm with residual add)")


def silu_and_mul(x: Any) -> Any:
    """SwiGLU: silu(x[..., :d]) * x[..., d:] for x (..., 2d)."""
    raise _missing("silu_and_mul (SwiGLU)")


def apply_rotary(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
    """Rotary position embedding applied to q and k."""
    raise _missing("apply_rotary (rotary position embedding)")
