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

`available()` builds the library once per machine and source (g++, c++ or clang++; -O3 -march=native
-fopenmp) into $TTT_BENCH_CACHE/kernels (default ~/.cache/ttt-bench/kernels) and loads it with ctypes; it
returns False, and the layer runs the PyTorch scan, where no compiler works or TTT_BENCH_MAMBA_KERNEL=0. The
(sequence, channel block) pairs are split over torch.get_num_threads() threads: PyTorch's own OpenMP threads
(the library's libgomp.so.1 is the one PyTorch loaded), or Python threads where the compiler has no OpenMP.
Same function as `scan.py`; tests/test_mamba_scan.py checks both against `scan_ref.py` (float64, outputs and
gradients).
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

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int W = 8;      // channels per block: one vector
constexpr int K = 16;     // tokens per checkpoint segment
constexpr int NMAX = 64;  // largest d_state

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef double vd __attribute__((vector_size(W * sizeof(double))));
template <typename T> struct Vec;
template <> struct Vec<float> { typedef vf type; };
template <> struct Vec<double> { typedef vd type; };

template <typename V, typename T> inline V load(const T* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename V, typename T> inline void store(T* p, V v) { std::memcpy(p, &v, sizeof v); }
template <typename V, typename T> inline V load_or(const T* p, T value) {
    return p ? load<V>(p) : V{} + value;
}

// float32: Cephes' expf and logf (about 1 ulp), as plain vector arithmetic. NaN stays NaN.
// exp: x < -87.3 (and -inf) gives 0, x > 88 e^88; nonpositive: x <= 0 is known (the decays), no clamp
// above.
template <bool nonpositive = false>
inline vf vexp(vf x) {
    const vf zero = vf{};
    if (!nonpositive) x = x > 88.0f ? zero + 88.0f : x;
    vf kf = x * 1.44269504088896341f + 12582912.0f;  // round to nearest: + 1.5 * 2^23
    kf = kf - 12582912.0f;
    vf r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    vf p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi ki = __builtin_convertvector(x < -87.0f ? zero : kf, vi);
    vi bits = (ki + 127) << 23;
    vf scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return x < -87.3365f ? zero : p * scale;
}
inline vf vlog(vf x) {  // x >= 1 (finite or NaN)
    vi bits;
    std::memcpy(&bits, &x, sizeof bits);
    vf e = __builtin_convertvector(((bits >> 23) & 0xff) - 126, vf);
    bits = (bits & 0x807fffff) | 0x3f000000;  // mantissa m in [0.5, 1)
    vf m;
    std::memcpy(&m, &bits, sizeof m);
    const auto small = m < 0.707106781186547524f;
    e = small ? e - 1.0f : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    const vf z = m * m;
    vf p = vf{} + 7.0376836292e-2f;
    p = p * m - 1.1514610310e-1f;
    p = p * m + 1.1676998740e-1f;
    p = p * m - 1.2420140846e-1f;
    p = p * m + 1.4249322787e-1f;
    p = p * m - 1.6668057665e-1f;
    p = p * m + 2.0000714765e-1f;
    p = p * m - 2.4999993993e-1f;
    p = p * m + 3.3333331174e-1f;
    vf y = p * m * z + e * -2.12194440e-4f - 0.5f * z;
    return m + y + e * 0.693359375f;
}
// dt = softplus(x) as F.softplus (x above 20 kept; log1p(e^x) as log(1 + e) e / ((1 + e) - 1)) and its
// derivative sigmoid(x) (1 above 20, as softplus_backward)
inline void vsoftplus(vf x, vf& dt, vf& grad) {
    const vf e = vexp(x), u = e + 1.0f, one = vf{} + 1.0f;
    dt = x > 20.0f ? x : (u == 1.0f ? e : vlog(u) * (e / (u - 1.0f)));
    grad = x > 20.0f ? one : e / u;
}
inline vf vsigmoid(vf x) { return 1.0f / (vexp(-x) + 1.0f); }
// float64 (the tests' exact comparisons): the standard library, lane by lane.
template <bool nonpositive = false>
inline vd vexp(vd x) { for (int j = 0; j < W; ++j) x[j] = std::exp(x[j]); return x; }
inline void vsoftplus(vd x, vd& dt, vd& grad) {
    for (int j = 0; j < W; ++j) {
        dt[j] = x[j] > 20 ? x[j] : std::log1p(std::exp(x[j]));
        grad[j] = x[j] > 20 ? 1 : 1 / (1 + std::exp(-x[j]));
    }
}
inline vd vsigmoid(vd x) { for (int j = 0; j < W; ++j) x[j] = 1 / (1 + std::exp(-x[j])); return x; }

// One call's tensors. [b, l, *] inputs are read at row (b l + t) * stride (views into wider tensors need no
// copy); outputs are contiguous. d is a multiple of W; a pair p is (sequence p / (d / W), channels
// W (p % (d / W)) + [0, W)). Optional pointers may be null. `saved` [4, b, l, d]: what the forward works out
// per token and channel for the backward (delta, its derivative, the output before the gate, sigmoid(z)).
// gAT [n, d], gB, gC [b, l, n], gD, gbias [d] are one worker's own partial sums, added into.
struct Args {
    int64_t b, l, d, n, softplus;
    int64_t nonpositive;  // delta A <= 0 everywhere (delta >= 0, A <= 0): exp needs no clamp above
    int64_t su, sd, sB, sC, sz, sg;
    const void *u, *draw, *bias, *AT, *B, *C, *D, *z, *h0, *gout, *ghlast;
    void *out, *hlast, *ckpt, *saved, *gu, *gdraw, *gz, *gh0, *gAT, *gB, *gC, *gD, *gbias;
};

// Forward: out = (C_t . h_t + D u_t) silu(z_t), the last state, and for the backward the state before every
// K-th token (ckpt [b, nseg, n, d]) and `saved`.
template <typename T, bool nonpositive>
void forward(const Args& a, int64_t p0, int64_t p1) {
    typedef typename Vec<T>::type V;
    const int64_t nblk = a.d / W, d = a.d, n = a.n, l = a.l, nseg = (l + K - 1) / K, plane = a.b * l * d;
    const T *AT = (const T*)a.AT, *B = (const T*)a.B, *C = (const T*)a.C, *h0 = (const T*)a.h0;
    T* saved = (T*)a.saved;
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / nblk, d0 = (p % nblk) * W;
        const V bias = load_or<V>(a.bias ? (const T*)a.bias + d0 : nullptr, T(0));
        const V Dv = load_or<V>(a.D ? (const T*)a.D + d0 : nullptr, T(0));
        V h[NMAX];
        for (int64_t i = 0; i < n; ++i)
            for (int j = 0; j < W; ++j) h[i][j] = h0 ? h0[(b * d + d0 + j) * n + i] : T(0);
        for (int64_t t = 0; t < l; ++t) {
            const int64_t bt = b * l + t, row = bt * d + d0;
            if (a.ckpt && t % K == 0)
                for (int64_t i = 0; i < n; ++i)
                    store((T*)a.ckpt + ((b * nseg + t / K) * n + i) * d + d0, h[i]);
            V dt = load<V>((const T*)a.draw + bt * a.sd + d0) + bias, sig = V{} + 1;
            if (a.softplus) vsoftplus(dt, dt, sig);
            const V u = load<V>((const T*)a.u + bt * a.su + d0), du = dt * u;
            const T *Bt = B + bt * a.sB, *Ct = C + bt * a.sC;
            V y = Dv * u;
            for (int64_t i = 0; i < n; ++i) {
                h[i] = vexp<nonpositive>(dt * load<V>(AT + i * d + d0)) * h[i] + du * Bt[i];
                y += Ct[i] * h[i];
            }
            if (saved) {
                store(saved + row, dt);
                store(saved + plane + row, sig);
                store(saved + 2 * plane + row, y);
            }
            if (a.z) {
                const V z = load<V>((const T*)a.z + bt * a.sz + d0), sz = vsigmoid(z);
                if (saved) store(saved + 3 * plane + row, sz);
                y = y * z * sz;
            }
            store((T*)a.out + row, y);
        }
        if (a.hlast)
            for (int64_t i = 0; i < n; ++i)
                for (int j = 0; j < W; ++j) ((T*)a.hlast)[(b * d + d0 + j) * n + i] = h[i][j];
    }
}

// Backward: each segment of K tokens is recomputed from its checkpoint (decays, states, outputs before the
// gate) into buffers that stay in L1, then walked backwards: g_t = dL/dh_t = C_t gy_t + a_{t+1} g_{t+1}.
template <typename T, bool nonpositive>
void backward(const Args& a, int64_t p0, int64_t p1) {
    typedef typename Vec<T>::type V;
    const int64_t nblk = a.d / W, d = a.d, n = a.n, l = a.l, nseg = (l + K - 1) / K;
    const T *AT = (const T*)a.AT, *B = (const T*)a.B, *C = (const T*)a.C, *ckpt = (const T*)a.ckpt;
    const T* saved = (const T*)a.saved;
    const int64_t plane = a.b * l * d;
    std::vector<V> abuf(K * n), hbuf(K * n);
    // dL/dB_t and dL/dC_t of the current sequence, one lane per channel of the blocks: summed over the lanes
    // into gB, gC when the worker moves on to the next sequence (or ends)
    std::vector<V> gBv(l * n), gCv(l * n);
    auto flush = [&](int64_t b) {
        for (int64_t r = 0; r < l * n; ++r) {
            T sb = 0, sc = 0;
            for (int j = 0; j < W; ++j) { sb += gBv[r][j]; sc += gCv[r][j]; }
            ((T*)a.gB)[b * l * n + r] += sb;
            ((T*)a.gC)[b * l * n + r] += sc;
            gBv[r] = gCv[r] = V{};
        }
    };
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / nblk, d0 = (p % nblk) * W;
        if (p > p0 && d0 == 0) flush(b - 1);
        const V Dv = load_or<V>(a.D ? (const T*)a.D + d0 : nullptr, T(0));
        V g[NMAX], gA[NMAX], hs0[NMAX], gDacc = V{}, gbacc = V{};
        for (int64_t i = 0; i < n; ++i) {
            for (int j = 0; j < W; ++j) g[i][j] = ((const T*)a.ghlast)[(b * d + d0 + j) * n + i];
            gA[i] = V{};
        }
        for (int64_t s = nseg - 1; s >= 0; --s) {
            const int64_t t0 = s * K, ns = l - t0 < K ? l - t0 : K;
            for (int64_t i = 0; i < n; ++i) hs0[i] = load<V>(ckpt + ((b * nseg + s) * n + i) * d + d0);
            for (int64_t tt = 0; tt < ns; ++tt) {  // the segment's decays and states again
                const int64_t bt = b * l + t0 + tt;
                const V dt = load<V>(saved + bt * d + d0);
                const V du = dt * load<V>((const T*)a.u + bt * a.su + d0);
                const T* Bt = B + bt * a.sB;
                for (int64_t i = 0; i < n; ++i) {
                    const V av = vexp<nonpositive>(dt * load<V>(AT + i * d + d0));
                    abuf[tt * n + i] = av;
                    hbuf[tt * n + i] = av * (tt ? hbuf[(tt - 1) * n + i] : hs0[i]) + du * Bt[i];
                }
            }
            for (int64_t tt = ns - 1; tt >= 0; --tt) {
                const int64_t bt = b * l + t0 + tt, row = bt * d + d0;
                const T *Bt = B + bt * a.sB, *Ct = C + bt * a.sC;
                V *gBt = &gBv[(t0 + tt) * n], *gCt = &gCv[(t0 + tt) * n];
                const V dt = load<V>(saved + row), u = load<V>((const T*)a.u + bt * a.su + d0), du = dt * u;
                const V go = load<V>((const T*)a.gout + bt * a.sg + d0);
                V gy = go;
                if (a.z) {  // out = y silu(z), silu' = s + silu (1 - s)
                    const V z = load<V>((const T*)a.z + bt * a.sz + d0);
                    const V sz = load<V>(saved + 3 * plane + row), silu = z * sz;
                    gy = go * silu;
                    store((T*)a.gz + row, go * load<V>(saved + 2 * plane + row) * (sz + silu * (1 - sz)));
                }
                gDacc += gy * u;
                V gdu = V{}, gdt = V{};
                for (int64_t i = 0; i < n; ++i) {
                    const V gv = g[i] + gy * Ct[i];
                    gdu += gv * Bt[i];
                    gBt[i] += du * gv;
                    gCt[i] += gy * hbuf[tt * n + i];
                    const V ga = gv * abuf[tt * n + i];
                    const V m = ga * (tt ? hbuf[(tt - 1) * n + i] : hs0[i]);  // dL/d(delta_t A)
                    gdt += m * load<V>(AT + i * d + d0);
                    gA[i] += m * dt;
                    g[i] = ga;
                }
                const V gpre = (gdt + gdu * u) * load<V>(saved + plane + row);
                gbacc += gpre;
                store((T*)a.gu + row, gdu * dt + gy * Dv);
                store((T*)a.gdraw + row, gpre);
            }
        }
        for (int64_t i = 0; i < n; ++i) {
            for (int j = 0; j < W; ++j) ((T*)a.gh0)[(b * d + d0 + j) * n + i] = g[i][j];
            store((T*)a.gAT + i * d + d0, load<V>((const T*)a.gAT + i * d + d0) + gA[i]);
        }
        store((T*)a.gD + d0, load<V>((const T*)a.gD + d0) + gDacc);
        store((T*)a.gbias + d0, load<V>((const T*)a.gbias + d0) + gbacc);
    }
    if (p1 > p0) flush((p1 - 1) / nblk);
}

