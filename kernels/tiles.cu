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

// The thread's place in a tile of `width` columns.
struct TileThread {
    int c, k, lanes;  // column, first row, row stride
    int first;        // first column of c's statistic (c - c % group)
    bool active;      // t < lanes * width
};

__device__ __forceinline__ TileThread tile_thread(int width, int group) {
    TileThread t;
    t.lanes = TILE_THREADS / width;
    t.c = threadIdx.x % width;
    t.k = threadIdx.x / width;
    t.first = t.c - t.c % group;
    t.active = t.k < t.lanes;
    return t;
}

// Sums of two values per thread over each statistic (the `lanes` threads of a column, then the
// `group` columns of a statistic), returned to every thread of the statistic in the same
// order, so all of them see the same bits. Every thread of the block must call it.
// part and column hold 2 * TILE_THREADS values each.
template <typename A>
__device__ __forceinline__ void tile_sum2(A& a, A& b, const TileThread& t, int ncols, int ngroup, A* part,
                                          A* column) {
    if (t.active) {
        part[threadIdx.x] = a;
        part[TILE_THREADS + threadIdx.x] = b;
    }
    __syncthreads();
    if (threadIdx.x < ncols) {
        A sa = A(0), sb = A(0);
        for (int q = 0; q < t.lanes; ++q) {
            sa += part[q * ncols + threadIdx.x];
            sb += part[TILE_THREADS + q * ncols + threadIdx.x];
        }
        column[threadIdx.x] = sa;
        column[TILE_THREADS + threadIdx.x] = sb;
    }
    __syncthreads();
    a = A(0);
    b = A(0);
    for (int q = 0; q < ngroup; ++q) {
        a += column[t.first + q];
        b += column[TILE_THREADS + t.first + q];
    }
    __syncthreads();  // part/column may be reused
}

// Copy the tile (rows 0..reduced-1, columns [first, first + ncols) of this o, the first
// `valid` of them inside inner) into tile[r * ncols + c], a batch of loads in flight per
// thread. With RES the tile holds h = x + res (also written). Tile offsets are 32-bit: a
// tile fits in shared memory. `base` is the element (o, 0, first).
//
// Scalar: thread (c, k) loads rows k, k + lanes, ... of column c.
template <typename T, bool RES>
__device__ __forceinline__ void load_rows(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                          T* __restrict__ h, long long base, int reduced,
                                          long long inner, const TileThread& t, int ncols, int valid) {
    if (!t.active || t.c >= valid) return;
    const long long step = (long long)t.lanes * inner;  // between one thread's rows
    for (int r0 = t.k; r0 < reduced; r0 += t.lanes * TILE_BATCH) {
        const long long e0 = base + (long long)r0 * inner + t.c;
        T v[TILE_BATCH];
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_BATCH; ++u)
            if (r0 + u * t.lanes < reduced) {
                v[u] = x[e0 + u * step];
                if (RES) v[u] = add_in_dtype(v[u], res[e0 + u * step]);
            }
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_BATCH; ++u)
            if (r0 + u * t.lanes < reduced) {
                tile[(r0 + u * t.lanes) * ncols + t.c] = v[u];
                if (RES) h[e0 + u * step] = v[u];
            }
    }
}

// 16-byte vectors (every row of the tile starts 16-byte aligned in memory and in shared
// memory): thread q + per_row * k loads vector q of rows k, k + row_lanes, ...
template <typename T, bool RES>
__device__ __forceinline__ void load_rows_vec(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                              T* __restrict__ h, long long base, int reduced,
                                              long long inner, int ncols, int valid) {
    const int V = VecLen<T>::value;
    const int per_row = ncols / V, row_lanes = TILE_THREADS / per_row;
    const int q = threadIdx.x % per_row, k = threadIdx.x / per_row;
    if (k >= row_lanes || q * V >= valid) return;
    const long long step = (long long)row_lanes * inner;
    for (int r0 = k; r0 < reduced; r0 += row_lanes * TILE_VEC_BATCH) {
        const long long e0 = base + (long long)r0 * inner + q * V;
        Vec16<T> v[TILE_VEC_BATCH];
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_VEC_BATCH; ++u)
            if (r0 + u * row_lanes < reduced) {
                v[u] = load16(x + e0 + u * step);
                if (RES) {
                    const Vec16<T> rv = load16(res + e0 + u * step);
                    ANYNORM_UNROLL
                    for (int j = 0; j < V; ++j) v[u].v[j] = add_in_dtype(v[u].v[j], rv.v[j]);
                }
            }
        ANYNORM_UNROLL
        for (int u = 0; u < TILE_VEC_BATCH; ++u)
            if (r0 + u * row_lanes < reduced) {
                store16(tile + (r0 + u * row_lanes) * ncols + q * V, v[u]);
                if (RES) store16(h + e0 + u * step, v[u]);
            }
    }
}

