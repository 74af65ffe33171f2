"""The et_vk-op LoRA LM of tests/test_etvk_step.py (also trained from the command line by
tests/test_runner_gaps.py): a frozen 4-bit base through upstream's et_vk ops, LoRA tensors, and one
hand-written step with its hyper-parameters traced in as Python floats."""
from __future__ import annotations

import numpy as np
import torch
import executorch.backends.vulkan.custom_ops_lib as upstream  # registers torch.ops.et_vk

from vktrain.quant import quantize

VOCAB, DIM, HIDDEN, RANK, GROUP = 64, 32, 48, 4, 16
BATCH = (2, 8)
STEPS = 10
LORA_SCALE = 2.0
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
# Traced as they are: an et_vk step cannot take them from its inputs (adamw_step's schema takes floats).
BIAS_CORRECTIONS = (1 - BETAS[0], 1 - BETAS[1])
N_VALID = float(BATCH[0] * (BATCH[1] - 1))   # the last position of every row is ignored (label -100)
LORA = ("l1", "l2")


class Float64Ops:
    """The et_vk ops in float64: upstream's CPU implementations where they take any dtype, and the 4-bit
    linears as products with the dequantized weight (upstream's own unpacking)."""

    @staticmethod
    def _dequantized(weights, scales, group_size, K):
        q = upstream.unpack_4bit_weight_tensor(weights, torch.empty(K)).to(torch.float64)
        return q * scales.t().to(torch.float64).repeat_interleave(group_size, dim=1)

    def linear_q4gsw(self, x, weights, scales, group_size):
        return x @ self._dequantized(weights, scales, group_size, x.shape[-1]).t()

    def linear_q4gsw_backward(self, d_out, weights, scales, group_size):
        return d_out @ self._dequantized(weights, scales, group_size, 2 * weights.shape[1])

    fused_ce = staticmethod(upstream.fused_ce_impl)
    linear_dW = staticmethod(upstream.linear_dW_impl)
    adamw_step = staticmethod(upstream.adamw_step_impl)


class EtvkLoraLM(torch.nn.Module):
    """Embedding -> 4-bit linear + LoRA -> ReLU -> 4-bit linear + LoRA (residual) -> 4-bit head, trained
    by one hand-written step: forward, fused CE, backward, AdamW."""

    def __init__(self, seed: int = 0, ops=None, dtype=torch.float32) -> None:
        super().__init__()
        self.ops = ops if ops is not None else torch.ops.et_vk
        rng = np.random.default_rng(seed)
        self.register_buffer("embedding", torch.from_numpy(rng.standard_normal((VOCAB, DIM))).to(dtype))
        shapes = {"l1": (HIDDEN, DIM), "l2": (DIM, HIDDEN), "head": (VOCAB, DIM)}
        for name, (n, k) in shapes.items():
            weights, scales = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), GROUP)
            self.register_buffer(f"{name}_weights", torch.from_numpy(weights))
            self.register_buffer(f"{name}_scales", torch.from_numpy(scales))
        for name in LORA:
            n, k = shapes[name]
            for tensor, shape in (("A", (RANK, k)), ("B", (n, RANK))):
                self.register_buffer(f"{name}_{tensor}", torch.from_numpy(0.1 * rng.standard_normal(shape)).to(dtype))
                self.register_buffer(f"{name}_{tensor}_m", torch.zeros(shape, dtype=dtype))
                self.register_buffer(f"{name}_{tensor}_v", torch.zeros(shape, dtype=dtype))

    def _linear(self, name, x):
        u = x @ getattr(self, f"{name}_A").t()
        base = self.ops.linear_q4gsw(x, getattr(self, f"{name}_weights"), getattr(self, f"{name}_scales"), GROUP)
        return base + LORA_SCALE * (u @ getattr(self, f"{name}_B").t()), u

    def _linear_backward(self, name, d_y, x, u, grads):
        B = getattr(self, f"{name}_B")
        grads[f"{name}_B"] = self.ops.linear_dW(d_y, u) * LORA_SCALE
        d_u = (d_y @ B) * LORA_SCALE
        grads[f"{name}_A"] = self.ops.linear_dW(d_u, x)
        base = self.ops.linear_q4gsw_backward(d_y, getattr(self, f"{name}_weights"), getattr(self, f"{name}_scales"),
                                              GROUP)
        return base + d_u @ getattr(self, f"{name}_A")

    def forward(self, token_ids, labels):
        x = torch.nn.functional.embedding(token_ids.reshape(-1), self.embedding)
        h, u1 = self._linear("l1", x)
        a = torch.relu(h)
        y, u2 = self._linear("l2", a)
        r = x + y
        logits = self.ops.linear_q4gsw(r, self.head_weights, self.head_scales, GROUP)
        loss, d_logits = self.ops.fused_ce(logits, labels.reshape(-1), N_VALID)

        grads = {}
        d_r = self.ops.linear_q4gsw_backward(d_logits, self.head_weights, self.head_scales, GROUP)
        d_a = self._linear_backward("l2", d_r, a, u2, grads)
        d_h = torch.ops.aten.threshold_backward(d_a, a, 0.0)
        self._linear_backward("l1", d_h, x, u1, grads)
        for name, grad in grads.items():
            self.ops.adamw_step(getattr(self, name), getattr(self, f"{name}_m"), getattr(self, f"{name}_v"), grad,
                                LR, *BETAS, EPS, WEIGHT_DECAY, *BIAS_CORRECTIONS)
        return loss

    def lora_state(self) -> dict[str, np.ndarray]:
        return {f"{name}_{t}": getattr(self, f"{name}_{t}").detach().numpy().copy() for name in LORA for t in "AB"}


def training_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, STEPS times: the LM memorises it, so the loss must fall."""
    tokens = np.random.default_rng(3).integers(0, VOCAB, BATCH)
    labels = np.roll(tokens, -1, axis=1)
    labels[:, -1] = -100
    return [(torch.from_numpy(tokens), torch.from_numpy(labels))] * STEPS