// The causal depthwise convolution and SiLU before the scan: u_t = silu(bias + sum_j w_j x_{t - (k-1) + j})
// for x [b, l, c] (rows at stride sx), wT [k, c], bias [c] or null; u [b, l, c] contiguous. Pairs as above
// (sequence, block of W channels).
struct ConvArgs {
    int64_t b, l, c, k, sx, sg;
    const void *x, *wT, *bias, *gu;
    void *u, *gx, *gwT, *gbias;  // gwT [k, c] and gbias [c]: one worker's own partial sums, added into
};

template <typename T, int k>  // k: the kernel's taps, a constant so that the window stays in registers
void conv_forward(const ConvArgs& a, int64_t p0, int64_t p1) {
    typedef typename Vec<T>::type V;
    const int64_t nblk = a.c / W, c = a.c, l = a.l;
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / nblk, c0 = (p % nblk) * W;
        V w[k], win[k];  // win[j]: x_{t - (k-1) + j}
        for (int j = 0; j < k; ++j) { w[j] = load<V>((const T*)a.wT + j * c + c0); win[j] = V{}; }
        const V bias = load_or<V>(a.bias ? (const T*)a.bias + c0 : nullptr, T(0));
        for (int64_t t = 0; t < l; ++t) {
            const int64_t bt = b * l + t;
            for (int j = 0; j + 1 < k; ++j) win[j] = win[j + 1];
            win[k - 1] = load<V>((const T*)a.x + bt * a.sx + c0);
            V pre = bias;
            for (int j = 0; j < k; ++j) pre += w[j] * win[j];
            store((T*)a.u + bt * c + c0, pre * vsigmoid(pre));
        }
    }
}

