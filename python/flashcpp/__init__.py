"""flashcpp: attention and fused LLM kernels in C++20/CUDA, with a flash-attn style Python API.

Works on numpy arrays (CPU backend) and, when torch imports, on torch tensors through the
``torch.ops.flashcpp.*`` custom ops (torch.compile and CUDA-graph friendly). See python/README.md.
"""
from . import _flashcpp as _C
from ._core import torch as _torch

if _torch is not None:
    from . import _torch_ops  # noqa: F401  (registers torch.ops.flashcpp.*)

from .attention import (KernelChoice, Rotary, attention, flash_attn_func, flash_attn_varlen_func,
                        select_kernel)
from .decode import BatchDecodeWithKVCache, BatchDecodeWithPagedKVCache, flash_attn_with_kvcache
from .fused import apply_rotary, fused_add_rms_norm, qk_norm_rope, rms_norm, rope_append_kv, silu_and_mul
from .merge import merge_attention_states

__version__ = _C.VERSION
#: True when this build has the CUDA kernels (FLASHCPP_CUDA=ON).
WITH_CUDA: bool = _C.WITH_CUDA
#: Git commit the extension was built from (recorded in reports).
GIT_COMMIT: str = _C.GIT_COMMIT
#: Head dims attention and decode take: every multiple of 8 in [8, 256], for q and k (head_dim)
#: and, independently, for v and the output (head_dim_v, v's last dim). The CPU backends run them all.
SUPPORTED_HEAD_DIMS = _C.SUPPORTED_HEAD_DIMS
#: The head-dim classes the CUDA kernels are built for. CUDA prefill, backward and decode
#: (flash_attn_func, flash_attn_with_kvcache and the rest) run every supported pair in the smallest
#: class that holds both, padded inside the kernel; CUDA decode over an fp8 KV cache takes head dims
#: that are multiples of 16 and raises NotImplementedError (the C++ library's answer) for others.
CUDA_HEAD_DIMS = _C.CUDA_HEAD_DIMS

__all__ = [
    "flash_attn_func", "flash_attn_varlen_func", "attention", "select_kernel", "KernelChoice", "Rotary",
    "merge_attention_states", "flash_attn_with_kvcache", "BatchDecodeWithKVCache", "BatchDecodeWithPagedKVCache",
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary", "qk_norm_rope", "rope_append_kv",
    "WITH_CUDA", "GIT_COMMIT", "SUPPORTED_HEAD_DIMS", "CUDA_HEAD_DIMS", "__version__",
]

# masks (flashcpp/masks.py): ALiBi slopes and block-sparse masks
from .masks import (BlockSparse, alibi_slopes, block_sparse_from_mask, block_sparse_from_rules,
                    causal_block_sparse, document_block_sparse)

__all__ += ["BlockSparse", "alibi_slopes", "block_sparse_from_mask", "block_sparse_from_rules",
            "causal_block_sparse", "document_block_sparse"]
