"""Kernel families: each module registers its plan functions into `KERNELS` (see registry.py).

Importing this package imports every family so that `KERNELS` is complete. To add a family, add one
import line below (nothing else).
"""
from vktrain.runtime.delegate.kernels.registry import KERNELS, get_kernel, register_kernel

from vktrain.runtime.delegate.kernels import linear  # noqa: E402,F401  (linear_q4gsw, linear_q4gsw_backward, linear_dW)
from vktrain.runtime.delegate.kernels import layout  # noqa: E402,F401  (view/permute/expand/clone/_to_copy/slice/select/cat copies)
from vktrain.runtime.delegate.kernels import elementwise  # noqa: E402,F401  (aten unary/binary elementwise ops, broadcasting)
from vktrain.runtime.delegate.kernels import reduction  # noqa: E402,F401  (aten.sum.dim_IntList, aten.mean.dim)
from vktrain.runtime.delegate.kernels import matmul  # noqa: E402,F401  (aten.mm, aten.bmm, aten.addmm, aten.baddbmm)
from vktrain.runtime.delegate.kernels import embedding  # noqa: E402,F401  (aten.embedding, aten.embedding_dense_backward)
from vktrain.runtime.delegate.kernels import cross_entropy  # noqa: E402,F401  (fused_ce)
from vktrain.runtime.delegate.kernels import optimizer  # noqa: E402,F401  (adamw)
from vktrain.runtime.delegate.kernels import requant  # noqa: E402,F401  (q4gsw_requant)
from vktrain.runtime.delegate.kernels import norm  # noqa: E402,F401  (rms_norm, rms_norm_backward)
from vktrain.runtime.delegate.kernels import rotary  # noqa: E402,F401  (rope)
from vktrain.runtime.delegate.kernels import attention  # noqa: E402,F401  (causal_attention, causal_attention_backward)
from vktrain.runtime.delegate.kernels import swiglu  # noqa: E402,F401  (swiglu, swiglu_backward)

__all__ = ["KERNELS", "get_kernel", "register_kernel"]
