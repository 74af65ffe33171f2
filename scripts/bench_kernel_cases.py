"""The cases scripts/bench_kernels.py times: per kernel family, the shapes (presets "quick", "smollm2",
"full"), how to build the Vulkan work (plans from the kernel registry, buffers, a result reader) and
the same computation in PyTorch, plus the alternative tilings its --sweep tries.

CASE_BUILDERS maps each kernel name to the builder of its family's cases; PRESET_BUILDERS take the shape
preset, the others the --quick flag; TUNED_KERNELS are the kernels whose plans take a device tuning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from vktrain import quant
from vktrain.runtime import Buffer
from vktrain.backend.kernel_planning.kernels import KERNELS

@dataclass
class Case:
    """One benchmark: how to build the Vulkan work and the PyTorch equivalent."""

    kernel: str
    shape: dict[str, int]
    nbytes: int  # minimum traffic
    flops: int | None
    # setup(device, limits) -> (dispatches, {key: Buffer}, read_result() -> np.ndarray)
    setup_vk: Callable[..., tuple[list, dict, Callable[[], np.ndarray]]]
    # setup(torch, device) -> (run() -> tensor, result_as_numpy(tensor) -> np.ndarray)
    setup_torch: Callable[..., tuple[Callable[[], Any], Callable[[Any], np.ndarray]]]
    notes: dict[str, Any] = field(default_factory=dict)



# ----------------------------------------------------------------------------------- torch helpers
def torch_dequantize(torch, flat, scales, group_size: int, K: int):
    """deq(W) [N, K] fp32 from flat uint8 [N, Kp/2] and scales [G, N], on flat's device."""
    N = flat.shape[0]
    codes = torch.stack((flat & 0xF, flat >> 4), dim=-1).reshape(N, -1)[:, :K]
    return (codes.to(torch.float32) - 8.0) * scales.t().repeat_interleave(group_size, dim=1)



# ----------------------------------------------------------------------------------- linear family
# SmolLM2-135M (hidden 576, kv 192, MLP 1536, vocab 49152), LoRA rank 8, a step of 64 tokens.
SMOLLM2_TOKENS = 64
SMOLLM2_LINEARS = ((576, 576), (192, 576), (1536, 576), (576, 1536))  # (N, K): q/o, k/v, gate/up, down
SMOLLM2_SMALL_M = (1, 4, 9)  # around the GEMV thresholds (linear.GEMV_MAX_ROWS, GEMV_MAX_M)


def _linear_cases(preset: str, rng) -> list[Case]:
    from vktrain.backend.kernel_planning.kernels.linear import prepack_weights

    group_size = 32
    if preset == "quick":
        shapes = [(N, 256, (1, 64)) for N in (256, 512)]
    elif preset == "smollm2":
        shapes = [(N, K, (SMOLLM2_TOKENS,) + (SMOLLM2_SMALL_M if (N, K) == (576, 576) else ()))
                  for N, K in SMOLLM2_LINEARS]
    else:
        shapes = [(N, 2048, (1, 128, 512, 2048)) for N in (2048, 8192)]
    cases = []
    for N, K, Ms in shapes:
        W = rng.standard_normal((N, K)).astype(np.float32) * 0.02
        flat, scales = quant.quantize(W, group_size)
        words = prepack_weights(flat, K)
        w_bytes = flat.nbytes + scales.nbytes
        for M in Ms:
            x = rng.standard_normal((M, K)).astype(np.float32)
            d_out = rng.standard_normal((M, N)).astype(np.float32)
            shape = dict(M=M, N=N, K=K, group_size=group_size)
            cases.append(_linear_forward_case(shape, x, flat, scales, words, w_bytes))
            cases.append(_linear_backward_case(shape, d_out, flat, scales, words, w_bytes))
            if preset != "smollm2":  # the LoRA step computes no base weight gradient
                cases.append(_linear_dw_case(shape, d_out, x))
    return cases


