// Mamba's selective scan and the causal depthwise conv + SiLU before it, for CPUs: the C++ kernels of
// scan_cpu.py (see its docstring), which builds this file at first use and calls it through ctypes.
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
