"""Kernel families: each module registers its plan functions into `KERNELS` (see registry.py) under the
op keys they implement.

Importing this package imports every module in it, so that `KERNELS` is complete: a new family is a new
module here, nothing else.
"""
import importlib
import pkgutil

from vktrain.backend.kernel_planning.kernels.registry import KERNELS, get_kernel, register_kernel

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["KERNELS", "get_kernel", "register_kernel"]