def _linear_setup(plan_name: str, plan_kwargs: dict, arrays: dict[str, np.ndarray], out_shape):
    """Vulkan setup of a linear-family case. `overrides` (tiles, split_k) come from --sweep; the
    default plan gets a split-K scratch buffer whenever it would use one."""
    from vktrain.backend.kernel_planning.kernels.gemm_passes import split_k_scratch_nbytes
    from vktrain.backend.kernel_planning.kernels.linear import plan_scratch_nbytes

    def setup(device, limits, **overrides):
        buffers = {key: Buffer.from_array(device, a, name=key) for key, a in arrays.items()}
        buffers["out"] = Buffer(device, 4 * int(np.prod(out_shape)), name="out")
        kwargs = dict(plan_kwargs, shared_memory_bytes=limits.max_compute_shared_memory_size, **overrides)
        M, N, K = kwargs["M"], kwargs["N"], kwargs["K"]
        if "split_k" in overrides:
            rows, cols = {"linear_q4gsw": (M, N), "linear_q4gsw_backward": (M, K), "linear_dW": (N, K)}[plan_name]
            scratch = split_k_scratch_nbytes(rows, cols, overrides["split_k"])
        else:
            scratch = plan_scratch_nbytes(plan_name, M=M, N=N, K=K, group_size=kwargs.get("group_size", 0),
                                          **_tuning_of(overrides))
        if scratch:
            buffers["scratch"] = Buffer(device, scratch, name="scratch")
            kwargs["scratch"] = "scratch"
        dispatches = KERNELS[f"vktrain.{plan_name}.default"](**kwargs)
        return dispatches, buffers, lambda: buffers["out"].read(np.float32, out_shape)
    return setup


def linear_sweep(plan_name: str, shape: dict[str, int]) -> list[dict[str, Any]]:
    """Alternative configurations --sweep times for a linear case (the default runs anyway)."""
    from vktrain.backend.kernel_planning.kernels.linear import GEMV_MAX_ROWS, GemmTiles, GemvTiles, default_split_k

    M, N, K = shape["M"], shape["N"], shape["K"]
    if plan_name != "linear_dW" and M <= GEMV_MAX_ROWS:
        pairs = ([(1, 64), (1, 128), (1, 256), (2, 64), (2, 128), (4, 32), (4, 64), (8, 32)]
                 if plan_name == "linear_q4gsw" else [(32, 8), (32, 2), (64, 4), (64, 1), (128, 2), (128, 1), (256, 1)])
        return [dict(tiles=GemvTiles(x, y, M)) for x, y in pairs]
    rows, cols, red = {"linear_q4gsw": (M, N, K), "linear_q4gsw_backward": (M, K, N), "linear_dW": (N, K, M)}[plan_name]
    configs = []
    for tiles in (GemmTiles(16, 16, 16), GemmTiles(16, 16, 8), GemmTiles(16, 16, 32), GemmTiles(16, 8, 16),
                  GemmTiles(8, 16, 16), GemmTiles(8, 8, 16)):
        splits = {1, default_split_k(rows, cols, red, tiles)}
        configs += [dict(tiles=tiles, split_k=split) for split in sorted(splits)]
    return configs


def mm_sweep(shape: dict[str, int]) -> list[dict[str, Any]]:
    """The split-K counts --sweep times for an aten.mm case besides the default plan's: unsplit, and the
    powers of two the default could pick (for the skinny LoRA products: one dispatch instead of two)."""
    from vktrain.backend.kernel_planning.kernels.matmul import MAX_SPLIT_K, default_split_k

    default = default_split_k(1, shape["M"], shape["N"], shape["K"])
    return [dict(split_k=split) for split in (1, 2, 4, 8, 16, MAX_SPLIT_K) if split != default]


