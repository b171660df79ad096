// Columns family (inner > 1) in one pass over memory: a block owns `width` consecutive inner
// positions of one `o` and the whole reduced extent, keeps that (reduced, width) tile in
// dynamic shared memory, and works out the statistics and the output from there. x is read
// once and y written once (the split path of cols.cu + finish.cu reads x twice); the
// backward reads dy and x once, writes dx once and sums dweight/dbias on the way (the split
// path and params.cu read dy and x three times: seven transfers where this takes three).
// The launcher takes this path whenever the tile fits its shared-memory budget.
//
// Block of 256 threads: thread t owns tile column c = t % width and walks the rows
// r = t / width, + lanes, ... (lanes = 256 / width; threads t >= lanes * width only join the
// barriers). `width` is a multiple of `group`, so a tile holds whole statistics.
#include "common.cuh"

using namespace anynorm;

#define TILE_THREADS 256
// Loads one thread keeps in flight before storing them to shared memory: scalars, 16-byte
// vectors (4 x 16 bytes x 256 threads: 16 KiB per block).
#define TILE_BATCH 8
#define TILE_VEC_BATCH 4
// Blocks per SM the register allocation must allow (float64 spills at 3).
#define TILE_MIN_BLOCKS(T) (sizeof(T) == 8 ? 2 : 3)

// One thread's place in its block's tile: all `nrows` rows of the columns
// [start, start + ncols) of inner, the first `valid_cols` of them inside inner.
struct TilePlace {
    int nrows, ncols, ngroup, valid_cols;  // 32-bit: a tile fits in shared memory
    long long start;                       // the tile's first inner position
    int c, k, lanes;                       // the thread's column, first row, row stride
    int stat_col;                          // first column of c's statistic (c - c % group)
    bool active;                           // thread < lanes * ncols
    bool valid;                            // active, and column c lies inside inner
};

__device__ __forceinline__ TilePlace tile_place(long long reduced, long long inner, long long group,
                                                long long width) {
    TilePlace t;
    t.nrows = (int)reduced;
    t.ncols = (int)width;
    t.ngroup = (int)group;
    t.start = (long long)blockIdx.x * width;
    t.valid_cols = inner - t.start < width ? (int)(inner - t.start) : t.ncols;
    t.lanes = TILE_THREADS / t.ncols;
    t.c = threadIdx.x % t.ncols;
    t.k = threadIdx.x / t.ncols;
    t.stat_col = t.c - t.c % t.ngroup;
    t.active = t.k < t.lanes;
    t.valid = t.active && t.c < t.valid_cols;
    return t;
}

// Sums of two values per thread over each statistic (the `lanes` threads of a column, then the
// `group` columns of a statistic), returned to every thread of the statistic in the same
// order, so all of them see the same bits. Every thread of the block must call it.
// part and column hold 2 * TILE_THREADS values each.
template <typename A>
__device__ __forceinline__ void tile_sum2(A& a, A& b, const TilePlace& t, A* part, A* column) {
    if (t.active) {
        part[threadIdx.x] = a;
        part[TILE_THREADS + threadIdx.x] = b;
    }
    __syncthreads();
    if (threadIdx.x < t.ncols) {
        A sa = A(0), sb = A(0);
        for (int q = 0; q < t.lanes; ++q) {
            sa += part[q * t.ncols + threadIdx.x];
            sb += part[TILE_THREADS + q * t.ncols + threadIdx.x];
        }
        column[threadIdx.x] = sa;
        column[TILE_THREADS + threadIdx.x] = sb;
    }
    __syncthreads();
    a = A(0);
    b = A(0);
    for (int q = 0; q < t.ngroup; ++q) {
        a += column[t.stat_col + q];
        b += column[TILE_THREADS + t.stat_col + q];
    }
    __syncthreads();  // part/column may be reused
}

// Copy this o's tile into tile[r * ncols + c] (columns past valid_cols untouched), a batch of
// loads in flight per thread. With RES the tile holds h = x + res (also written). `base` is
// the element (o, 0, start).
//
// Scalar: thread (c, k) loads rows k, k + lanes, ... of column c.
template <typename T, bool RES>
__device__ __forceinline__ void load_rows(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                          T* __restrict__ h, long long base, long long inner,
                                          const TilePlace& t) {
    if (!t.valid) return;
    const int nrows = t.nrows, ncols = t.ncols;
    const long long step = (long long)t.lanes * inner;  // between one thread's rows
    for (int r0 = t.k; r0 < nrows; r0 += t.lanes * TILE_BATCH) {
        const long long e0 = base + (long long)r0 * inner + t.c;
        T v[TILE_BATCH];
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_BATCH; ++u)
            if (r0 + u * t.lanes < nrows) {
                v[u] = x[e0 + u * step];
                if (RES) v[u] = add_in_dtype(v[u], res[e0 + u * step]);
            }
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_BATCH; ++u)
            if (r0 + u * t.lanes < nrows) {
                tile[(r0 + u * t.lanes) * ncols + t.c] = v[u];
                if (RES) h[e0 + u * step] = v[u];
            }
    }
}

