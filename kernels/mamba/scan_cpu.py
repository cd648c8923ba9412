"""Mamba's selective scan (and the conv + SiLU before it) as a small C++ kernel for CPUs, built at first use.

The recurrence h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t, y_t = C_t . h_t is sequential in t, which
PyTorch runs as a loop of whole-tensor operations (`scan.py`): every step is a pass over memory, and those
passes were most of a training step. Here each block of 8 channels of one sequence keeps its [d_state, 8]
state in registers for the whole sequence, vectorised over the channels (contiguous in the (batch, length,
channels) layout), so no [b, l, d, n] tensor is ever written: the forward keeps the state before every 16th
token (1/16 of the states) and, per token and channel, delta, softplus', the output before the gate and
sigmoid(z); the backward recomputes each segment of 16 tokens (decays and states) from its checkpoint into
buffers that stay in L1 and walks it backwards. softplus(delta + bias), the D skip and the silu(z) gate are
part of the kernel, and the inputs are read where they are (z a view into in_proj's output, B and C into
x_proj's). The exponential and logarithm are Cephes' expf/logf polynomials (about 1 ulp), plain vector
arithmetic; float64 (the tests) uses the standard library. `conv_silu` does the layer's causal depthwise
convolution and its SiLU the same way (one pass forward, one backward, instead of conv2d, cat and silu).

The C++ is scan_cpu.cpp, beside this file. `available()` builds it once per machine and source (g++, c++ or
clang++; -O3 -march=native -fopenmp) into $TTT_BENCH_CACHE/kernels (default ~/.cache/ttt-bench/kernels) and
loads it with ctypes; it returns False, and the layer runs the PyTorch scan, where no compiler works or
TTT_BENCH_MAMBA_KERNEL=0. The (sequence, channel block) pairs are split over torch.get_num_threads()
threads: PyTorch's own OpenMP threads (the library's libgomp.so.1 is the one PyTorch loaded), or Python
threads where the compiler has no OpenMP.
Same function as `scan.py`; tests/test_ops_selective_scan.py checks both against `scan_ref.py` (float64,
outputs and gradients).
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

W = 8  # channels per block: the kernel's vector width (8 floats = one AVX2 register)
MAX_STATE = 64  # d_state the kernel supports (local arrays); larger states use the PyTorch scan

SOURCE = Path(__file__).with_suffix(".cpp")  # scan_cpu.cpp: the kernels, built by `_build`
K = 16  # tokens per checkpoint segment, as in SOURCE's K
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-Wno-psabi"]


def _cache_dir() -> Path:
    root = os.environ.get("TTT_BENCH_CACHE") or Path.home() / ".cache" / "ttt-bench"
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """-march=native code runs only on this kind of CPU: the library's name includes its flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


@functools.cache
def _library():
    """The built and loaded library, or None (logged once) where it cannot be built or is turned off. Built
    with OpenMP where the compiler can (the ranges then run on PyTorch's OpenMP threads), else without (on
    Python threads)."""
    if os.environ.get("TTT_BENCH_MAMBA_KERNEL", "1") == "0":
        return None
    candidates = (os.environ.get("CXX"), "g++", "c++", "clang++")
    compiler = next((c for c in candidates if c and shutil.which(c)), None)
    if compiler is None:
        log.info("Mamba CPU kernel: no C++ compiler found, using the PyTorch scan")
        return None
    failures = []
    for flags in ([*FLAGS, "-fopenmp"], FLAGS):
        try:
            lib = ctypes.CDLL(str(_build(compiler, flags)))
        except (OSError, subprocess.SubprocessError) as e:
            failures.append((getattr(e, "stderr", None) or str(e)).strip()[-300:])
            continue
        lib.openmp.restype = ctypes.c_int64
        for kind in ("ssm", "conv"):
            for name in ("forward_f32", "forward_f64", "backward_f32", "backward_f64"):
                fn = getattr(lib, f"{kind}_{name}")
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        return lib
    log.warning("Mamba CPU kernel: building it failed, using the PyTorch scan: %s", " / ".join(failures))
    return None