def _linear_forward_case(shape, x, flat, scales, words, w_bytes) -> Case:
    M, N, K, gs = shape["M"], shape["N"], shape["K"], shape["group_size"]

    def setup_torch(torch, dev):
        x_t = torch.from_numpy(x).to(dev)
        flat_t, scales_t = torch.from_numpy(flat).to(dev), torch.from_numpy(scales).to(dev)
        return (lambda: x_t @ torch_dequantize(torch, flat_t, scales_t, gs, K).t()), (lambda y: y.cpu().numpy())

    return Case("linear_q4gsw", shape, x.nbytes + w_bytes + 4 * M * N, 2 * M * N * K,
                _linear_setup("linear_q4gsw", dict(M=M, N=N, K=K, group_size=gs, out="out", x="x", weights="w",
                                                   scales="s"), {"x": x, "w": words, "s": scales}, (M, N)),
                setup_torch)


def _linear_backward_case(shape, d_out, flat, scales, words, w_bytes) -> Case:
    M, N, K, gs = shape["M"], shape["N"], shape["K"], shape["group_size"]

    def setup_torch(torch, dev):
        d_t = torch.from_numpy(d_out).to(dev)
        flat_t, scales_t = torch.from_numpy(flat).to(dev), torch.from_numpy(scales).to(dev)
        return (lambda: d_t @ torch_dequantize(torch, flat_t, scales_t, gs, K)), (lambda y: y.cpu().numpy())

    return Case("linear_q4gsw_backward", shape, d_out.nbytes + w_bytes + 4 * M * K, 2 * M * N * K,
                _linear_setup("linear_q4gsw_backward", dict(M=M, N=N, K=K, group_size=gs, out="out", d_out="d",
                                                            weights="w", scales="s"),
                              {"d": d_out, "w": words, "s": scales}, (M, K)),
                setup_torch)


def _linear_dw_case(shape, d_out, x) -> Case:
    M, N, K = shape["M"], shape["N"], shape["K"]

    def setup_torch(torch, dev):
        d_t, x_t = torch.from_numpy(d_out).to(dev), torch.from_numpy(x).to(dev)
        return (lambda: d_t.t() @ x_t), (lambda y: y.cpu().numpy())

    return Case("linear_dW", dict(M=M, N=N, K=K), d_out.nbytes + x.nbytes + 4 * N * K, 2 * M * N * K,
                _linear_setup("linear_dW", dict(M=M, N=N, K=K, out="out", d_out="d", x="x"), {"d": d_out, "x": x},
                              (N, K)),
                setup_torch)


def _tuning_of(overrides: dict) -> dict:
    return {"tuning": overrides["tuning"]} if "tuning" in overrides else {}


