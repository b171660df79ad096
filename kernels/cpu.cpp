// anynorm's CPU kernels: layer norm and RMS norm over contiguous rows (forward and backward),
// and statistics over a middle axis (channels-first layer norm, NHWC instance/group norm),
// each slice read from memory once and kept in cache for its passes.
//
// The NumPy executor (anynorm/_numpy_rows.py, anynorm/_numpy_columns.py) calls them through
// ctypes where the host has a C++ compiler (anynorm/_native.py builds this file at first use,
// -O3 -march=native, into a per-user cache).  Both sum the data shifted by a first mean
// taken from the data, as the corrected two-pass does, and sum again about the full mean
// where that shift was far (the variance then loses no bits):
//
//     m1 = a first mean (of a row's first 64 elements, or of a chunk of a column)
//     c = mean(x - m1);  q = mean((x - m1)^2), again about m1 + c where c^2 > q / 16
//     var = max(q - c*c, 0);  mean = m1 + c;  rstd = 1 / sqrt(var + eps)
//     y   = (x - mean) * rstd * w + b             (RMS norm: m1 = c = 0, no b)
//
// with float32 sums of at most a few hundred terms added in float64, and `x - m1` formed
// where it is exact (near the data), so rows far from zero keep float32 rounding.  float32,
// float16 and bfloat16 slices form y in float32 with the mean split into two floats (`x - hi` exact,
// `- lo` the rest); float64 ones work in float64 throughout.  Parameters come in the
// accumulation type (float32 for float16/bfloat16/float32 x, float64 for float64).  A NaN or Inf in a
// slice makes that slice's output NaN, and no other slice's.
//
// Built with GCC/Clang vector extensions (8 lanes of the widest type a loop handles), which
// compile to whatever SIMD -march=native offers.  Entry points (extern "C", 0 on success; the
// arguments at each kernel below and in kernels/README.md):
//
//     anynorm_rows_<f16|bf16|f32|f64>(x, res, h, y, w, b, w_run, mean, rstd, rows, n, center, eps)
//     anynorm_rows_packed_<f16|bf16|f32|f64|hp_f16|hp_bf16>(x, y, w, b, mean, rstd, &{rows, n, w_run, w_count, center, eps})
//     anynorm_cols_<f16|bf16|f32|f64>(x, y, w, b, mean, rstd, samples, P, Q, group, strip, param_rows, eps)
//     anynorm_cols_packed_<f16|bf16|f32|f64|hp_f16|hp_bf16>(x, y, w, b, mean, rstd, &{samples, P, Q, group, strip, param_rows, eps})
//     anynorm_rows_bwd_<f16|bf16|f32|f64>(x, dy, dx, w, w_run, mean, rstd, dw, db, rows, n, center, eps)
//     anynorm_segmented_bwd_<f16|bf16|f32|f64>(x, dy, dx, w, mean, rstd, dw, db, rows, n, segments, seg_stride, center, eps)
//     anynorm_cols_bwd_<f16|bf16|f32|f64>(x, dy, dx, w, mean, rstd, dw, db, samples, P, Q, group, strip, param_rows, eps)
//     anynorm_far_<f16|bf16|f32|f64>(mean, rstd, n, limit)   (1 where some |mean * rstd| > limit, else 0)

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

// float16 rows where converting them is cheap: x86 with F16C, or a CPU whose compiler
// converts _Float16 in hardware (AArch64); elsewhere the NumPy executor keeps them
#if defined(__FLT16_MAX__) && (defined(__F16C__) || defined(__aarch64__))
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

typedef double vd __attribute__((vector_size(64)));
typedef float vf __attribute__((vector_size(32)));

template <typename T> struct Lanes;  // 8 elements of T as one vector
template <> struct Lanes<double> { typedef double type __attribute__((vector_size(64))); };
template <> struct Lanes<float> { typedef float type __attribute__((vector_size(32))); };
#if HAVE_F16
template <> struct Lanes<_Float16> { typedef _Float16 type __attribute__((vector_size(16))); };
#endif

template <typename T> inline typename Lanes<T>::type load(const T *p) {
    typename Lanes<T>::type v;
    memcpy(&v, p, sizeof v);
    return v;
}
template <typename T> inline void store(T *p, typename Lanes<T>::type v) { memcpy(p, &v, sizeof v); }
template <typename T> inline vf narrow(const T *p) { return __builtin_convertvector(load(p), vf); }
template <typename T> inline void store_f32(T *p, vf v) {  // rounded once to T
    store(p, __builtin_convertvector(v, typename Lanes<T>::type));
}
#if HAVE_F16 && defined(__F16C__)
// GCC converts _Float16 vectors element by element in software unless the CPU has
// AVX512-FP16; F16C converts 8 at once (round to nearest even, as a cast)
template <> inline vf narrow<_Float16>(const _Float16 *p) {
    __m128i v;
    memcpy(&v, p, 16);
    __m256 f = _mm256_cvtph_ps(v);
    vf out;
    memcpy(&out, &f, 32);
    return out;
}
template <> inline void store_f32<_Float16>(_Float16 *p, vf v) {
    __m256 f;
    memcpy(&f, &v, 32);
    __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    memcpy(p, &h, 16);
}
#endif

