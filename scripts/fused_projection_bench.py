"""TTT layer fwd+bwd on the CPU: q, k, v, the gate and the learning rate's logits in one GEMM
(TTTLayer.project, fused=True, what CUDA runs) vs one GEMM each (fused=False, what the CPU runs), timed in
alternation after a warm-up: medians and ranges of 15. Mamba backbone (share_qk, the gate), 2 x 512 tokens.
Usage: python scripts/fused_projection_bench.py THREADS D_MODEL HEADS"""
import statistics
import sys
import time
from functools import partial

import torch

from ttt_bench.models.ttt import TTTLayer

threads, d, H = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
torch.manual_seed(0)
layer = TTTLayer(d, H, share_qk=True, use_gate=True)
x = torch.randn(2, 512, d, requires_grad=True)


def step(fused: bool) -> float:
    layer.project = partial(TTTLayer.project, layer, fused=fused)
    start = time.perf_counter()
    layer(x).square().mean().backward()
    return time.perf_counter() - start


times = {True: [], False: []}
for fused in times:
    step(fused)
for _ in range(15):
    for fused in times:
        times[fused].append(step(fused))
for fused, t in times.items():
    low, high = 1e3 * min(t), 1e3 * max(t)
    print(f"fused={fused}: median {1e3 * statistics.median(t):.1f} ms, range {low:.1f}-{high:.1f}")
print(f"fused / separate: {statistics.median(times[True]) / statistics.median(times[False]):.3f}")