# ----------------------------------------------------------------------------------- aten.mm
def _mm_cases(preset: str, rng) -> list[Case]:
    """aten.mm as the LoRA step runs it: operands that are transposed weights or activations are strided
    views read in place (kernels/matmul.py)."""
    from vktrain.serialization.strided_view import StridedView

    T, D, r, V = SMOLLM2_TOKENS, 576, 8, 49152
    if preset == "quick":
        T, D, V = 16, 64, 1000
    # (what, A storage shape, A transposed?, B storage shape, B transposed?)
    products = [
        ("lora_down x @ A^T", (T, D), False, (r, D), True),
        ("lora_up h @ B^T", (T, r), False, (D, r), True),
        ("lora_dA dh^T @ x", (T, r), True, (T, D), False),
        ("lora_dB dy^T @ h", (T, D), True, (T, r), False),
        ("head x @ E^T", (T, D), False, (V, D), True),
        ("head_dx dlogits @ E", (T, V), False, (V, D), False),
    ]
    if preset not in ("quick", "smollm2"):
        # The head, and the LoRA r16 products of Llama-3.2-1B at 4 x 512 tokens (hidden 2048, MLP 8192):
        # the skinny ones with their split-K (--sweep times them unsplit and at other splits too).
        T, r = 2048, 16
        products = products[4:] + [
            ("lora_down x @ A^T", (T, 2048), False, (r, 2048), True),
            ("lora_down x @ A^T", (T, 8192), False, (r, 8192), True),
            ("lora_up h @ B^T", (T, r), False, (2048, r), True),
            ("lora_dx dh @ A", (T, r), False, (r, 2048), False),
            ("lora_dh dy @ B", (T, 2048), False, (2048, r), False),
            ("lora_dA dh^T @ x", (T, r), True, (T, 2048), False),
            ("lora_dB dy^T @ h", (T, 2048), True, (T, r), False),
        ]
    cases = []
    for what, a_shape, a_t, b_shape, b_t in products:
        a = rng.standard_normal(a_shape).astype(np.float32)
        b = rng.standard_normal(b_shape).astype(np.float32)
        a_op, b_op = (a.T if a_t else a), (b.T if b_t else b)
        M, K = a_op.shape
        N = b_op.shape[1]

        def view(shape, transposed):
            v = StridedView.contiguous(shape)
            return v.transpose(0, 1) if transposed else v

        def setup_vk(device, limits, a=a, b=b, a_view=view(a_shape, a_t), b_view=view(b_shape, b_t), M=M, N=N, K=K,
                     **overrides):
            from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_gemm, split_k_scratch_nbytes

            buffers = {"a": Buffer.from_array(device, a), "b": Buffer.from_array(device, b),
                       "out": Buffer(device, 4 * M * N)}
            scratch = (split_k_scratch_nbytes(1, M, N, overrides["split_k"]) if "split_k" in overrides
                       else gemm_scratch_nbytes(1, M, N, K, **_tuning_of(overrides)))
            if scratch:
                buffers["scratch"] = Buffer(device, scratch)
            dispatches = plan_gemm("out", "a", a_view, "b", b_view, scratch="scratch" if scratch else None,
                                   **overrides)
            return dispatches, buffers, lambda: buffers["out"].read(np.float32, (M, N))

        def setup_torch(torch, dev, a_op=a_op, b_op=b_op):
            a_t_, b_t_ = torch.from_numpy(np.ascontiguousarray(a_op)).to(dev), torch.from_numpy(
                np.ascontiguousarray(b_op)).to(dev)
            return (lambda: a_t_ @ b_t_), (lambda y: y.cpu().numpy())

        cases.append(Case("aten.mm.default", dict(M=M, N=N, K=K), 4 * (M * K + K * N + M * N), 2 * M * N * K,
                          setup_vk, setup_torch, notes={"what": what}))
    return cases


# ----------------------------------------------------------------------------------- other families
def _fused_ce_cases(quick: bool, rng) -> list[Case]:
    from vktrain.backend.kernel_planning.kernels.cross_entropy import fused_ce_scratch_nbytes

    V = 1000 if quick else 128256
    cases = []
    for R in ((16,) if quick else (512, 2048)):
        logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
        labels = rng.integers(0, V, size=R).astype(np.int32)
        labels[::7] = -100  # some ignored rows, as padding produces
        n_valid = np.array(np.count_nonzero(labels >= 0), dtype=np.float32)

        def setup_vk(device, limits, R=R, V=V, logits=logits, labels=labels, n_valid=n_valid):
            buffers = {"logits": Buffer.from_array(device, logits), "labels": Buffer.from_array(device, labels),
                       "n_valid": Buffer.from_array(device, n_valid), "loss": Buffer(device, 4),
                       "out": Buffer(device, logits.nbytes), "row_loss": Buffer(device, fused_ce_scratch_nbytes(R))}
            dispatches = KERNELS["vktrain.fused_ce.default"](R=R, V=V, logits="logits", labels="labels", n_valid="n_valid",
                                             loss="loss", dlogits="out", row_loss="row_loss")
            return dispatches, buffers, lambda: buffers["out"].read(np.float32, (R, V))

        def setup_torch(torch, dev, logits=logits, labels=labels, n_valid=n_valid):
            lg = torch.from_numpy(logits).to(dev)
            lb = torch.from_numpy(labels).to(dev).long()
            nv = torch.from_numpy(n_valid).to(dev)
            valid = lb >= 0
            safe = lb.clamp(min=0)
            rows = torch.arange(lg.shape[0], device=dev)

            def run():
                lse = torch.logsumexp(lg, dim=1)
                loss = ((lse - lg[rows, safe]) * valid).sum() / nv
                grad = torch.softmax(lg, dim=1)
                grad[rows, safe] -= 1.0
                grad *= (valid.to(lg.dtype) / nv)[:, None]
                return loss, grad

            return run, (lambda out: out[1].cpu().numpy())

        cases.append(Case("fused_ce", dict(R=R, V=V), 2 * logits.nbytes + labels.nbytes, None, setup_vk,
                          setup_torch))
    return cases