// bfloat16: the upper half of a float32's bits.  Widening is a shift; narrowing rounds to
// nearest even as torch's and ml_dtypes' casts do (a NaN stays a quiet NaN): by AVX512-BF16's
// conversion where the CPU has it, except for vectors holding a subnormal (the instruction
// flushes those to zero), else in integer vector operations.
struct bf16 {
    uint16_t bits;
    bf16() = default;
    explicit bf16(float f) {
        uint32_t u;
        memcpy(&u, &f, 4);
        bits = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                               : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    operator float() const {
        const uint32_t u = (uint32_t)bits << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
};
typedef uint16_t vu16 __attribute__((vector_size(16)));
typedef uint32_t vu32 __attribute__((vector_size(32)));
typedef int32_t vi32 __attribute__((vector_size(32)));
const vi32 LANE = {0, 1, 2, 3, 4, 5, 6, 7};
template <> inline vf narrow<bf16>(const bf16 *p) {
#if defined(__AVX2__)
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    vf out;
    memcpy(&out, &w, 32);
    return out;
#else
    vu16 h;
    memcpy(&h, p, 16);
    const vu32 u = __builtin_convertvector(h, vu32) << 16;
    vf out;
    memcpy(&out, &u, 32);
    return out;
#endif
}
inline void round_bf16(bf16 *p, vu32 u) {
    const vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu32 nan = (vu32)((vi32)(u & 0x7fffffffu) > 0x7f800000);  // all ones where NaN
    const vu16 h = __builtin_convertvector((rounded & ~nan) | (((u >> 16) | 0x40u) & nan), vu16);
    memcpy(p, &h, 16);
}
template <> inline void store_f32<bf16>(bf16 *p, vf v) {
    vu32 u;
    memcpy(&u, &v, 32);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    __m256i w;
    memcpy(&w, &u, 32);
    const __mmask8 subnormal = _mm256_testn_epi32_mask(w, _mm256_set1_epi32(0x7f800000)) &
                               _mm256_test_epi32_mask(w, _mm256_set1_epi32(0x7fffffff));
    if (__builtin_expect(subnormal == 0, 1)) {
        __m256 f;
        memcpy(&f, &v, 32);
        const __m128bh h = _mm256_cvtneps_pbh(f);
        memcpy(p, &h, 16);
        return;
    }
#endif
    round_bf16(p, u);
}
// One vector of y into T (float32 lanes rounded once to T; float64 as they are); `put_y<NT>`
// by non-temporal stores where NT and y is float32 (past the caches, no read of the line
// first; 16-byte aligned addresses; a kernel that makes them ends with nt_fence()), an
// ordinary store elsewhere; put_nt4: the first 4 lanes so
template <typename T> inline void put(T *p, vf v) { store_f32(p, v); }
inline void put(double *p, vd v) { store(p, v); }
template <typename T> inline void put_nt(T *p, vf v) { put(p, v); }
inline void put_nt(double *p, vd v) { put(p, v); }
template <typename T, typename VV> inline void put_nt4(T *p, VV v) {
    for (int j = 0; j < 4; j++) p[j] = (T)v[j];
}
#if defined(__SSE2__)
template <> inline void put_nt<float>(float *p, vf v) {
    __m128 a, b;
    memcpy(&a, &v, 16);
    memcpy(&b, (const char *)&v + 16, 16);
    _mm_stream_ps(p, a);
    _mm_stream_ps(p + 4, b);
}
template <> inline void put_nt4<float, vf>(float *p, vf v) {
    __m128 a;
    memcpy(&a, &v, 16);
    _mm_stream_ps(p, a);
}
inline void nt_fence() { _mm_sfence(); }
#else
inline void nt_fence() {}
#endif
template <bool NT, typename T, typename VV> inline void put_y(T *p, VV v) {
    if (NT) put_nt(p, v);
    else put(p, v);
}
inline double total(vd a) {
    double s = 0;
    for (int k = 0; k < 8; k++) s += a[k];
    return s;
}
typedef float vf4 __attribute__((vector_size(16)));
typedef double vd4 __attribute__((vector_size(32)));
inline double total(vf a) {  // pairwise: 3 dependent adds where a chain took 8 (short rows)
    const vf4 lo = {a[0], a[1], a[2], a[3]}, hi = {a[4], a[5], a[6], a[7]};
    const vd4 s = __builtin_convertvector(lo, vd4) + __builtin_convertvector(hi, vd4);
    return (s[0] + s[2]) + (s[1] + s[3]);
}

// Statistics of one row: m1 (the first mean, 0 for RMS norm), c = mean(x - m1) and
// q = mean((x - m1)^2), in float64.  Several independent accumulators a loop (a vector add's
// latency is 3-4 cycles, two issue a cycle).

inline double sum_f64(const double *x, long long n) {
    vd a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long long i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 += load(x + i);
        a1 += load(x + i + 8);
        a2 += load(x + i + 16);
        a3 += load(x + i + 24);
    }
    for (; i + 8 <= n; i += 8) a0 += load(x + i);
    double s = total((a0 + a1) + (a2 + a3));
    for (; i < n; i++) s += x[i];
    return s;
}

// float64 rows: both passes in float64
inline void row_moments(const double *x, long long n, int center, double *m1, double *c, double *q) {
    const double m = center ? sum_f64(x, n) / (double)n : 0.0;
    vd u0 = {0}, u1 = {0}, q0 = {0}, q1 = {0};
    long long i = 0;
    for (; i + 16 <= n; i += 16) {
        vd d0 = load(x + i) - m, d1 = load(x + i + 8) - m;
        u0 += d0;
        u1 += d1;
        q0 += d0 * d0;
        q1 += d1 * d1;
    }
    for (; i + 8 <= n; i += 8) {
        vd d0 = load(x + i) - m;
        u0 += d0;
        q0 += d0 * d0;
    }
    double su = total(u0 + u1), sq = total(q0 + q1);
    for (; i < n; i++) {
        double d = x[i] - m;
        su += d;
        sq += d * d;
    }
    *m1 = m;
    *c = center ? su / (double)n : 0.0;
    *q = sq / (double)n;
}

// float32 and float16 rows: sums of float32 terms over chunks of SUM_CHUNK elements (16
// lanes of at most 128 terms each) added in float64, so that long rows keep float32
// rounding.  The first mean m1 is that of the row's first HEAD elements (in float32): one
// pass then sums d = x - m1 and d*d, d formed in float32 (exact near the data: far-offset
// rows keep their digits), and var = q - c^2 loses nothing while c^2 <= q / 16; where m1
// missed the mean by more than that (a quarter of the spread: rows whose head is not like
// the rest, or long float32 sums far from zero), the pass is taken again about m1 + c, the
// whole row's mean.  (One pass over the row where the full first mean took two: rows of
// 4096 and 768 in 0.89-0.95x the time, A/B in one process.)  A chunk's last < 8 elements go
// as its last 8 with the lanes already summed zeroed, and `total` adds pairwise: short rows
// are latency-bound (one thread, rows of 37: 32 -> 25 ns a row, of 8: 19.5 -> 17, of 100:
// 36 -> 30.5; with `affine` inlined).
const long long SUM_CHUNK = 2048;
const long long HEAD = 64;

template <typename T> inline double sum_f32(const T *x, long long n, float m, double *squares) {
    double su = 0.0, sq = 0.0;
    for (long long c0 = 0; c0 < n; c0 += SUM_CHUNK) {
        const long long c1 = c0 + SUM_CHUNK < n ? c0 + SUM_CHUNK : n;
        vf u0 = {0}, u1 = {0}, q0 = {0}, q1 = {0};
        long long i = c0;
        for (; i + 16 <= c1; i += 16) {
            vf d0 = narrow(x + i) - m, d1 = narrow(x + i + 8) - m;
            u0 += d0;
            u1 += d1;
            if (squares) {
                q0 += d0 * d0;
                q1 += d1 * d1;
            }
        }
        for (; i + 8 <= c1; i += 8) {
            vf d0 = narrow(x + i) - m;
            u0 += d0;
            if (squares) q0 += d0 * d0;
        }
        if (i < c1 && c1 - c0 >= 8) {  // the last < 8 elements: the chunk's last 8, lanes done zeroed
            const vi32 fresh = LANE >= (int)(8 - (c1 - i));
            vf d1 = narrow(x + c1 - 8) - m;
            d1 = fresh ? d1 : (vf){0};
            u1 += d1;
            if (squares) q1 += d1 * d1;
            i = c1;
        }
        su += total(u0 + u1);
        if (squares) sq += total(q0 + q1);
        for (; i < c1; i++) {
            const double d = (double)((float)x[i] - m);
            su += d;
            if (squares) sq += d * d;
        }
    }
    if (squares) *squares = sq;
    return su;
}

template <typename T>
inline void row_moments(const T *x, long long n, int center, double *m1, double *c, double *q) {
    const double inv_n = 1.0 / (double)n;
    const long long head = n < HEAD ? n : HEAD;
    float m = center ? (float)(sum_f32(x, head, 0.0f, nullptr) / (double)head) : 0.0f;
    double sq, su = sum_f32(x, n, m, &sq);
    if (center && su * su > sq * (double)n / 16.0) {  // c^2 > q / 16
        m = (float)((double)m + su * inv_n);
        su = sum_f32(x, n, m, &sq);
    }
    *m1 = (double)m;
    *c = center ? su * inv_n : 0.0;
    *q = sq * inv_n;
}

// y = ((x - hi) - lo) * r * w + b over elements [i0, i1) of a row, in float32 (float16 and
// float32 rows), as (x - hi) * r - lo * r and then * w + b (fused multiply-adds where the CPU
// has them); wp/bp null: no weight / no bias; `scalar_params`: w and b are wp[0], bp[0];
// parameters of type P: float32, or x's half type (widened exactly, as torch's kernels do)
template <bool NT, typename T, typename P>
inline void affine_f32(const T *x, T *y, long long i0, long long i1, float hi, float lo, float r,
                       const P *wp, const P *bp, int scalar_params) {
    long long i = i0;
    const float lor = lo * r;
    if (scalar_params || (!wp && !bp)) {
        const float s = r * (wp ? (float)wp[0] : 1.0f), los = lo * s, b0 = bp ? (float)bp[0] : 0.0f;
        for (; i + 8 <= i1; i += 8) put_y<NT>(y + i, ((narrow(x + i) - hi) * s - los) + b0);
        for (; i < i1; i++) y[i] = (T)((((float)x[i] - hi) * s - los) + b0);
    } else if (wp && bp) {
        for (; i + 8 <= i1; i += 8) put_y<NT>(y + i, ((narrow(x + i) - hi) * r - lor) * narrow(wp + i) + narrow(bp + i));
        for (; i < i1; i++) y[i] = (T)((((float)x[i] - hi) * r - lor) * (float)wp[i] + (float)bp[i]);
    } else if (wp) {
        for (; i + 8 <= i1; i += 8) put_y<NT>(y + i, ((narrow(x + i) - hi) * r - lor) * narrow(wp + i));
        for (; i < i1; i++) y[i] = (T)((((float)x[i] - hi) * r - lor) * (float)wp[i]);
    } else {
        for (; i + 8 <= i1; i += 8) put_y<NT>(y + i, ((narrow(x + i) - hi) * r - lor) + narrow(bp + i));
        for (; i < i1; i++) y[i] = (T)((((float)x[i] - hi) * r - lor) + (float)bp[i]);
    }
}

// the same in float64 (float64 rows): y = ((x - m1) - c) * r * w + b
inline void affine_f64(const double *x, double *y, long long i0, long long i1, double m1, double c,
                       double r, const double *wp, const double *bp, int scalar_params) {
    long long i = i0;
    const double w0 = wp ? wp[0] : 1.0, b0 = bp ? bp[0] : 0.0;
    if (scalar_params || (!wp && !bp)) {
        const double s = r * w0;
        for (; i + 8 <= i1; i += 8) store(y + i, ((load(x + i) - m1) - c) * s + b0);
        for (; i < i1; i++) y[i] = ((x[i] - m1) - c) * s + b0;
        return;
    }
    for (; i + 8 <= i1; i += 8) {
        vd v = ((load(x + i) - m1) - c) * r;
        if (wp) v *= load(wp + i);
        if (bp) v += load(bp + i);
        store(y + i, v);
    }
    for (; i < i1; i++) {
        double v = ((x[i] - m1) - c) * r;
        if (wp) v *= wp[i];
        if (bp) v += bp[i];
        y[i] = v;
    }
}

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

// `nt`: y by non-temporal stores where its part [i0, i1) starts 16-byte aligned (float32)
template <typename T, typename P>
__attribute__((always_inline)) inline void affine(const T *x, T *y, long long i0, long long i1, double m1, double c, double r,
                   const P *wp, const P *bp, int scalar_params, bool nt) {
    const double mean = m1 + c;
    const float hi = (float)mean, lo = (float)(mean - (double)hi);
    if (nt && (uintptr_t)(y + i0) % 16 == 0) affine_f32<true>(x, y, i0, i1, hi, lo, (float)r, wp, bp, scalar_params);
    else affine_f32<false>(x, y, i0, i1, hi, lo, (float)r, wp, bp, scalar_params);
}
template <>
inline void affine<double, double>(const double *x, double *y, long long i0, long long i1, double m1, double c,
                                   double r, const double *wp, const double *bp, int scalar_params, bool) {
    affine_f64(x, y, i0, i1, m1, c, r, wp, bp, scalar_params);
}

// ---- rows: statistics over the last axis of x viewed as (rows, n) ----------------------------

// A row's statistics and where its values are (x, or h with a residual)
template <typename T> struct RowStats {
    const T *x;
    double m1, c, rs;
};

template <typename T>
inline RowStats<T> row_stats(const T *x, const T *res, T *h, long long r, long long n, int center, double eps,
                             typename Acc<T>::type *mean, typename Acc<T>::type *rstd) {
    typedef typename Acc<T>::type A;
    const T *xr = x + r * n;
    if (res) {  // h = x + res in T, then the row of h is normalized
        T *hr = h + r * n;
        const T *rr = res + r * n;
        for (long long i = 0; i < n; i++) hr[i] = (T)(xr[i] + rr[i]);
        xr = hr;
    }
    double m1, c, q;
    row_moments(xr, n, center, &m1, &c, &q);
    double var = q - c * c;
    if (var < 0.0) var = 0.0;  // NaN stays NaN
    const double rs = 1.0 / sqrt(var + eps);
    if (mean) mean[r] = (A)(m1 + c);
    if (rstd) rstd[r] = (A)rs;
    return RowStats<T>{xr, m1, c, rs};
}

// ---- short rows (8 <= n <= 8 * SHORT_VECTORS), held in registers (with AVX) ---------------
//
// A row of K vectors is loaded once (the last one as the row's last 8 elements where n is
// not a multiple of 8, its lanes already loaded zeroed for the sums) and its statistics
// and y made from the registers.  Short rows are bound by the totals of their sums (a
// vector's lanes added, converted, added again: three a row), so with AVX the rows go four
// at a time, their 12 totals taken together by horizontal adds and their rstd by one
// vector square root.  The arithmetic is the general path's with float32 totals (at most
// 64 terms, added pairwise): m1 the row's mean in float32, c and q about it (again about
// m1 + c where c^2 > q / 16), y by `affine_f32`'s formula with w = 1 and b = 0 where a
// parameter is absent.  y is stored after the row is read (x and y may be one array), the
// overlapping last vector with the values the vector before it stored.  Without AVX the
// general path takes them (these vectors of 8 are two registers there, and measured slower).
#if defined(__AVX__)
const int SHORT_VECTORS = 8;

// a[0] + ... + a[K-1] as a balanced tree (a chain of K - 1 dependent adds was the bound)
template <int K> struct Tree {
    static inline vf sum(const vf *a) { return Tree<K / 2>::sum(a) + Tree<K - K / 2>::sum(a + K / 2); }
};
template <> struct Tree<1> {
    static inline vf sum(const vf *a) { return a[0]; }
};

inline float total_f32(vf a) {
    const vf4 lo = {a[0], a[1], a[2], a[3]}, hi = {a[4], a[5], a[6], a[7]};
    const vf4 s = lo + hi;
    return (s[0] + s[2]) + (s[1] + s[3]);
}

// the row's K vectors (the last one's stale lanes zeroed by `fresh`) about m: sum(d), sum(d^2)
template <int K> inline void short_sums(const vf *v, vf fresh, float m, vf *su, vf *sq) {
    vf d[K], dd[K];
    for (int k = 0; k < K; k++) {
        d[k] = k == K - 1 ? (v[k] - m) * fresh : v[k] - m;
        dd[k] = d[k] * d[k];
    }
    *su = Tree<K>::sum(d);
    *sq = Tree<K>::sum(dd);
}

// one row's m1, c, q (as row_moments)
template <int K> inline void short_moments(const vf *v, vf fresh, int center, double inv_n, double *m1, double *c,
                                           double *q) {
    float m = 0.0f;
    if (center) {
        vf t[K];
        for (int k = 0; k < K; k++) t[k] = k == K - 1 ? v[k] * fresh : v[k];
        m = (float)((double)total_f32(Tree<K>::sum(t)) * inv_n);
    }
    vf u, uu;
    short_sums<K>(v, fresh, m, &u, &uu);
    double su = total_f32(u), sq = total_f32(uu);
    if (center && su * su > sq * ((double)1 / inv_n) / 16.0) {  // c^2 > q / 16: again about the mean
        m = (float)((double)m + su * inv_n);
        short_sums<K>(v, fresh, m, &u, &uu);
        su = total_f32(u);
        sq = total_f32(uu);
    }
    *m1 = (double)m;
    *c = center ? su * inv_n : 0.0;
    *q = sq * inv_n;
}

// y of one row from its registers and statistics
template <int K, typename T>
__attribute__((always_inline)) inline void short_y(const vf *v, T *yr, long long last, double m1, double c,
                                                   double rs, const vf *wv, const vf *bv, const float *w1,
                                                   const float *b1) {
    const double mu = m1 + c;
    const float hi = (float)mu, lo = (float)(mu - (double)hi), rf = (float)rs;
    vf out[K];
    if (w1) {  // one weight and bias for the row: affine_f32's scalar form
        const float s = rf * *w1, los = lo * s;
        for (int j = 0; j < K; j++) out[j] = ((v[j] - hi) * s - los) + *b1;
    } else {
        const float lor = lo * rf;
        for (int j = 0; j < K; j++) out[j] = ((v[j] - hi) * rf - lor) * wv[j] + bv[j];
    }
    for (int j = 0; j < K; j++) put(yr + (j == K - 1 ? last : 8 * j), out[j]);
}

template <int K, typename T, typename P>
int short_rows(const T *x, T *y, const P *w, const P *b, long long w_count, typename Acc<T>::type *mean,
               typename Acc<T>::type *rstd, long long nrows, long long n, int center, double eps, bool per_row) {
    typedef typename Acc<T>::type A;
    const long long last = n - 8;  // the last vector's offset
    const vf fresh = LANE >= (int)(8 * K - n) ? (vf){1, 1, 1, 1, 1, 1, 1, 1} : (vf){0};
    const double inv_n = 1.0 / (double)n;
    vf wv[K], bv[K];
    for (int k = 0; k < K; k++) {
        const long long o = k == K - 1 ? last : 8 * k;
        wv[k] = w && !per_row ? narrow(w + o) : (vf){1, 1, 1, 1, 1, 1, 1, 1};
        bv[k] = b && !per_row ? narrow(b + o) : (vf){0};
    }
    float w1[4] = {1, 1, 1, 1}, b1[4] = {0, 0, 0, 0};
    long long r = 0;
    const float inv_n_f = (float)inv_n;
    for (; r + 4 <= nrows; r += 4) {
        vf v[4][K];
        for (int i = 0; i < 4; i++)
            for (int k = 0; k < K; k++) v[i][k] = narrow(x + (r + i) * n + (k == K - 1 ? last : 8 * k));
        vf4 m = {0, 0, 0, 0};
        if (center) {
            vf s[4];
            for (int i = 0; i < 4; i++) {
                vf t[K];
                for (int k = 0; k < K; k++) t[k] = k == K - 1 ? v[i][k] * fresh : v[i][k];
                s[i] = Tree<K>::sum(t);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)s[0], (__m256)s[1]),
                                            _mm256_hadd_ps((__m256)s[2], (__m256)s[3]));
            m = ((vf4)_mm256_castps256_ps128(h) + (vf4)_mm256_extractf128_ps(h, 1)) * inv_n_f;
        }
        vf u[8];
        for (int i = 0; i < 4; i++) short_sums<K>(v[i], fresh, m[i], &u[i], &u[4 + i]);
        const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)u[0], (__m256)u[1]),
                                         _mm256_hadd_ps((__m256)u[2], (__m256)u[3]));
        const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)u[4], (__m256)u[5]),
                                         _mm256_hadd_ps((__m256)u[6], (__m256)u[7]));
        const vf tot = (vf)(_mm256_permute2f128_ps(t0, t1, 0x20) + _mm256_permute2f128_ps(t0, t1, 0x31));
        const vd4 su = __builtin_convertvector(((vf4){tot[0], tot[1], tot[2], tot[3]}), vd4);
        const vd4 sq = __builtin_convertvector(((vf4){tot[4], tot[5], tot[6], tot[7]}), vd4);
        vd4 m1 = __builtin_convertvector(m, vd4), c = center ? su * inv_n : (vd4){0}, q = sq * inv_n;
        if (center) {
            const auto far = su * su > sq * (double)n / 16.0;  // c^2 > q / 16
            if (far[0] | far[1] | far[2] | far[3])
                for (int i = 0; i < 4; i++)
                    if (far[i]) {
                        double m1_i, c_i, q_i;
                        short_moments<K>(v[i], fresh, center, inv_n, &m1_i, &c_i, &q_i);
                        m1[i] = m1_i;
                        c[i] = c_i;
                        q[i] = q_i;
                    }
        }
        vd4 var = q - c * c;
        var = var < 0.0 ? (vd4){0} : var;  // NaN stays NaN
        const vd4 rs = 1.0 / (vd4)_mm256_sqrt_pd((__m256d)(var + eps));
        for (int i = 0; i < 4; i++) {
            if (mean) mean[r + i] = (A)(m1[i] + c[i]);
            if (rstd) rstd[r + i] = (A)rs[i];
            if (per_row) {
                const long long k = w_count > 0 ? (r + i) % w_count : r + i;
                w1[i] = w ? (float)w[k] : 1.0f;
                b1[i] = b ? (float)b[k] : 0.0f;
            }
        }
        for (int i = 0; i < 4; i++)
            short_y<K>(v[i], y + (r + i) * n, last, m1[i], c[i], rs[i], wv, bv, per_row ? w1 + i : 0, b1 + i);
    }
    for (; r < nrows; r++) {
        vf v[K];
        for (int k = 0; k < K; k++) v[k] = narrow(x + r * n + (k == K - 1 ? last : 8 * k));
        double m1, c, q;
        short_moments<K>(v, fresh, center, inv_n, &m1, &c, &q);
        double var = q - c * c;
        if (var < 0.0) var = 0.0;  // NaN stays NaN
        const double rs = 1.0 / sqrt(var + eps);
        if (mean) mean[r] = (A)(m1 + c);
        if (rstd) rstd[r] = (A)rs;
        if (per_row) {
            const long long k = w_count > 0 ? r % w_count : r;
            w1[0] = w ? (float)w[k] : 1.0f;
            b1[0] = b ? (float)b[k] : 0.0f;
        }
        short_y<K>(v, y + r * n, last, m1, c, rs, wv, bv, per_row ? w1 : 0, b1);
    }
    return 0;
}

