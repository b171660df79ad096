// Second stage of the split path (long rows and the columns family): merge per-chunk
// partial results into per-slice statistics, then apply them elementwise.
//
// Partials are laid out as ws[(o * nchunk + c) * inner + i]; slice s = o * (inner/group) + j
// merges c in [0, nchunk) and i in [j*group, (j+1)*group). Rows pass inner = group = 1.
#include "common.cuh"

using namespace anynorm;

// mean = merged mean, rstd = 1/sqrt(m2/n + eps) (RMS: 1/sqrt(m2/n + mean^2 + eps)).
template <typename T>
__global__ void stats_finalize(const acc_t<T>* __restrict__ ws_n, const acc_t<T>* __restrict__ ws_mean,
                               const acc_t<T>* __restrict__ ws_m2, acc_t<T>* __restrict__ mean,
                               acc_t<T>* __restrict__ rstd, long long outer, long long nchunk,
                               long long inner, long long group, int center, double eps) {
    typedef acc_t<T> A;
    const long long per_o = inner / group;
    const long long slices = outer * per_o;
    for (long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x; s < slices;
         s += (long long)gridDim.x * blockDim.x) {
        const long long o = s / per_o, j = s % per_o;
        Welford<A> acc = welford_empty<A>();
        for (long long c = 0; c < nchunk; ++c) {
            const long long row = (o * nchunk + c) * inner + j * group;
            for (long long k = 0; k < group; ++k) {
                Welford<A> q;
                q.n = ws_n[row + k];
                q.mean = ws_mean[row + k];
                q.m2 = ws_m2[row + k];
                acc = welford_merge(acc, q);
            }
        }
        rstd[s] = welford_rstd(acc, center, A(eps));
        if (mean) mean[s] = acc.mean;
    }
}

// mean_g = sum(g) / count, mean_gx = sum(g * xhat) / count per slice.
template <typename T>
__global__ void grad_finalize(const acc_t<T>* __restrict__ ws_g, const acc_t<T>* __restrict__ ws_gx,
                              acc_t<T>* __restrict__ mean_g, acc_t<T>* __restrict__ mean_gx,
                              long long outer, long long nchunk, long long inner, long long group,
                              double count) {
    typedef acc_t<T> A;
    const long long per_o = inner / group;
    const long long slices = outer * per_o;
    for (long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x; s < slices;
         s += (long long)gridDim.x * blockDim.x) {
        const long long o = s / per_o, j = s % per_o;
        A sg = A(0), sgx = A(0);
        for (long long c = 0; c < nchunk; ++c) {
            const long long row = (o * nchunk + c) * inner + j * group;
            for (long long k = 0; k < group; ++k) {
                sg += ws_g[row + k];
                sgx += ws_gx[row + k];
            }
        }
        mean_g[s] = sg / A(count);
        mean_gx[s] = sgx / A(count);
    }
}

// y = (v - mean) * rstd * w + b elementwise (v = x, or h when a residual was added).
template <typename T>
__global__ void apply_fwd(const T* __restrict__ src, T* __restrict__ y, const acc_t<T>* __restrict__ w,
                          const acc_t<T>* __restrict__ b, const acc_t<T>* __restrict__ mean,
                          const acc_t<T>* __restrict__ rstd, long long total, long long reduced,
                          long long inner, long long group, long long p_div, long long p_len,
                          int center) {
    typedef acc_t<T> A;
    const IndexMap map = block_index_map(reduced, inner, group, p_div, p_len);
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long s = slice_at(map, e);
        const long long p = param_at(map, e);
        const A mu = center ? mean[s] : A(0);
        y[e] = from_acc<T>((to_acc(src[e]) - mu) * rstd[s] * weight_at(w, p) + bias_at(b, p));
    }
}

// dx = rstd * (g - mean_g - xhat * mean_gx), g = dy * w (RMS: no mean_g term).
template <typename T>
__global__ void apply_bwd(const T* __restrict__ dy, const T* __restrict__ x, const acc_t<T>* __restrict__ w,
                          const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                          const acc_t<T>* __restrict__ mean_g, const acc_t<T>* __restrict__ mean_gx,
                          T* __restrict__ dx, long long total, long long reduced, long long inner,
                          long long group, long long p_div, long long p_len, int center) {
    typedef acc_t<T> A;
    const IndexMap map = block_index_map(reduced, inner, group, p_div, p_len);
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long s = slice_at(map, e);
        const long long p = param_at(map, e);
        const A r = rstd[s];
        const A xhat = (to_acc(x[e]) - (center ? mean[s] : A(0))) * r;
        const A g = to_acc(dy[e]) * weight_at(w, p);
        const A mg = center ? mean_g[s] : A(0);
        dx[e] = from_acc<T>(r * (g - mg - xhat * mean_gx[s]));
    }
}
