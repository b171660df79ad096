// Columns family (inner > 1): the reduced extent is strided by `inner`, e.g. layer norm
// over the channels of NCHW (inner = H*W) or instance/group norm on NHWC (inner = C).
//
// Block (32, 8): threadIdx.x owns one inner position (coalesced along inner), threadIdx.y
// walks the reduced axis with stride 8 inside the block's chunk; the 8 partial results of a
// column are merged in shared memory and written per (o, chunk, i). finish.cu merges the
// chunks (and the `group` columns of one statistic) and applies the result.
#include "common.cuh"

using namespace anynorm;

#define COLS_X 32
#define COLS_Y 8

// The value of slice (o, i / group)'s first element, row 0 of the group's first column
// (x + res rounded to T with a residual, as h holds it): the shift of the split forward.
template <typename T>
__device__ __forceinline__ acc_t<T> slice_shift(const T* __restrict__ x, const T* __restrict__ res, long long o,
                                                long long reduced, long long inner, long long i, long long group) {
    const long long e = o * reduced * inner + (i - i % group);
    return to_acc(res ? add_in_dtype(x[e], res[e]) : x[e]);
}

// Welford state of d = v - shift over column i's rows reduced[c*chunk : (c+1)*chunk], for
// each o, with shift the slice's first element (slice_shift; 0 where center == 0, RMS):
// stats_finalize turns the states into the mean of d and rstd, and cols_apply_fwd forms
// y from v - shift, exact near the data (the mean itself, rounded to the data's magnitude,
// never meets v).
template <typename T>
__global__ void cols_stats_partial(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                                   acc_t<T>* __restrict__ ws_n, acc_t<T>* __restrict__ ws_mean,
                                   acc_t<T>* __restrict__ ws_m2, long long outer, long long reduced,
                                   long long inner, long long chunk, long long group, int center) {
    typedef acc_t<T> A;
    __shared__ A sn[COLS_Y][COLS_X], smean[COLS_Y][COLS_X], sm2[COLS_Y][COLS_X];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long i = (long long)blockIdx.x * COLS_X + tx;
    const long long nchunk = gridDim.y;
    const long long start = (long long)blockIdx.y * chunk;
    const long long end = start + chunk < reduced ? start + chunk : reduced;
    for (long long o = blockIdx.z; o < outer; o += gridDim.z) {
        Welford<A> s = welford_empty<A>();
        if (i < inner) {
            const A shift = center ? slice_shift(x, res, o, reduced, inner, i, group) : A(0);
            for (long long r = start + ty; r < end; r += COLS_Y) {
                const long long e = (o * reduced + r) * inner + i;
                T v = x[e];
                if (res) {
                    v = add_in_dtype(v, res[e]);
                    h[e] = v;
                }
                welford_push(s, to_acc(v) - shift);
            }
        }
        sn[ty][tx] = s.n;
        smean[ty][tx] = s.mean;
        sm2[ty][tx] = s.m2;
        __syncthreads();
        if (ty == 0 && i < inner) {
            for (int k = 1; k < COLS_Y; ++k) {
                Welford<A> q;
                q.n = sn[k][tx];
                q.mean = smean[k][tx];
                q.m2 = sm2[k][tx];
                s = welford_merge(s, q);
            }
            const long long k = (o * nchunk + blockIdx.y) * inner + i;
            ws_n[k] = s.n;
            ws_mean[k] = s.mean;
            ws_m2[k] = s.m2;
        }
        __syncthreads();
    }
}

// The split forward's output from the shifted statistics: with shift the slice's first
// element (slice_shift) and c = mean(v - shift) (stats_finalize's mean of cols_stats_partial's
// states, in ws_c), y = ((v - shift) - c) * rstd * w + b and mean = shift + c (nullable:
// written by row 0 of each statistic's first column). RMS (center == 0): shift = c = 0, ws_c
// and mean null. y nullable (the mean alone). Launch as cols_stats_partial: block (32, 8),
// grid (ceil(inner/32), nchunk, min(outer, 65535)), rows reduced[c*chunk : (c+1)*chunk].
template <typename T>
__global__ void cols_apply_fwd(const T* __restrict__ src, T* __restrict__ y, const void* __restrict__ w_arg,
                               const void* __restrict__ b_arg, const acc_t<T>* __restrict__ ws_c,
                               const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ mean,
                               long long outer, long long reduced, long long inner, long long group,
                               long long chunk, long long p_div, long long p_len, int center,
                               int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    typedef acc_t<T> A;
    const IndexMap map = block_index_map(reduced, inner, group, p_div, p_len);
    const long long i = (long long)blockIdx.x * COLS_X + threadIdx.x;
    if (i >= inner) return;
    const long long start = (long long)blockIdx.y * chunk;
    const long long end = start + chunk < reduced ? start + chunk : reduced;
    for (long long o = blockIdx.z; o < outer; o += gridDim.z) {
        const long long s = o * (inner / group) + i / group;
        const A shift = center ? to_acc(src[o * reduced * inner + (i - i % group)]) : A(0);
        const A c = center ? ws_c[s] : A(0);
        if (mean && blockIdx.y == 0 && threadIdx.y == 0 && i % group == 0) mean[s] = shift + c;
        if (!y) continue;
        const A rs = rstd[s];
        for (long long r = start + threadIdx.y; r < end; r += COLS_Y) {
            const long long e = (o * reduced + r) * inner + i;
            const long long p = param_at(map, e);
            y[e] = from_acc<T>(((to_acc(src[e]) - shift) - c) * rs * weight_at(w, p) + bias_at(b, p));
        }
    }
}

// sum(g) and sum(g * xhat) of column i over reduced[c*chunk : (c+1)*chunk] for each o.
template <typename T>
__global__ void cols_grad_partial(const T* __restrict__ dy, const T* __restrict__ x,
                                  const void* __restrict__ w_arg, const acc_t<T>* __restrict__ mean,
                                  const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ ws_g,
                                  acc_t<T>* __restrict__ ws_gx, long long outer, long long reduced,
                                  long long inner, long long group, long long chunk, long long p_div,
                                  long long p_len, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    __shared__ A sg_s[COLS_Y][COLS_X], sgx_s[COLS_Y][COLS_X];
    const IndexMap map = block_index_map(reduced, inner, group, p_div, p_len);
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long i = (long long)blockIdx.x * COLS_X + tx;
    const long long nchunk = gridDim.y;
    const long long start = (long long)blockIdx.y * chunk;
    const long long end = start + chunk < reduced ? start + chunk : reduced;
    for (long long o = blockIdx.z; o < outer; o += gridDim.z) {
        A sg = A(0), sgx = A(0);
        if (i < inner) {
            const long long s = o * (inner / group) + i / group;
            const A mu = center ? mean[s] : A(0);
            const A r = rstd[s];
            for (long long rr = start + ty; rr < end; rr += COLS_Y) {
                const long long e = (o * reduced + rr) * inner + i;
                const A g = to_acc(dy[e]) * weight_at(w, param_at(map, e));
                sg += g;
                sgx += g * (to_acc(x[e]) - mu) * r;
            }
        }
        sg_s[ty][tx] = sg;
        sgx_s[ty][tx] = sgx;
        __syncthreads();
        if (ty == 0 && i < inner) {
            for (int k = 1; k < COLS_Y; ++k) {
                sg += sg_s[k][tx];
                sgx += sgx_s[k][tx];
            }
            const long long k = (o * nchunk + blockIdx.y) * inner + i;
            ws_g[k] = sg;
            ws_gx[k] = sgx;
        }
        __syncthreads();
    }
}