// f(std::integral_constant<int, K>()) for K = n's vectors of 8 (1 to SHORT_VECTORS); 1 past them
template <typename F> inline int by_vectors(long long n, F f) {
    switch ((n + 7) / 8) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    case 8: return f(std::integral_constant<int, 8>());
    }
    return 1;
}

// short_rows for n's number of vectors; 1 where it does not take the row length
template <typename T, typename P>
int short_rows_for(const T *x, T *y, const P *w, const P *b, long long w_count, typename Acc<T>::type *mean,
                   typename Acc<T>::type *rstd, long long nrows, long long n, int center, double eps, bool per_row) {
    return by_vectors(n, [&](auto k) {
        return short_rows<decltype(k)::value>(x, y, w, b, w_count, mean, rstd, nrows, n, center, eps, per_row);
    });
}
// float64 rows keep the general path (the registers here hold float32)
inline int short_rows_for(const double *, double *, const double *, const double *, long long, double *, double *,
                          long long, long long, int, double, bool) {
    return 1;
}
#endif

// Rows whose weight and bias are too long to stay in L1 from one row's y pass to the next
// (2 x n x 4 bytes past ROW_PARAMS_L1) go in groups of ROW_GROUP: the group's statistics, then
// its y passes column chunk by column chunk, each chunk of w and b read from L2 once for the
// group (rows of 4096: 0.92x the time; rows of 768, whose parameters stay in L1: 1.03x, so
// they go one by one).
const long long ROW_GROUP = 4, ROW_CHUNK = 1024, ROW_PARAMS_L1 = 16 << 10, ROWS_NT_BYTES = 4 << 20;

// Parameters (of type P: the accumulation type, or x's half type) by position in the row
// (`w_run == 0`: layer/RMS norm), or constant over runs of `w_run` elements, indexed by
// `(row * n + i) / w_run` modulo `w_count` where that is > 0 (NCHW instance/group norm: a run
// is a channel's spatial extent, `w_count` the channels, so that one sample's C values serve
// every sample).  With `res`, h = x + res (rounded to x's type) is written to `h` and
// normalized.  Returns 1 for n <= 0 or n not a multiple of w_run.
template <typename T, typename P>
int rows(const T *x, const T *res, T *h, T *y, const P *w, const P *b, long long w_run, long long w_count,
         typename Acc<T>::type *mean, typename Acc<T>::type *rstd, long long nrows, long long n, int center,
         double eps) {
    if (n <= 0 || (w_run > 0 && n % w_run)) return 1;
    // float32 y past ROWS_NT_BYTES by non-temporal stores: written once and not read here, and
    // a store that misses first reads its line (rows of 768: 0.90x the time, 1024 rows of 4096
    // 0.66x, 65536 rows of 256 0.92x, 8192 rows of 4096 0.98x, 4096 of 2048 1.05x); smaller
    // outputs stay in the caches for whoever reads them next
    const bool nt = sizeof(T) == 4 && nrows * n * (long long)sizeof(T) >= ROWS_NT_BYTES;
    const bool grouped = w_run <= 0 && (w || b) && 2 * n * (long long)sizeof(P) > ROW_PARAMS_L1;
    if (grouped) {
        RowStats<T> st[ROW_GROUP];
        for (long long r0 = 0; r0 < nrows; r0 += ROW_GROUP) {
            const long long g = r0 + ROW_GROUP < nrows ? ROW_GROUP : nrows - r0;
            for (long long k = 0; k < g; k++) st[k] = row_stats(x, res, h, r0 + k, n, center, eps, mean, rstd);
            for (long long s = 0; s < n; s += ROW_CHUNK) {
                const long long e = s + ROW_CHUNK < n ? s + ROW_CHUNK : n;
                for (long long k = 0; k < g; k++)
                    affine(st[k].x, y + (r0 + k) * n, s, e, st[k].m1, st[k].c, st[k].rs, w, b, 0, nt);
            }
        }
        if (nt) nt_fence();
        return 0;
    }
#if defined(__AVX__)
    if (!res && n >= 8 && n <= 8 * SHORT_VECTORS && (w_run <= 0 || w_run == n) &&
        short_rows_for(x, y, w, b, w_count, mean, rstd, nrows, n, center, eps, w_run > 0) == 0)
        return 0;
#endif
    for (long long r = 0; r < nrows; r++) {
        const RowStats<T> st = row_stats(x, res, h, r, n, center, eps, mean, rstd);
        T *yr = y + r * n;
        if (w_run <= 0) {
            affine(st.x, yr, 0, n, st.m1, st.c, st.rs, w, b, 0, nt);
        } else {
            for (long long s = 0; s < n; s += w_run) {
                long long k = (r * n + s) / w_run;
                if (w_count > 0) k %= w_count;
                affine(st.x, yr, s, s + w_run, st.m1, st.c, st.rs, w ? w + k : 0, b ? b + k : 0, 1, nt);
            }
        }
    }
    if (nt) nt_fence();
    return 0;
}

// ---- segmented rows: layer/RMS norm over outer and inner axes, keeping those between ------------
//
// x viewed as (A, R, B) normalized over A and B for each of the R rows: row r is A segments
// of B contiguous elements, segment j at x + j * seg_stride + r * B (seg_stride = R * B),
// its parameters those of positions j * B ... (j + 1) * B - 1 of the (A, B) weight and bias;
// y in x's layout.  The statistics as `row_moments`'s: the first mean m1 from the first
// segment's head, then sum(x - m1) and sum((x - m1)^2) (again about the full mean where
// c^2 > q / 16).  float32/float16/bfloat16 segments of 8 to SEG_VECTOR_MAX elements sum in
// float32 vectors across the row's segments (a segment's last < 8 elements as its last 8
// with the lanes already summed zeroed), added into float64 before a lane holds more than
// SEG_LANE_TERMS terms, and form y by vectors (the last one overlapping, computed before
// the segment's stores); longer ones, and float64, take `sum_f32`/`row_moments` and
// `affine` a segment.
const long long SEG_VECTOR_MAX = 1024, SEG_LANE_TERMS = 128;

// sum(d) and sum(d^2), d = x - m over a segment of 8 <= len <= SEG_VECTOR_MAX, into the vectors
template <typename T>
inline void segment_sums(const T *p, long long len, float m, vi32 tail_fresh, vf *u, vf *uu) {
    vf u0 = *u, q0 = *uu, u1 = {0}, q1 = {0};
    long long i = 0;
    for (; i + 16 <= len; i += 16) {
        const vf d0 = narrow(p + i) - m, d1 = narrow(p + i + 8) - m;
        u0 += d0;
        q0 += d0 * d0;
        u1 += d1;
        q1 += d1 * d1;
    }
    if (i + 8 <= len) {
        const vf d0 = narrow(p + i) - m;
        u0 += d0;
        q0 += d0 * d0;
        i += 8;
    }
    if (i < len) {
        vf d1 = narrow(p + len - 8) - m;
        d1 = tail_fresh ? d1 : (vf){0};
        u1 += d1;
        q1 += d1 * d1;
    }
    *u = u0 + u1;
    *uu = q0 + q1;
}

template <typename T>
inline void segmented_moments(const T *xr, long long segments, long long len, long long stride, int center,
                              double *m1, double *c, double *q) {
    const double inv_n = 1.0 / (double)(segments * len);
    const long long head = len < HEAD ? len : HEAD;
    float m = center ? (float)(sum_f32(xr, head, 0.0f, nullptr) / (double)head) : 0.0f;
    const bool vectors = len >= 8 && len <= SEG_VECTOR_MAX;
    const vi32 tail_fresh = LANE >= (int)(8 - len % 8);
    const long long lane_terms = (len + 7) / 8;  // a segment's terms in each lane
    double su = 0.0, sq = 0.0;
    for (int pass = 0; pass < 2; pass++) {
        su = sq = 0.0;
        vf u = {0}, uu = {0};
        long long held = 0;
        for (long long j = 0; j < segments; j++) {
            if (vectors) {
                if (held + lane_terms > SEG_LANE_TERMS) {
                    su += total(u);
                    sq += total(uu);
                    u = uu = (vf){0};
                    held = 0;
                }
                segment_sums(xr + j * stride, len, m, tail_fresh, &u, &uu);
                held += lane_terms;
            } else {
                double squares;
                su += sum_f32(xr + j * stride, len, m, &squares);
                sq += squares;
            }
        }
        su += total(u);
        sq += total(uu);
        if (!center || su * su <= sq * (double)(segments * len) / 16.0) break;  // c^2 <= q / 16
        m = (float)((double)m + su * inv_n);
    }
    *m1 = (double)m;
    *c = center ? su * inv_n : 0.0;
    *q = sq * inv_n;
}
inline void segmented_moments(const double *xr, long long segments, long long len, long long stride, int center,
                              double *m1, double *c, double *q) {
    const double inv_n = 1.0 / (double)(segments * len);
    double m = 0.0;
    if (center) {
        for (long long j = 0; j < segments; j++) m += sum_f64(xr + j * stride, len);
        m *= inv_n;
    }
    double su = 0.0, sq = 0.0;
    for (long long j = 0; j < segments; j++) {  // about m, as row_moments
        const double *p = xr + j * stride;
        vd u0 = {0}, q0 = {0};
        long long i = 0;
        for (; i + 8 <= len; i += 8) {
            const vd d = load(p + i) - m;
            u0 += d;
            q0 += d * d;
        }
        su += total(u0);
        sq += total(q0);
        for (; i < len; i++) {
            const double d = p[i] - m;
            su += d;
            sq += d * d;
        }
    }
    *m1 = m;
    *c = center ? su * inv_n : 0.0;
    *q = sq * inv_n;
}

// y of one segment of 8 <= len elements: affine_f32's formula, by vectors, w = 1 and b = 0
// where a parameter is absent
template <typename T, typename P>
inline void segment_y(const T *x, T *y, long long len, float hi, float lo, float r, const P *wp, const P *bp) {
    const float lor = lo * r;
    const vf one = {1, 1, 1, 1, 1, 1, 1, 1}, zero = {0};
    const long long t = len - 8;
    const vf last = ((narrow(x + t) - hi) * r - lor) * (wp ? narrow(wp + t) : one) + (bp ? narrow(bp + t) : zero);
    for (long long i = 0; i + 8 <= len; i += 8)
        put(y + i, ((narrow(x + i) - hi) * r - lor) * (wp ? narrow(wp + i) : one) + (bp ? narrow(bp + i) : zero));
    put(y + t, last);
}

template <typename T, typename P>
inline void segmented_y(const T *xr, T *yr, long long segments, long long len, long long stride, double m1, double c,
                        double rs, const P *w, const P *b) {
    const double mean = m1 + c;
    const float hi = (float)mean, lo = (float)(mean - (double)hi);
    for (long long j = 0; j < segments; j++) {
        const P *wp = w ? w + j * len : 0, *bp = b ? b + j * len : 0;
        if (len >= 8) segment_y(xr + j * stride, yr + j * stride, len, hi, lo, (float)rs, wp, bp);
        else affine(xr + j * stride, yr + j * stride, 0, len, m1, c, rs, wp, bp, 0, false);
    }
}
inline void segmented_y(const double *xr, double *yr, long long segments, long long len, long long stride, double m1,
                        double c, double rs, const double *w, const double *b) {
    for (long long j = 0; j < segments; j++)
        affine(xr + j * stride, yr + j * stride, 0, len, m1, c, rs, w ? w + j * len : 0, b ? b + j * len : 0, 0,
               false);
}

template <typename T, typename P>
int segmented_rows(const T *x, T *y, const P *w, const P *b, typename Acc<T>::type *mean,
                   typename Acc<T>::type *rstd, long long nrows, long long n, long long segments, long long stride,
                   int center, double eps) {
    typedef typename Acc<T>::type A;
    if (n <= 0 || segments <= 0 || n % segments) return 1;
    const long long len = n / segments;
    for (long long r = 0; r < nrows; r++) {
        const T *xr = x + r * len;
        double m1, c, q;
        segmented_moments(xr, segments, len, stride, center, &m1, &c, &q);
        double var = q - c * c;
        if (var < 0.0) var = 0.0;  // NaN stays NaN
        const double rs = 1.0 / sqrt(var + eps);
        if (mean) mean[r] = (A)(m1 + c);
        if (rstd) rstd[r] = (A)rs;
        segmented_y(xr, y + r * len, segments, len, stride, m1, c, rs, w, b);
    }
    return 0;
}

// the working precision of a kernel's arithmetic, its vectors, and x's elements widened to them
template <typename T> struct Work { typedef float type; typedef vf vec; };
template <> struct Work<double> { typedef double type; typedef vd vec; };

