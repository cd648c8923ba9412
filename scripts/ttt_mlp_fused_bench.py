"""TTT-MLP layer fwd+bwd on CPU, eager vs fused (each mini-batch's state compiled, issue 49): medians of 5.
Usage: python scripts/ttt_mlp_fused_bench.py THREADS D_MODEL  (4 heads, 2 x 512 tokens, mini-batch 16)"""
import statistics, sys, time, torch
from ttt_bench.models.ttt import TTTLayer
torch.manual_seed(0); torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
d, H = int(sys.argv[2]), 4
T, B = 512, 2  # 32 mini-batches of 16
layers = {f: TTTLayer(d, H, learner="mlp", mini_batch_size=16, fused=f) for f in (False, True)}
layers[True].load_state_dict(layers[False].state_dict())
x = torch.randn(B, T, d)
def step(layer):
    layer.zero_grad(set_to_none=True); layer(x).square().mean().backward()
for f, layer in layers.items():
    for _ in range(2): step(layer)  # warm-up (compiles)
times = {False: [], True: []}
for _ in range(5):
    for f, layer in layers.items():
        t = time.perf_counter(); step(layer); times[f].append(time.perf_counter() - t)
for f in (False, True):
    print(f"fused={f}: median {statistics.median(times[f]) * 1e3:.1f} ms (spread {min(times[f]) * 1e3:.1f}-{max(times[f]) * 1e3:.1f}) fwd+bwd, d={d} H={H} T={T} B={B}")
print(f"eager/fused: {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")