def _adamw_cases(quick: bool, rng) -> list[Case]:
    cases = []
    hparams = np.array([1e-3, 0.9, 0.999, 1e-8, 0.01], dtype=np.float32)
    for numel in ((4099,) if quick else (1 << 20, 1 << 24)):
        param = rng.standard_normal(numel).astype(np.float32)
        grad = rng.standard_normal(numel).astype(np.float32)

        def setup_vk(device, limits, numel=numel, param=param, grad=grad):
            buffers = {"out": Buffer.from_array(device, param), "m": Buffer.from_array(device, np.zeros_like(param)),
                       "v": Buffer.from_array(device, np.zeros_like(param)), "g": Buffer.from_array(device, grad),
                       "h": Buffer.from_array(device, hparams),
                       "t": Buffer.from_array(device, np.array(1.0, dtype=np.float32))}
            dispatches = KERNELS["vktrain.adamw.default"](numel=numel, param="out", exp_avg="m", exp_avg_sq="v", grad="g",
                                          hparams="h", step="t")
            return dispatches, buffers, lambda: buffers["out"].read(np.float32, (numel,))

        def setup_torch(torch, dev, param=param, grad=grad):
            p = torch.nn.Parameter(torch.from_numpy(param.copy()).to(dev))
            p.grad = torch.from_numpy(grad).to(dev)
            fused = dev.type == "cuda"
            opt = torch.optim.AdamW([p], lr=float(hparams[0]), betas=(float(hparams[1]), float(hparams[2])),
                                    eps=float(hparams[3]), weight_decay=float(hparams[4]), fused=fused or None)

            def run():
                opt.step()
                return p

            return run, (lambda t: t.detach().cpu().numpy())

        # Both sides take their first step from the same state before timing, so the first results
        # are compared (the timed repeats keep stepping; their values are not compared).
        cases.append(Case("adamw", dict(numel=numel), 7 * 4 * numel, None, setup_vk, setup_torch,
                          notes={"compare": "first step only"}))
    return cases


def _elementwise_cases(quick: bool, rng) -> list[Case]:
    """Same-shape contiguous add / mul (a training step's residual adds, gradient sums, SwiGLU and norm
    products; Llama-3.2-1B at 4 x 512 tokens: [2048, 2048] and [2048, 8192]) on the VEC4 variant the
    plan picks (vec4=1) and on the general variant (vec4=0: a thread per element, index arithmetic)."""
    from dataclasses import replace

    from vktrain.backend.kernel_planning.kernels.elementwise import plan_binary
    from vktrain.serialization.strided_view import StridedView
    from vktrain.backend.kernel_planning.kernels.layout import elementwise_groups

    cases = []
    for rows, cols in (((64, 260),) if quick else ((2048, 2048), (2048, 8192))):
        a = rng.standard_normal((rows, cols)).astype(np.float32)
        b = rng.standard_normal((rows, cols)).astype(np.float32)
        for op in ("add", "mul"):
            for vec4 in (1, 0):
                def setup_vk(device, limits, a=a, b=b, op=op, vec4=vec4):
                    view = StridedView.contiguous(a.shape)
                    (dispatch,) = plan_binary(op, "out", "a", view, "b", view, scalar0=1.0)
                    if not vec4:
                        dispatch = replace(dispatch, shader=dispatch.shader.removesuffix("+VEC4"),
                                           groups=elementwise_groups(a.size))
                    buffers = {"a": Buffer.from_array(device, a), "b": Buffer.from_array(device, b),
                               "out": Buffer(device, a.nbytes)}
                    return [dispatch], buffers, lambda: buffers["out"].read(np.float32, a.shape)

                def setup_torch(torch, dev, a=a, b=b, op=op):
                    ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
                    function = torch.add if op == "add" else torch.mul
                    return (lambda: function(ta, tb)), (lambda t: t.cpu().numpy())

                cases.append(Case(f"aten.{op}.Tensor", dict(rows=rows, cols=cols, vec4=vec4), 3 * a.nbytes, None,
                                  setup_vk, setup_torch))
    return cases