template <typename T> inline vf lanes(const T *p) { return narrow(p); }
inline vd lanes(const double *p) { return load(p); }

// ---- rows backward: the gradients through a row's normalization ------------------------------
//
// Per row, with xhat = ((x - hi) - lo) * r (the statistics given: hi = mean, lo = sum(x - hi)
// / n from the row's sums, what the mean's rounding left out; or taken again as the forward
// takes them) and g = dy * w:
//
//     dx = (g - xhat * mean(g * xhat) - mean(g)) * r          (RMS norm: no mean(g))
//     dweight += dy * xhat,  dbias += dy                      (summed over rows / runs)
//
// The row is read from memory once (x, dy) and again from L1/L2 for dx.  Weight gradients by
// position (w_run = 0) gather in float32 vectors a call, added to the caller's float64 ones
// every BWD_FLUSH_ROWS rows; by run (w_run = S > 0: NCHW instance/group norm) each run's sums
// are float32 over chunks of SUM_CHUNK added in float64, written to dw[k] and db[k] of run k.

// sum(g), sum(g * (x - hi)) and sum(x - hi) over elements [i0, i1) of a row (float32 over
// chunks of SUM_CHUNK, added in float64), the weight `wp` by position or `wk` for all of them
// where wp is null (POS: wp not null); sum(g * xhat) is then r * (the second - lo * the first),
// and with the forward's mean as hi (rounded to the statistics' dtype) lo = the third / n is
// what that rounding left out (OFF: the third wanted)
template <bool POS, bool OFF, typename T, typename V, typename F>
inline void grad_sums_by(const T *x, const T *dy, long long i0, long long i1, F hi, const F *wp, F wk, double *sg,
                         double *sgd, double *sx) {
    double tg = 0.0, tgd = 0.0, tx = 0.0;
    for (long long c0 = i0; c0 < i1; c0 += SUM_CHUNK) {
        const long long c1 = c0 + SUM_CHUNK < i1 ? c0 + SUM_CHUNK : i1;
        V u0 = {0}, u1 = {0}, v0 = {0}, v1 = {0}, e0 = {0}, e1 = {0};
        long long i = c0;
        for (; i + 16 <= c1; i += 16) {
            const V d0 = lanes(dy + i), d1 = lanes(dy + i + 8);
            const V g0 = POS ? d0 * load(wp + i) : d0 * wk, g1 = POS ? d1 * load(wp + i + 8) : d1 * wk;
            const V m0 = lanes(x + i) - hi, m1 = lanes(x + i + 8) - hi;
            u0 += g0;
            u1 += g1;
            v0 += g0 * m0;
            v1 += g1 * m1;
            if (OFF) {
                e0 += m0;
                e1 += m1;
            }
        }
        for (; i + 8 <= c1; i += 8) {
            const V d = lanes(dy + i), m = lanes(x + i) - hi;
            const V g = POS ? d * load(wp + i) : d * wk;
            u0 += g;
            v0 += g * m;
            if (OFF) e0 += m;
        }
        tg += total(u0 + u1);
        tgd += total(v0 + v1);
        if (OFF) tx += total(e0 + e1);
        for (; i < c1; i++) {
            const F d = (F)dy[i], g = POS ? d * wp[i] : d * wk, m = (F)x[i] - hi;
            tg += (double)g;
            tgd += (double)(g * m);
            if (OFF) tx += (double)m;
        }
    }
    *sg = tg;
    *sgd = tgd;
    *sx = tx;
}

template <typename T, typename V, typename F>
inline void grad_sums(const T *x, const T *dy, long long i0, long long i1, F hi, const F *wp, F wk, bool off,
                      double *sg, double *sgd, double *sx) {
    if (wp && off) grad_sums_by<true, true, T, V, F>(x, dy, i0, i1, hi, wp, wk, sg, sgd, sx);
    else if (wp) grad_sums_by<true, false, T, V, F>(x, dy, i0, i1, hi, wp, wk, sg, sgd, sx);
    else if (off) grad_sums_by<false, true, T, V, F>(x, dy, i0, i1, hi, wp, wk, sg, sgd, sx);
    else grad_sums_by<false, false, T, V, F>(x, dy, i0, i1, hi, wp, wk, sg, sgd, sx);
}

// A row's constants for its dx: xhat = ((x - hi) - lo) * r, dx = ((g - c2) - xhat * c1) * r
template <typename F> struct GradRow {
    F hi, lo, r, c1, c2;
};

// dx of a group of `g` (<= BWD_GROUP) rows whose weight is by position (`wp`) or `wk` (wp null),
// element by element across the rows, so that `aw`, `ab` (nullable: += dy * xhat, += dy)
// are read and written once for the group
template <int G, bool NT, bool POS, typename T, typename V, typename F>
inline void grad_x_rows(const T *x, const T *dy, T *dx, long long n, const GradRow<F> *k_,
                        const F *wp, F *aw, F *ab, F wk) {
    const int g = G;
    long long i = 0;
    for (; i + 8 <= n; i += 8) {
        V sw = {0}, sb = {0};
        for (int k = 0; k < g; k++) {
            const GradRow<F> &c = k_[k];
            const long long e = k * n + i;
            const V xh = ((lanes(x + e) - c.hi) - c.lo) * c.r, d = lanes(dy + e);
            const V gv = POS ? d * load(wp + i) : d * wk;
            put_y<NT>(dx + e, ((gv - c.c2) - xh * c.c1) * c.r);
            sw += d * xh;
            sb += d;
        }
        if (aw) {
            store(aw + i, load(aw + i) + sw);
            store(ab + i, load(ab + i) + sb);
        }
    }
    for (; i < n; i++) {
        F sw = 0, sb = 0;
        for (int k = 0; k < g; k++) {
            const GradRow<F> &c = k_[k];
            const long long e = k * n + i;
            const F xh = (((F)x[e] - c.hi) - c.lo) * c.r, d = (F)dy[e], gv = POS ? d * wp[i] : d * wk;
            dx[e] = (T)(((gv - c.c2) - xh * c.c1) * c.r);
            sw += d * xh;
            sb += d;
        }
        if (aw) {
            aw[i] += sw;
            ab[i] += sb;
        }
    }
}

// dx over elements [i0, i1): (g - xhat * c1 - c2) * r
template <typename T, typename V, typename F>
inline void grad_x(const T *x, const T *dy, T *dx, long long i0, long long i1, F hi, F lo, F r, const F *wp, F wk,
                   F c1, F c2) {
    long long i = i0;
    for (; i + 8 <= i1; i += 8) {
        const V xh = ((lanes(x + i) - hi) - lo) * r, d = lanes(dy + i);
        const V g = wp ? d * load(wp + i) : d * wk;
        put(dx + i, ((g - c2) - xh * c1) * r);
    }
    for (; i < i1; i++) {
        const F xh = (((F)x[i] - hi) - lo) * r, d = (F)dy[i], g = wp ? d * wp[i] : d * wk;
        dx[i] = (T)(((g - c2) - xh * c1) * r);
    }
}

// grad_x_rows by weight (by position or none) and store kind, each loop without a branch
template <int G, typename T, typename V, typename F>
inline void grad_x_group(const T *x, const T *dy, T *dx, long long n, const GradRow<F> *rows, const F *wp, F *aw,
                         F *ab, bool nt) {
    if (nt && wp) grad_x_rows<G, true, true, T, V, F>(x, dy, dx, n, rows, wp, aw, ab, F(1));
    else if (nt) grad_x_rows<G, true, false, T, V, F>(x, dy, dx, n, rows, wp, aw, ab, F(1));
    else if (wp) grad_x_rows<G, false, true, T, V, F>(x, dy, dx, n, rows, wp, aw, ab, F(1));
    else grad_x_rows<G, false, false, T, V, F>(x, dy, dx, n, rows, wp, aw, ab, F(1));
}

// hi, lo and r of row r from the statistics the forward wrote (lo then comes from the row's
// sums), or false where none are given (`rstd` null)
template <typename F, typename A>
inline bool given_stats(GradRow<F> *c, const A *mean, const A *rstd, long long r, int center) {
    if (!rstd) return false;
    c->hi = center ? (F)mean[r] : F(0);
    c->lo = 0;
    c->r = (F)rstd[r];
    return true;
}

// A row's GradRow: its statistics as given (`mean` null for RMS norm; lo, what the mean's
// rounding to the statistics' dtype left out, taken back from the row in the same pass as the
// sums: xhat about hi alone was off by |mean| * rstd * 2^-24, 6e-3 of dx at 1e6 std) or, with
// rstd null, taken again from x as `rows` takes them; then sum(g) and sum(g * xhat) over its
// elements, the weight by position (`wp`) or by run (`w`, w_run > 0: its runs' sums also go
// to dw[k], db[k] where dw is not null; `runs`: 2 * n / w_run doubles of scratch)
template <typename T, typename V, typename F>
inline GradRow<F> grad_row(const T *x, const T *dy, long long r, long long n, const typename Acc<T>::type *mean,
                           const typename Acc<T>::type *rstd, const F *w, long long w_run, double *dw,
                           double *db, int center, double eps, double *runs) {
    GradRow<F> c;
    const bool off = rstd && center;  // lo from the row's sums
    if (!given_stats(&c, mean, rstd, r, center)) {
        const RowStats<T> st = row_stats(x, (const T *)nullptr, (T *)nullptr, r, n, center, eps,
                                         (typename Acc<T>::type *)nullptr, (typename Acc<T>::type *)nullptr);
        // float64: ((x - m1) - c), as its forward; float32: the mean in two floats
        const double m = st.m1 + st.c;
        c.hi = sizeof(F) == 8 ? (F)st.m1 : (F)m;
        c.lo = sizeof(F) == 8 ? (F)st.c : (F)(m - (double)c.hi);
        c.r = (F)st.rs;
    }
    const T *xr = x + r * n, *dyr = dy + r * n;
    const double rs = (double)c.r, inv_n = 1.0 / (double)n;
    double sg = 0.0, sgx = 0.0;
    if (w_run <= 0) {
        double sgd, sx;
        grad_sums<T, V, F>(xr, dyr, 0, n, c.hi, w, F(1), off, &sg, &sgd, &sx);
        if (off) c.lo = (F)(sx * inv_n);
        sgx = rs * (sgd - (double)c.lo * sg);
    } else {
        const long long nruns = n / w_run;
        double tx = 0.0;
        for (long long j = 0; j < nruns; j++) {
            double sx;
            grad_sums<T, V, F>(xr, dyr, j * w_run, (j + 1) * w_run, c.hi, (const F *)nullptr, F(1), off,
                               runs + 2 * j, runs + 2 * j + 1, &sx);
            tx += sx;
        }
        if (off) c.lo = (F)(tx * inv_n);
        const double lo = (double)c.lo;
        for (long long j = 0; j < nruns; j++) {
            const long long k = (r * n + j * w_run) / w_run;
            const double sd = runs[2 * j], sdx = rs * (runs[2 * j + 1] - lo * sd), wk = w ? (double)w[k] : 1.0;
            sg += wk * sd;
            sgx += wk * sdx;
            if (dw) {
                dw[k] += sdx;
                db[k] += sd;
            }
        }
    }
    c.c1 = (F)(sgx * inv_n);
    c.c2 = center ? (F)(sg * inv_n) : F(0);
    return c;
}

// Rows by position whose weight and gradient vectors exceed L1 go in groups of BWD_GROUP: each
// row's sums, then the group's dx element by element across its rows, the weight and bias
// gradients added once a group to float32 vectors of n (read and written once a group, not
// once a row), which go to the caller's float64 ones every BWD_FLUSH_ROWS rows.
const int BWD_GROUP = 4;
const long long BWD_FLUSH_ROWS = 64;  // a multiple of BWD_GROUP

#if defined(__AVX__)
// Short rows (8 <= n <= 8 * SHORT_VECTORS, weight by position), held in registers as the
// forward's short rows (the statistics given, or taken again from the registers as the
// forward takes them): x and dy loaded once (the last vector overlapping,
// its stale lanes zeroed by `fresh` in every sum), four rows at a time with their 12 totals
// by horizontal adds (float32, at most 64 terms), dx from the registers (stored after the
// row is read), the weight and bias gradients gathered in float32 vectors across rows and
// added to dw, db every BWD_FLUSH_ROWS rows.  The arithmetic is `grad_row`'s and
// `grad_x_rows`'s.
template <int K> struct ShortGrad {
    vf x[K], dy[K];
};

inline vf4 totals4(vf a, vf b, vf c, vf d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a, (__m256)b), _mm256_hadd_ps((__m256)c, (__m256)d));
    return (vf4)_mm256_castps256_ps128(h) + (vf4)_mm256_extractf128_ps(h, 1);
}

