"""TTT-Linear's Triton kernels on a GPU: the prefill kernel checked against float64 and timed against the
dual-form chunk kernel, and the chunk kernel's training step (forward and backward) at every launch we
would choose among.

    python -m ttt_bench.kernels.speed --out DIR      # installed
    python3 -m kernels.speed --out DIR      # from the repository root, not installed

scripts/gpu_speed.sh runs it (make gpu-speed). Torch and Triton only, like the rest of kernels/, so that it
runs on a GPU node where ttt_bench's other dependencies are not installed.

1. check (DIR/prefill_check.csv): on fresh random inputs, with the output poisoned (NaN) before each run,
   the kernel in bf16 at every candidate num_warps (up to f = 64) and at its default launch in bf16, tf32 and
   exact float32 ("ieee", up to f = 64), T = 40 (two mini-batches and a short last one), against
   `prefill_reference` in float64: the largest error over the reference's largest entry, per output (Z,
   W_last, b_last), within CHECK_TOL.
2. speed (DIR/prefill_speed.csv): at the head shapes of 125m (12 heads of 64) and 1.3b (32 of 64), batch 16,
   contexts 2k and 8k, bf16 activations [B, T, H, f] as the projections give them:
     old_kernel  the chunk kernel (kernels/ttt_linear.py, tf32, no states kept: inference) on float32
                 heads-major copies [B, H, T, f], made before the timing;
     old_path    the chunk kernel as the layer calls it: on the bf16 [B, T, H, f] activations as they are,
                 the output token-major in bf16;
     new         the prefill kernel from the bf16 [B, T, H, f] activations, at num_warps 1, 2, 4 (and its
                 default), the final weights written.
   Each the median of --repeats timed calls (CUDA events) after --warmup untimed ones; ms per position is
   ms / T (one layer, the whole batch), model_ms_per_position that times the model's layers (the TTT inner
   loop's share of a forward: issue 48 measured 0.223 ms per position for the whole 1.3b model with the old
   kernel, the target 0.12). rel_err_vs_old: the new kernel's Z against the old kernel's on the same inputs.
3. train (DIR/train_speed.csv): the chunk kernel's forward and backward (`ttt_linear_dual`, tf32, as a
   training step runs it under autocast: bf16 [B, T, H, f] activations, lr, token_eta, weights and LN, every
   gradient) at the 125m and 1.3b head shapes, batch --train-batch, context 2k, at its default launch and at
   each (forward, backward) num_warps of TRAIN_LAUNCHES, every launch's outputs and gradients against the
   default's (`ok` within CHECK_TOL); beside it the PyTorch dual form on float32 copies (kernels/ttt), whose
   time the kernel replaces. The fastest launch that is `ok` is what _LAUNCH in kernels/ttt_linear.py should
   say.
Every timed row also carries the op's floor on this card (`op_floor`): its FLOPs (the dual form's,
ttt/forms.chunk_flops; a training step 3x the forward) at the matmul rate of its precision and its least
traffic (each input read and each output written once; a training step also writes each mini-batch's W and
reads it back) at the copy bandwidth, both measured at the start of the run (`card_rates`, DIR/card.csv);
`floor_ms` is the larger, `bound` which, `of_floor` = floor_ms / ms_median (1 at the roofline).
"""

import argparse
import csv
import os
import statistics
import sys
import time
from functools import partial

import torch

from . import ttt_linear
from . import ttt_linear_prefill as P
from .interpreter import emulate_bf16_dot
from .ttt import forms

# model: (heads, head size, layers)
MODELS = {"125m": (12, 64, 12), "1.3b": (32, 64, 24)}
BATCH, CONTEXTS, MINI_BATCH = 16, (2048, 8192), 16
CHECK_TOL = {"bf16": 1.5e-2, "fp16": 1e-2, "tf32": 1e-2, "ieee": 1e-5}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over the largest |b| (NaN anywhere: inf)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def make_inputs(B, T, H, f, dtype, device, seed):
    """Random inputs as the layer has them, every weight off its init: XQ, XK, XV [B, T, H, f] in dtype, lr
    [B, H, T] (a transposed float32 view, as TTTLayer.inner_lr's) in [0, 0.3) / f * 16, W [H, f, f], bias,
    LN weight and bias, token scaling te [b] = 1/i plus an offset."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0, shift=0.0: shift + scale * torch.randn(*s, generator=g, device=device)
    XQ, XK, XV = (r(B, T, H, f).to(dtype) for _ in range(3))
    lr = (0.3 * 16 / f * torch.rand(B, T, H, generator=g, device=device)).transpose(1, 2)
    te = 1.0 / torch.arange(1, MINI_BATCH + 1, device=device) + 0.1 * torch.rand(MINI_BATCH, generator=g,
                                                                                  device=device)
    return XQ, XK, XV, lr, r(H, f, f, scale=0.3), r(H, 1, f, scale=0.3), r(H, 1, f, scale=0.2, shift=1.0), \
        r(H, 1, f, scale=0.2), te


def matmul_tflops(device, dtype: torch.dtype, n: int | None = None, tf32: bool = False,
                  repeats: int = 5) -> float:
    """The matmul ceiling of this device and dtype, measured now: 2 n^3 over the median time of `repeats`
    n x n products (n = 8192 on a GPU, 1024 else); tf32: float32 products on tf32 tensor cores."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        ms = statistics.median(timed(lambda: a @ b, 2, repeats, device.type))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return 2.0 * n**3 / ms / 1e9