template <typename T, int k>
void conv_backward(const ConvArgs& a, int64_t p0, int64_t p1) {
    typedef typename Vec<T>::type V;
    const int64_t nblk = a.c / W, c = a.c, l = a.l;
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / nblk, c0 = (p % nblk) * W;
        V w[k], win[k], gw[k], gxw[k];  // gxw[j]: the gradient of x_{t - (k-1) + j} so far
        for (int j = 0; j < k; ++j) {
            w[j] = load<V>((const T*)a.wT + j * c + c0);
            win[j] = gw[j] = gxw[j] = V{};
        }
        const V bias = load_or<V>(a.bias ? (const T*)a.bias + c0 : nullptr, T(0));
        V gb = V{};
        for (int64_t t = 0; t < l; ++t) {
            const int64_t bt = b * l + t;
            if (t >= k) store((T*)a.gx + (bt - k) * c + c0, gxw[0]);  // x_{t-k}: complete
            for (int j = 0; j + 1 < k; ++j) { win[j] = win[j + 1]; gxw[j] = gxw[j + 1]; }
            win[k - 1] = load<V>((const T*)a.x + bt * a.sx + c0);
            gxw[k - 1] = V{};
            V pre = bias;
            for (int j = 0; j < k; ++j) pre += w[j] * win[j];
            const V s = vsigmoid(pre);
            const V g = load<V>((const T*)a.gu + bt * a.sg + c0) * s * (1 + pre * (1 - s));  // silu'
            gb += g;
            for (int j = 0; j < k; ++j) { gw[j] += g * win[j]; gxw[j] += g * w[j]; }
        }
        for (int j = 0; j < k; ++j) {  // the last k positions (those >= 0)
            const int64_t t = l - k + j;
            if (t >= 0) store((T*)a.gx + (b * l + t) * c + c0, gxw[j]);
            store((T*)a.gwT + j * c + c0, load<V>((const T*)a.gwT + j * c + c0) + gw[j]);
        }
        store((T*)a.gbias + c0, load<V>((const T*)a.gbias + c0) + gb);
    }
}