template <int K, typename T>
int short_rows_bwd(const T *x, const T *dy, T *dx, const float *w, const float *mean, const float *rstd, double *dw,
                   double *db, long long nrows, long long n, int center, double eps) {
    const long long last = n - 8;
    const vf fresh = LANE >= (int)(8 * K - n) ? (vf){1, 1, 1, 1, 1, 1, 1, 1} : (vf){0};
    const float inv_n = (float)(1.0 / (double)n);
    const bool given = rstd != nullptr;  // else hi, lo and r as the forward takes them
    vf wv[K], aw[K], ab[K];
    for (int k = 0; k < K; k++) {
        wv[k] = w ? load(w + (k == K - 1 ? last : 8 * k)) : (vf){1, 1, 1, 1, 1, 1, 1, 1};
        aw[k] = ab[k] = (vf){0};
    }
    for (long long r0 = 0; r0 < nrows; r0 += 4) {
        const int g = r0 + 4 <= nrows ? 4 : (int)(nrows - r0);
        ShortGrad<K> row[4];
        vf sg[4], sgd[4], sx[4];
        float hi[4], lo_taken[4], rs[4];
        for (int i = 0; i < 4; i++) {
            const long long rr = i < g ? r0 + i : r0;  // past the last row: the first again, unused
            for (int k = 0; k < K; k++) {
                const long long o = rr * n + (k == K - 1 ? last : 8 * k);
                row[i].x[k] = narrow(x + o);
                row[i].dy[k] = narrow(dy + o);
            }
            if (given) {
                hi[i] = center ? mean[rr] : 0.0f;
                rs[i] = rstd[rr];
            } else {
                double m1, c, q;
                short_moments<K>(row[i].x, fresh, center, 1.0 / (double)n, &m1, &c, &q);
                double var = q - c * c;
                if (var < 0.0) var = 0.0;  // NaN stays NaN
                const double mu = m1 + c;
                hi[i] = (float)mu;
                lo_taken[i] = (float)(mu - (double)hi[i]);
                rs[i] = (float)(1.0 / sqrt(var + eps));
            }
            vf tg[K], tgd[K], tx[K];
            for (int k = 0; k < K; k++) {
                const vf keep = k == K - 1 ? fresh : (vf){1, 1, 1, 1, 1, 1, 1, 1};
                const vf m = (row[i].x[k] - hi[i]) * keep, gk = row[i].dy[k] * wv[k] * keep;
                tg[k] = gk;
                tgd[k] = gk * m;
                tx[k] = m;
            }
            sg[i] = Tree<K>::sum(tg);
            sgd[i] = Tree<K>::sum(tgd);
            sx[i] = Tree<K>::sum(tx);
        }
        const vf4 tot_g = totals4(sg[0], sg[1], sg[2], sg[3]), tot_gd = totals4(sgd[0], sgd[1], sgd[2], sgd[3]),
                  tot_x = totals4(sx[0], sx[1], sx[2], sx[3]);
        for (int i = 0; i < g; i++) {
            const float lo = !given ? lo_taken[i] : center ? tot_x[i] * inv_n : 0.0f, r = rs[i];
            const float c1 = r * (tot_gd[i] - lo * tot_g[i]) * inv_n, c2 = center ? tot_g[i] * inv_n : 0.0f;
            vf out[K];
            for (int k = 0; k < K; k++) {
                const vf xh = ((row[i].x[k] - hi[i]) - lo) * r, d = row[i].dy[k];
                out[k] = ((d * wv[k] - c2) - xh * c1) * r;
                const vf keep = k == K - 1 ? fresh : (vf){1, 1, 1, 1, 1, 1, 1, 1};
                aw[k] += d * xh * keep;
                ab[k] += d * keep;
            }
            T *dxr = dx + (r0 + i) * n;
            for (int k = 0; k < K; k++) put(dxr + (k == K - 1 ? last : 8 * k), out[k]);
        }
        if (dw && ((r0 + g) % BWD_FLUSH_ROWS == 0 || r0 + g == nrows)) {
            for (int k = 0; k < K; k++) {
                const long long o = k == K - 1 ? last : 8 * k;
                for (int l = 0; l < 8; l++) {
                    dw[o + l] += (double)aw[k][l];
                    db[o + l] += (double)ab[k][l];
                }
                aw[k] = ab[k] = (vf){0};
            }
        }
    }
    return 0;
}

template <typename T>
int short_rows_bwd_for(const T *x, const T *dy, T *dx, const float *w, const float *mean, const float *rstd,
                       double *dw, double *db, long long nrows, long long n, int center, double eps) {
    return by_vectors(n, [&](auto k) {
        return short_rows_bwd<decltype(k)::value>(x, dy, dx, w, mean, rstd, dw, db, nrows, n, center, eps);
    });
}
inline int short_rows_bwd_for(const double *, const double *, double *, const double *, const double *,
                              const double *, double *, double *, long long, long long, int, double) {
    return 1;  // float64 rows keep the general path
}
#endif

// dx for `rows` rows of n; `mean`/`rstd` as the forward wrote them (mean null for RMS norm), or
// rstd null: taken again from x (as `rows` takes them, eps then used).  `w` (nullable) by
// position (w_run = 0, n values) or by run (w_run = S: w[(row*n + i)/S]).  `dw`/`db`
// (nullable, float64, the caller's zeros or earlier sums): += the weight and bias gradients,
// n values by position or one a run.  Returns 1 for n <= 0, n % w_run, or centred statistics
// given without their mean.
template <typename T>
int rows_bwd(const T *x, const T *dy, T *dx, const typename Acc<T>::type *w, long long w_run,
             const typename Acc<T>::type *mean, const typename Acc<T>::type *rstd, double *dw, double *db,
             long long nrows, long long n, int center, double eps) {
    typedef typename Work<T>::type F;
    typedef typename Work<T>::vec V;
    if (n <= 0 || (w_run > 0 && n % w_run) || (center && rstd && !mean)) return 1;
    // float32 dx of 4 MiB and up by non-temporal stores, as `rows` writes y, where every row
    // (and run) starts 16-byte aligned; rows in groups where their weight and its two gradient
    // vectors would not stay in L1 one row to the next
    const bool nt = sizeof(T) == 4 && nrows * n * (long long)sizeof(T) >= ROWS_NT_BYTES && n % 4 == 0 &&
                    w_run % 4 == 0 && (uintptr_t)dx % 16 == 0;
    if (w_run > 0) {
        std::vector<double> runs(2 * (n / w_run));
        for (long long r = 0; r < nrows; r++) {
            const GradRow<F> c = grad_row<T, V, F>(x, dy, r, n, mean, rstd, w, w_run, dw, db, center, eps, runs.data());
            for (long long s = 0; s < n; s += w_run) {
                const F wk = w ? (F)w[(r * n + s) / w_run] : F(1);
                const long long e = r * n + s;
                if (nt) grad_x_rows<1, true, false, T, V, F>(x + e, dy + e, dx + e, w_run, &c, nullptr, nullptr, nullptr, wk);
                else grad_x_rows<1, false, false, T, V, F>(x + e, dy + e, dx + e, w_run, &c, nullptr, nullptr, nullptr, wk);
            }
        }
        if (nt) nt_fence();
        return 0;
    }
#if defined(__AVX__)
    if (n >= 8 && n <= 8 * SHORT_VECTORS && (dw == nullptr) == (db == nullptr) &&
        short_rows_bwd_for(x, dy, dx, w, mean, rstd, dw, db, nrows, n, center, eps) == 0)
        return 0;
#endif
    const int group = w && 3 * n * (long long)sizeof(F) > ROW_PARAMS_L1 ? BWD_GROUP : 1;
    std::vector<F> acc;  // float32 weight and bias gradients by position, flushed to dw, db
    if (dw) acc.assign(2 * n, F(0));
    F *aw = acc.empty() ? nullptr : acc.data(), *ab = aw ? aw + n : nullptr;
    GradRow<F> rows[BWD_GROUP];
    for (long long r0 = 0; r0 < nrows; r0 += group) {
        const int g = r0 + group < nrows ? group : (int)(nrows - r0);
        for (int k = 0; k < g; k++)
            rows[k] = grad_row<T, V, F>(x, dy, r0 + k, n, mean, rstd, w, 0, nullptr, nullptr, center, eps, nullptr);
        const long long e = r0 * n;
        if (g == BWD_GROUP) {
            grad_x_group<BWD_GROUP, T, V, F>(x + e, dy + e, dx + e, n, rows, w, aw, ab, nt);
        } else {
            for (int k = 0; k < g; k++)
                grad_x_group<1, T, V, F>(x + e + k * n, dy + e + k * n, dx + e + k * n, n, rows + k, w, aw, ab, nt);
        }
        if (aw && ((r0 + g) % BWD_FLUSH_ROWS == 0 || r0 + g == nrows)) {
            for (long long i = 0; i < n; i++) {
                dw[i] += (double)aw[i];
                db[i] += (double)ab[i];
            }
            std::fill(acc.begin(), acc.end(), F(0));
        }
    }
    if (nt) nt_fence();
    return 0;
}


// ---- segmented rows backward: x as (A, R, B), normalized over A and B ----------------------
//
// The gradients of `segmented_rows`: a row's statistics given (lo from its sums, as
// `grad_row`) or taken again as the forward takes them, then sum(g) and sum(g * (x - hi))
// over its A runs, then each run's dx and its share of the weight and bias gradients (by
// position j * B + i), gathered in float32 vectors and added to dw, db every
// BWD_FLUSH_ROWS rows.
template <typename T>
int segmented_rows_bwd(const T *x, const T *dy, T *dx, const typename Acc<T>::type *w,
                       const typename Acc<T>::type *mean, const typename Acc<T>::type *rstd, double *dw, double *db,
                       long long nrows, long long n, long long segments, long long stride, int center, double eps) {
    typedef typename Work<T>::type F;
    typedef typename Work<T>::vec V;
    if (n <= 0 || segments <= 0 || n % segments || (center && rstd && !mean)) return 1;
    const long long len = n / segments;
    const double inv_n = 1.0 / (double)n;
    std::vector<F> acc;  // float32 (float64) weight and bias gradients by position, flushed to dw, db
    if (dw) acc.assign(2 * n, F(0));
    F *aw = acc.empty() ? nullptr : acc.data(), *ab = aw ? aw + n : nullptr;
    for (long long r = 0; r < nrows; r++) {
        const T *xr = x + r * len, *dyr = dy + r * len;
        GradRow<F> c;
        const bool off = rstd && center;  // lo from the row's sums
        if (!given_stats(&c, mean, rstd, r, center)) {
            double m1, cc, q;
            segmented_moments(xr, segments, len, stride, center, &m1, &cc, &q);
            double var = q - cc * cc;
            if (var < 0.0) var = 0.0;  // NaN stays NaN
            const double m = m1 + cc;  // float64: ((x - m1) - c), as its forward; else the mean in two floats
            c.hi = sizeof(F) == 8 ? (F)m1 : (F)m;
            c.lo = sizeof(F) == 8 ? (F)cc : (F)(m - (double)c.hi);
            c.r = (F)(1.0 / sqrt(var + eps));
        }
        double sg = 0.0, sgd = 0.0, sx = 0.0;
        for (long long j = 0; j < segments; j++) {
            double g, gd, tx;
            grad_sums<T, V, F>(xr + j * stride, dyr + j * stride, 0, len, c.hi, w ? w + j * len : nullptr, F(1), off,
                               &g, &gd, &tx);
            sg += g;
            sgd += gd;
            sx += tx;
        }
        if (off) c.lo = (F)(sx * inv_n);
        const double sgx = (double)c.r * (sgd - (double)c.lo * sg);
        c.c1 = (F)(sgx * inv_n);
        c.c2 = center ? (F)(sg * inv_n) : F(0);
        for (long long j = 0; j < segments; j++) {
            const long long e = r * len + j * stride;
            F *awj = aw ? aw + j * len : nullptr, *abj = ab ? ab + j * len : nullptr;
            if (w) grad_x_rows<1, false, true, T, V, F>(x + e, dy + e, dx + e, len, &c, w + j * len, awj, abj, F(1));
            else grad_x_rows<1, false, false, T, V, F>(x + e, dy + e, dx + e, len, &c, nullptr, awj, abj, F(1));
        }
        if (aw && ((r + 1) % BWD_FLUSH_ROWS == 0 || r + 1 == nrows)) {
            for (long long i = 0; i < n; i++) {
                dw[i] += (double)aw[i];
                db[i] += (double)ab[i];
            }
            std::fill(acc.begin(), acc.end(), F(0));
        }
    }
    return 0;
}

// ---- columns: statistics over the middle axis of x viewed as (B, P, Q) -------------------
//
// Channels-first layer norm (P = C, Q = H*W, a statistic per column, weight and bias per row
// p: `param_rows`) and NHWC instance/group norm (P = H*W, Q = C, a statistic per `group`
// adjacent columns, weight and bias per column).  A sample's columns are taken in strips of
// `strip` columns (a multiple of `group`; the caller sizes P x strip to stay in L2), a strip's
// rows in chunks of at most COL_CHUNK_ROWS.  A chunk is summed twice down its rows, four
// column vectors at a time (one 128-byte piece a row, the sums in registers): the column
// means m1 in float32, then d = x - m1, sum(d) and sum(d*d); each column's state (mean, M2)
// is merged across chunks in float64 by Chan's formula, then a group's columns likewise, and
// y is written in one more pass over the strip:
//
//     y = (x - hi) * (r * w) + (b - lo * r * w)          (hi + lo: the mean in two floats)

const long long COL_CHUNK_ROWS = 128;  // float32 sums of at most this many terms a column
const long long Y_BLOCK = 512;  // columns of channels-first y a block (3 x 2 KiB of constants)


// The cache lines of [p, end) into L2, for reading soon
inline void prefetch_l2(const char *p, const char *end) {
    for (p -= (uintptr_t)p % 64; p < end; p += 64) __builtin_prefetch(p, 0, 2);
}

// A row of channels-first y, columns [c0, c1), whole vectors up to cv: y = (x - hi) * (r * w_p)
// + (b_p - lo * r * w_p). With NT the row ends 0 or 4 columns past cv (rows of 16-byte
// pieces): those 4 go as the first half of a vector.
template <bool NT, typename V, typename T, typename F>
inline void cf_y_row(const T *row, T *out, long long c0, long long cv, long long c1, F wp, F bp,
                     const F *hi, const F *rs, const F *lor) {
    long long q = c0;
    for (; q < cv; q += 8) {
        const V sc = load(rs + q) * wp;
        put_y<NT>(out + q, (lanes(row + q) - load(hi + q)) * sc + (bp - load(lor + q) * wp));
    }
    if (NT && q < c1) {
        V t;
        for (int j = 0; j < 8; j++) t[j] = 0;
        for (int j = 0; j < 4; j++) t[j] = ((F)row[q + j] - hi[q + j]) * (rs[q + j] * wp) + (bp - lor[q + j] * wp);
        put_nt4(out + q, t);
        return;
    }
    for (; q < c1; q++) out[q] = (T)(((F)row[q] - hi[q]) * (rs[q] * wp) + (bp - lor[q] * wp));
}