def card_rates(device, repeats: int = 5) -> dict:
    """What the card does at best, measured in this run: matmul TFLOP/s in bf16 and in tf32 (median of
    `repeats` n x n products, n = 8192 on a GPU) and a copy's bandwidth in GB/s (bytes read plus written,
    1 GiB on a GPU)."""
    n, numel = (8192, 1 << 28) if device == "cuda" else (256, 1 << 20)
    rates = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
             "bf16_tflops": round(matmul_tflops(device, torch.bfloat16, n, repeats=repeats), 1),
             "tf32_tflops": round(matmul_tflops(device, torch.float32, n, tf32=True, repeats=repeats), 1)}
    x = torch.empty(numel, device=device)
    y = torch.empty_like(x)
    rates["copy_gb_s"] = round(2.0 * 4 * numel / statistics.median(timed(lambda: y.copy_(x), 2, repeats,
                                                                            device)) / 1e6, 1)
    return rates


def op_floor(rates: dict, batch: int, T: int, H: int, f: int, act_bytes: int, precision: str,
             training: bool = False) -> dict:
    """The least time of TTT-Linear's inner loop over batch x H sequences of T tokens on this card (the
    module's docstring): activations (q, k, v, Z; in training dZ and the input gradients) of act_bytes
    bytes, lr and weights float32."""
    N, W = T // MINI_BATCH, 4.0 * (f * f + f)
    flops = batch * H * N * forms.chunk_flops([(f, f)], MINI_BATCH, "dual", bias=True)
    traffic = batch * H * (4.0 * T * f * act_bytes + 4.0 * T + 2 * W)  # q, k, v in, Z out; lr; W, b in, out
    if training:  # the backward: about twice the forward's FLOPs; dZ in, dq, dk, dv out, dlr; the states
        flops *= 3
        traffic += batch * H * (4.0 * T * f * act_bytes + 4.0 * T + 2 * N * W + W)
    compute = flops / rates["bf16_tflops" if precision == "bf16" else "tf32_tflops"] / 1e9
    memory = traffic / rates["copy_gb_s"] / 1e6
    return {"op_gflop": round(flops / 1e9, 3), "op_mb": round(traffic / 1e6, 1),
            "floor_ms": float(f"{max(compute, memory):.4g}"),
            "bound": "compute" if compute > memory else "memory"}


def warps_candidates(f: int, precision: str, warps=P.WARPS) -> list[int]:
    """num_warps to run: with 16-bit operands `warps` and the default, else the default alone."""
    default = P.launch_options(f, precision)["num_warps"]
    return sorted({*warps, default}) if precision in ("bf16", "fp16") else [default]


