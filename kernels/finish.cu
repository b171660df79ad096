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

// Long rows: merge rows_stats_partial's states of d = v - shift (shift = the row's first
// value, src[row * count]: x, or h with a residual). mean = shift + mean(d) rounded once;
// mean_lo (nullable) = its rounding, mean(d) - (mean - shift) (exact: mean and shift are
// close), so that rows_apply_fwd forms (v - mean) - mean_lo, the deviation from the exact
// mean, instead of v - mean with up to half an ulp of the row's offset in it.
// rstd = 1/sqrt(m2/n + eps) (RMS: 1/sqrt(m2/n + mean^2 + eps)).
template <typename T>
__global__ void rows_stats_finalize(const T* __restrict__ src, const acc_t<T>* __restrict__ ws_n,
                                    const acc_t<T>* __restrict__ ws_mean, const acc_t<T>* __restrict__ ws_m2,
                                    acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                                    acc_t<T>* __restrict__ mean_lo, long long rows, long long count,
                                    long long nchunk, int center, double eps) {
    typedef acc_t<T> A;
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < rows;
         row += (long long)gridDim.x * blockDim.x) {
        Welford<A> acc = welford_empty<A>();
        for (long long c = 0; c < nchunk; ++c) {
            Welford<A> q;
            q.n = ws_n[row * nchunk + c];
            q.mean = ws_mean[row * nchunk + c];
            q.m2 = ws_m2[row * nchunk + c];
            acc = welford_merge(acc, q);
        }
        const A shift = to_acc(src[row * count]);
        const A mu = shift + acc.mean;
        if (mean) mean[row] = mu;
        if (mean_lo) mean_lo[row] = acc.mean - (mu - shift);
        acc.mean = mu;
        rstd[row] = welford_rstd(acc, center, A(eps));
    }
}

// Long rows after rows_grad_partial: mean_g = sum(g) / count and mean_gx = sum(g * xhat) /
// count per row, with xhat from the exact mean. The partials took x - mean from the saved
// mean, rounded (near 1e6 in float32, to 1/16); ws_d (nullable: taken as 0) holds sum(x - mean),
// exact terms, so lo = sum(x - mean) / count is that rounding, the true xhat is
// (x - mean) * rstd - lo * rstd, and so sum(g * xhat) loses lo * rstd * sum(g). apply_bwd,
// which forms (x - mean) * rstd, gets the rest of the correction folded into mean_g:
// dx = rstd * (g - (mean_g - lo * rstd * mean_gx) - (x - mean) * rstd * mean_gx).
template <typename T>
__global__ void rows_grad_finalize(const acc_t<T>* __restrict__ ws_g, const acc_t<T>* __restrict__ ws_gx,
                                   const acc_t<T>* __restrict__ ws_d, const acc_t<T>* __restrict__ mean,
                                   const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ mean_g,
                                   acc_t<T>* __restrict__ mean_gx, long long rows, long long nchunk,
                                   double count) {
    typedef acc_t<T> A;
    const A n = A(count);
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < rows;
         row += (long long)gridDim.x * blockDim.x) {
        A sg = A(0), sgx = A(0), sd = A(0);
        for (long long c = 0; c < nchunk; ++c) {
            sg += ws_g[row * nchunk + c];
            sgx += ws_gx[row * nchunk + c];
            if (ws_d) sd += ws_d[row * nchunk + c];
        }
        const A lo_r = mean_correction(sd / n, mean, row) * rstd[row];
        const A mg = sg / n;
        const A mgx = (sgx - lo_r * sg) / n;
        mean_g[row] = mg - lo_r * mgx;
        mean_gx[row] = mgx;
    }
}

// Rows made of segments of one parameter each (NCHW group norm: a row holds C/G channels of
// HW elements; instance norm: one): rows_grad_partial, run over the segments with no weight,
// left sum(dy), sum(dy * xhat) and (ws_d, nullable) sum(x - mean) per (segment, chunk) at
// ws[k * nchunk + c]. Per slice s (segments k = s * per_slice + j, parameter p = k % p_len)
// this takes the saved mean's rounding lo = sum(x - mean) / count out as rows_grad_finalize
// does (dy * xhat about the exact mean: sum(dy * xhat) - lo * rstd * sum(dy) per segment) and
// writes the means of g = dy * w and of g * xhat that apply_bwd takes, the weight applied once
// per segment, and (nullable) the segment's own sums as dweight/dbias partials:
// part_w[k] = sum(dy * xhat), part_b[k] = sum(dy) (param_grad_finish adds them up over the batch).
template <typename T>
__global__ void segment_grad_finalize(const acc_t<T>* __restrict__ ws_g, const acc_t<T>* __restrict__ ws_gx,
                                      const acc_t<T>* __restrict__ ws_d, const void* __restrict__ w_arg,
                                      const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                                      acc_t<T>* __restrict__ mean_g, acc_t<T>* __restrict__ mean_gx,
                                      acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b,
                                      long long slices, long long per_slice, long long nchunk,
                                      long long p_len, double count, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    const A n = A(count);
    for (long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x; s < slices;
         s += (long long)gridDim.x * blockDim.x) {
        A sd = A(0);
        if (ws_d) {
            for (long long k = s * per_slice * nchunk; k < (s + 1) * per_slice * nchunk; ++k) sd += ws_d[k];
        }
        const A lo_r = mean_correction(sd / n, mean, s) * rstd[s];
        A sg = A(0), sgx = A(0);
        for (long long j = 0; j < per_slice; ++j) {
            const long long k = s * per_slice + j;
            A dy_sum = A(0), dyx_sum = A(0);
            for (long long c = 0; c < nchunk; ++c) {
                dy_sum += ws_g[k * nchunk + c];
                dyx_sum += ws_gx[k * nchunk + c];
            }
            dyx_sum -= lo_r * dy_sum;
            if (part_w) part_w[k] = dyx_sum;
            if (part_b) part_b[k] = dy_sum;
            const A wk = weight_at(w, k % p_len);  // one division per segment
            sg += wk * dy_sum;
            sgx += wk * dyx_sum;
        }
        const A mgx = sgx / n;
        mean_g[s] = sg / n - lo_r * mgx;
        mean_gx[s] = mgx;
    }
}