def _build(compiler: str, flags: list[str]) -> Path:
    """The library built from SOURCE with these flags, cached under a name that hashes all of it."""
    source = SOURCE.read_text()
    key = hashlib.sha256("\0".join([source, compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"mamba_scan_{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, out = Path(tmp) / "mamba_scan.cpp", Path(tmp) / "mamba_scan.so"
            src.write_text(source)
            subprocess.run([compiler, *flags, str(src), "-o", str(out)], check=True, capture_output=True,
                           text=True, timeout=300)
            os.replace(out, path)  # atomic: concurrent builds each write a whole library
    return path


def available() -> bool:
    return _library() is not None


def supports(u: torch.Tensor, n: int) -> bool:
    """Whether the kernel runs these inputs: on the CPU, computed in float32 or float64 (the scan's dtypes:
    lower precisions compute in float32), d_state <= MAX_STATE."""
    dtype = torch.promote_types(u.dtype, torch.float32)
    return u.device.type == "cpu" and dtype in (torch.float32, torch.float64) and n <= MAX_STATE


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """Threads for the kernel's calls, per process (a forked child has none of its parent's threads)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="mamba-scan")


class _Args(ctypes.Structure):
    """SOURCE's `Args`: sizes, row strides (elements between consecutive tokens), pointers (None: null)."""

    _fields_ = [(k, ctypes.c_int64) for k in "b l d n softplus nonpositive su sd sB sC sz sg".split()] + [
        (k, ctypes.c_void_p)
        for k in ("u draw bias AT B C D z h0 gout ghlast out hlast ckpt saved gu gdraw gz gh0 gAT gB gC gD "
                  "gbias").split()]


class _ConvArgs(ctypes.Structure):
    """SOURCE's `ConvArgs`."""

    _fields_ = ([(k, ctypes.c_int64) for k in "b l c k sx sg".split()]
                + [(k, ctypes.c_void_p) for k in "x wT bias gu u gx gwT gbias".split()])


def _run(name: str, dtype: torch.dtype, pairs: int, args: list) -> None:
    """The kernel `name` on the pairs split into len(args) ranges, args[i] (its arguments struct, with its own
    partial sums) for the i-th: one call on PyTorch's OpenMP threads, or (a library built without OpenMP)
    the first range on this thread and the others on the pool's (ctypes releases the GIL)."""
    lib, n = _library(), len(args)
    fn = getattr(lib, f"{name}_{'f32' if dtype == torch.float32 else 'f64'}")
    structs = (type(args[0]) * n)(*args)
    if n == 1 or lib.openmp():
        fn(structs, n, 0, pairs)
        return
    bounds = [pairs * i // n for i in range(n + 1)]
    others = [_pool(n - 1, os.getpid()).submit(fn, ctypes.byref(structs[i]), 1, bounds[i], bounds[i + 1])
              for i in range(1, n)]
    fn(ctypes.byref(structs[0]), 1, bounds[0], bounds[1])
    for f in others:
        f.result()


def _workers(pairs: int) -> int:
    """Ranges to split the pairs into: torch's intra-op threads (`--threads`, torch.set_num_threads)."""
    return max(1, min(torch.get_num_threads(), pairs))


def _rows(x: torch.Tensor | None, d: int):
    """(x, row stride) with x's rows [b, l, k] at (b l + t) * stride: views into wider tensors (in_proj's z,
    x_proj's B and C) are passed as they are; anything else, or a channel count padded to d, is copied."""
    if x is None:
        return None, 0
    b, l, k = x.shape
    if k != d:
        x = torch.nn.functional.pad(x, (0, d - k))
    if not (x.stride(-1) == 1 and (b == 1 or x.stride(0) == l * x.stride(1))):
        x = x.contiguous()
    return x, x.stride(1)


def _padded(x: torch.Tensor | None, d: int) -> torch.Tensor | None:
    """[..., k] zero-padded to [..., d], contiguous. Padded channels have delta = 0 (a = 1, no input): their
    state stays 0, their outputs are 0."""
    if x is None:
        return None
    return (x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))).contiguous()


def _ptrs(**tensors) -> dict:
    """{name: data pointer, or None (null) for None}, for an arguments struct."""
    return {k: None if x is None else x.data_ptr() for k, x in tensors.items()}


class KernelScan(torch.autograd.Function):
    """scan.selective_scan through the kernel: (u, delta, A, B, C, D, z, delta_bias, h0) -> (out, h_last),
    out = (scan + D u) silu(z) with delta = softplus(delta + delta_bias); D, z, delta_bias, h0 may be None."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, h0, softplus):
        b, l, d = u.shape
        n = A.shape[1]
        dp = -(-d // W) * W
        (u_, su), (dr, sd), (z_, sz) = _rows(u, dp), _rows(delta, dp), _rows(z, dp)
        (B_, sB), (C_, sC) = _rows(B, n), _rows(C, n)
        AT, D_, bias = _padded(A.t(), dp), _padded(D, dp), _padded(delta_bias, dp)
        h0_ = None if h0 is None else _padded(h0.transpose(1, 2), dp).transpose(1, 2).contiguous()
        out, h_last = u_.new_empty(b, l, dp), u_.new_empty(b, dp, n)
        keep = any(ctx.needs_input_grad)
        ckpt = u_.new_empty(b, -(-l // K), n, dp) if keep else None
        saved = u_.new_empty(4, b, l, dp) if keep else None
        nonpositive = bool(softplus and (A <= 0).all())  # delta >= 0: every exponent delta A <= 0
        sizes = dict(b=b, l=l, d=dp, n=n, softplus=int(softplus), nonpositive=int(nonpositive), su=su, sd=sd,
                     sB=sB, sC=sC, sz=sz)
        args = _Args(**sizes, **_ptrs(u=u_, draw=dr, bias=bias, AT=AT, B=B_, C=C_, D=D_, z=z_, h0=h0_,
                                      out=out, hlast=h_last, ckpt=ckpt, saved=saved))
        _run("ssm_forward", u_.dtype, b * dp // W, [args] * _workers(b * dp // W))
        if keep:
            ctx.save_for_backward(u_, bias, AT, B_, C_, D_, z_, ckpt, saved)
            ctx.sizes, ctx.d = sizes, d
            ctx.given = (D is not None, z is not None, delta_bias is not None, h0 is not None)
        return out[..., :d], h_last[:, :d]

    @staticmethod
    def backward(ctx, gout, gh_last):
        u_, bias, AT, B_, C_, D_, z_, ckpt, saved = ctx.saved_tensors
        d, (has_D, has_z, has_bias, has_h0) = ctx.d, ctx.given
        b, l, dp, n = (ctx.sizes[k] for k in "bldn")
        pairs = b * dp // W
        workers = _workers(pairs)
        go, sg = _rows(gout, dp)
        gh = _padded(gh_last.transpose(1, 2), dp).transpose(1, 2).contiguous()
        gu, gdr, gh0 = u_.new_empty(b, l, dp), u_.new_empty(b, l, dp), torch.empty_like(gh)
        gz = u_.new_empty(b, l, dp) if has_z else None
        gAT = u_.new_zeros(workers, n, dp)  # every worker's own partial sums
        gB, gC = u_.new_zeros(workers, b, l, n), u_.new_zeros(workers, b, l, n)
        gD, gbias = u_.new_zeros(workers, dp), u_.new_zeros(workers, dp)
        common = dict(**ctx.sizes, sg=sg, **_ptrs(u=u_, bias=bias, AT=AT, B=B_, C=C_, D=D_, z=z_, gout=go,
                                                  ghlast=gh, ckpt=ckpt, saved=saved, gu=gu, gdraw=gdr, gz=gz,
                                                  gh0=gh0))
        _run("ssm_backward", u_.dtype, pairs,
             [_Args(**common, **_ptrs(gAT=gAT[i], gB=gB[i], gC=gC[i], gD=gD[i], gbias=gbias[i]))
              for i in range(workers)])
        return (gu[..., :d], gdr[..., :d], gAT.sum(0).t()[:d], gB.sum(0), gC.sum(0),
                gD.sum(0)[:d] if has_D else None, gz[..., :d] if has_z else None,
                gbias.sum(0)[:d] if has_bias else None, gh0[:, :d] if has_h0 else None, None)


MAX_CONV = 8  # the most taps conv_silu takes (SOURCE's `conv` dispatch)


class ConvSiLU(torch.autograd.Function):
    """silu(causal depthwise conv1d(x)) for x [b, l, c] (the layer's CausalConv1d with no state: zeros before
    the first token), weight [c, 1, k] (nn.Conv1d's), bias [c] or None."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        b, l, c = x.shape
        k = weight.shape[-1]
        cp = -(-c // W) * W
        x_, sx = _rows(x, cp)
        wT, bias_ = _padded(weight[:, 0].t(), cp), _padded(bias, cp)
        u = x_.new_empty(b, l, cp)
        args = _ConvArgs(b=b, l=l, c=cp, k=k, sx=sx, **_ptrs(x=x_, wT=wT, bias=bias_, u=u))
        _run("conv_forward", x_.dtype, b * cp // W, [args] * _workers(b * cp // W))
        ctx.save_for_backward(x_, wT, bias_)
        ctx.info = (c, sx, bias is not None)
        return u[..., :c]

    @staticmethod
    def backward(ctx, gu):
        x_, wT, bias_ = ctx.saved_tensors
        c, sx, has_bias = ctx.info
        (b, l, cp), k = x_.shape, wT.shape[0]
        pairs = b * cp // W
        workers = _workers(pairs)
        g, sg = _rows(gu, cp)
        gx = x_.new_empty(b, l, cp)
        gwT, gbias = x_.new_zeros(workers, k, cp), x_.new_zeros(workers, cp)
        common = dict(b=b, l=l, c=cp, k=k, sx=sx, sg=sg, **_ptrs(x=x_, wT=wT, bias=bias_, gu=g, gx=gx))
        _run("conv_backward", x_.dtype, pairs,
             [_ConvArgs(**common, **_ptrs(gwT=gwT[i], gbias=gbias[i])) for i in range(workers)])
        gw = gwT.sum(0).t()[:c, None, :]
        return gx[..., :c], gw, gbias.sum(0)[:c] if has_bias else None


def conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x convolved causally with the depthwise kernel weight [c, 1, k]), in x's dtype (float32/64)."""
    return ConvSiLU.apply(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