def check(device, head_sizes, warps, T=40, seed=0) -> list[dict]:
    """Every launch against float64 at T tokens (default 40: two mini-batches and a short last one, so one
    compile covers both paths): bf16 at every candidate num_warps up to f = 64 (the timed head size), else
    and in tf32 and ieee (up to f = 64: it spills KBs at 128, slow to compile) at the default launch."""
    rows = []
    cases = [("bf16", torch.bfloat16), ("tf32", torch.float32), ("ieee", torch.float32)]
    for f in head_sizes:
        for precision, dtype in cases:
            if (precision == "tf32" and device == "cpu") or (precision == "ieee" and f > 64):
                continue  # the interpreter runs tf32 as exact float32: nothing ieee does not check
            for num_warps in warps_candidates(f, precision, warps if f <= 64 else ()):
                seed += 1
                inputs = make_inputs(2, T, 3, f, dtype, device, seed)
                out = torch.full_like(inputs[0], float("nan"))
                start = time.perf_counter()
                try:
                    got = P.ttt_linear_prefill(*inputs, precision=precision, num_warps=num_warps, out=out)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    error = ""
                except Exception as e:  # noqa: BLE001  (recorded: a failed check)
                    got, error = None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]
                seconds = time.perf_counter() - start
                errs = {"Z": float("inf"), "W": float("inf"), "b": float("inf")}
                if got is not None:
                    errs = {k: rel_err(a, r) for k, a, r in zip(errs, got, P.prefill_reference(*inputs),
                                                                 strict=True)}
                ok = not error and max(errs.values()) <= CHECK_TOL[precision]
                rows.append({"f": f, "precision": precision, "dtype": str(dtype).removeprefix("torch."),
                             "num_warps": num_warps, "T": T,
                             **{f"err_{k}": f"{v:.2e}" for k, v in errs.items()},
                             "tolerance": CHECK_TOL[precision], "ok": ok, "first_call_s": round(seconds, 2),
                             "error": error})
                print(f"check f={f:3d} {precision:4s} warps={num_warps} T={T}: Z {errs['Z']:.1e} "
                      f"W {errs['W']:.1e} b {errs['b']:.1e} {'ok' if ok else 'FAILED'} {error}", flush=True)
    return rows


