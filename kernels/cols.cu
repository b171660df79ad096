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

// Welford state of column i over reduced[c*chunk : (c+1)*chunk] for each o.
template <typename T>
__global__ void cols_stats_partial(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                                   acc_t<T>* __restrict__ ws_n, acc_t<T>* __restrict__ ws_mean,
                                   acc_t<T>* __restrict__ ws_m2, long long outer, long long reduced,
                                   long long inner, long long chunk) {
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
            for (long long r = start + ty; r < end; r += COLS_Y) {
                const long long e = (o * reduced + r) * inner + i;
                T v = x[e];
                if (res) {
                    v = add_in_dtype(v, res[e]);
                    h[e] = v;
                }
                welford_push(s, to_acc(v));
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