def _requant_cases(quick: bool, rng) -> list[Case]:
    K, group_size = (256, 32) if quick else (2048, 32)
    cases = []
    for N in ((256,) if quick else (2048, 8192)):
        latent = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        _, scales = quant.quantize(latent, group_size)
        words = quant.w4x8_num_words(N, K)

        def setup_vk(device, limits, N=N, latent=latent, scales=scales, words=words):
            buffers = {"latent": Buffer.from_array(device, latent), "s": Buffer.from_array(device, scales),
                       "out": Buffer(device, 4 * words)}
            dispatches = KERNELS["vktrain.q4gsw_requant.default"](N=N, K=K, group_size=group_size, out="out", latent="latent",
                                                  scales="s")
            # Compare codes in the flat layout (the kernel writes W_4X8 words).
            return dispatches, buffers, lambda: quant.unpack_w4x8(buffers["out"].read(np.uint32, (words,)), N, K)

        def setup_torch(torch, dev, N=N, latent=latent, scales=scales):
            lat = torch.from_numpy(latent).to(dev)
            s = torch.from_numpy(scales).to(dev).t().repeat_interleave(group_size, dim=1)

            def run():
                q = torch.where(s == 0, torch.zeros_like(lat), torch.round(lat / s)).clamp(-8, 7)
                codes = (q + 8).to(torch.uint8)
                pad = quant.padded_k(K) - K
                if pad:
                    codes = torch.cat([codes, torch.full((N, pad), 8, dtype=torch.uint8, device=dev)], dim=1)
                return codes[:, 0::2] | (codes[:, 1::2] << 4)

            return run, (lambda t: t.cpu().numpy())

        nbytes = latent.nbytes + scales.nbytes + 4 * words
        cases.append(Case("q4gsw_requant", dict(N=N, K=K, group_size=group_size), nbytes, None, setup_vk,
                          setup_torch, notes={"compare": "codes (fraction of mismatching bytes)"}))
    return cases


