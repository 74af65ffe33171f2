"""Kernel families: each module registers its plan functions into `KERNELS` (see registry.py).

Importing this package imports every family so that `KERNELS` is complete. To add a family, add one
import line below (nothing else).
"""
from .registry import KERNELS, get_kernel, register_kernel

from . import linear  # noqa: E402,F401  (linear_q4gsw, linear_q4gsw_backward, linear_dW)
from . import layout  # noqa: E402,F401  (view/permute/expand/clone/_to_copy/slice/select/cat copies)
from . import elementwise  # noqa: E402,F401  (aten unary/binary elementwise ops, broadcasting)
from . import reduction  # noqa: E402,F401  (aten.sum.dim_IntList, aten.mean.dim)
from . import matmul  # noqa: E402,F401  (aten.mm, aten.bmm, aten.addmm, aten.baddbmm)
from . import embedding  # noqa: E402,F401  (aten.embedding, aten.embedding_dense_backward)
from . import cross_entropy  # noqa: E402,F401  (fused_ce)
from . import optimizer  # noqa: E402,F401  (adamw)
from . import requant  # noqa: E402,F401  (q4gsw_requant)
from . import norm  # noqa: E402,F401  (rms_norm, rms_norm_backward)
from . import rotary  # noqa: E402,F401  (rope)
from . import attention  # noqa: E402,F401  (causal_attention, causal_attention_backward)
from . import swiglu  # noqa: E402,F401  (swiglu, swiglu_backward)

__all__ = ["KERNELS", "get_kernel", "register_kernel"]