// 16-byte vectors (every row of the tile starts 16-byte aligned in memory and in shared
// memory): thread q + per_row * k loads vector q of rows k, k + row_lanes, ...
template <typename T, bool RES>
__device__ __forceinline__ void load_rows_vec(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                              T* __restrict__ h, long long base, long long inner,
                                              const TilePlace& t) {
    const int V = VecLen<T>::value;
    const int nrows = t.nrows, ncols = t.ncols, valid = t.valid_cols;
    const int per_row = ncols / V, row_lanes = TILE_THREADS / per_row;
    const int q = threadIdx.x % per_row, k = threadIdx.x / per_row;
    if (k >= row_lanes || q * V >= valid) return;
    const long long step = (long long)row_lanes * inner;
    for (int r0 = k; r0 < nrows; r0 += row_lanes * TILE_VEC_BATCH) {
        const long long e0 = base + (long long)r0 * inner + q * V;
        Vec16<T> v[TILE_VEC_BATCH];
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_VEC_BATCH; ++u)
            if (r0 + u * row_lanes < nrows) {
                v[u] = load16(x + e0 + u * step);
                if (RES) {
                    const Vec16<T> rv = load16(res + e0 + u * step);
                    ANYNORM_UNROLL
                    for (int j = 0; j < V; ++j) v[u].v[j] = add_in_dtype(v[u].v[j], rv.v[j]);
                }
            }
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_VEC_BATCH; ++u)
            if (r0 + u * row_lanes < nrows) {
                store16(tile + (r0 + u * row_lanes) * ncols + q * V, v[u]);
                if (RES) store16(h + e0 + u * step, v[u]);
            }
    }
}

template <typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                          T* __restrict__ h, long long base, long long inner,
                                          const TilePlace& t) {
    const int V = VecLen<T>::value;
    const bool vec = inner % V == 0 && t.ncols % V == 0 && aligned16(x) && aligned16_or_null(res) &&
                     aligned16_or_null(h);
    if (vec && res)
        load_rows_vec<T, true>(tile, x, res, h, base, inner, t);
    else if (vec)
        load_rows_vec<T, false>(tile, x, res, h, base, inner, t);
    else if (res)
        load_rows<T, true>(tile, x, res, h, base, inner, t);
    else
        load_rows<T, false>(tile, x, res, h, base, inner, t);
}

// Forward: mean = sum(v)/n, rstd = 1/sqrt(sum((v - mean)^2)/n + eps) over the tile's rows and
// the group's columns (two passes over shared memory; RMS: mean 0), then
// y = (v - mean) * rstd * w + b. y nullable (statistics only).
// grid (ceil(inner / width), min(outer, 65535)); dynamic smem reduced * width * sizeof(T).
template <typename T>
__global__ void __launch_bounds__(TILE_THREADS, TILE_MIN_BLOCKS(T))
cols_fwd_tile(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
              const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
              acc_t<T>* __restrict__ rstd, long long outer, long long reduced, long long inner,
              long long group, long long width, long long p_div, long long p_len, int center,
              double eps, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    typedef acc_t<T> A;
    __shared__ A part[2 * TILE_THREADS], column[2 * TILE_THREADS];
    T* tile = dynamic_shared<T>();
    const IndexMap& map = block_index_map(reduced, inner, group, p_div, p_len);
    const TilePlace t = tile_place(reduced, inner, group, width);
    const long long i = t.start + t.c;
    const A n = A(reduced * group);
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long tile_base = o * reduced * inner + t.start;  // element (o, 0, start)
        const long long base = tile_base + t.c;
        load_tile(tile, x, res, h, tile_base, inner, t);
        __syncthreads();
        A mu = A(0);
        if (center) {
            A sum = A(0), unused = A(0);
            if (t.valid)
                for (int r = t.k; r < t.nrows; r += t.lanes) sum += to_acc(tile[r * t.ncols + t.c]);
            tile_sum2(sum, unused, t, part, column);
            mu = sum / n;
        }
        // Second pass over the deviations: their sum corrects the first pass's rounding of the
        // mean (corrected two-pass algorithm: var = (sum d^2 - (sum d)^2 / n) / n).
        A sd = A(0), ss = A(0);
        if (t.valid)
            for (int r = t.k; r < t.nrows; r += t.lanes) {
                const A d = to_acc(tile[r * t.ncols + t.c]) - mu;
                sd += d;
                ss += d * d;
            }
        tile_sum2(sd, ss, t, part, column);
        const A shift = center ? sd / n : A(0);
        mu += shift;
        const A var = ss / n - shift * shift;
        const A rs = inv_sqrt((var > A(0) ? var : A(0)) + A(eps));
        if (t.valid && t.k == 0 && t.c == t.stat_col) {
            const long long s = o * (inner / group) + i / group;
            if (rstd) rstd[s] = rs;  // optional, as in rows.cu
            if (mean) mean[s] = mu;
        }
        if (y && t.valid)
            for (int r = t.k; r < t.nrows; r += t.lanes) {
                const long long e = base + (long long)r * inner;
                const long long p = param_at(map, e);
                y[e] = from_acc<T>((to_acc(tile[r * t.ncols + t.c]) - mu) * rs * weight_at(w, p) + bias_at(b, p));
            }
        __syncthreads();  // the tile is refilled for the next o
    }
}