// One element of the forward: ((v - mean) - mean_lo) * rstd * w + b for element e
// (mean_lo nullable: the rounding of the mean, rows_stats_finalize).
template <typename T>
__device__ __forceinline__ T forward_element(T v, long long e, const IndexMap& map,
                                             const Param<T> w, const Param<T> b,
                                             const acc_t<T>* __restrict__ mean,
                                             const acc_t<T>* __restrict__ mean_lo,
                                             const acc_t<T>* __restrict__ rstd, int center) {
    typedef acc_t<T> A;
    const long long s = slice_at(map, e);
    const long long p = param_at(map, e);
    const A mu = center ? mean[s] : A(0);
    const A lo = center && mean_lo ? mean_lo[s] : A(0);
    return from_acc<T>(((to_acc(v) - mu) - lo) * rstd[s] * weight_at(w, p) + bias_at(b, p));
}

// One element of the backward: rstd * (g - mean_g - xhat * mean_gx), g = dy * w.
template <typename T>
__device__ __forceinline__ T backward_element(T dyv, T xv, long long e, const IndexMap& map,
                                              const Param<T> w,
                                              const acc_t<T>* __restrict__ mean,
                                              const acc_t<T>* __restrict__ rstd,
                                              const acc_t<T>* __restrict__ mean_g,
                                              const acc_t<T>* __restrict__ mean_gx, int center) {
    typedef acc_t<T> A;
    const long long s = slice_at(map, e);
    const A r = rstd[s];
    const A xhat = (to_acc(xv) - (center ? mean[s] : A(0))) * r;
    const A g = to_acc(dyv) * weight_at(w, param_at(map, e));
    const A mg = center ? mean_g[s] : A(0);
    return from_acc<T>(r * (g - mg - xhat * mean_gx[s]));
}

// Long rows after rows_stats_finalize: y = ((v - mean) - mean_lo) * rstd * w + b
// elementwise (v = x, or h when a residual was added; mean_lo nullable: the mean's rounding):
// 16-byte accesses where both buffers start aligned, the last total % V elements one by one.
template <typename T>
__global__ void rows_apply_fwd(const T* __restrict__ src, T* __restrict__ y, const void* __restrict__ w_arg,
                               const void* __restrict__ b_arg, const acc_t<T>* __restrict__ mean,
                               const acc_t<T>* __restrict__ mean_lo, const acc_t<T>* __restrict__ rstd,
                               long long total, long long count, long long p_div, long long p_len,
                               int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    const IndexMap map = block_index_map(count, 1, 1, p_div, p_len);
    const int V = VecLen<T>::value;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long nvec = aligned16(src) && aligned16(y) ? total / V : 0;
    for (long long v = first; v < nvec; v += stride) {
        const Vec16<T> in = load16(src + v * V);
        Vec16<T> out;
        ANYNORM_UNROLL
        for (int j = 0; j < V; ++j)
            out.v[j] = forward_element(in.v[j], v * V + j, map, w, b, mean, mean_lo, rstd, center);
        store16(y + v * V, out);
    }
    for (long long e = nvec * V + first; e < total; e += stride)
        y[e] = forward_element(src[e], e, map, w, b, mean, mean_lo, rstd, center);
}

// dx = rstd * (g - mean_g - xhat * mean_gx), g = dy * w (RMS: no mean_g term); vectors as
// rows_apply_fwd.
template <typename T>
__global__ void apply_bwd(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
                          const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                          const acc_t<T>* __restrict__ mean_g, const acc_t<T>* __restrict__ mean_gx,
                          T* __restrict__ dx, long long total, long long reduced, long long inner,
                          long long group, long long p_div, long long p_len, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    const IndexMap map = block_index_map(reduced, inner, group, p_div, p_len);
    const int V = VecLen<T>::value;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long nvec = aligned16(dy) && aligned16(x) && aligned16(dx) ? total / V : 0;
    for (long long v = first; v < nvec; v += stride) {
        const Vec16<T> dyv = load16(dy + v * V), xv = load16(x + v * V);
        Vec16<T> out;
        ANYNORM_UNROLL
        for (int j = 0; j < V; ++j)
            out.v[j] = backward_element(dyv.v[j], xv.v[j], v * V + j, map, w, mean, rstd, mean_g,
                                        mean_gx, center);
        store16(dx + v * V, out);
    }
    for (long long e = nvec * V + first; e < total; e += stride)
        dx[e] = backward_element(dy[e], x[e], e, map, w, mean, rstd, mean_g, mean_gx, center);
}