template <typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                          T* __restrict__ h, long long base, int reduced,
                                          long long inner, const TileThread& t, int ncols, int valid) {
    const int V = VecLen<T>::value;
    const bool vec = inner % V == 0 && ncols % V == 0 && aligned16(x) && aligned16_or_null(res) &&
                     aligned16_or_null(h);
    if (vec && res)
        load_rows_vec<T, true>(tile, x, res, h, base, reduced, inner, ncols, valid);
    else if (vec)
        load_rows_vec<T, false>(tile, x, res, h, base, reduced, inner, ncols, valid);
    else if (res)
        load_rows<T, true>(tile, x, res, h, base, reduced, inner, t, ncols, valid);
    else
        load_rows<T, false>(tile, x, res, h, base, reduced, inner, t, ncols, valid);
}

// Forward: mean = sum(v)/n, rstd = 1/sqrt(sum((v - mean)^2)/n + eps) over the tile's rows and
// the group's columns (two passes over shared memory; RMS: mean 0), then
// y = (v - mean) * rstd * w + b. y nullable (statistics only).
// grid (ceil(inner / width), min(outer, 65535)); dynamic smem reduced * width * sizeof(T).
template <typename T>
__global__ void __launch_bounds__(TILE_THREADS, TILE_MIN_BLOCKS(T))
cols_fwd_tile(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
              const acc_t<T>* __restrict__ w, const acc_t<T>* __restrict__ b, acc_t<T>* __restrict__ mean,
              acc_t<T>* __restrict__ rstd, long long outer, long long reduced, long long inner,
              long long group, long long width, long long p_div, long long p_len, int center,
              double eps) {
    typedef acc_t<T> A;
    __shared__ A part[2 * TILE_THREADS], column[2 * TILE_THREADS];
    T* tile = dynamic_shared<T>();
    const IndexMap& map = block_index_map(reduced, inner, group, p_div, p_len);
    const int nrows = (int)reduced, ncols = (int)width, ngroup = (int)group;  // a tile fits in shared memory
    const TileThread t = tile_thread(ncols, ngroup);
    const long long first = (long long)blockIdx.x * width;
    const long long i = first + t.c;
    const bool valid = t.active && i < inner;
    const int valid_cols = inner - first < width ? (int)(inner - first) : ncols;
    const A n = A(reduced * group);
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long tile_base = o * reduced * inner + first;  // element (o, 0, first)
        const long long base = tile_base + t.c;
        load_tile(tile, x, res, h, tile_base, nrows, inner, t, ncols, valid_cols);
        __syncthreads();
        A mu = A(0);
        if (center) {
            A sum = A(0), unused = A(0);
            if (valid)
                for (int r = t.k; r < nrows; r += t.lanes) sum += to_acc(tile[r * ncols + t.c]);
            tile_sum2(sum, unused, t, ncols, ngroup, part, column);
            mu = sum / n;
        }
        // Second pass over the deviations: their sum corrects the first pass's rounding of the
        // mean (corrected two-pass algorithm: var = (sum d^2 - (sum d)^2 / n) / n).
        A sd = A(0), ss = A(0);
        if (valid)
            for (int r = t.k; r < nrows; r += t.lanes) {
                const A d = to_acc(tile[r * ncols + t.c]) - mu;
                sd += d;
                ss += d * d;
            }
        tile_sum2(sd, ss, t, ncols, ngroup, part, column);
        const A shift = center ? sd / n : A(0);
        mu += shift;
        const A var = ss / n - shift * shift;
        const A rs = inv_sqrt((var > A(0) ? var : A(0)) + A(eps));
        if (valid && t.k == 0 && t.c == t.first) {
            const long long s = o * (inner / group) + i / group;
            rstd[s] = rs;
            if (mean) mean[s] = mu;
        }
        if (y && valid)
            for (int r = t.k; r < nrows; r += t.lanes) {
                const long long e = base + (long long)r * inner;
                const long long p = param_at(map, e);
                y[e] = from_acc<T>((to_acc(tile[r * ncols + t.c]) - mu) * rs * weight_at(w, p) + bias_at(b, p));
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
cols_bwd_tile(const T* __restrict__ dy, const T* __restrict__ x, const acc_t<T>* __restrict__ w,
              const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
              acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long outer,
              long long reduced, long long inner, long long group, long long width, long long p_div,
              long long p_len, int param_rows, int center) {
    typedef acc_t<T> A;
    __shared__ A part[2 * TILE_THREADS], column[2 * TILE_THREADS];
    T* dy_tile = dynamic_shared<T>();
    T* x_tile = dy_tile + reduced * width;
    const IndexMap& map = block_index_map(reduced, inner, group, p_div, p_len);
    const int nrows = (int)reduced, ncols = (int)width, ngroup = (int)group;  // a tile fits in shared memory
    const TileThread t = tile_thread(ncols, ngroup);
    const long long first = (long long)blockIdx.x * width;
    const long long i = first + t.c;
    const bool valid = t.active && i < inner;
    const int valid_cols = inner - first < width ? (int)(inner - first) : ncols;
    const A n = A(reduced * group);
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long tile_base = o * reduced * inner + first;  // element (o, 0, first)
        const long long base = tile_base + t.c;
        load_tile(dy_tile, dy, (const T*)0, (T*)0, tile_base, nrows, inner, t, ncols, valid_cols);
        load_tile(x_tile, x, (const T*)0, (T*)0, tile_base, nrows, inner, t, ncols, valid_cols);
        __syncthreads();
        A mu = A(0), rs = A(0);
        if (valid) {
            const long long s = o * (inner / group) + i / group;
            mu = center ? mean[s] : A(0);
            rs = rstd[s];
        }
        A sg = A(0), sgx = A(0), sdx = A(0), sd = A(0);
        if (valid)
            for (int r = t.k; r < nrows; r += t.lanes) {
                const int j = r * ncols + t.c;
                const A d = to_acc(dy_tile[j]);
                const A xhat = (to_acc(x_tile[j]) - mu) * rs;
                const A g = d * weight_at(w, param_at(map, base + (long long)r * inner));
                sg += g;
                sgx += g * xhat;
                sdx += d * xhat;
                sd += d;
            }
        tile_sum2(sg, sgx, t, ncols, ngroup, part, column);
        const A mg = center ? sg / n : A(0);
        const A mgx = sgx / n;
        if (valid)
            for (int r = t.k; r < nrows; r += t.lanes) {
                const int j = r * ncols + t.c;
                const long long e = base + (long long)r * inner;
                const A g = to_acc(dy_tile[j]) * weight_at(w, param_at(map, e));
                const A xhat = (to_acc(x_tile[j]) - mu) * rs;
                dx[e] = from_acc<T>(rs * (g - mg - xhat * mgx));
            }
        if (part_w && !param_rows) {  // per column: the column's lanes add up (no group merge)
            TileThread own = t;
            own.first = t.c;
            tile_sum2(sdx, sd, own, ncols, 1, part, column);
            if (valid && t.k == 0) {
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
            for (int r = warp; r < nrows; r += TILE_THREADS / 32) {
                A rw = A(0), rb = A(0);
                for (int c = lane; c < valid_cols; c += 32) {
                    const A d = to_acc(dy_tile[r * ncols + c]);
                    rw += d * (to_acc(x_tile[r * ncols + c]) - column[c]) * column[TILE_THREADS + c];
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