// A row of NHWC y, its W columns (whole vectors up to WV): y = (x - hi) * sc + sh, sc and sh
// (in rs, lor) per column; the tail as cf_y_row's
template <bool NT, typename V, typename T, typename F>
inline void cl_y_row(const T *row, T *out, long long WV, long long W, const F *hi, const F *rs, const F *lor) {
    long long q = 0;
    for (; q < WV; q += 8) put_y<NT>(out + q, (lanes(row + q) - load(hi + q)) * load(rs + q) + load(lor + q));
    if (NT && q < W) {
        V t;
        for (int j = 0; j < 8; j++) t[j] = 0;
        for (int j = 0; j < 4; j++) t[j] = ((F)row[q + j] - hi[q + j]) * rs[q + j] + lor[q + j];
        put_nt4(out + q, t);
        return;
    }
    for (; q < W; q++) out[q] = (T)(((F)row[q] - hi[q]) * rs[q] + lor[q]);
}

// four independent accumulations of d and d*d (four add chains and four fma chains)
template <typename V> inline void add_moments(const V (&d)[4], V (&u)[4], V (&v)[4]) {
    for (int k = 0; k < 4; k++) {
        u[k] += d[k];
        v[k] += d[k] * d[k];
    }
}

// sum(d) and sum(d*d), d = x - m1 per column, over rows [p0, p1) of a strip of W columns:
// the columns' second pass where it is taken again (the first is fused with the means)
template <typename T, typename F, typename V>
void deviations(const T *xs, long long Q, long long p0, long long p1, long long W, const F *m1, F *su,
                F *sq) {
    long long q = 0;
    for (; q + 8 <= W; q += 8) {
        const V m = load(m1 + q);
        V u = {0}, v = {0};
        for (long long p = p0; p < p1; p++) {
            const V d = lanes(xs + p * Q + q) - m;
            u += d;
            v += d * d;
        }
        store(su + q, u);
        store(sq + q, v);
    }
    for (; q < W; q++) {
        F u = 0, v = 0;
        for (long long p = p0; p < p1; p++) {
            const F d = (F)xs[p * Q + q] - m1[q];
            u += d;
            v += d * d;
        }
        su[q] = u;
        sq[q] = v;
    }
}

// Independent sets of column sums a chunk's rows alternate between: two where the CPU has
// 32 vector registers (a set's 4 add chains wait 3-4 cycles a row; two sets keep the adders
// busy), one where it has 16 (two would spill)
#if defined(__AVX512F__)
const int SETS = 2;
#else
const int SETS = 1;
#endif
template <typename V> inline V fold(const V (&a)[SETS][4], int k) {
    V t = a[0][k];
    for (int s = 1; s < SETS; s++) t += a[s][k];
    return t;
}

// The moments of a strip's W columns (of a sample viewed as (P, Q), starting at xs) over its
// P rows: per column the mean as `cpiv + cmean` (the first chunk's first mean, a value near
// the data, and the deviation from it: two doubles, so that far from zero the mean keeps the
// bits one double would round off) and M2 (the sum of squared deviations) `cm2` in float64,
// from chunks of COL_CHUNK_ROWS rows summed in float32 and merged by Chan's formula, each
// chunk's mean taken relative to the pivot (`m1 - cpiv` is exact near the data); m1, su, sq:
// W floats of scratch each
template <typename T, typename F, typename V>
void strip_moments(const T *xs, long long P, long long Q, long long W, double *cpiv, double *cmean, double *cm2,
                   F *m1, F *su, F *sq) {
    const long long WV = W / 8 * 8;
    const long long R = COL_CHUNK_ROWS;
    std::fill(cmean, cmean + W, 0.0);
    std::fill(cm2, cm2 + W, 0.0);
    double done = 0.0;
    for (long long p0 = 0; p0 < P; p0 += R) {
        const long long p1 = p0 + R < P ? p0 + R : P;
        const F inv = (F)1 / (F)(p1 - p0);
        // four column vectors' sums in registers down the chunk's rows: one 128-byte
        // piece of each row (a page and two lines a row, not one a vector)
        long long q = 0;
        for (; q + 32 <= WV; q += 32) {
            const T *col = xs + q;
            V a[SETS][4] = {}, m[4], d[4], u[SETS][4] = {}, v[SETS][4] = {};
            long long p = p0;
            for (; p + SETS <= p1; p += SETS)
                for (int s = 0; s < SETS; s++)
                    for (int k = 0; k < 4; k++) a[s][k] += lanes(col + (p + s) * Q + 8 * k);
            for (; p < p1; p++)
                for (int k = 0; k < 4; k++) a[0][k] += lanes(col + p * Q + 8 * k);
            for (int k = 0; k < 4; k++) m[k] = fold(a, k) * inv;
            for (p = p0; p + SETS <= p1; p += SETS)
                for (int s = 0; s < SETS; s++) {
                    for (int k = 0; k < 4; k++) d[k] = lanes(col + (p + s) * Q + 8 * k) - m[k];
                    add_moments(d, u[s], v[s]);
                }
            for (; p < p1; p++) {
                for (int k = 0; k < 4; k++) d[k] = lanes(col + p * Q + 8 * k) - m[k];
                add_moments(d, u[0], v[0]);
            }
            for (int k = 0; k < 4; k++) {
                store(m1 + q + 8 * k, m[k]);
                store(su + q + 8 * k, fold(u, k));
                store(sq + q + 8 * k, fold(v, k));
            }
        }
        // single column vectors (4 rows a step); a strip's last W % 8 columns (W >= 8)
        // as the vector of its last 8, which sums the columns it overlaps again (their
        // m1, su and sq all from that pass)
        for (const long long WT = W >= 8 ? W : WV; q < WT; q += 8) {
            const long long qv = q < WV ? q : W - 8;
            const T *col = xs + qv;
            V a[4] = {}, d[4], u[4] = {}, v[4] = {};
            long long p = p0;
            for (; p + 4 <= p1; p += 4)
                for (int k = 0; k < 4; k++) a[k] += lanes(col + (p + k) * Q);
            for (; p < p1; p++) a[0] += lanes(col + p * Q);
            const V m = ((a[0] + a[1]) + (a[2] + a[3])) * inv;
            for (p = p0; p + 4 <= p1; p += 4) {
                for (int k = 0; k < 4; k++) d[k] = lanes(col + (p + k) * Q) - m;
                add_moments(d, u, v);
            }
            for (; p < p1; p++) {
                const V e = lanes(col + p * Q) - m;
                u[0] += e;
                v[0] += e * e;
            }
            store(m1 + qv, m);
            store(su + qv, (u[0] + u[1]) + (u[2] + u[3]));
            store(sq + qv, (v[0] + v[1]) + (v[2] + v[3]));
        }
        for (; q < W; q++) {
            F a = 0, u = 0, v = 0;
            for (long long p = p0; p < p1; p++) a += (F)xs[p * Q + q];
            const F m = a * inv;
            for (long long p = p0; p < p1; p++) {
                const F d = (F)xs[p * Q + q] - m;
                u += d;
                v += d * d;
            }
            m1[q] = m;
            su[q] = u;
            sq[q] = v;
        }
        // where a column's first mean missed by more than a quarter of its spread
        // (c^2 > q / 16: sq - su * c would lose bits), centre its chunk again on m1 + c
        bool far = false;
        for (long long q = 0; q < W; q++) {
            const F c = su[q] * inv;
            if (c * c > sq[q] * inv / 16) {
                m1[q] += c;
                far = true;
            }
        }
        if (far) deviations<T, F, V>(xs, Q, p0, p1, W, m1, su, sq);
        const double nc = (double)(p1 - p0), total_n = done + nc;
        if (done == 0.0)
            for (long long q = 0; q < W; q++) cpiv[q] = (double)m1[q];
        for (long long q = 0; q < W; q++) {  // Chan: merge the chunk's state
            const double c = (double)su[q] / nc, mc = ((double)m1[q] - cpiv[q]) + c;
            double m2c = (double)sq[q] - (double)su[q] * c;
            if (m2c < 0.0) m2c = 0.0;
            const double delta = mc - cmean[q];
            cmean[q] += delta * (nc / total_n);
            cm2[q] += m2c + delta * delta * (done * nc / total_n);
        }
        done = total_n;
    }
}

// A strip's statistics from its strip_moments, a slice of `group` adjacent columns each: per
// column hi + lo the slice's mean (hi in F, lo the rest: two floats, or two doubles for
// float64, each column's pivot taken relative to the slice's first) and rs its rstd; where
// `md` is not null, md/rd the slice's mean and rstd in float64 at each of its columns.
// group 1: a loop the compiler vectorizes.
template <typename F>
inline void strip_stats(const double *cpiv, const double *cmean, const double *cm2, long long W, long long group,
                        long long P, double eps, F *hi, F *lo, F *rs, double *md, double *rd) {
    if (group == 1) {
        const double inv_p = 1.0 / (double)P;
        for (long long q = 0; q < W; q++) {
            const double var = cm2[q] * inv_p, m = cpiv[q] + cmean[q];
            const double r = 1.0 / sqrt((var < 0.0 ? 0.0 : var) + eps);  // NaN stays NaN
            const F h = (F)m;
            hi[q] = h;
            lo[q] = (F)((cpiv[q] - (double)h) + cmean[q]);
            rs[q] = (F)r;
            if (md) {
                md[q] = m;
                rd[q] = r;
            }
        }
        return;
    }
    for (long long c0 = 0; c0 < W; c0 += group) {
        const double pivot = cpiv[c0];
        double dev = 0.0;
        for (long long k = c0; k < c0 + group; k++) dev += (cpiv[k] - pivot) + cmean[k];
        dev /= (double)group;
        double m2 = 0.0;
        for (long long k = c0; k < c0 + group; k++) {
            const double e = ((cpiv[k] - pivot) + cmean[k]) - dev;
            m2 += cm2[k] + (double)P * e * e;
        }
        double var = m2 / ((double)P * (double)group);
        if (var < 0.0) var = 0.0;  // NaN stays NaN
        const double m = pivot + dev, r = 1.0 / sqrt(var + eps);
        const F h = (F)m, l = (F)((pivot - (double)h) + dev), rf = (F)r;
        for (long long k = c0; k < c0 + group; k++) {
            hi[k] = h;
            lo[k] = l;
            rs[k] = rf;
            if (md) {
                md[k] = m;
                rd[k] = r;
            }
        }
    }
}

template <typename T, typename Par>  // Par: the parameters' type (as `rows`' P)
int cols(const T *x, T *y, const Par *w, const Par *b, typename Acc<T>::type *mean, typename Acc<T>::type *rstd,
         long long nb, long long P, long long Q, long long group, long long strip, int param_rows, double eps) {
    typedef typename Acc<T>::type A;
    typedef typename Work<T>::type F;
    typedef typename Work<T>::vec V;
    if (P <= 0 || Q <= 0 || group <= 0 || Q % group || strip <= 0 || strip % group) return 1;
    const long long S = Q / group;  // statistics a sample
    // float32 y by non-temporal stores where its rows are in 16-byte pieces: y is written once
    // and not read here, and a store that misses would first read its line from memory (a
    // third of the traffic); x and the next strip keep the caches.  With y preallocated, the
    // kernel alone / a copy: 32x96x56x56 2.62 -> 1.41, 32x384x14x14 2.69 -> 1.87
    const bool nt = sizeof(T) == 4 && (uintptr_t)y % 16 == 0 && Q % 4 == 0;
    std::vector<double> cpiv(strip), cmean(strip), cm2(strip), md(strip), rd(strip);
    std::vector<F> m1(strip), su(strip), sq(strip), hi(strip), rs(strip), lor(strip);
    for (long long bi = 0; bi < nb; bi++) {
        for (long long q0 = 0; q0 < Q; q0 += strip) {
            const long long W = q0 + strip < Q ? strip : Q - q0, WV = W / 8 * 8;
            const T *xs = x + bi * P * Q + q0;
            T *ys = y + bi * P * Q + q0;
            const bool nts = nt && q0 % 4 == 0 && W % 4 == 0;  // y's rows in this strip: 16-byte pieces
            strip_moments<T, F, V>(xs, P, Q, W, cpiv.data(), cmean.data(), cm2.data(), m1.data(), su.data(),
                                   sq.data());
            strip_stats<F>(cpiv.data(), cmean.data(), cm2.data(), W, group, P, eps, hi.data(), lor.data(), rs.data(),
                           md.data(), rd.data());
            for (long long q = 0; q < W; q++) lor[q] *= rs[q];
            for (long long c0 = 0; c0 < W; c0 += group) {
                const long long s = bi * S + (q0 + c0) / group;
                if (mean) mean[s] = (A)md[c0];
                if (rstd) rstd[s] = (A)rd[c0];
            }
            if (param_rows) {  // y = (x - hi) * (r * w_p) + (b_p - lo * r * w_p)
                // in blocks of columns, all rows a block: the block's hi, r, lo * r stay in L1.
                // Row p of block k also prefetches the k-th share of row p of the next strip
                // (or of the next sample's first), whose statistics come next: read from memory
                // in row order during this pass rather than by the statistics' column vectors,
                // a page a row (32x384x14x14: 0.7x the time; 32x96x56x56 in 256 KiB strips:
                // 0.75-0.8x).
                const char *nx = nullptr;
                long long NW = 0;  // the next strip's width
                if (q0 + strip < Q) {
                    nx = (const char *)(xs + strip);
                    NW = std::min(strip, Q - q0 - strip);
                } else if (bi + 1 < nb) {
                    nx = (const char *)(x + (bi + 1) * P * Q);
                    NW = std::min(strip, Q);
                }
                const long long nblk = (W + Y_BLOCK - 1) / Y_BLOCK, row_bytes = Q * (long long)sizeof(T);
                for (long long c0 = 0, k = 0; c0 < W; c0 += Y_BLOCK, k++) {
                    const long long c1 = c0 + Y_BLOCK < W ? c0 + Y_BLOCK : W, cv = c0 + (c1 - c0) / 8 * 8;
                    const long long f0 = k * NW / nblk * (long long)sizeof(T);
                    const long long f1 = (k + 1) * NW / nblk * (long long)sizeof(T);
                    for (long long p = 0; p < P; p++) {
                        const T *row = xs + p * Q;
                        T *out = ys + p * Q;
                        if (nx) prefetch_l2(nx + p * row_bytes + f0, nx + p * row_bytes + f1);
                        const F wp = w ? (F)w[p] : (F)1, bp = b ? (F)b[p] : (F)0;
                        if (nts) cf_y_row<true, V>(row, out, c0, cv, c1, wp, bp, hi.data(), rs.data(), lor.data());
                        else cf_y_row<false, V>(row, out, c0, cv, c1, wp, bp, hi.data(), rs.data(), lor.data());
                    }
                }
            } else {  // y = (x - hi) * sc + sh with sc = r * w_q, sh = b_q - lo * r * w_q per column
                for (long long q = 0; q < W; q++) {
                    const F wq = w ? (F)w[q0 + q] : (F)1, bq = b ? (F)b[q0 + q] : (F)0;
                    lor[q] = bq - lor[q] * wq;
                    rs[q] *= wq;
                }
                for (long long p = 0; p < P; p++) {
                    if (nts) cl_y_row<true, V>(xs + p * Q, ys + p * Q, WV, W, hi.data(), rs.data(), lor.data());
                    else cl_y_row<false, V>(xs + p * Q, ys + p * Q, WV, W, hi.data(), rs.data(), lor.data());
                }
            }
        }
    }
    if (nt) nt_fence();
    return 0;
}

