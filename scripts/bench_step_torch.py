"""The PyTorch side of scripts/bench_step.py: the same LoRA training step written in eager PyTorch, and its
timing in each precision a user of the GPU would pick.

EagerLlamaLoRA is a Llama written with standard ops (q4gsw bases dequantized on the GPU every step from
the packed codes and scales the .pte holds, LoRA adapters, RMSNorm, rope, SDPA with GQA by
repeat_interleave, SwiGLU, F.cross_entropy) with fused AdamW on the LoRA tensors; `config` is
bench_step's BenchConfig, `arrays` its baseline_arrays (the blob's weights), so both sides start from the
same weights. TORCH_VARIANTS: variant -> (TF32 matmuls, bf16 autocast, torch.compile of the loss).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np

TORCH_VARIANTS = {"fp32": (False, False, False), "tf32": (True, False, False), "bf16": (False, True, False),
                  "bf16_compile": (False, True, True)}


def torch_dequantize(torch, flat, scales, group_size: int):
    """deq(W) [N, K] float32 on flat's device, from flat codes uint8 [N, Kp/2] (even k in the low nibble,
    w4x8.md) and scales [G, N]: the per-step work of the eager baseline."""
    n, k = flat.shape[0], scales.shape[0] * group_size
    codes = torch.stack((flat & 0xF, flat >> 4), dim=-1).reshape(n, -1)[:, :k]
    return (codes.to(torch.float32) - 8.0) * scales.t().repeat_interleave(group_size, dim=1)


class EagerLlamaLoRA:
    """The same training step in plain PyTorch (see the module docstring); weights from baseline_arrays."""

    def __init__(self, torch, device, config, arrays: dict[str, np.ndarray], *, hparams: tuple[float, ...],
                 autocast_bf16: bool = False, compile_loss: bool = False):
        self.torch, self.F = torch, torch.nn.functional
        self.device, self.config = device, config
        self.autocast_bf16 = autocast_bf16
        # Only the loss is compiled: the optimizer step is already one fused kernel per tensor group.
        self.loss_fn = torch.compile(self.loss) if compile_loss else self.loss
        m = config.model
        self.n_layers, self.n_heads, self.n_kv_heads = m["n_layers"], m["n_heads"], m["n_kv_heads"]
        self.head_dim = m["dim"] // m["n_heads"]
        self.eps = m["norm_eps"]
        self.scaling = config.lora_alpha / config.lora_rank

        def on_device(array, requires_grad=False):
            # A copy: on the CPU, from_numpy(...).to(device) would share the (cached) host array, and the
            # optimizer would then train it in place.
            tensor = torch.tensor(np.ascontiguousarray(array), device=device)
            return tensor.requires_grad_(requires_grad)

        self.embed = on_device(arrays["embed"])
        self.lm_head = on_device(arrays["lm_head"]) if "lm_head" in arrays else self.embed
        self.norm = on_device(arrays["norm"])
        self.rope_cos, self.rope_sin = on_device(arrays["rope_cos"]), on_device(arrays["rope_sin"])
        self.layers = []
        self.lora_params = []
        for layer in range(self.n_layers):
            entry = {"input_norm": on_device(arrays[f"{layer}.input_norm"]),
                     "post_norm": on_device(arrays[f"{layer}.post_norm"])}
            for target in config.lora_targets:
                lora_a = on_device(arrays[f"{layer}.{target}.lora_A"], requires_grad=True)
                lora_b = on_device(arrays[f"{layer}.{target}.lora_B"], requires_grad=True)
                self.lora_params += [lora_a, lora_b]
                entry[target] = (on_device(arrays[f"{layer}.{target}.weights"]),
                                 on_device(arrays[f"{layer}.{target}.scales"]), lora_a, lora_b)
            self.layers.append(entry)
        lr, beta1, beta2, eps, weight_decay = hparams
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.lora_params, lr=lr, betas=(beta1, beta2), eps=eps,
                                           weight_decay=weight_decay, **fused)

    def lora_linear(self, x, params):
        flat, scales, lora_a, lora_b = params
        base = self.F.linear(x, torch_dequantize(self.torch, flat, scales, self.config.group_size))
        return base + self.F.linear(self.F.linear(x, lora_a) * self.scaling, lora_b)

    def rms_norm(self, x, weight):
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def loss(self, token_ids, labels, n_valid):
        F = self.F
        batch, seq = token_ids.shape
        cos, sin = self.rope_cos[:seq, None, :], self.rope_sin[:seq, None, :]  # [S, 1, D/2] over heads
        h = F.embedding(token_ids, self.embed)
        groups = self.n_heads // self.n_kv_heads
        for layer in self.layers:
            x = self.rms_norm(h, layer["input_norm"])
            q = self.lora_linear(x, layer["q_proj"]).view(batch, seq, self.n_heads, self.head_dim)
            k = self.lora_linear(x, layer["k_proj"]).view(batch, seq, self.n_kv_heads, self.head_dim)
            v = self.lora_linear(x, layer["v_proj"]).view(batch, seq, self.n_kv_heads, self.head_dim)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim))
            attn = attn.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)
            h = h + self.lora_linear(attn, layer["o_proj"])
            x = self.rms_norm(h, layer["post_norm"])
            gate, up = self.lora_linear(x, layer["gate_proj"]), self.lora_linear(x, layer["up_proj"])
            h = h + self.lora_linear(F.silu(gate) * up, layer["down_proj"])
        logits = F.linear(self.rms_norm(h, self.norm), self.lm_head)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum") / n_valid

    def step(self, token_ids, labels, n_valid):
        self.optimizer.zero_grad(set_to_none=True)
        with self.torch.autocast(self.device.type, dtype=self.torch.bfloat16, enabled=self.autocast_bf16):
            loss = self.loss_fn(token_ids, labels, n_valid)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def time_torch(torch, device, config, arrays, batches, warmup: int, steps: int,
               variant: str = "fp32", *, hparams: tuple[float, ...]) -> dict[str, Any]:
    """Time the eager step in one of TORCH_VARIANTS (TF32 flags are restored to off afterwards)."""
    tf32, autocast_bf16, compile_loss = TORCH_VARIANTS[variant]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if compile_loss:
        # Each shape compiled for itself, as in a process of its own: when the same code is recompiled for new
        # sizes (the call's previous shape or model), dynamo otherwise marks them dynamic.
        torch._dynamo.reset()
    try:
        result = _time_torch_steps(torch, device, config, EagerLlamaLoRA(
            torch, device, config, arrays, hparams=hparams, autocast_bf16=autocast_bf16, compile_loss=compile_loss),
            batches, warmup, steps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    result["variant"] = variant
    if cuda:
        result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.empty_cache()  # the model is gone: its cached blocks go back before vktrain's next load
    return result


def _time_torch_steps(torch, device, config, model, batches, warmup: int, steps: int) -> dict[str, Any]:
    cuda = device.type == "cuda"
    on_device = [(torch.from_numpy(t).to(device), torch.from_numpy(l).to(device),
                  torch.tensor(float(np.count_nonzero(l >= 0)), device=device)) for t, l in batches]
    losses, samples, first_step_s = [], [], None
    for index in range(warmup + steps):
        inputs = on_device[index % len(on_device)]
        wall_start = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(model.step(*inputs))
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) * 1e-3
        else:
            begin = time.perf_counter()
            losses.append(model.step(*inputs))
            elapsed = time.perf_counter() - begin
        if index == 0:
            first_step_s = time.perf_counter() - wall_start  # includes torch.compile's compilation
        if index >= warmup:
            samples.append(elapsed)
    median_s = statistics.median(samples)
    return {"ms_per_step": 1e3 * median_s, "ms_per_step_mean": 1e3 * statistics.fmean(samples),
            "ms_per_step_min": 1e3 * min(samples), "tokens_per_s": config.tokens / median_s,
            "first_step_s": first_step_s, "timing": "CUDA events" if cuda else "wall clock",
            "losses": [float(l) for l in losses]}


def load_torch(requested: str | None):
    """(torch module, device, None), or (None, None, why there is no baseline)."""
    try:
        import torch
    except ImportError:
        return None, None, "torch is not installed"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if requested == "cuda" and not torch.cuda.is_available():
        return None, None, "--torch-device cuda but CUDA is not available"
    return torch, torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu")), None
