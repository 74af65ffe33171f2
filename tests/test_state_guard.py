"""StateGuard (vktrain/runtime/delegate/state_guard.py) replaying the dispatches the planner gives it
(vktrain/backend/kernel_planning/state_guard.py) on lavapipe, through both device layers: the backup is the
state bit for bit, the flag says whether any word is NaN/inf exactly when numpy's isfinite does, and restore
puts the backup back. The training loop's use of it is tested in test_train_loop.py."""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.backend.kernel_planning.state_guard import plan_state_guard
from vktrain.runtime import Buffer
from vktrain.runtime.delegate.executor import SharedTensor
from vktrain.runtime.delegate.state_guard import StateGuard
from vktrain.serialization import graph as vk
from vktrain.serialization.dispatch import BufferBinding

SHAPES = {"optimizer.step": ((), vk.DType.FLOAT32), "a": ((3, 70), vk.DType.FLOAT32),
          "b": ((130, 5), vk.DType.FLOAT32), "h": ((33,), vk.DType.FLOAT16), "i": ((7,), vk.DType.INT32)}


def _state(rng):
    arrays = {}
    for name, (shape, dtype) in SHAPES.items():
        low, high = (-8, 4) if dtype == vk.DType.FLOAT16 else (-40, 38)  # denormals to near the largest
        values = rng.standard_normal(shape) * 10.0 ** rng.integers(low, high, shape)
        drawn = rng.integers(-2**31, 2**31, shape) if dtype == vk.DType.INT32 else values
        arrays[name] = np.asarray(drawn).astype(dtype.numpy_dtype)
    return arrays


def _upload(device, arrays):
    """Each tensor in a buffer of its own, at a nonzero offset (as the executor's shared state can be)."""
    buffers, shared = [], {}
    for name, array in arrays.items():
        dtype = SHAPES[name][1]
        buffer = Buffer(device, 256 + max(4, array.nbytes + 4))
        buffer.write(np.ascontiguousarray(array), 256)
        buffers.append(buffer)
        shared[name] = SharedTensor(buffer, 256, vk.TensorValue(dtype, SHAPES[name][0], name=name))
    return buffers, shared


def _guard(device, shared, staging):
    """The guard of `shared` (each tensor in a buffer of its own, keyed by its name) as the planner plans it."""
    plan = plan_state_guard([(name, BufferBinding(name, s.offset, -(-s.tensor.stored_nbytes // 4) * 4),
                              s.tensor.storage_dtype) for name, s in shared.items()])
    return StateGuard(device, plan, {name: s.buffer for name, s in shared.items()},
                      {name: s.tensor for name, s in shared.items()}, slots=2, staging=staging)


def _non_finite(arrays):
    return any(array.dtype.kind == "f" and not np.isfinite(array).all() for array in arrays.values())


@pytest.fixture(params=["vulkan", "vulkan-staging", "webgpu"])
def device_and_staging(request):
    """The device, and whether the guard's buffers take the discrete-GPU path (staging copies)."""
    return request.getfixturevalue("webgpu_device" if request.param == "webgpu" else "vk_device"), \
        request.param == "vulkan-staging"


@pytest.mark.parametrize("poison", [None, ("a", np.nan), ("b", np.inf), ("b", -np.inf), ("h", np.nan),
                                    ("h", -np.inf), ("optimizer.step", np.inf)])
def test_backup_flag_and_restore_match_numpy(device_and_staging, poison):
    device, staging = device_and_staging
    rng = np.random.default_rng(7)
    arrays = _state(rng)
    if poison is not None:
        name, value = poison
        arrays[name].flat[rng.integers(arrays[name].size)] = value
    buffers, shared = _upload(device, arrays)
    try:
        with _guard(device, shared, staging) as guard:
            assert guard.save(1) == _non_finite(arrays) == (poison is not None)
            for name, backup in guard.read(1).items():
                assert backup.dtype == arrays[name].dtype
                assert backup.shape == arrays[name].shape and backup.tobytes() == arrays[name].tobytes(), name
            clean = _state(np.random.default_rng(8))  # finite: the flag clears on the next save
            for name, array in clean.items():
                shared[name].buffer.write(np.ascontiguousarray(array), 256)
            assert guard.save(0) is False
            guard.restore(1)  # slot 1 (the first arrays) back into the state
            for name, array in arrays.items():
                stored = shared[name].buffer.read(array.dtype, array.shape, 256)
                assert stored.tobytes() == array.tobytes(), name
            assert guard.save(0) == (poison is not None)
            assert [guard.read(0)[name].tobytes() for name in arrays] == [a.tobytes() for a in arrays.values()]
    finally:
        for buffer in buffers:
            buffer.destroy()
