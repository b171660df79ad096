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

// sum(g) and sum(g * (x - mean) * rstd) of column i over reduced[c*chunk : (c+1)*chunk] for
// each o, and (ws_x, nullable; with center) sum(x - mean): cols_grad_finalize takes the
// saved mean's rounding from it, c = sum(x - mean) / n, and corrects the other two for it.
// (x - mean is exact near the mean; the saved mean, rounded to the data's magnitude, is up
// to half an ulp of it away from the true one, which xhat = (x - mean) * rstd would carry.)
template <typename T>
__global__ void cols_grad_partial(const T* __restrict__ dy, const T* __restrict__ x,
                                  const void* __restrict__ w_arg, const acc_t<T>* __restrict__ mean,
                                  const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ ws_g,
                                  acc_t<T>* __restrict__ ws_gx, acc_t<T>* __restrict__ ws_x, long long outer,
                                  long long reduced, long long inner, long long group, long long chunk,
                                  long long p_div, long long p_len, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    __shared__ A sg_s[COLS_Y][COLS_X], sgx_s[COLS_Y][COLS_X], sx_s[COLS_Y][COLS_X];
    const IndexMap map = block_index_map(reduced, inner, group, p_div, p_len);
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long i = (long long)blockIdx.x * COLS_X + tx;
    const long long nchunk = gridDim.y;
    const long long start = (long long)blockIdx.y * chunk;
    const long long end = start + chunk < reduced ? start + chunk : reduced;
    for (long long o = blockIdx.z; o < outer; o += gridDim.z) {
        A sg = A(0), sgx = A(0), sx = A(0);
        if (i < inner) {
            const long long s = o * (inner / group) + i / group;
            const A mu = center ? mean[s] : A(0);
            const A r = rstd[s];
            for (long long rr = start + ty; rr < end; rr += COLS_Y) {
                const long long e = (o * reduced + rr) * inner + i;
                const A g = to_acc(dy[e]) * weight_at(w, param_at(map, e));
                const A d = to_acc(x[e]) - mu;
                sg += g;
                sgx += g * d * r;
                sx += d;
            }
        }
        sg_s[ty][tx] = sg;
        sgx_s[ty][tx] = sgx;
        sx_s[ty][tx] = sx;
        __syncthreads();
        if (ty == 0 && i < inner) {
            for (int k = 1; k < COLS_Y; ++k) {
                sg += sg_s[k][tx];
                sgx += sgx_s[k][tx];
                sx += sx_s[k][tx];
            }
            const long long k = (o * nchunk + blockIdx.y) * inner + i;
            ws_g[k] = sg;
            ws_gx[k] = sgx;
            if (ws_x) ws_x[k] = sx;
        }
        __syncthreads();
    }
}