// ---- columns backward: the gradients through statistics over the middle axis ----------------
//
// x, dy as (B, P, Q), a statistic per `group` adjacent columns over the P rows, as `cols`
// takes it; per strip of a sample's columns (the caller keeps x's and dy's P x strip in L2):
//
//     [the strip's statistics as `cols` takes them, where none are given]
//     D_q = sum_p dy * w_p,  E_q = sum_p dy * w_p * (x - hi_q)   (one pass down the rows; with
//                          param_rows also dw_p += sum_q dy * xhat, db_p += sum_q dy; with
//                          the statistics given, hi_q = their mean and F_q = sum_p (x - hi_q),
//                          whose mean over a slice is its lo)
//     per slice: c2 = sum w_q D_q / n,  c1 = r * (sum w_q E_q - lo sum w_q D_q) / n
//                (w_q: the column's weight, or 1 with param_rows; n = P * group)
//     dx = dy * w_p * (r * w_q) - (x - hi) * (r^2 c1) + (r^2 c1 lo - r c2)      (a second pass)
//
// (xhat = ((x - hi) - lo) * r; w_p the row's weight with param_rows, else 1), without
// param_rows dw_q += r * (E_q - lo * D_q), db_q += D_q.  float32 column sums over chunks of
// COL_CHUNK_ROWS rows, added in float64.

// the sum of a vector's 8 lanes, in its own precision
template <typename V> inline auto lane_sum(V v) -> decltype(v[0] + v[0]) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// one row of a strip's pass 1: D += dy * wp, E += dy * wp * (x - hi) per column; with RG
// (channels first, weight gradients by row) also *rw += sum dy * xhat, *rb += sum dy over the
// row's columns (float32 sums of the strip's columns, added in float64)
template <bool RG, bool OFF, typename T, typename V, typename F>
inline void col_grad_row(const T *xr, const T *dyr, long long W, long long WV, F wp, const F *hi, const F *lo,
                         const F *rs, F *dsum, F *esum, F *fsum, double *rw, double *rb) {
    V aw = {0}, ab = {0};
    long long q = 0;
    for (; q < WV; q += 8) {
        const V d = lanes(dyr + q), xm = lanes(xr + q) - load(hi + q), g = d * wp;
        store(dsum + q, load(dsum + q) + g);
        store(esum + q, load(esum + q) + g * xm);
        if (OFF) store(fsum + q, load(fsum + q) + xm);
        if (RG) {
            aw += d * ((xm - load(lo + q)) * load(rs + q));
            ab += d;
        }
    }
    F tw = RG ? lane_sum(aw) : F(0), tb = RG ? lane_sum(ab) : F(0);
    for (; q < W; q++) {
        const F d = (F)dyr[q], xm = (F)xr[q] - hi[q], g = d * wp;
        dsum[q] += g;
        esum[q] += g * xm;
        if (OFF) fsum[q] += xm;
        if (RG) {
            tw += d * ((xm - lo[q]) * rs[q]);
            tb += d;
        }
    }
    if (RG) {
        *rw += (double)tw;
        *rb += (double)tb;
    }
}


// one row of a strip's dx: dy * wp * a - (x - hi) * k + z per column (whole vectors up to WV;
// with NT, a last 4 columns as the first half of a vector); with DOT, returns sum dy * v
// over the row's columns (float32 lanes, added in float64), else 0
template <bool NT, bool DOT, typename V, typename T, typename F>
inline double col_dx_row(const T *xr, const T *dyr, T *dxr, long long W, long long WV, F wp, const F *hi,
                         const F *a, const F *k, const F *z, const F *v) {
    V acc = {0};
    long long q = 0;
    for (; q < WV; q += 8) {
        const V d = lanes(dyr + q);
        put_y<NT>(dxr + q, (d * wp) * load(a + q) - (lanes(xr + q) - load(hi + q)) * load(k + q) + load(z + q));
        if (DOT) acc += d * load(v + q);
    }
    double dot = DOT ? total(acc) : 0.0;
    if (NT && q + 4 <= W) {
        V t;
        for (int j = 0; j < 8; j++) t[j] = 0;
        for (int j = 0; j < 4; j++) {
            const F d = (F)dyr[q + j];
            t[j] = (d * wp) * a[q + j] - ((F)xr[q + j] - hi[q + j]) * k[q + j] + z[q + j];
            if (DOT) dot += (double)(d * v[q + j]);
        }
        put_nt4(dxr + q, t);
        q += 4;
    }
    for (; q < W; q++) {
        const F d = (F)dyr[q];
        dxr[q] = (T)((d * wp) * a[q] - ((F)xr[q] - hi[q]) * k[q] + z[q]);
        if (DOT) dot += (double)(d * v[q]);
    }
    return dot;
}

// `mean`/`rstd` (nullable together: then taken again as `cols` takes them) at
// [s * Q/group + q/group]; `w` by row p (param_rows) or column q, nullable; `dw`/`db` (float64,
// nullable; P values with param_rows, else Q): += the sample's weight and bias gradients.
// Returns 1 for sizes `cols` refuses.
template <typename T>
int cols_bwd(const T *x, const T *dy, T *dx, const typename Acc<T>::type *w, const typename Acc<T>::type *mean,
             const typename Acc<T>::type *rstd, double *dw, double *db, long long nb, long long P, long long Q,
             long long group, long long strip, int param_rows, double eps) {
    typedef typename Work<T>::type F;
    typedef typename Work<T>::vec V;
    if (P <= 0 || Q <= 0 || group <= 0 || Q % group || strip <= 0 || strip % group || (!mean) != (!rstd)) return 1;
    const long long S = Q / group;
    const bool nt = sizeof(T) == 4 && (uintptr_t)dx % 16 == 0 && Q % 4 == 0;
    std::vector<double> cpiv(strip), cmean(strip), cm2(strip), dtot(strip), etot(strip), ftot(strip);
    std::vector<F> m1(strip), su(strip), sq(strip), hi(strip), lo(strip), rs(strip), dsum(strip), esum(strip),
        fsum(strip), rl(strip), a(strip), k(strip), z(strip);
    for (long long bi = 0; bi < nb; bi++) {
        for (long long q0 = 0; q0 < Q; q0 += strip) {
            const long long W = q0 + strip < Q ? strip : Q - q0, WV = W / 8 * 8;
            const long long off = bi * P * Q + q0;
            const T *xs = x + off, *dys = dy + off;
            T *dxs = dx + off;
            const bool nts = nt && q0 % 4 == 0 && W % 4 == 0;
            // the strip's statistics: hi + lo the mean (where given, lo from pass 1), rs the rstd
            if (rstd) {
                for (long long q = 0; q < W; q++) {
                    const long long s = bi * S + (q0 + q) / group;
                    hi[q] = (F)mean[s];
                    rs[q] = (F)rstd[s];
                }
                std::fill(lo.begin(), lo.begin() + W, F(0));  // until pass 1 has taken it
            } else {
                strip_moments<T, F, V>(xs, P, Q, W, cpiv.data(), cmean.data(), cm2.data(), m1.data(), su.data(),
                                       sq.data());
                strip_stats<F>(cpiv.data(), cmean.data(), cm2.data(), W, group, P, eps, hi.data(), lo.data(), rs.data(),
                               nullptr, nullptr);
            }
            // pass 1: D and E per column, down the rows in chunks; with the statistics given,
            // also sum(x - hi) per column, whose mean over a slice is its lo (what the given
            // mean's rounding left out: xhat about hi alone was off by |mean| * rstd * 2^-24).
            // The rows' dweight (param_rows) is then taken about hi; pass 2 subtracts
            // sum_q dy * r * lo from it.
            const bool given = rstd != nullptr;
            std::fill(dtot.begin(), dtot.begin() + W, 0.0);
            std::fill(etot.begin(), etot.begin() + W, 0.0);
            std::fill(ftot.begin(), ftot.begin() + W, 0.0);
            for (long long p0 = 0; p0 < P; p0 += COL_CHUNK_ROWS) {
                const long long p1 = p0 + COL_CHUNK_ROWS < P ? p0 + COL_CHUNK_ROWS : P;
                std::fill(dsum.begin(), dsum.begin() + W, F(0));
                std::fill(esum.begin(), esum.begin() + W, F(0));
                std::fill(fsum.begin(), fsum.begin() + W, F(0));
                for (long long p = p0; p < p1; p++) {
                    const F wp = param_rows && w ? (F)w[p] : F(1);
                    const T *xr = xs + p * Q, *dyr = dys + p * Q;
                    if (param_rows && dw && given)
                        col_grad_row<true, true, T, V, F>(xr, dyr, W, WV, wp, hi.data(), lo.data(), rs.data(), dsum.data(),
                                                          esum.data(), fsum.data(), dw + p, db + p);
                    else if (param_rows && dw)
                        col_grad_row<true, false, T, V, F>(xr, dyr, W, WV, wp, hi.data(), lo.data(), rs.data(), dsum.data(),
                                                           esum.data(), fsum.data(), dw + p, db + p);
                    else if (given)
                        col_grad_row<false, true, T, V, F>(xr, dyr, W, WV, wp, hi.data(), lo.data(), rs.data(),
                                                           dsum.data(), esum.data(), fsum.data(), nullptr, nullptr);
                    else
                        col_grad_row<false, false, T, V, F>(xr, dyr, W, WV, wp, hi.data(), lo.data(), rs.data(),
                                                            dsum.data(), esum.data(), fsum.data(), nullptr, nullptr);
                }
                for (long long q = 0; q < W; q++) {
                    dtot[q] += (double)dsum[q];
                    etot[q] += (double)esum[q];
                    ftot[q] += (double)fsum[q];
                }
            }
            if (given) {
                for (long long c0 = 0; c0 < W; c0 += group) {
                    double t = 0.0;
                    for (long long j = c0; j < c0 + group; j++) t += ftot[j];
                    const F l = (F)(t / ((double)P * (double)group));
                    for (long long j = c0; j < c0 + group; j++) {
                        lo[j] = l;
                        rl[j] = rs[j] * l;
                    }
                }
            }
            // per slice: c1, c2, and each column's constants of dx
            const double inv_n = 1.0 / ((double)P * (double)group);
            for (long long c0 = 0; c0 < W; c0 += group) {
                double sd = 0.0, se = 0.0;
                for (long long j = c0; j < c0 + group; j++) {
                    const double wq = !param_rows && w ? (double)w[q0 + j] : 1.0;
                    sd += wq * dtot[j];
                    se += wq * etot[j];
                }
                const double r = (double)rs[c0], l = (double)lo[c0];
                const double c2 = sd * inv_n, c1 = r * (se - l * sd) * inv_n, kk = r * r * c1;
                for (long long j = c0; j < c0 + group; j++) {
                    const double wq = !param_rows && w ? (double)w[q0 + j] : 1.0;
                    a[j] = (F)(r * wq);
                    k[j] = (F)kk;
                    z[j] = (F)(kk * l - r * c2);
                    if (!param_rows && dw) {
                        dw[q0 + j] += r * (etot[j] - l * dtot[j]);
                        db[q0 + j] += dtot[j];
                    }
                }
            }
            // pass 2: dx.  Row p also prefetches row p of the next strip's x and dy (or of the
            // next sample's first strip) into L2, as the forward's y pass does: its pass 1
            // then reads them from L2 in row order rather than by strided misses
            const char *nx = nullptr, *ndy = nullptr;
            long long nbytes = 0;
            if (q0 + strip < Q) {
                nx = (const char *)(xs + strip);
                ndy = (const char *)(dys + strip);
                nbytes = std::min(strip, Q - q0 - strip) * (long long)sizeof(T);
            } else if (bi + 1 < nb) {
                nx = (const char *)(x + (bi + 1) * P * Q);
                ndy = (const char *)(dy + (bi + 1) * P * Q);
                nbytes = std::min(strip, Q) * (long long)sizeof(T);
            }
            const long long row_bytes = Q * (long long)sizeof(T);
            for (long long p = 0; p < P; p++) {
                const F wp = param_rows && w ? (F)w[p] : F(1);
                if (nx) {
                    prefetch_l2(nx + p * row_bytes, nx + p * row_bytes + nbytes);
                    prefetch_l2(ndy + p * row_bytes, ndy + p * row_bytes + nbytes);
                }
                const T *xr = xs + p * Q, *dyr = dys + p * Q;
                T *dxr = dxs + p * Q;
                if (param_rows && dw && given) {  // the row's dweight about hi + lo (pass 1: about hi)
                    dw[p] -= nts ? col_dx_row<true, true, V>(xr, dyr, dxr, W, WV, wp, hi.data(), a.data(), k.data(), z.data(), rl.data())
                                 : col_dx_row<false, true, V>(xr, dyr, dxr, W, WV, wp, hi.data(), a.data(), k.data(), z.data(), rl.data());
                } else if (nts) {
                    col_dx_row<true, false, V>(xr, dyr, dxr, W, WV, wp, hi.data(), a.data(), k.data(), z.data(), rl.data());
                } else {
                    col_dx_row<false, false, V>(xr, dyr, dxr, W, WV, wp, hi.data(), a.data(), k.data(), z.data(), rl.data());
                }
            }
        }
    }
    if (nt) nt_fence();
    return 0;
}

