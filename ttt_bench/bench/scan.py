"""`ttt-bench bench scan`: forward+backward time of Mamba's selective scan on CPU.

Compares the C++ kernel (`scan_cpu.py`, where it builds), our chunked PyTorch scan, the sequential
reference (at a shorter length by default: it is one Python step per token) and mambapy's Blelloch
parallel scan (`mambapy.pscan`) on the same inputs, each including softplus(delta + bias), the D skip
and the silu(z) gate, gradients to every input.
"""

import argparse

import pandas as pd
import torch
import torch.nn.functional as F

from ttt_bench.kernels.mamba import scan_cpu, selective_scan
from ttt_bench.kernels.mamba.scan_ref import selective_scan_ref

from . import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=128, help="d_inner = expand * d_model")
    parser.add_argument("--expand", type=int, default=2)
    parser.add_argument("--d-state", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="the chunked scan's tokens per chunk (0: its default)")
    parser.add_argument("--ref-seqlen", type=int, default=256, help="sequential reference's length (0: skip)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)


def _mambapy_scan(u, delta, A, B, C, D, z, delta_bias):
    from mambapy.mamba import MambaBlock  # optional dev dependency

    y = MambaBlock.selective_scan(None, u, F.softplus(delta + delta_bias), A, B, C, D)
    return y * F.silu(z)


def _inputs(batch, seqlen, d_inner, d_state, generator):
    r = lambda *shape: torch.randn(*shape, generator=generator)
    return dict(u=r(batch, seqlen, d_inner), delta=r(batch, seqlen, d_inner) * 0.5,
                A=-torch.arange(1, d_state + 1.0).repeat(d_inner, 1), B=r(batch, seqlen, d_state),
                C=r(batch, seqlen, d_state), D=torch.ones(d_inner), z=r(batch, seqlen, d_inner),
                delta_bias=torch.full((d_inner,), -3.0))


def _fwd_bwd(fn, inputs):
    """A call of fn forward and backward, gradients to every input."""
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}

    def call():
        fn(**leaves).sum().backward()
        for v in leaves.values():
            v.grad = None

    return call


def run(args) -> pd.DataFrame:
    torch.set_num_threads(args.threads)
    d_inner = args.expand * args.d_model
    g = torch.Generator().manual_seed(args.seed)
    chunk = args.chunk_size or None
    ours = lambda **kw: selective_scan(**kw, delta_softplus=True, chunk_size=chunk, backend="torch")
    kernel = lambda **kw: selective_scan(**kw, delta_softplus=True, backend="cpu")
    ref = lambda **kw: selective_scan_ref(**kw, delta_softplus=True)
    cases = [("mambapy_pscan", _mambapy_scan, args.seqlen), ("chunked", ours, args.seqlen)]
    if scan_cpu.available():
        cases.append(("kernel", kernel, args.seqlen))
    if args.ref_seqlen:
        if args.ref_seqlen != args.seqlen:
            cases.insert(0, ("mambapy_pscan", _mambapy_scan, args.ref_seqlen))
        cases.append(("sequential_ref", ref, args.ref_seqlen))
    rows = []
    for seqlen in dict.fromkeys(seqlen for _, _, seqlen in cases):  # each length's impls round-robin
        inputs = _inputs(args.batch, seqlen, d_inner, args.d_state, g)
        fns = {impl: _fwd_bwd(fn, inputs) for impl, fn, n in cases if n == seqlen}
        seconds = common.time_interleaved(fns, torch.device("cpu"), args.warmup, args.repeats)
        rows += [dict(impl=impl, batch=args.batch, seqlen=seqlen, d_model=args.d_model, d_inner=d_inner,
                      d_state=args.d_state, threads=args.threads, median_ms=1e3 * sec)
                 for impl, sec in seconds.items()]
    df = pd.DataFrame(rows)
    baseline = df[df.impl == "mambapy_pscan"].set_index("seqlen").median_ms
    df["speedup_vs_mambapy"] = df.seqlen.map(baseline) / df.median_ms
    return df