def timed(fn, warmup: int, repeats: int, device) -> list[float]:
    """ms of each of `repeats` calls after `warmup` untimed ones (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def old_inputs(XQ, XK, XV, lr, W, bias, te):
    """The chunk kernel's inputs in float32: xq, xk, xv [B, H, T, f] (contiguous copies, heads-major), lr,
    token_eta, W and bias expanded over the batch."""
    B, T, H, f = XQ.shape
    heads = lambda x: x.float().transpose(1, 2).contiguous()
    return heads(XQ), heads(XK), heads(XV), lr, te, W.expand(B, H, f, f), bias.expand(B, H, 1, f)


def record(rows, common, variant, precision, launch, times, Z=None, Z_old=None, floor=None) -> float:
    """Append the row of one timed variant (common: model, heads, head_dim, layers, batch, context, ...),
    with the op's floor (`op_floor`) against its time."""
    ms, T = statistics.median(times), common["context"]
    floor = floor or {}
    row = {**common, "variant": variant, "precision": precision, **launch, "ms_median": round(ms, 4),
           "ms_min": round(min(times), 4), "ms_max": round(max(times), 4), "repeats": len(times),
           "ms_per_position": ms / T, "model_ms_per_position": common["layers"] * ms / T,
           "tokens_per_s": round(common["batch"] * T / ms * 1e3),
           "us_per_mini_batch": round(1e3 * ms / (T // MINI_BATCH), 3),
           "rel_err_vs_old": "" if Z is None else f"{rel_err(Z, Z_old):.2e}", **floor,
           "of_floor": float(f"{floor['floor_ms'] / ms:.3g}") if floor else ""}
    rows.append(row)
    print(f"{common['model']} T={T} {variant:10s} {precision:4s} warps={launch.get('num_warps', '-')}: "
          f"{ms:9.3f} ms ({row['us_per_mini_batch']:8.2f} us a mini-batch, "
          f"{row['model_ms_per_position']:.4f} model ms/position) {row['rel_err_vs_old']}", flush=True)
    return ms


def old_kernel(old, lnw, lnb):
    """The chunk kernel on float32 copies (the inference path: under no_grad no states are kept)."""
    return ttt_linear.ttt_linear_dual(*old, lnw, lnb, precision="tf32")


def old_path(XQ, XK, XV, lr, W, bias, lnw, lnb, te):
    """The chunk kernel as the layer calls it: on the bf16 [B, T, H, f] activations as they are (heads-major
    views), Z back token-major in bf16 (the layer's [B, T, H * f] for its post-norm: a free reshape)."""
    B, T, H, f = XQ.shape
    heads = lambda x: x.transpose(1, 2)
    Z, _, _ = ttt_linear.ttt_linear_dual(heads(XQ), heads(XK), heads(XV), lr, te, W.expand(B, H, f, f),
                                         bias.expand(B, H, 1, f), lnw, lnb, precision="tf32")
    return Z.transpose(1, 2).reshape(B, T, H * f)


def speed(device, models, contexts, batch, warps, warmup, repeats, rates, seed=100) -> list[dict]:
    rows = []
    for model in models:
        H, f, layers = MODELS[model]
        for T in contexts:
            floor = partial(op_floor, rates, batch, T, H, f)
            seed += 1
            args = make_inputs(batch, T, H, f, torch.bfloat16, device, seed)
            XQ, XK, XV, lr, W, bias, lnw, lnb, te = args
            common = {"model": model, "heads": H, "head_dim": f, "layers": layers, "batch": batch,
                      "context": T, "dtype": "bfloat16",
                      "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
            with torch.no_grad():
                old = [t.contiguous() for t in old_inputs(XQ, XK, XV, lr, W, bias, te)]
                Z_old = old_kernel(old, lnw, lnb)[0].transpose(1, 2)  # [B, T, H, f]
                old_launch = ttt_linear.launch_options(f, "tf32")
                old_ms = record(rows, common, "old_kernel", "tf32", old_launch,
                                timed(partial(old_kernel, old, lnw, lnb), warmup, repeats, device),
                                floor=floor(4, "tf32"))
                del old
                record(rows, common, "old_path", "tf32", old_launch,
                       timed(partial(old_path, *args), warmup, repeats, device), floor=floor(2, "tf32"))
                for num_warps in warps_candidates(f, "bf16", warps):
                    launch = {**P.launch_options(f, "bf16"), "num_warps": num_warps}
                    out = torch.full_like(XQ, float("nan"))  # poisoned: is every element written?
                    Z = P.ttt_linear_prefill(*args, out=out, **launch)[0]
                    new = partial(P.ttt_linear_prefill, *args, **launch)
                    ms = record(rows, common, "new", "bf16", launch, timed(new, warmup, repeats, device),
                                Z, Z_old, floor=floor(2, "bf16"))
                    rows[-1]["speedup_vs_old_kernel"] = round(old_ms / ms, 2)
                del Z_old
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


# (forward, backward) num_warps tried by the train stage at head size f, from the ahead-of-time compile (tf32,
# 3 stages; aot.compile_kernel): at f = 64 with 4 warps 2 programs fit an SM, the forward spills nothing and
# the backward 32 (sm_80) / 184 (sm_90) bytes a thread; with 8 (the default) 1 program, no spill; 16 warps
# spill 56-608 bytes for nothing: not tried. At f = 16 nothing spills: 2 warps fit 6 (4) programs an SM.
TRAIN_LAUNCHES = {16: [(2, 2), (4, 4), (8, 8)], 64: [(4, 4), (4, 8), (8, 8)]}
TRAIN_CONTEXT = 2048


def _train_step(inputs, dZ, kernel=None):
    """One fwd+bwd of the chunk kernel in tf32 (or `kernel`): the gradients of every input under the
    upstream gradient dZ."""
    Z = (kernel or partial(ttt_linear.ttt_linear_dual, precision="tf32"))(*inputs)[0]
    return torch.autograd.grad(Z, inputs, dZ)


def train(device, models, batch, warmup, repeats, rates, context=TRAIN_CONTEXT, seed=200) -> list[dict]:
    from .ttt import ops

    rows = []
    for model in models:
        H, f, layers = MODELS[model]
        seed += 1
        XQ, XK, XV, lr, W, bias, lnw, lnb, te = make_inputs(batch, context, H, f, torch.float32, device, seed)
        heads = lambda x: x.bfloat16().transpose(1, 2)  # bf16 views of [B, T, H, f], as under autocast
        inputs = [heads(XQ), heads(XK), heads(XV), lr, te, W.expand(batch, H, f, f).contiguous(),
                  bias.expand(batch, H, 1, f).contiguous(), lnw, lnb]
        inputs = [t.detach().requires_grad_() for t in inputs]
        dZ = torch.randn_like(inputs[0])
        common = {"model": model, "heads": H, "head_dim": f, "layers": layers, "batch": batch,
                  "context": context, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
        default = ttt_linear._LAUNCH["tf32"][f]
        floor = op_floor(rates, batch, context, H, f, 2, "tf32", training=True)
        of_floor = lambda ms, floor=floor: float(f"{floor['floor_ms'] / ms:.3g}")
        ref = _train_step(inputs, dZ)
        ms_default = None
        for fwd, bwd in dict.fromkeys([(default[0][0], default[1][0]), *TRAIN_LAUNCHES.get(f, [])]):
            ttt_linear._LAUNCH["tf32"][f] = ((fwd, default[0][1]), (bwd, default[1][1]))
            try:
                err = max(rel_err(a, b) for a, b in zip(_train_step(inputs, dZ), ref, strict=True))
                times, error = timed(partial(_train_step, inputs, dZ), warmup, repeats, device), ""
            except Exception as e:  # noqa: BLE001  (a launch that does not compile or fit: recorded)
                err, times, error = float("inf"), [float("nan")], f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                ttt_linear._LAUNCH["tf32"][f] = default
            ms = statistics.median(times)
            ms_default = ms_default or ms
            rows.append({**common, "variant": "triton", "precision": "tf32", "fwd_warps": fwd,
                         "bwd_warps": bwd, "ms_median": round(ms, 4), "ms_min": round(min(times), 4),
                         "ms_max": round(max(times), 4), "repeats": len(times),
                         "us_per_mini_batch": round(1e3 * ms / (context // MINI_BATCH), 3),
                         "speedup_vs_default": round(ms_default / ms, 3), "err_vs_default": f"{err:.1e}",
                         "ok": err <= CHECK_TOL["tf32"], "error": error, **floor, "of_floor": of_floor(ms)})
            print(f"train {model} warps fwd={fwd} bwd={bwd}: {ms:9.3f} ms fwd+bwd, err {err:.1e} {error}",
                  flush=True)
        pytorch = lambda q, k, v, lr, te, W, b, lnw, lnb: ops.linear(  # the PyTorch path: float32 copies
            q.float(), k.float(), v.float(), lr, te, (W, b), (lnw, lnb), backend="dual")
        times = timed(partial(_train_step, inputs, dZ, pytorch), warmup, repeats, device)
        rows.append({**common, "variant": "pytorch_dual", "precision": "float32",
                     "ms_median": round(statistics.median(times), 4), "ms_min": round(min(times), 4),
                     "ms_max": round(max(times), 4), "repeats": len(times),
                     "speedup_vs_default": round(ms_default / statistics.median(times), 3), "ok": True,
                     **floor, "of_floor": of_floor(statistics.median(times))})
        print(f"train {model} pytorch dual: {statistics.median(times):9.3f} ms fwd+bwd", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def write_csv(path, rows):
    if not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True,
                   help="folder for prefill_check.csv, prefill_speed.csv and train_speed.csv")
    p.add_argument("--stage", choices=("check", "speed", "train", "all"), default="all")
    p.add_argument("--train-batch", type=int, default=8, help="sequences of the train stage's step")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--warps", type=int, nargs="+", default=list(P.WARPS))
    p.add_argument("--check-f", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dry", action="store_true",
                   help="tiny shapes (on CPU in Triton's interpreter), for the tests")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry:
        p.error("no CUDA GPU: only --dry runs here (under TRITON_INTERPRET=1)")
    if device == "cpu":
        emulate_bf16_dot()
    if args.dry:  # one tiny shape in place of the models: heads 2 of 16, contexts of 2 and 3 mini-batches
        MODELS["dry"] = (2, 16, 2)
        args.models, args.contexts, args.batch, args.check_f = ["dry"], [32, 48], 1, [16]
        args.train_batch, train_context = 1, 32
    else:
        train_context = TRAIN_CONTEXT
    os.makedirs(args.out, exist_ok=True)
    ok = True
    if args.stage in ("check", "all"):
        rows = check(device, args.check_f, args.warps)
        write_csv(os.path.join(args.out, "prefill_check.csv"), rows)
        bad = [r for r in rows if not r["ok"]]
        print(f"check: {len(rows) - len(bad)} of {len(rows)} within tolerance", flush=True)
        ok = not bad
    if args.stage in ("speed", "train", "all"):
        rates = card_rates(device)
        write_csv(os.path.join(args.out, "card.csv"), [rates])
        print(f"card: {rates}", flush=True)
    if args.stage in ("speed", "all"):
        rows = speed(device, args.models, args.contexts, args.batch, args.warps, args.warmup, args.repeats,
                     rates)
        write_csv(os.path.join(args.out, "prefill_speed.csv"), rows)
        print()
        print("| model | T | variant | warps | ms | us/mini-batch | model ms/pos | speedup | err vs old | "
              "of floor |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['context']} | {r['variant']} | {r['num_warps']} | {r['ms_median']} | "
                  f"{r['us_per_mini_batch']} | {r['model_ms_per_position']:.4f} | "
                  f"{r.get('speedup_vs_old_kernel', '')} | {r['rel_err_vs_old']} | {r['of_floor']} |")
    if args.stage in ("train", "all"):
        rows = train(device, args.models, args.train_batch, args.warmup, args.repeats, rates, train_context)
        write_csv(os.path.join(args.out, "train_speed.csv"), rows)
        ok = ok and all(r["ok"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