def _attention_cases(quick: bool, rng) -> list[Case]:
    """Causal GQA attention [B, S, H, D] (Llama-3.2-1B: Hq=32, Hkv=8, D=64). FLOPs count the causal
    half of the matmuls: 2 for the forward (q k^T, P v), 5 for the backward (the algorithm's, not the
    recomputation the deterministic kernels add)."""
    from vktrain.runtime import run_dispatches
    from vktrain.backend.kernel_planning.kernels.attention import causal_attention_backward_scratch_nbytes

    B, Hq, Hkv, D = (1, 4, 2, 64) if quick else (1, 32, 8, 64)
    cases = []
    for S in ((64,) if quick else (512, 2048)):
        q = rng.standard_normal((B, S, Hq, D)).astype(np.float32)
        k = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
        d_out = rng.standard_normal((B, S, Hq, D)).astype(np.float32)
        scale = 1.0 / math.sqrt(D)
        dims = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
        shape = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D)
        causal_mnk = B * Hq * S * S * D  # one causal [S, S] x [S, D] matmul: S*S*D/2 MACs = S*S*D flops

        def forward_plan(limits, dims=dims, scale=scale):
            return KERNELS["vktrain.causal_attention.default"](**dims, q="q", k="k", v="v", out="out", lse="lse", scale=scale,
                                               shared_memory_bytes=limits.max_compute_shared_memory_size)

        def setup_forward(device, limits, q=q, k=k, v=v, S=S, forward_plan=forward_plan):
            buffers = {"q": Buffer.from_array(device, q), "k": Buffer.from_array(device, k),
                       "v": Buffer.from_array(device, v), "out": Buffer(device, q.nbytes),
                       "lse": Buffer(device, 4 * B * Hq * S)}
            return forward_plan(limits), buffers, lambda: buffers["out"].read(np.float32, q.shape)

        def setup_backward(device, limits, q=q, k=k, v=v, d_out=d_out, S=S, dims=dims, scale=scale,
                           forward_plan=forward_plan):
            buffers = {"q": Buffer.from_array(device, q), "k": Buffer.from_array(device, k),
                       "v": Buffer.from_array(device, v), "d_out": Buffer.from_array(device, d_out),
                       "out": Buffer(device, q.nbytes), "lse": Buffer(device, 4 * B * Hq * S),
                       "d_q": Buffer(device, q.nbytes), "d_k": Buffer(device, k.nbytes),
                       "d_v": Buffer(device, v.nbytes),
                       "delta": Buffer(device, causal_attention_backward_scratch_nbytes(B, S, Hq))}
            run_dispatches(device, forward_plan(limits), buffers)  # out and lse, outside the timing
            dispatches = KERNELS["vktrain.causal_attention_backward.default"](
                **dims, d_out="d_out", q="q", k="k", v="v", out="out", lse="lse", d_q="d_q", d_k="d_k", d_v="d_v",
                delta="delta", scale=scale, shared_memory_bytes=limits.max_compute_shared_memory_size)

            def read():
                return np.concatenate([buffers[name].read(np.float32, a.shape).ravel()
                                       for name, a in (("d_q", q), ("d_k", k), ("d_v", v))])
            return dispatches, buffers, read

        def torch_inputs(torch, dev, q=q, k=k, v=v, requires_grad=False):
            # SDPA wants [B, H, S, D]; enable_gqa maps query head h to kv head h // (Hq / Hkv) as vktrain does.
            return [torch.from_numpy(a).to(dev).transpose(1, 2).contiguous().requires_grad_(requires_grad)
                    for a in (q, k, v)]

        def setup_torch_forward(torch, dev, torch_inputs=torch_inputs, scale=scale):
            tq, tk, tv = torch_inputs(torch, dev)
            run = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                tq, tk, tv, is_causal=True, scale=scale, enable_gqa=True)
            return run, (lambda out: out.transpose(1, 2).cpu().numpy())

        def setup_torch_backward(torch, dev, torch_inputs=torch_inputs, d_out=d_out, scale=scale):
            leaves = torch_inputs(torch, dev, requires_grad=True)
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale,
                                                                   enable_gqa=True)
            grad = torch.from_numpy(d_out).to(dev).transpose(1, 2)
            run = lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)  # noqa: E731
            return run, (lambda grads: np.concatenate([g.transpose(1, 2).cpu().numpy().ravel() for g in grads]))

        io_fwd = q.nbytes + k.nbytes + v.nbytes + q.nbytes + 4 * B * Hq * S
        io_bwd = 3 * q.nbytes + 2 * (k.nbytes + v.nbytes) + q.nbytes + 4 * B * Hq * S
        cases.append(Case("causal_attention", shape, io_fwd, 2 * causal_mnk, setup_forward, setup_torch_forward))
        cases.append(Case("causal_attention_backward", shape, io_bwd, 5 * causal_mnk, setup_backward,
                          setup_torch_backward))
    return cases


CASE_BUILDERS = {
    "linear_q4gsw": _linear_cases, "linear_q4gsw_backward": _linear_cases, "linear_dW": _linear_cases,
    "fused_ce": _fused_ce_cases, "adamw": _adamw_cases, "q4gsw_requant": _requant_cases,
    "causal_attention": _attention_cases, "causal_attention_backward": _attention_cases,
    "aten.mm.default": _mm_cases, "aten.add.Tensor": _elementwise_cases, "aten.mul.Tensor": _elementwise_cases,
}
# Builders taking the shape preset ("quick", "smollm2", "full") rather than the --quick flag.
PRESET_BUILDERS = (_linear_cases, _mm_cases)
# Kernels whose plans take a device tuning (--tunings).
TUNED_KERNELS = ("linear_q4gsw", "linear_q4gsw_backward", "aten.mm.default")