template <typename T, bool backward>
void conv(const ConvArgs& a, int64_t p0, int64_t p1) {
    switch (a.k) {
#define TAPS(k) \
    case k: return backward ? conv_backward<T, k>(a, p0, p1) : conv_forward<T, k>(a, p0, p1);
        TAPS(1) TAPS(2) TAPS(3) TAPS(4) TAPS(5) TAPS(6) TAPS(7) TAPS(8)
#undef TAPS
    }
}

// Entry points: [p0, p1) split into n ranges, args[i] (with its own partial sums) driving the i-th. Built
// with OpenMP, the ranges run on the threads of the process's OpenMP runtime: PyTorch's own (the library
// asks for libgomp.so.1, which PyTorch has loaded before), so no second pool spins against PyTorch's.
template <typename A, typename F>
void ranges(const A* args, int64_t n, int64_t p0, int64_t p1, F f) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(n) schedule(static, 1) if (n > 1)
#endif
    for (int64_t i = 0; i < n; ++i) f(args[i], p0 + (p1 - p0) * i / n, p0 + (p1 - p0) * (i + 1) / n);
}
}  // namespace

extern "C" {
int64_t openmp() {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
#define ENTRY(name, A, ...) \
    void name(const A* args, int64_t n, int64_t p0, int64_t p1) { \
        ranges(args, n, p0, p1, [](const A& a, int64_t q0, int64_t q1) { __VA_ARGS__; }); \
    }
ENTRY(ssm_forward_f32, Args,
      a.nonpositive ? forward<float, true>(a, q0, q1) : forward<float, false>(a, q0, q1))
ENTRY(ssm_backward_f32, Args,
      a.nonpositive ? backward<float, true>(a, q0, q1) : backward<float, false>(a, q0, q1))
ENTRY(ssm_forward_f64, Args, forward<double, false>(a, q0, q1))
ENTRY(ssm_backward_f64, Args, backward<double, false>(a, q0, q1))
ENTRY(conv_forward_f32, ConvArgs, conv<float, false>(a, q0, q1))
ENTRY(conv_forward_f64, ConvArgs, conv<double, false>(a, q0, q1))
ENTRY(conv_backward_f32, ConvArgs, conv<float, true>(a, q0, q1))
ENTRY(conv_backward_f64, ConvArgs, conv<double, true>(a, q0, q1))
#undef ENTRY
}
"""
K = 16  # tokens per checkpoint segment, as in SOURCE
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
    key = hashlib.sha256("\0".join([SOURCE, compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"mamba_scan_{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, out = Path(tmp) / "mamba_scan.cpp", Path(tmp) / "mamba_scan.so"
            src.write_text(SOURCE)
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