// Per slice s = o * (inner / group) + j, from cols_grad_partial's sums over the nchunk chunks
// and the group's columns i = j * group + k:
//   c = sum(x - mean) / count, the saved mean's rounding (0 unless ws_x and center, and
//       where |c| exceeds a few ulps of the mean: a mean that is not this x's, used as given);
//   sum(g * xhat) = sum(g * (x - mean) * rstd) - c * rstd * sum(g)   (xhat of the exact mean);
//   mean_gx = sum(g * xhat) / count, and for apply_bwd, which forms (x - mean) * rstd from the
//   saved mean, mean_g = sum(g) / count - c * rstd * mean_gx, so that its
//   rstd * (g - mean_g - (x - mean) * rstd * mean_gx) is dx of the exact mean.
// With `w` (nullable) the partials were summed without the weight, whose index is the column
// (p = i: NHWC instance and group norm): it is applied here once per column, and part_w /
// part_b (nullable) take the columns' own sums, part_w[o * inner + i] = sum(dy * xhat),
// part_b[...] = sum(dy), the dweight/dbias partials that param_grad_finish adds up over o.
// mean_lo (nullable) takes c, for cols_param_grad_rows.
// Launch: block (256), grid (min(ceil(slices / 256), 65535)), grid-stride over slices.
template <typename T>
__global__ void cols_grad_finalize(const acc_t<T>* __restrict__ ws_g, const acc_t<T>* __restrict__ ws_gx,
                                   const acc_t<T>* __restrict__ ws_x, const void* __restrict__ w_arg,
                                   const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                                   acc_t<T>* __restrict__ mean_g, acc_t<T>* __restrict__ mean_gx,
                                   acc_t<T>* __restrict__ mean_lo, acc_t<T>* __restrict__ part_w,
                                   acc_t<T>* __restrict__ part_b,
                                   long long outer, long long nchunk, long long inner, long long group,
                                   double count, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    const long long per_o = inner / group;
    const long long slices = outer * per_o;
    for (long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x; s < slices;
         s += (long long)gridDim.x * blockDim.x) {
        const long long o = s / per_o, j = s % per_o;
        const long long first = o * nchunk * inner + j * group;  // ws index of (o, chunk 0, i0)
        A c = A(0);
        if (center && ws_x) {
            for (long long q = 0; q < nchunk; ++q)
                for (long long k = 0; k < group; ++k) c += ws_x[first + q * inner + k];
            c = mean_correction(c / A(count), mean, s);
        }
        if (mean_lo) mean_lo[s] = c;
        const A cr = c * rstd[s];  // xhat's correction
        A sg = A(0), sgx = A(0);
        for (long long k = 0; k < group; ++k) {
            A cg = A(0), cgx = A(0);
            for (long long q = 0; q < nchunk; ++q) {
                cg += ws_g[first + q * inner + k];
                cgx += ws_gx[first + q * inner + k];
            }
            cgx -= cr * cg;
            const long long i = j * group + k;
            if (part_w) part_w[o * inner + i] = cgx;
            if (part_b) part_b[o * inner + i] = cg;
            const A wi = weight_at(w, i);
            sg += wi * cg;
            sgx += wi * cgx;
        }
        const A mgx = sgx / A(count);
        mean_gx[s] = mgx;
        mean_g[s] = sg / A(count) - cr * mgx;
    }
}

// dweight/dbias partial sums of the columns' split backward where the parameter is the row
// (p = r, channels-first layer norm past the tiles): xhat = ((x - mean) - mean_lo) * rstd with
// mean_lo the saved mean's rounding (cols_grad_finalize's c; nullable: 0), so that dweight
// carries no rounding of the data's offset (param_grad_rows forms x - mean from the rounded
// mean alone). Block (32, 8): warp ty walks rows r = c*chunk + ty, +8, ... of the block's 32
// columns and adds dy * xhat and dy across them (a fixed shuffle order), lane 0 writing
// part_w[(o * gridDim.x + blockIdx.x) * reduced + r] (part_b nullable): param_grad_finish adds
// the nchunk = outer * gridDim.x partial rows. Grid (ceil(inner / 32), ceil(reduced / chunk),
// min(outer, 65535)), loops o by gridDim.z.
template <typename T>
__global__ void cols_param_grad_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                     const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ mean_lo,
                                     const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ part_w,
                                     acc_t<T>* __restrict__ part_b, long long outer, long long reduced,
                                     long long inner, long long chunk) {
    typedef acc_t<T> A;
    const long long i = (long long)blockIdx.x * COLS_X + threadIdx.x;
    const long long start = (long long)blockIdx.y * chunk;
    const long long end = start + chunk < reduced ? start + chunk : reduced;
    for (long long o = blockIdx.z; o < outer; o += gridDim.z) {
        A mu = A(0), lo = A(0), rs = A(0);
        if (i < inner) {  // the slice is (o, i): group 1
            const long long s = o * inner + i;
            mu = mean ? mean[s] : A(0);
            lo = mean_lo ? mean_lo[s] : A(0);
            rs = rstd[s];
        }
        const long long row0 = (o * gridDim.x + blockIdx.x) * reduced;
        for (long long r = start + threadIdx.y; r < end; r += COLS_Y) {
            A sw = A(0), sb = A(0);
            if (i < inner) {
                const long long e = (o * reduced + r) * inner + i;
                const A d = to_acc(dy[e]);
                sw = d * (((to_acc(x[e]) - mu) - lo) * rs);
                sb = d;
            }
            sw = warp_sum(sw);
            sb = warp_sum(sb);
            if (threadIdx.x == 0) {
                part_w[row0 + r] = sw;
                if (part_b) part_b[row0 + r] = sb;
            }
        }
    }
}