// Backward: g = dy * w, xhat = (x - mean) * rstd,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (RMS: no mean(g) term).
// With part_w (nullable; part_b nullable too), also the parameter gradients' partial sums
// sum(dy * xhat) and sum(dy) of the tile, for param_grad_finish, where the parameter index
// is the tile's column or row:
//   param_rows == 0: p = i (p_div == 1, p_len == inner), part[o * inner + i] (chunk = o);
//   param_rows == 1: p = r (p_div == inner, p_len == reduced),
//                    part[(o * gridDim.x + tile) * reduced + r] (chunk = (o, tile)).
// Launch as cols_fwd_tile; dynamic smem 2 * reduced * width * sizeof(T) (dy tile, then x tile).
template <typename T>
__global__ void __launch_bounds__(TILE_THREADS, TILE_MIN_BLOCKS(T))
cols_bwd_tile(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
              const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
              acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long outer,
              long long reduced, long long inner, long long group, long long width, long long p_div,
              long long p_len, int param_rows, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    __shared__ A part[2 * TILE_THREADS], column[2 * TILE_THREADS];
    T* dy_tile = dynamic_shared<T>();
    T* x_tile = dy_tile + reduced * width;
    const IndexMap& map = block_index_map(reduced, inner, group, p_div, p_len);
    const TilePlace t = tile_place(reduced, inner, group, width);
    const long long i = t.start + t.c;
    const A n = A(reduced * group);
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long tile_base = o * reduced * inner + t.start;  // element (o, 0, start)
        const long long base = tile_base + t.c;
        load_tile(dy_tile, dy, (const T*)0, (T*)0, tile_base, inner, t);
        load_tile(x_tile, x, (const T*)0, (T*)0, tile_base, inner, t);
        __syncthreads();
        A mu = A(0), rs = A(0);
        if (t.valid) {
            const long long s = o * (inner / group) + i / group;
            mu = center ? mean[s] : A(0);
            rs = rstd[s];
        }
        A sg = A(0), sgx = A(0), sdx = A(0), sd = A(0);
        if (t.valid)
            for (int r = t.k; r < t.nrows; r += t.lanes) {
                const int j = r * t.ncols + t.c;
                const A d = to_acc(dy_tile[j]);
                const A xhat = (to_acc(x_tile[j]) - mu) * rs;
                const A g = d * weight_at(w, param_at(map, base + (long long)r * inner));
                sg += g;
                sgx += g * xhat;
                sdx += d * xhat;
                sd += d;
            }
        tile_sum2(sg, sgx, t, part, column);
        const A mg = center ? sg / n : A(0);
        const A mgx = sgx / n;
        if (t.valid)
            for (int r = t.k; r < t.nrows; r += t.lanes) {
                const int j = r * t.ncols + t.c;
                const long long e = base + (long long)r * inner;
                const A g = to_acc(dy_tile[j]) * weight_at(w, param_at(map, e));
                const A xhat = (to_acc(x_tile[j]) - mu) * rs;
                dx[e] = from_acc<T>(rs * (g - mg - xhat * mgx));
            }
        if (part_w && !param_rows) {  // per column: the column's lanes add up (no group merge)
            TilePlace own = t;
            own.stat_col = t.c;
            own.ngroup = 1;
            tile_sum2(sdx, sd, own, part, column);
            if (t.valid && t.k == 0) {
                part_w[o * inner + i] = sdx;
                if (part_b) part_b[o * inner + i] = sd;
            }
        } else if (part_w) {  // per row: warp by warp over the rows, lanes across the columns
            if (t.k == 0) {  // the column's statistics, for every warp
                column[t.c] = mu;
                column[TILE_THREADS + t.c] = rs;
            }
            __syncthreads();
            const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
            for (int r = warp; r < t.nrows; r += TILE_THREADS / 32) {
                A rw = A(0), rb = A(0);
                for (int c = lane; c < t.valid_cols; c += 32) {
                    const A d = to_acc(dy_tile[r * t.ncols + c]);
                    rw += d * (to_acc(x_tile[r * t.ncols + c]) - column[c]) * column[TILE_THREADS + c];
                    rb += d;
                }
                rw = warp_sum(rw);
                rb = warp_sum(rb);
                if (lane == 0) {
                    const long long k = (o * gridDim.x + blockIdx.x) * reduced + r;
                    part_w[k] = rw;
                    if (part_b) part_b[k] = rb;
                }
            }
        }
        __syncthreads();
    }
}