// ---- a call's rows over the threads of torch's OpenMP team ----------------------------------------
//
// The entry points of the process's OpenMP runtime (libgomp's ABI, which LLVM's and Intel's also
// export), set by anynorm_use_openmp where the Python side found the one torch runs on: a region
// there starts on threads torch's own ops left spinning (a few us), where threads of our own would
// share the cores with them.
typedef void (*OmpParallel)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*OmpInt)();
OmpParallel omp_parallel = nullptr;
OmpInt omp_thread_num = nullptr, omp_num_threads = nullptr;

// body(r0, r1) over rows [0, nrows) cut into `threads` ranges whose bounds are multiples of
// `align` rows, one a thread of the team (in turn on this thread without one); the first
// nonzero result, or 0
template <typename Body>
int over_threads(long long nrows, long long threads, long long align, const Body &body) {
    if (threads <= 1 || !omp_parallel || nrows < 2 * align) return body(0, nrows);
    struct Region {
        const Body *body;
        long long nrows, align;
        std::atomic<int> err;
    } region{&body, nrows, align, {0}};
    omp_parallel(
        [](void *p) {
            Region &g = *static_cast<Region *>(p);
            const long long t = omp_thread_num(), nt = omp_num_threads();
            const long long blocks = (g.nrows + g.align - 1) / g.align;
            const long long r0 = std::min(g.nrows, blocks * t / nt * g.align);
            const long long r1 = std::min(g.nrows, blocks * (t + 1) / nt * g.align);
            if (r0 >= r1) return;
            int err;
            try {
                err = (*g.body)(r0, r1);
            } catch (...) {  // nothing may leave an OpenMP region
                err = 2;
            }
            if (err) g.err.store(err);
        },
        &region, (unsigned)threads, 0);
    return region.err.load();
}

inline long long gcd(long long a, long long b) {
    while (b) {
        const long long t = a % b;
        a = b;
        b = t;
    }
    return a;
}

// The same rows with a call's sizes in one struct, made once per call signature (a ctypes call
// costs ~70 ns an argument: 14 of them 1.0 us, 7 pointers 0.4), no residual, parameters of
// type P; anynorm_rows_packed_hp_*: float16/bfloat16 x with parameters of its own dtype.
// threads > 1: over that many threads of the OpenMP team (over_threads), each its own rows.
struct RowsCall {
    long long rows, n, w_run, w_count, center;
    double eps;
    long long segments, seg_stride;  // segments > 1: segmented_rows (w_run 0)
    long long threads;
};

template <typename T, typename P>
int rows_packed(const T *x, T *y, const P *w, const P *b, typename Acc<T>::type *mean,
                typename Acc<T>::type *rstd, const RowsCall &c) {
    const long long n = c.n;  // its sizes are checked by rows / segmented_rows, range by range
    auto stat = [](typename Acc<T>::type *s, long long r0) { return s ? s + r0 : s; };
    if (c.segments > 1) {  // row r's runs start at r * len
        const long long len = n / c.segments;
        return over_threads(c.rows, c.threads, 1, [&](long long r0, long long r1) {
            return segmented_rows<T, P>(x + r0 * len, y + r0 * len, w, b, stat(mean, r0), stat(rstd, r0), r1 - r0,
                                        n, c.segments, c.seg_stride, (int)c.center, c.eps);
        });
    }
    // parameters by run, modulo w_count: a range starts at a multiple of their period in rows
    // (without w_count, one range)
    long long align = 1;
    if (c.w_run > 0) align = c.w_count > 0 ? c.w_count / gcd(c.w_count, n / c.w_run) : std::max(1LL, c.rows);
    return over_threads(c.rows, c.threads, align, [&](long long r0, long long r1) {
        return rows<T, P>(x + r0 * n, nullptr, nullptr, y + r0 * n, w, b, c.w_run, c.w_count, stat(mean, r0),
                          stat(rstd, r0), r1 - r0, n, (int)c.center, c.eps);
    });
}

// The same columns with a call's sizes in one struct (as RowsCall), parameters of type Par;
// threads > 1: the samples over that many threads of the team, each its own
struct ColsCall {
    long long samples, P, Q, group, strip, param_rows;
    double eps;
    long long threads;
};

template <typename T, typename Par>
int cols_packed(const T *x, T *y, const Par *w, const Par *b, typename Acc<T>::type *mean,
                typename Acc<T>::type *rstd, const ColsCall &c) {
    if (c.group <= 0) return 1;
    const long long per = c.P * c.Q, stats = c.Q / c.group;  // a sample's elements, statistics
    return over_threads(c.samples, c.threads, 1, [&](long long s0, long long s1) {
        return cols<T, Par>(x + s0 * per, y + s0 * per, w, b, mean ? mean + s0 * stats : mean,
                            rstd ? rstd + s0 * stats : rstd, s1 - s0, c.P, c.Q, c.group, c.strip, (int)c.param_rows,
                            c.eps);
    });
}

}  // namespace

#define ANYNORM_ROWS(SUFFIX, T)                                                                    \
    extern "C" int anynorm_rows_##SUFFIX(const T *x, const T *res, T *h, T *y,                   \
                                         const Acc<T>::type *w, const Acc<T>::type *b,             \
                                         long long w_run, Acc<T>::type *mean, Acc<T>::type *rstd, \
                                         long long nrows, long long n, int center, double eps) {  \
        return rows<T, Acc<T>::type>(x, res, h, y, w, b, w_run, 0, mean, rstd, nrows, n, center, eps); \
    }

#define ANYNORM_ROWS_PACKED(SUFFIX, T, P)                                                           \
    extern "C" int anynorm_rows_packed_##SUFFIX(const T *x, T *y, const P *w, const P *b,          \
                                                Acc<T>::type *mean, Acc<T>::type *rstd,             \
                                                const RowsCall *c) {                               \
        return rows_packed<T, P>(x, y, w, b, mean, rstd, *c);                                       \
    }

extern "C" void anynorm_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    omp_thread_num = (OmpInt)thread_num;
    omp_num_threads = (OmpInt)num_threads;
    omp_parallel = (OmpParallel)parallel;
}

#define ANYNORM_COLS(SUFFIX, T)                                                                     \
    extern "C" int anynorm_cols_##SUFFIX(const T *x, T *y, const Acc<T>::type *w, const Acc<T>::type *b, \
                                         Acc<T>::type *mean, Acc<T>::type *rstd, long long nb,       \
                                         long long P, long long Q, long long group, long long strip, \
                                         int param_rows, double eps) {                               \
        return cols<T, Acc<T>::type>(x, y, w, b, mean, rstd, nb, P, Q, group, strip, param_rows, eps);          \
    }

#define ANYNORM_COLS_PACKED(SUFFIX, T, Par)                                                         \
    extern "C" int anynorm_cols_packed_##SUFFIX(const T *x, T *y, const Par *w, const Par *b,      \
                                                Acc<T>::type *mean, Acc<T>::type *rstd,             \
                                                const ColsCall *c) {                               \
        return cols_packed<T, Par>(x, y, w, b, mean, rstd, *c);                                     \
    }

#define ANYNORM_ROWS_BWD(SUFFIX, T)                                                                  \
    extern "C" int anynorm_rows_bwd_##SUFFIX(const T *x, const T *dy, T *dx, const Acc<T>::type *w,      \
                                             long long w_run, const Acc<T>::type *mean,                    \
                                             const Acc<T>::type *rstd, double *dw, double *db,             \
                                             long long nrows, long long n, int center, double eps) {      \
        return rows_bwd<T>(x, dy, dx, w, w_run, mean, rstd, dw, db, nrows, n, center, eps);             \
    }

#define ANYNORM_SEGMENTED_BWD(SUFFIX, T)                                                              \
    extern "C" int anynorm_segmented_bwd_##SUFFIX(const T *x, const T *dy, T *dx, const Acc<T>::type *w,  \
                                                  const Acc<T>::type *mean, const Acc<T>::type *rstd,        \
                                                  double *dw, double *db, long long nrows, long long n,       \
                                                  long long segments, long long seg_stride, int center,      \
                                                  double eps) {                                              \
        return segmented_rows_bwd<T>(x, dy, dx, w, mean, rstd, dw, db, nrows, n, segments, seg_stride,     \
                                     center, eps);                                                           \
    }

#define ANYNORM_COLS_BWD(SUFFIX, T)                                                                   \
    extern "C" int anynorm_cols_bwd_##SUFFIX(const T *x, const T *dy, T *dx, const Acc<T>::type *w,       \
                                             const Acc<T>::type *mean, const Acc<T>::type *rstd, double *dw, \
                                             double *db, long long nb, long long P, long long Q,             \
                                             long long group, long long strip, int param_rows, double eps) { \
        return cols_bwd<T>(x, dy, dx, w, mean, rstd, dw, db, nb, P, Q, group, strip, param_rows, eps);    \
    }

// The conditioning check of torch's one-pass statistics (anynorm/_torch.py): 1 where some
// slice's |mean| * rstd exceeds `limit` (its variance lost the digits a two-pass keeps), else
// 0; a NaN slice passes (its output is NaN on every path).  One ctypes call costs 0.5 us
// where torch's three ops and an item() took 3-4 us, a loop over tolist() 1.1-1.4.  Eight
// statistics a step through the kernels' widening (float16's scalar conversion is a
// library call a value: 9.5 us for 1000 statistics where the vectors take 0.6).
template <typename T> inline int far_stats(const T *mean, const T *rstd, long long n, double limit) {
    const float lim = (float)limit;
    vi32 hit = {0};
    long long i = 0;
    for (; i + 8 <= n; i += 8) {
        const vf p = narrow(mean + i) * narrow(rstd + i);
        hit |= (p > lim) | (p < -lim);
    }
    int far = 0;
    for (int j = 0; j < 8; j++) far |= hit[j] != 0;
    for (; i < n; i++) far |= fabs((double)(float)mean[i] * (double)(float)rstd[i]) > limit;
    return far;
}

inline int far_stats(const double *mean, const double *rstd, long long n, double limit) {
    int far = 0;
    for (long long i = 0; i < n; ++i) far |= fabs(mean[i] * rstd[i]) > limit;
    return far;
}

#define ANYNORM_FAR(SUFFIX, T)                                                                      \
    extern "C" int anynorm_far_##SUFFIX(const T *mean, const T *rstd, long long n, double limit) { \
        return far_stats(mean, rstd, n, limit);                                                     \
    }

ANYNORM_FAR(f32, float)
ANYNORM_FAR(f64, double)
ANYNORM_FAR(bf16, bf16)  // torch's CPU kernels return half inputs' statistics in their dtype
ANYNORM_ROWS(f32, float)
ANYNORM_ROWS(f64, double)
ANYNORM_ROWS(bf16, bf16)
ANYNORM_ROWS_PACKED(f32, float, float)
ANYNORM_ROWS_PACKED(f64, double, double)
ANYNORM_ROWS_PACKED(bf16, bf16, float)
ANYNORM_ROWS_PACKED(hp_bf16, bf16, bf16)
ANYNORM_COLS(f32, float)
ANYNORM_COLS(f64, double)
ANYNORM_COLS(bf16, bf16)
ANYNORM_COLS_PACKED(f32, float, float)
ANYNORM_COLS_PACKED(f64, double, double)
ANYNORM_COLS_PACKED(bf16, bf16, float)
ANYNORM_COLS_PACKED(hp_bf16, bf16, bf16)
ANYNORM_ROWS_BWD(f32, float)
ANYNORM_ROWS_BWD(f64, double)
ANYNORM_ROWS_BWD(bf16, bf16)
ANYNORM_SEGMENTED_BWD(f32, float)
ANYNORM_SEGMENTED_BWD(f64, double)
ANYNORM_SEGMENTED_BWD(bf16, bf16)
ANYNORM_COLS_BWD(f32, float)
ANYNORM_COLS_BWD(f64, double)
ANYNORM_COLS_BWD(bf16, bf16)
#if HAVE_F16
ANYNORM_FAR(f16, _Float16)
ANYNORM_ROWS(f16, _Float16)
ANYNORM_ROWS_PACKED(f16, _Float16, float)
ANYNORM_ROWS_PACKED(hp_f16, _Float16, _Float16)
ANYNORM_COLS(f16, _Float16)
ANYNORM_COLS_PACKED(f16, _Float16, float)
ANYNORM_COLS_PACKED(hp_f16, _Float16, _Float16)
ANYNORM_ROWS_BWD(f16, _Float16)
ANYNORM_SEGMENTED_BWD(f16, _Float16)
ANYNORM_COLS_BWD(f16, _Float16)
#endif
