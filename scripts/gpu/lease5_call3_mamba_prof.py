"""Lease 5, call 3: where Mamba's PyTorch chunked scan spends its time at 2 x 34,816 tokens, size s.

`python scripts/gpu/lease5_call3_mamba_prof.py [TOKENS]` with ttt-bench installed. Moved from
results/gpu/lease5/call3_mamba_prof.py (issue 51); its output is results/gpu/leases/lease5/call3_mamba_prof.txt.
"""
import sys
import time

import torch
from hydra.utils import instantiate
from ttt_bench.kernels.mamba import selective_scan

from ttt_bench.config import compose

dev = "cuda" if torch.cuda.is_available() else "cpu"
l = int(sys.argv[1]) if len(sys.argv) > 1 else 34816
b, d, n = 2, 256, 16
g = torch.Generator(device="cpu").manual_seed(0)
mk = lambda *s: torch.randn(*s, generator=g).to(dev).requires_grad_()
u, delta, z, B, C = mk(b, l, d), mk(b, l, d), mk(b, l, d), mk(b, l, n), mk(b, l, n)
A = (-torch.rand(d, n, generator=g)).to(dev).requires_grad_()
D, bias = mk(d), mk(d)


def timed(f, reps=3):
    f()
    torch.cuda.synchronize() if dev == "cuda" else None
    t = time.perf_counter()
    for _ in range(reps):
        f()
    torch.cuda.synchronize() if dev == "cuda" else None
    return (time.perf_counter() - t) / reps * 1000


for q in (None, 16, 64, 256, 1024):
    f = lambda q=q: selective_scan(u, delta, A, B, C, D, z, bias, delta_softplus=True, chunk_size=q,
                                   backend="torch").sum().backward()
    torch.cuda.reset_peak_memory_stats() if dev == "cuda" else None
    ms = timed(f)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
    print(f"scan chunk {q}: {ms:.1f} ms fwd+bwd, peak {peak:.1f} GiB", flush=True)

cfg = compose("train", ["data=books", "size=s", f"data.seq_len={l}", "model=mamba"])
model = instantiate(cfg.model, vocab_size=256).to(dev)
x = torch.randint(0, 256, (b, l), device=dev)


def step():
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        out = model(x)
    out.float().logsumexp(-1).mean().backward()


print(f"mamba size s model: {timed(step):.1f} ms fwd+bwd at {b} x {l}", flush=True)
acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
with torch.profiler.profile(activities=acts) as p:
    step()
key = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
print(p.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=40))
