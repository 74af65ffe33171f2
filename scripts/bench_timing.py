"""PyTorch CUDA timing shared by the benchmark scripts (bench_kernels.py, bench_coopmat.py,
bench_coopmat_attention.py): the median of CUDA-event times, the reference side of their comparisons."""
from __future__ import annotations

import statistics
from typing import Any, Callable


def median_cuda_ms(torch, run: Callable[[], Any], replays: int, warmup: int) -> float:
    """Median milliseconds of `run()` on the current CUDA stream over `replays` calls, each between two
    CUDA events, after `warmup` untimed calls and a synchronize."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)
