// Columns family (inner > 1) in one pass over memory: a block owns `width` consecutive inner
// positions of one `o` and the whole reduced extent, keeps that (reduced, width) tile in
// dynamic shared memory, and works out the statistics and the output from there. x is read
// once and y written once (the split path of cols.cu + finish.cu reads x twice); the
// backward reads dy and x once, writes dx once and sums dweight/dbias on the way (the split
// path and params.cu read dy and x three times: seven transfers where this takes three).
// The launcher takes this path whenever the tile fits its shared-memory budget. The forward
// runs a block per (tile, o); the backward a persistent grid, each block taking (o, tile)
// items in turn and keeping channels-first layer norm's dweight/dbias sums over them.
//
// Block of 256 threads: thread t owns tile column c = t % width and walks the rows
// r = t / width, + lanes, ... (lanes = 256 / width; threads t >= lanes * width only join the
// barriers). `width` is a multiple of `group`, so a tile holds whole statistics. Rows move
// between memory and the tile in vectors where inner, width and the buffers allow
// (tile_vec_len); y and dx are written into the tile in place of x and dy and stored from
// there in the same vectors.
#include "common.cuh"

using namespace anynorm;

#define TILE_THREADS 256
// Scalar loads one thread keeps in flight before storing them to shared memory (vectors go
// by cp.async, all of a thread's at once).
#define TILE_BATCH 8
// Blocks per SM the register allocation must allow: the forward 4 x 256 threads (50%
// occupancy, 64 registers), the backward, which holds twice the state, 3 (37.5%, 80);
// float64 2 (128 registers: fewer spill).
#define TILE_MIN_BLOCKS(T) (sizeof(T) == 8 ? 2 : 4)
#define TILE_MIN_BLOCKS_BWD(T) (sizeof(T) == 8 ? 2 : 3)
// The loops over a thread's rows stay rolled: unrolled, their loads in flight take the
// registers that 4 blocks per SM do not have (ptxas spills float32 at 64).
#ifdef ANYNORM_CUDA_EMU
#define TILE_ROLLED
#else
#define TILE_ROLLED _Pragma("unroll 1")
#endif

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
                                                long long width, long long tile) {
    TilePlace t;
    t.nrows = (int)reduced;
    t.ncols = (int)width;
    t.ngroup = (int)group;
    t.start = tile * width;
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

// load_rows' register batches: TILE_BATCH loads of a thread in flight, then their stores
// (and h = x + res with RES).
template <typename T, bool RES>
__device__ __forceinline__ void load_rows_batched(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                                  T* __restrict__ h, long long base, long long inner,
                                                  const TilePlace& t) {
    const int nrows = t.nrows, ncols = t.ncols;
    const long long step = (long long)t.lanes * inner;  // between one thread's rows
    TILE_ROLLED
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

// Vectors of n elements (n * sizeof(T) bytes: 16, 8 or 4, chosen per launch by
// tile_vec_len; every row of the tile starts n-aligned in memory and in shared memory):
// thread q + per_row * k moves vector q of rows k, k + row_lanes, ... The geometry is worked
// out once at run time for every n alike (TileVecPlace); only the copy loops are templated on
// the width, so that the kernel keeps one set of indices live, not one per width.
template <typename T, int N> struct alignas(N * sizeof(T)) TileVec { T v[N]; };

struct TileVecPlace {
    int n, q, k, row_lanes;  // vector q of rows k, k + row_lanes, ...
    bool active;             // the thread has a vector inside inner
};

__device__ __forceinline__ TileVecPlace tile_vec_place(int n, const TilePlace& t) {
    TileVecPlace v;
    const int per_row = t.ncols / n;
    v.n = n;
    v.row_lanes = TILE_THREADS / per_row;
    v.q = threadIdx.x % per_row;
    v.k = threadIdx.x / per_row;
    v.active = v.k < v.row_lanes && v.q * n < t.valid_cols;
    return v;
}

template <typename T, bool RES, int N>
__device__ __forceinline__ void load_rows_n(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                            T* __restrict__ h, long long base, long long inner,
                                            const TilePlace& t, const TileVecPlace& p) {
    typedef TileVec<T, N> V;
    const int nrows = t.nrows, ncols = t.ncols, lanes = p.row_lanes;
    const long long step = (long long)lanes * inner;
    const long long first = base + (long long)p.k * inner + p.q * N;
    // every vector of the thread in flight at once, in no register (cp.async: 4, 8 or 16 bytes)
    long long e = first;
    TILE_ROLLED
    for (int r = p.k; r < nrows; r += lanes, e += step)
        cp_async<(int)sizeof(V)>(tile + r * ncols + p.q * N, x + e);
    cp_async_commit();
    if (!RES) return;  // the caller waits (cp_async_wait_all) before its barrier
    cp_async_wait_all();  // h = x + res rounded to T, in place of x (the thread's own vectors)
    e = first;
    TILE_ROLLED
    for (int r = p.k; r < nrows; r += lanes, e += step) {
        V* slot = reinterpret_cast<V*>(tile + r * ncols + p.q * N);
        V v = *slot;
        const V rv = *reinterpret_cast<const V*>(res + e);
        ANYNORM_UNROLL
        for (int j = 0; j < N; ++j) v.v[j] = add_in_dtype(v.v[j], rv.v[j]);
        *slot = v;
        *reinterpret_cast<V*>(h + e) = v;
    }
}

// Copy this o's tile into tile[r * ncols + c] (columns past valid_cols untouched), a batch of
// loads in flight per thread. With RES the tile holds h = x + res (also written). `base` is
// the element (o, 0, start).
//
// Scalar: thread (c, k) loads rows k, k + lanes, ... of column c: float32/float64 by cp.async
// (every element in flight; a batch of 8 in registers left the 7x7 stage's tiles waiting on
// latency), 16-bit types (cp.async copies 4 bytes at least) and h = x + res a batch at a time.
template <typename T, bool RES>
__device__ __forceinline__ void load_rows(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                          T* __restrict__ h, long long base, long long inner,
                                          const TilePlace& t) {
    if (!t.valid) return;
    if (!RES && sizeof(T) >= 4) {  // 4- and 8-byte elements by cp.async: all in flight, in no register
        load_rows_n<T, false, 1>(tile, x, res, h, base, inner, t, tile_vec_place(1, t));
    } else {
        load_rows_batched<T, RES>(tile, x, res, h, base, inner, t);
    }
}

template <typename T, bool RES>
__device__ __forceinline__ void load_rows_vec(int n, T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                              T* __restrict__ h, long long base, long long inner,
                                              const TilePlace& t) {
    const TileVecPlace p = tile_vec_place(n, t);
    if (!p.active) return;
    const int V = VecLen<T>::value;
    if (n == V)
        load_rows_n<T, RES, VecLen<T>::value>(tile, x, res, h, base, inner, t, p);
    else if (V >= 4 && n == V / 2)
        load_rows_n<T, RES, (VecLen<T>::value >= 4 ? VecLen<T>::value / 2 : 1)>(tile, x, res, h, base, inner, t, p);
    else if (V >= 8)
        load_rows_n<T, RES, (VecLen<T>::value >= 8 ? VecLen<T>::value / 4 : 1)>(tile, x, res, h, base, inner, t, p);
}

template <typename T, int N>
__device__ __forceinline__ void store_rows_n(T* __restrict__ out, const T* tile, long long base, long long inner,
                                             const TilePlace& t, const TileVecPlace& p) {
    typedef TileVec<T, N> V;
    const long long step = (long long)p.row_lanes * inner;
    long long e = base + (long long)p.k * inner + p.q * N;
    TILE_ROLLED
    for (int r = p.k; r < t.nrows; r += p.row_lanes, e += step)
        *reinterpret_cast<V*>(out + e) = *reinterpret_cast<const V*>(tile + r * t.ncols + p.q * N);
}

// The tile's columns inside inner, rows to memory (y or dx staged in shared memory), in
// vectors of n elements as load_rows_vec (n = 1: element by element).
template <typename T>
__device__ __forceinline__ void store_tile(int n, T* __restrict__ out, const T* tile, long long base,
                                           long long inner, const TilePlace& t) {
    const TileVecPlace p = tile_vec_place(n, t);
    if (!p.active) return;
    const int V = VecLen<T>::value;
    if (n == V)
        store_rows_n<T, VecLen<T>::value>(out, tile, base, inner, t, p);
    else if (V >= 4 && n == V / 2)
        store_rows_n<T, (VecLen<T>::value >= 4 ? VecLen<T>::value / 2 : 1)>(out, tile, base, inner, t, p);
    else if (V >= 8 && n == V / 4)
        store_rows_n<T, (VecLen<T>::value >= 8 ? VecLen<T>::value / 4 : 1)>(out, tile, base, inner, t, p);
    else
        store_rows_n<T, 1>(out, tile, base, inner, t, p);
}

__device__ __forceinline__ bool aligned_to(const void* p, int bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1)) == 0;
}

// Elements per vector of a tile's rows in memory at `a` and `b` (nullable): the widest of
// 16, 8 and 4 bytes (at least 2 elements) that divides inner and the tile width and to which
// both start aligned; 1 (element by element) where none does (inner odd: 7 x 7 = 49).
template <typename T>
__device__ __forceinline__ int tile_vec_len(long long inner, int ncols, const void* a, const void* b) {
    for (int n = VecLen<T>::value; n >= 2; n /= 2) {
        const int bytes = n * (int)sizeof(T);
        if (bytes >= 4 && inner % n == 0 && ncols % n == 0 && aligned_to(a, bytes) && (!b || aligned_to(b, bytes)))
            return n;
    }
    return 1;
}

// MIN_BYTES: the narrowest vector taken. Both kernels take 16 (16-byte vectors or none): with
// the 8- and 4-byte loops as well, the backward spilled 16-bit types at 80 registers and the
// float32 forward spilled on sm_80 at 64.
template <typename T, int MIN_BYTES = 4>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ x, const T* __restrict__ res,
                                          T* __restrict__ h, long long base, long long inner,
                                          const TilePlace& t) {
    if (MIN_BYTES == 16) {
        const int n = res ? tile_vec_len<T>(inner, t.ncols, x, res) : tile_vec_len<T>(inner, t.ncols, x, 0);
        const int nh = res ? tile_vec_len<T>(inner, t.ncols, h, 0) : n;
        if (n == VecLen<T>::value && nh == n) {
            const TileVecPlace p = tile_vec_place(VecLen<T>::value, t);
            if (!p.active) return;
            if (res)
                load_rows_n<T, true, VecLen<T>::value>(tile, x, res, h, base, inner, t, p);
            else
                load_rows_n<T, false, VecLen<T>::value>(tile, x, res, h, base, inner, t, p);
        } else if (res) {
            load_rows<T, true>(tile, x, res, h, base, inner, t);
        } else {
            load_rows<T, false>(tile, x, res, h, base, inner, t);
        }
        return;
    }
    if (res) {
        // x, res and h alike: the narrowest of their vectors
        const int n = tile_vec_len<T>(inner, t.ncols, x, res), nh = tile_vec_len<T>(inner, t.ncols, h, 0);
        if ((nh < n ? nh : n) > 1)
            load_rows_vec<T, true>(nh < n ? nh : n, tile, x, res, h, base, inner, t);
        else
            load_rows<T, true>(tile, x, res, h, base, inner, t);
    } else {
        const int n = tile_vec_len<T>(inner, t.ncols, x, 0);
        if (n > 1)
            load_rows_vec<T, false>(n, tile, x, res, h, base, inner, t);
        else
            load_rows<T, false>(tile, x, res, h, base, inner, t);
    }
}

// Where an element's parameter index p = (e / p_div) % p_len comes from, with
// e = (o * reduced + r) * inner + i (the launcher takes the tile kernels only for these):
// PARAM_COL where p_div * p_len divides inner: p = (i / p_div) % p_len, one per column
// (NHWC instance/group norm: p = i; no parameters: p_div = p_len = 1);
// PARAM_ROW where p_div == inner and p_len == reduced: p = r (channels-first layer norm).
enum { PARAM_COL = 0, PARAM_ROW = 1 };

// v as a value the compiler keeps (no rematerializing it from what it was computed from):
// cols_bwd_tile_vec's param_mode was folded into its 64-bit remainder, which stayed live
// across the kernel and was what ptxas spilled.
__device__ __forceinline__ int opaque(int v) {
#ifdef ANYNORM_CUDA_EMU
    return v;
#else
    int out;
    asm volatile("mov.b32 %0, %1;" : "=r"(out) : "r"(v));
    return out;
#endif
}

__device__ __forceinline__ int param_mode(long long inner, long long p_div, long long p_len) {
    return inner % (p_div * p_len) == 0 ? PARAM_COL : PARAM_ROW;
}

// The weight (or bias) of tile row r for a thread whose column's own parameter is `own`.
template <int MODE, typename T>
__device__ __forceinline__ acc_t<T> param_of_row(const Param<T>& q, acc_t<T> own, int r, acc_t<T> none) {
    return MODE == PARAM_COL ? own : param_value(q, r, none);
}

// y = ((v - shift) - c) * rs * w + b over the thread's rows of its column (mean = shift + c),
// into y (y[base + r * inner]), or STAGED in place of v in the tile (each element is read and
// written by the same thread), for store_tile's vectors.
// `wc`, `bc`: the column's own parameters (PARAM_COL).
template <int MODE, bool STAGED, typename T>
__device__ __forceinline__ void write_y(T* __restrict__ y, T* tile, const TilePlace& t, long long base,
                                        long long inner, acc_t<T> shift, acc_t<T> c, acc_t<T> rs,
                                        acc_t<T> wc, acc_t<T> bc, const Param<T>& w, const Param<T>& b) {
    typedef acc_t<T> A;
    const long long step = (long long)t.lanes * inner;
    long long e = base + (long long)t.k * inner;
    const A scale = rs * wc;
    TILE_ROLLED
    for (int r = t.k; r < t.nrows; r += t.lanes, e += step) {
        const int j = r * t.ncols + t.c;
        const A d = (to_acc(tile[j]) - shift) - c;
        T v;
        if (MODE == PARAM_COL)
            v = from_acc<T>(d * scale + bc);
        else
            v = from_acc<T>(d * rs * param_of_row<MODE>(w, A(1), r, A(1)) + param_of_row<MODE>(b, A(0), r, A(0)));
        if (STAGED)
            tile[j] = v;
        else
            y[e] = v;
    }
}

// ---- the forward's arithmetic in vectors ------------------------------------------------
//
// Where the tile's rows hold a power-of-two number (<= 64) of CPT-element vectors
// (tile_vec_compute), each thread owns one vector of columns (CPT = 16 bytes of T) and walks
// rows k, k + lanes, ...: one shared-memory load and CPT independent sums per step, where the
// scalar form takes a load, a conversion and a dependent add per element (about three times
// the instructions per element: the kernel is bound by the instructions it issues). A warp
// holds qw = min(per_row, 8) vectors side by side and 32 / qw rows, so each quarter-warp
// reads 128 contiguous bytes (no bank conflicts at any row pitch) and the rows of a column in
// a warp are summed by shuffles; the warps sharing columns add their partials in shared memory.
struct TileVecSpot {
    int q;      // the thread's vector: tile columns q*CPT ... q*CPT + CPT - 1
    int k;      // its first row; then k + lanes, ...
    int lanes;  // rows walked side by side (256 / vectors per row)
    int qw;     // vectors side by side in a warp: the shuffles go over lane offsets qw ... 16
    int rg, G;  // the warp's row group of G (warps holding the same columns)
};

template <typename T> struct TileCpt { enum { value = sizeof(T) == 2 ? 4 : VecLen<T>::value }; };

__device__ __forceinline__ bool tile_vec_compute(int ncols, int cpt) {
    if (ncols % cpt) return false;
    const int per_row = ncols / cpt;
    return per_row <= 64 && (per_row & (per_row - 1)) == 0;
}

// Whether cols_bwd_tile_vec takes a launch: the vector geometry, a parameter period within 32
// bits where the parameter is the column's, and per-column dweight/dbias (!param_rows) only
// there (the row's weight is in its sums).
__device__ __forceinline__ bool tile_bwd_vector(int width, int cpt, int mode, bool param_grads, int param_rows,
                                                long long period) {
    return tile_vec_compute(width, cpt) &&
           (mode == PARAM_ROW ? !(param_grads && !param_rows) : period < (1ll << 31));
}

__device__ __forceinline__ TileVecSpot tile_vec_spot(int ncols, int cpt) {
    TileVecSpot s;
    const int per_row = ncols / cpt;
    s.qw = per_row < 8 ? per_row : 8;
    const int chunks = per_row / s.qw;  // warps across a row
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int rows_in_warp = 32 / s.qw;
    s.G = (TILE_THREADS / 32) / chunks;
    s.rg = warp / chunks;
    s.q = (warp % chunks) * s.qw + lane % s.qw;
    s.k = s.rg * rows_in_warp + lane / s.qw;
    s.lanes = s.G * rows_in_warp;
    return s;
}

// Sums over each statistic (rows of the tile, `group` columns) of every thread's per-column
// a[j] (and b[j] with TWO), returned to each thread per column; fixed orders, so every thread
// of a statistic gets the same bits. red: 4 * TILE_THREADS values (2 * G * ncols <= 1024
// partials). Every thread of the block calls it.
template <int CPT, bool TWO, typename A>
__device__ __forceinline__ void tile_vec_sum(A (&a)[CPT], A (&b)[CPT], const TileVecSpot& s, int ncols,
                                             int group, A* red) {
    ANYNORM_UNROLL
    for (int off = s.qw; off < 32; off <<= 1)
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            a[j] += __shfl_xor_sync(0xffffffffu, a[j], off);
            if (TWO) b[j] += __shfl_xor_sync(0xffffffffu, b[j], off);
        }
    const int span = s.G * ncols;  // b's partials after a's
    if ((threadIdx.x % 32) < s.qw)  // the warp's first row: its sums
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            red[s.rg * ncols + s.q * CPT + j] = a[j];
            if (TWO) red[span + s.rg * ncols + s.q * CPT + j] = b[j];
        }
    __syncthreads();
    if (s.G > 1 && (int)threadIdx.x < ncols) {  // the row groups' partials, in place of the first
        A sa = red[threadIdx.x], sb = TWO ? red[span + threadIdx.x] : A(0);
        for (int g = 1; g < s.G; ++g) {
            sa += red[g * ncols + threadIdx.x];
            if (TWO) sb += red[span + g * ncols + threadIdx.x];
        }
        red[threadIdx.x] = sa;
        if (TWO) red[span + threadIdx.x] = sb;
    }
    if (group > 1) {  // the statistic's columns, in place of its first
        __syncthreads();
        if ((int)threadIdx.x < ncols / group) {
            const int c0 = threadIdx.x * group;
            A sa = red[c0], sb = TWO ? red[span + c0] : A(0);
            for (int u = 1; u < group; ++u) {
                sa += red[c0 + u];
                if (TWO) sb += red[span + c0 + u];
            }
            red[c0] = sa;
            if (TWO) red[span + c0] = sb;
        }
    }
    __syncthreads();
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) {
        const int c = s.q * CPT + j, sc = c - c % group;
        a[j] = red[sc];
        if (TWO) b[j] = red[span + sc];
    }
    __syncthreads();  // red is reused
}

// Element j of a tile vector in the accumulation type (bfloat16: bf16_of_words, CPT even).
template <typename T, int CPT> __device__ __forceinline__ acc_t<T> tile_acc(const TileVec<T, CPT>& t, int j) {
    return to_acc(t.v[j]);
}
template <int CPT> __device__ __forceinline__ float tile_acc(const TileVec<__nv_bfloat16, CPT>& t, int j) {
    return CPT % 2 ? to_acc(t.v[j]) : bf16_of_words(&t, j);
}

template <typename T, int CPT>
__device__ __forceinline__ void load_cols(const T* p, acc_t<T> (&v)[CPT]) {
    const TileVec<T, CPT> t = *reinterpret_cast<const TileVec<T, CPT>*>(p);
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) v[j] = tile_acc(t, j);
}

// Tile column of the first column of each of the thread's CPT columns' statistics.
template <int CPT>
__device__ __forceinline__ void stat_cols(int c0, int group, int (&sc)[CPT]) {
    int rem = c0 % group, first = c0 - rem;
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) {
        sc[j] = first;
        if (++rem == group) {
            rem = 0;
            first = c0 + j + 1;
        }
    }
}

// The thread's CPT weights (scale *= w) and biases, PARAM_COL: the parameter of column
// i is (i / p_div) % p_len; m0 = (start + c0) % (p_div * p_len) for the first (32-bit: the
// vector form runs only where p_div * p_len < 2^31), the others by steps.
template <typename T, int CPT>
__device__ __forceinline__ void column_params(const Param<T>& w, const Param<T>& b, int m0, int p_div, int p_len,
                                              acc_t<T> (&scale)[CPT], acc_t<T> (&bias)[CPT]) {
    int p = m0 / p_div, rem = m0 - p * p_div;
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) {
        scale[j] *= weight_at(w, p);
        bias[j] = bias_at(b, p);
        if (++rem == p_div) {
            rem = 0;
            if (++p == p_len) p = 0;
        }
    }
}

// fwd_tile_vec's y for PARAM_ROW with weight and bias both stored as P (T or A): the
// generic loop's per-row choice between null, T and A cost about as many instructions as the
// row's arithmetic. y = ((v - shift) - c) * rstd * w[r] + b[r], staged in the tile.
template <typename T, typename P, int CPT>
__device__ __forceinline__ void write_rows_vec(T* tile, const TileVecSpot& s, int nrows, int ncols, int c0,
                                               const acc_t<T> (&shift)[CPT], const acc_t<T> (&c)[CPT],
                                               const acc_t<T> (&rs)[CPT], const P* __restrict__ w,
                                               const P* __restrict__ b) {
    typedef acc_t<T> A;
    TILE_ROLLED
    for (int r = s.k; r < nrows; r += s.lanes) {
        const A wr = to_acc(w[r]), br = to_acc(b[r]);
        A v[CPT];
        load_cols<T, CPT>(tile + r * ncols + c0, v);
        TileVec<T, CPT> out;
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) out.v[j] = from_acc<T>(((v[j] - shift[j]) - c[j]) * rs[j] * wr + br);
        *reinterpret_cast<TileVec<T, CPT>*>(tile + r * ncols + c0) = out;
    }
}

// cols_fwd_tile's statistics for one o, and y staged in the tile in place of x (with
// stage_y; every column: the caller stores the valid ones), in vectors. As the scalar form,
// shifted two-pass:
//   shift = v[row 0, first column of the statistic],  c1 = sum(v - shift) / n,
//   d = (v - shift) - c1,  c2 = sum(d) / n,  mean = shift + (c1 + c2),
//   rstd = 1/sqrt(sum(d^2)/n - c2^2 + eps),  y = ((v - shift) - (c1 + c2)) * rstd * w + b.
// Columns past valid_cols hold no data: their sums are never read for a valid column.
template <typename T, int CPT>
__device__ __forceinline__ void fwd_tile_vec(T* tile, acc_t<T>* red, const TilePlace& t, long long o,
                                             long long inner, int m0, int p_div, int p_len, int mode, int center,
                                             double eps, bool stage_y,
                                             const Param<T>& w, const Param<T>& b, acc_t<T>* __restrict__ mean,
                                             acc_t<T>* __restrict__ rstd) {
    typedef acc_t<T> A;
    const TileVecSpot s = tile_vec_spot(t.ncols, CPT);
    const int nrows = t.nrows, ncols = t.ncols, group = t.ngroup, c0 = s.q * CPT;
    const A n = A((long long)nrows * group);
    const T* col = tile + c0;  // row r of the thread's vector: col + r * ncols
    A shift[CPT], s1[CPT], s2[CPT], c1[CPT];
    {
        int sc[CPT];
        stat_cols<CPT>(c0, group, sc);
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            shift[j] = center ? to_acc(tile[sc[j]]) : A(0);
            c1[j] = A(0);
        }
    }
    if (center) {
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) s1[j] = A(0);
        TILE_ROLLED
        for (int r = s.k; r < nrows; r += s.lanes) {
            A v[CPT];
            load_cols<T, CPT>(col + r * ncols, v);
            ANYNORM_UNROLL
            for (int j = 0; j < CPT; ++j) s1[j] += v[j] - shift[j];
        }
        tile_vec_sum<CPT, false>(s1, s2, s, ncols, group, red);
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) c1[j] = s1[j] / n;
    }
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) s1[j] = s2[j] = A(0);
    TILE_ROLLED
    for (int r = s.k; r < nrows; r += s.lanes) {
        A v[CPT];
        load_cols<T, CPT>(col + r * ncols, v);
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            const A d = (v[j] - shift[j]) - c1[j];
            s1[j] += d;
            s2[j] += d * d;
        }
    }
    tile_vec_sum<CPT, true>(s1, s2, s, ncols, group, red);
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) {  // s1: c = c1 + c2, s2: rstd
        const A c2 = center ? s1[j] / n : A(0);
        const A var = s2[j] / n - c2 * c2;
        s1[j] = c1[j] + c2;
        s2[j] = inv_sqrt((var < A(0) ? A(0) : var) + A(eps));
    }
    if (s.k == 0) {
        int sc[CPT];
        stat_cols<CPT>(c0, group, sc);
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j)
            if (sc[j] == c0 + j && c0 + j < t.valid_cols) {
                const long long st = o * (inner / group) + (t.start + c0 + j) / group;
                if (rstd) rstd[st] = s2[j];  // optional, as in rows.cu
                if (mean) mean[st] = shift[j] + s1[j];
            }
    }
    if (!stage_y) return;
    if (mode == PARAM_COL) {  // y = ((v - shift) - c) * (rstd * w) + b, one w and b per column
        A bias[CPT];
        column_params<T, CPT>(w, b, m0, p_div, p_len, s2, bias);
        TILE_ROLLED
        for (int r = s.k; r < nrows; r += s.lanes) {
            A v[CPT];
            load_cols<T, CPT>(col + r * ncols, v);
            TileVec<T, CPT> out;
            ANYNORM_UNROLL
            for (int j = 0; j < CPT; ++j) out.v[j] = from_acc<T>(((v[j] - shift[j]) - s1[j]) * s2[j] + bias[j]);
            *reinterpret_cast<TileVec<T, CPT>*>(tile + r * ncols + c0) = out;
        }
    } else if (w.ptr && b.ptr && w.in_t == b.in_t) {  // PARAM_ROW, the common case: one loop per storage
        if (w.in_t)
            write_rows_vec<T, T, CPT>(tile, s, nrows, ncols, c0, shift, s1, s2, static_cast<const T*>(w.ptr),
                                      static_cast<const T*>(b.ptr));
        else
            write_rows_vec<T, A, CPT>(tile, s, nrows, ncols, c0, shift, s1, s2, static_cast<const A*>(w.ptr),
                                      static_cast<const A*>(b.ptr));
    } else {  // PARAM_ROW: y = ((v - shift) - c) * rstd * w[r] + b[r]
        TILE_ROLLED
        for (int r = s.k; r < nrows; r += s.lanes) {
            const A wr = weight_at(w, r), br = bias_at(b, r);
            A v[CPT];
            load_cols<T, CPT>(col + r * ncols, v);
            TileVec<T, CPT> out;
            ANYNORM_UNROLL
            for (int j = 0; j < CPT; ++j) out.v[j] = from_acc<T>(((v[j] - shift[j]) - s1[j]) * s2[j] * wr + br);
            *reinterpret_cast<TileVec<T, CPT>*>(tile + r * ncols + c0) = out;
        }
    }
}

// cols_fwd_tile's loop over o in the vector form (fwd_tile_vec).
template <typename T, int CPT>
__device__ __forceinline__ void fwd_tiles_vec(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                                              T* __restrict__ y, const Param<T>& w, const Param<T>& b,
                                              acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                                              acc_t<T>* red, T* tile, const TilePlace& t, long long outer,
                                              long long reduced, long long inner, long long p_div, long long p_len,
                                              int mode, int center, double eps) {
    // the thread's first column's place in the parameters' period (PARAM_COL)
    const int m0 = mode == PARAM_COL ? (int)((t.start + tile_vec_spot(t.ncols, CPT).q * CPT) % (p_div * p_len)) : 0;
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long tile_base = o * reduced * inner + t.start;  // element (o, 0, start)
        load_tile<T, 16>(tile, x, res, h, tile_base, inner, t);
        cp_async_wait_all();
        __syncthreads();
        fwd_tile_vec<T, CPT>(tile, red, t, o, inner, m0, (int)p_div, (int)p_len, mode, center, eps, y != 0, w, b, mean,
                             rstd);
        if (y) {
            __syncthreads();
            // worked out here rather than kept: a register across the loop made ptxas spill
            store_tile(tile_vec_len<T>(inner, t.ncols, y, 0), y, tile, tile_base, inner, t);
        }
        __syncthreads();  // the tile is refilled for the next o
    }
}

// Forward, shifted two-pass statistics over the tile's rows and the group's columns (n values):
//   shift = v[first row, first column of the statistic]    (an element: v - shift is exact near it)
//   c1 = sum(v - shift) / n,   d = (v - shift) - c1,   c2 = sum(d) / n   (c2: c1's rounding)
//   mean = shift + (c1 + c2),  rstd = 1/sqrt(sum(d^2)/n - c2^2 + eps)
//   y = ((v - shift) - (c1 + c2)) * rstd * w + b
// so y never meets a mean rounded to the data's magnitude (RMS: shift = c1 = c2 = 0).
// y nullable (statistics only).
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
    const int CPT = TileCpt<T>::value;
    __shared__ A red[4 * TILE_THREADS];  // the scalar form's part and column; the vector form's partials
    A* part = red;
    A* column = red + 2 * TILE_THREADS;
    T* tile = dynamic_shared<T>();
    const TilePlace t = tile_place(reduced, inner, group, width, blockIdx.x);
    const long long i = t.start + t.c;
    const int mode = param_mode(inner, p_div, p_len);
    if (tile_vec_compute(t.ncols, CPT) && (mode == PARAM_ROW || p_div * p_len < (1ll << 31))) {
        fwd_tiles_vec<T, TileCpt<T>::value>(x, res, h, y, w, b, mean, rstd, red, tile, t, outer, reduced, inner,
                                            p_div, p_len, mode, center, eps);
        return;
    }
    A wc = A(1), bc = A(0);
    if (mode == PARAM_COL && t.valid) {
        const long long p = (i / p_div) % p_len;
        wc = weight_at(w, p);
        bc = bias_at(b, p);
    }
    const A n = A(reduced * group);
    const int vy = y ? tile_vec_len<T>(inner, t.ncols, y, 0) : 1;  // > 1: y stored in vectors
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long tile_base = o * reduced * inner + t.start;  // element (o, 0, start)
        load_tile<T, 16>(tile, x, res, h, tile_base, inner, t);
        cp_async_wait_all();  // load_tile's copies (if it took them)
        __syncthreads();
        const T* col = tile + t.c;  // row r of the thread's column: col[r * ncols]
        const A shift = center && t.valid ? to_acc(tile[t.stat_col]) : A(0);
        A c1 = A(0);
        if (center) {
            A s1 = A(0), unused = A(0);
            if (t.valid)
                TILE_ROLLED
                for (int r = t.k; r < t.nrows; r += t.lanes) s1 += to_acc(col[r * t.ncols]) - shift;
            tile_sum2(s1, unused, t, part, column);
            c1 = s1 / n;
        }
        A sd = A(0), ss = A(0);
        if (t.valid)
            TILE_ROLLED
            for (int r = t.k; r < t.nrows; r += t.lanes) {
                const A d = (to_acc(col[r * t.ncols]) - shift) - c1;
                sd += d;
                ss += d * d;
            }
        tile_sum2(sd, ss, t, part, column);
        const A c2 = center ? sd / n : A(0);
        const A c = c1 + c2;
        const A var = ss / n - c2 * c2;
        const A rs = inv_sqrt((var < A(0) ? A(0) : var) + A(eps));
        if (t.valid && t.k == 0 && t.c == t.stat_col) {
            const long long s = (o * inner + i) / group;  // one division: o * (inner / group) spilled
            if (rstd) rstd[s] = rs;  // optional, as in rows.cu
            if (mean) mean[s] = shift + c;
        }
        if (y && t.valid) {
            const long long base = tile_base + t.c;
            if (mode == PARAM_COL && vy > 1)
                write_y<PARAM_COL, true>(y, tile, t, base, inner, shift, c, rs, wc, bc, w, b);
            else if (mode == PARAM_COL)
                write_y<PARAM_COL, false>(y, tile, t, base, inner, shift, c, rs, wc, bc, w, b);
            else if (vy > 1)
                write_y<PARAM_ROW, true>(y, tile, t, base, inner, shift, c, rs, wc, bc, w, b);
            else
                write_y<PARAM_ROW, false>(y, tile, t, base, inner, shift, c, rs, wc, bc, w, b);
        }
        if (y && vy > 1) {  // y staged in the tile: out in vectors
            __syncthreads();
            store_tile(vy, y, tile, tile_base, inner, t);
        }
        __syncthreads();  // the tile is refilled for the next o
    }
}

// The backward's two passes over the tile, with xhat = ((x - mean) - c) * rstd:
// sums of g = dy * w, g * xhat, dy * xhat and dy over the thread's rows, then dx.
template <int MODE, typename T>
__device__ __forceinline__ void backward_sums(const T* dy_tile, const T* x_tile, const TilePlace& t,
                                              acc_t<T> mu, acc_t<T> c, acc_t<T> rs, acc_t<T> wc,
                                              const Param<T>& w, acc_t<T>* sums) {
    typedef acc_t<T> A;
    A sg = A(0), sgx = A(0), sdx = A(0), sd = A(0);
    TILE_ROLLED
    for (int r = t.k; r < t.nrows; r += t.lanes) {
        const int j = r * t.ncols + t.c;
        const A d = to_acc(dy_tile[j]);
        const A xhat = ((to_acc(x_tile[j]) - mu) - c) * rs;
        const A g = d * param_of_row<MODE>(w, wc, r, A(1));
        sg += g;
        sgx += g * xhat;
        sdx += d * xhat;
        sd += d;
    }
    sums[0] = sg;
    sums[1] = sgx;
    sums[2] = sdx;
    sums[3] = sd;
}

// dx = rs * (g - mg - xhat * mgx) over the thread's rows of its column, into dx
// (dx[base + r * inner]), or STAGED in place of dy in dy_tile (each element is read and
// written by the same thread), for store_tile's vectors.
template <int MODE, bool STAGED, typename T>
__device__ __forceinline__ void write_dx(T* __restrict__ dx, T* dy_tile, const T* x_tile, const TilePlace& t,
                                         long long base, long long inner, acc_t<T> mu, acc_t<T> c, acc_t<T> rs,
                                         acc_t<T> wc, acc_t<T> mg, acc_t<T> mgx, const Param<T>& w) {
    typedef acc_t<T> A;
    const long long step = (long long)t.lanes * inner;
    long long e = base + (long long)t.k * inner;
    TILE_ROLLED
    for (int r = t.k; r < t.nrows; r += t.lanes, e += step) {
        const int j = r * t.ncols + t.c;
        const A g = to_acc(dy_tile[j]) * param_of_row<MODE>(w, wc, r, A(1));
        const A xhat = ((to_acc(x_tile[j]) - mu) - c) * rs;
        const T v = from_acc<T>(rs * (g - mg - xhat * mgx));
        if (STAGED)
            dy_tile[j] = v;
        else
            dx[e] = v;
    }
}

// ---- the backward's arithmetic in vectors (fwd_tile_vec's geometry) ------------------------

// Ordinal, from the tile's first column, of each of the thread's CPT columns' statistics.
template <int CPT>
__device__ __forceinline__ void stat_ordinals(int c0, int group, int (&k)[CPT]) {
    int rem = c0 % group, ord = c0 / group;
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) {
        k[j] = ord;
        if (++rem == group) {
            rem = 0;
            ++ord;
        }
    }
}

// The weight of tile row r (PARAM_ROW) stored as K: 0 none (1), 1 in T, 2 in A; one loop per
// storage, as write_rows_vec.
template <int K, typename T>
__device__ __forceinline__ acc_t<T> row_weight(const void* w, int r) {
    if (K == 0) return acc_t<T>(1);
    if (K == 1) return to_acc(static_cast<const T*>(w)[r]);
    return static_cast<const acc_t<T>*>(w)[r];
}

// Sums over the thread's rows of its CPT columns: sa += dw, sb += dw * (x - mu) with dw = dy
// (PARAM_COL: a column's weight is applied to its sums afterwards, and these are its
// dweight/dbias sums too) or dy * w[r] (PARAM_ROW, stored as K). The caller forms
// sum(dw * xhat) = rs * (sb - c * sa) for xhat = ((x - mu) - c) * rs: the loop holds mu alone.
template <typename T, int CPT, int MODE, int K>
__device__ __forceinline__ void bwd_vec_sums(const T* dy_tile, const T* x_tile, const TileVecSpot& s, int nrows,
                                             int ncols, int c0, const acc_t<T> (&mu)[CPT], const void* w,
                                             acc_t<T> (&sa)[CPT], acc_t<T> (&sb)[CPT]) {
    typedef acc_t<T> A;
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) sa[j] = sb[j] = A(0);
    TILE_ROLLED
    for (int r = s.k; r < nrows; r += s.lanes) {
        A d[CPT], v[CPT];
        load_cols<T, CPT>(dy_tile + r * ncols + c0, d);
        load_cols<T, CPT>(x_tile + r * ncols + c0, v);
        const A wr = MODE == PARAM_ROW ? row_weight<K, T>(w, r) : A(1);
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            const A g = MODE == PARAM_ROW ? d[j] * wr : d[j];
            sa[j] += g;
            sb[j] += g * (v[j] - mu[j]);
        }
    }
}

// dx = rs * ((g - mean(g)) - xhat * mean(g * xhat)) over the thread's rows, g = dy * w,
// xhat = ((x - mu) - c) * rs (the scalar form's arithmetic: a slice of one element, or of
// equal elements, gets dx = 0 exactly), staged in place of dy. wc: the columns' weights
// (PARAM_COL) or row r's by K (PARAM_ROW).
template <typename T, int CPT, int MODE, int K>
__device__ __forceinline__ void bwd_vec_dx(T* dy_tile, const T* x_tile, const TileVecSpot& s, int nrows, int ncols,
                                           int c0, const acc_t<T> (&mu)[CPT], const acc_t<T> (&c)[CPT],
                                           const acc_t<T> (&rs)[CPT], const acc_t<T> (&wc)[CPT],
                                           const acc_t<T> (&mg)[CPT], const acc_t<T> (&mgx)[CPT], const void* w) {
    typedef acc_t<T> A;
    TILE_ROLLED
    for (int r = s.k; r < nrows; r += s.lanes) {
        A d[CPT], v[CPT];
        load_cols<T, CPT>(dy_tile + r * ncols + c0, d);
        load_cols<T, CPT>(x_tile + r * ncols + c0, v);
        const A wr = MODE == PARAM_ROW ? row_weight<K, T>(w, r) : A(1);
        TileVec<T, CPT> out;
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            const A g = d[j] * (MODE == PARAM_ROW ? wr : wc[j]);
            const A xhat = ((v[j] - mu[j]) - c[j]) * rs[j];
            out.v[j] = from_acc<T>(rs[j] * ((g - mg[j]) - xhat * mgx[j]));
        }
        *reinterpret_cast<TileVec<T, CPT>*>(dy_tile + r * ncols + c0) = out;
    }
}

// dweight/dbias of each tile row (p = r): a warp per row, lanes across the row's vectors,
// each column's mu, rs and c from `cols` ([c], [TILE_THREADS + c], [2 * TILE_THREADS + c]),
// added into the block's row_acc in the fixed order of its items (as the scalar form). Half
// vectors: five whole ones in flight spilled; a check per column (the last vector may run
// past valid_cols): without it, the whole vectors' loop and the last one's took more
// registers than the bound leaves.
template <typename T, int CPT>
__device__ __forceinline__ void bwd_vec_row_grads(const T* dy_tile, const T* x_tile, const acc_t<T>* cols,
                                                  acc_t<T>* row_acc, const TilePlace& t) {
    typedef acc_t<T> A;
    const int HALF = CPT > 1 ? CPT / 2 : 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nvec = (t.valid_cols + CPT - 1) / CPT;
    for (int r = warp; r < t.nrows; r += TILE_THREADS / 32) {
        A rw = A(0), rb = A(0);
        for (int q = lane; q < nvec; q += 32)
            ANYNORM_UNROLL
            for (int h = 0; h < CPT; h += HALF) {
                const int c0 = q * CPT + h;
                A d[HALF], v[HALF], mu[HALF], rs[HALF], c[HALF];
                load_cols<T, HALF>(dy_tile + r * t.ncols + c0, d);
                load_cols<T, HALF>(x_tile + r * t.ncols + c0, v);
                load_cols<A, HALF>(cols + c0, mu);
                load_cols<A, HALF>(cols + TILE_THREADS + c0, rs);
                load_cols<A, HALF>(cols + 2 * TILE_THREADS + c0, c);
                ANYNORM_UNROLL
                for (int j = 0; j < HALF; ++j)
                    if (c0 + j < t.valid_cols) {
                        rw += d[j] * (((v[j] - mu[j]) - c[j]) * rs[j]);
                        rb += d[j];
                    }
            }
        rw = warp_sum(rw);
        rb = warp_sum(rb);
        if (lane == 0) {  // row r's accumulators: always this warp's lane 0
            row_acc[r] += rw;
            row_acc[t.nrows + r] += rb;
        }
    }
}

// cols_bwd_tile's work on one item (o, tile) in vectors: the scalar form's passes (the saved
// mean's rounding c, the sums, the parameter gradients, dx staged in the dy tile) with
// fwd_tile_vec's geometry. Columns past valid_cols take mu = rs = 0 and are never stored.
template <typename T, int CPT>
__device__ __forceinline__ void bwd_tile_vec(T* dy_tile, const T* x_tile, acc_t<T>* red, acc_t<T>* row_acc,
                                             const TilePlace& t, long long o, long long inner, long long p_div,
                                             long long p_len, int mode, int center, const Param<T>& w,
                                             const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                                             acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b,
                                             int param_rows) {
    typedef acc_t<T> A;
    const TileVecSpot s = tile_vec_spot(t.ncols, CPT);
    const int nrows = t.nrows, ncols = t.ncols, group = t.ngroup, c0 = s.q * CPT;
    const A n = A((long long)nrows * group);
    A mu[CPT], rs[CPT], c[CPT];
    {
        int k[CPT];
        stat_ordinals<CPT>(c0, group, k);
        const long long st0 = o * (inner / group) + t.start / group;
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            const bool ok = c0 + j < t.valid_cols;
            mu[j] = center && ok ? mean[st0 + k[j]] : A(0);
            rs[j] = ok ? rstd[st0 + k[j]] : A(0);
            c[j] = A(0);
        }
    }
    if (center) {  // c = sum(x - mean) / n: the saved mean's rounding (0 where not this x's mean)
        A sx[CPT], unused[CPT];
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) sx[j] = A(0);
        TILE_ROLLED
        for (int r = s.k; r < nrows; r += s.lanes) {
            A v[CPT];
            load_cols<T, CPT>(x_tile + r * ncols + c0, v);
            ANYNORM_UNROLL
            for (int j = 0; j < CPT; ++j) sx[j] += v[j] - mu[j];
        }
        tile_vec_sum<CPT, false>(sx, unused, s, ncols, group, red);
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            const A cj = sx[j] / n;
            c[j] = fabs(cj) <= mean_rounding<A>() * fabs(mu[j]) ? cj : A(0);
        }
    }
    A sg[CPT], sgx[CPT];  // sums of g = dy * w and g * (x - mu), then g * xhat
    if (mode == PARAM_COL)
        bwd_vec_sums<T, CPT, PARAM_COL, 0>(dy_tile, x_tile, s, nrows, ncols, c0, mu, w.ptr, sg, sgx);
    else if (!w.ptr)
        bwd_vec_sums<T, CPT, PARAM_ROW, 0>(dy_tile, x_tile, s, nrows, ncols, c0, mu, w.ptr, sg, sgx);
    else if (w.in_t)
        bwd_vec_sums<T, CPT, PARAM_ROW, 1>(dy_tile, x_tile, s, nrows, ncols, c0, mu, w.ptr, sg, sgx);
    else
        bwd_vec_sums<T, CPT, PARAM_ROW, 2>(dy_tile, x_tile, s, nrows, ncols, c0, mu, w.ptr, sg, sgx);
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) sgx[j] = rs[j] * (sgx[j] - c[j] * sg[j]);
    // the thread's first column's place in the parameters' period (PARAM_COL)
    const long long span = p_div * p_len, i0 = t.start + c0;
    const int m0 = mode == PARAM_COL ? (int)(i0 < span ? i0 : i0 % span) : 0;
    if (part_w && !param_rows) {  // per column (no group merge) to part[o * inner + i]: sum(dy * xhat), sum(dy)
        A sdx[CPT], sd[CPT];
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            sdx[j] = sgx[j];
            sd[j] = sg[j];
        }
        tile_vec_sum<CPT, true>(sdx, sd, s, ncols, 1, red);
        if (s.k == 0)
            ANYNORM_UNROLL
            for (int j = 0; j < CPT; ++j)
                if (c0 + j < t.valid_cols) {
                    const long long e = o * inner + t.start + c0 + j;
                    part_w[e] = sdx[j];
                    if (part_b) part_b[e] = sd[j];
                }
    }
    if (mode == PARAM_COL && w.ptr) {  // the columns' weights, loaded here and again for dx (not kept)
        A wc[CPT], unused[CPT];
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) wc[j] = A(1);
        column_params<T, CPT>(w, Param<T>{0, 0}, m0, (int)p_div, (int)p_len, wc, unused);
        ANYNORM_UNROLL
        for (int j = 0; j < CPT; ++j) {
            sg[j] *= wc[j];
            sgx[j] *= wc[j];
        }
    }
    tile_vec_sum<CPT, true>(sg, sgx, s, ncols, group, red);
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) {  // sg -> mean(g), sgx -> mean(g * xhat)
        sg[j] = center ? sg[j] / n : A(0);
        sgx[j] /= n;
    }
    if (part_w && param_rows) {
        if (s.k == 0)
            ANYNORM_UNROLL
            for (int j = 0; j < CPT; ++j) {
                red[c0 + j] = mu[j];
                red[TILE_THREADS + c0 + j] = rs[j];
                red[2 * TILE_THREADS + c0 + j] = c[j];
            }
        __syncthreads();
        bwd_vec_row_grads<T, CPT>(dy_tile, x_tile, red, row_acc, t);
        __syncthreads();  // dx goes in place of dy next
    }
    A wc[CPT];  // the columns' weights (PARAM_COL)
    ANYNORM_UNROLL
    for (int j = 0; j < CPT; ++j) wc[j] = A(1);
    if (mode == PARAM_COL && w.ptr) {
        A unused[CPT];
        column_params<T, CPT>(w, Param<T>{0, 0}, m0, (int)p_div, (int)p_len, wc, unused);
    }
    if (mode == PARAM_COL)
        bwd_vec_dx<T, CPT, PARAM_COL, 0>(dy_tile, x_tile, s, nrows, ncols, c0, mu, c, rs, wc, sg, sgx, w.ptr);
    else if (!w.ptr)
        bwd_vec_dx<T, CPT, PARAM_ROW, 0>(dy_tile, x_tile, s, nrows, ncols, c0, mu, c, rs, wc, sg, sgx, w.ptr);
    else if (w.in_t)
        bwd_vec_dx<T, CPT, PARAM_ROW, 1>(dy_tile, x_tile, s, nrows, ncols, c0, mu, c, rs, wc, sg, sgx, w.ptr);
    else
        bwd_vec_dx<T, CPT, PARAM_ROW, 2>(dy_tile, x_tile, s, nrows, ncols, c0, mu, c, rs, wc, sg, sgx, w.ptr);
}

// The block's dweight/dbias partial row (p = r: part_w and param_rows), written once after its
// items: part[blockIdx.x * reduced + r].
template <typename A>
__device__ __forceinline__ void write_row_partials(const A* row_acc, A* __restrict__ part_w, A* __restrict__ part_b,
                                                   long long reduced) {
    __syncthreads();
    const long long k0 = (long long)blockIdx.x * reduced;
    for (int r = threadIdx.x; r < (int)reduced; r += TILE_THREADS) {
        part_w[k0 + r] = row_acc[r];
        if (part_b) part_b[k0 + r] = row_acc[reduced + r];
    }
}

// cols_bwd_tile's loop over its items in the vector form (bwd_tile_vec).
template <typename T, int CPT>
__device__ __forceinline__ void bwd_tiles_vec(const T* __restrict__ dy, const T* __restrict__ x, const Param<T>& w,
                                              const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                                              T* __restrict__ dx, acc_t<T>* __restrict__ part_w,
                                              acc_t<T>* __restrict__ part_b, acc_t<T>* red, T* dy_tile, T* x_tile,
                                              acc_t<T>* row_acc, long long outer, long long reduced, long long inner,
                                              long long group, long long width, long long p_div, long long p_len,
                                              int param_rows, int center, int mode) {
    const long long tiles = (inner + width - 1) / width;
    // the item count read from shared memory each item: in a register across the item's
    // work, ptxas spilled half of it at 80 registers
    __shared__ long long items;
    if (threadIdx.x == 0) items = outer * tiles;
    __syncthreads();
    for (long long q = blockIdx.x; q < items; q += gridDim.x) {
        const long long o = q / tiles;
        const TilePlace t = tile_place(reduced, inner, group, width, q - o * tiles);
        const long long tile_base = o * reduced * inner + t.start;  // element (o, 0, start)
        load_tile<T, 16>(dy_tile, dy, (const T*)0, (T*)0, tile_base, inner, t);
        load_tile<T, 16>(x_tile, x, (const T*)0, (T*)0, tile_base, inner, t);
        cp_async_wait_all();
        __syncthreads();
        bwd_tile_vec<T, CPT>(dy_tile, x_tile, red, row_acc, t, o, inner, p_div, p_len, mode, center, w, mean, rstd,
                             part_w, part_b, param_rows);
        __syncthreads();
        store_tile(tile_vec_len<T>(inner, t.ncols, dx, 0), dx, dy_tile, tile_base, inner, t);
        __syncthreads();
    }
    if (part_w && param_rows) write_row_partials(row_acc, part_w, part_b, reduced);
}

// cols_bwd_tile's loop over its items in the scalar form: thread (c, k) owns column c.
template <typename T>
__device__ __forceinline__ void bwd_tiles_scalar(const T* __restrict__ dy, const T* __restrict__ x,
                                                 const Param<T>& w, const acc_t<T>* __restrict__ mean,
                                                 const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
                                                 acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b,
                                                 acc_t<T>* red, T* dy_tile, T* x_tile, acc_t<T>* row_acc,
                                                 long long outer, long long reduced, long long inner, long long group,
                                                 long long width, long long p_div, long long p_len, int param_rows,
                                                 int center, int mode) {
    typedef acc_t<T> A;
    A* part = red;
    A* column = red + 2 * TILE_THREADS;
    const A n = A(reduced * group);
    const long long tiles = (inner + width - 1) / width;
    const int vdx = tile_vec_len<T>(inner, (int)width, dx, 0);  // > 1: dx stored in vectors
    for (long long q = blockIdx.x; q < outer * tiles; q += gridDim.x) {
        const long long o = q / tiles;
        const TilePlace t = tile_place(reduced, inner, group, width, q - o * tiles);
        const long long i = t.start + t.c;
        const A wc = mode == PARAM_COL && t.valid ? weight_at(w, (i / p_div) % p_len) : A(1);
        const long long tile_base = o * reduced * inner + t.start;  // element (o, 0, start)
        const long long base = tile_base + t.c;
        load_tile<T, 16>(dy_tile, dy, (const T*)0, (T*)0, tile_base, inner, t);
        load_tile<T, 16>(x_tile, x, (const T*)0, (T*)0, tile_base, inner, t);
        cp_async_wait_all();  // both tiles' copies (if load_tile took them)
        __syncthreads();
        A mu = A(0), rs = A(0);
        if (t.valid) {
            const long long s = o * (inner / group) + i / group;
            mu = center ? mean[s] : A(0);
            rs = rstd[s];
        }
        A c = A(0);
        if (center) {
            A sx = A(0), unused = A(0);
            if (t.valid)
                TILE_ROLLED
                for (int r = t.k; r < t.nrows; r += t.lanes) sx += to_acc(x_tile[r * t.ncols + t.c]) - mu;
            tile_sum2(sx, unused, t, part, column);
            c = sx / n;
            if (!(fabs(c) <= mean_rounding<A>() * fabs(mu))) c = A(0);
        }
        A sums[4] = {A(0), A(0), A(0), A(0)};
        if (t.valid && mode == PARAM_COL)
            backward_sums<PARAM_COL>(dy_tile, x_tile, t, mu, c, rs, wc, w, sums);
        else if (t.valid)
            backward_sums<PARAM_ROW>(dy_tile, x_tile, t, mu, c, rs, wc, w, sums);
        tile_sum2(sums[0], sums[1], t, part, column);
        const A mg = center ? sums[0] / n : A(0);
        const A mgx = sums[1] / n;
        if (part_w && !param_rows) {  // per column: the column's lanes add up (no group merge)
            TilePlace own = t;
            own.stat_col = t.c;
            own.ngroup = 1;
            tile_sum2(sums[2], sums[3], own, part, column);
            if (t.valid && t.k == 0) {
                part_w[o * inner + i] = sums[2];
                if (part_b) part_b[o * inner + i] = sums[3];
            }
        } else if (part_w) {  // per row: warp by warp over the rows, lanes across the columns
            if (t.k == 0) {  // the column's statistics, for every warp (mean = mu + c)
                column[t.c] = mu;
                column[TILE_THREADS + t.c] = rs;
                part[t.c] = c;
            }
            __syncthreads();
            const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
            for (int r = warp; r < t.nrows; r += TILE_THREADS / 32) {
                A rw = A(0), rb = A(0);
                for (int k = lane; k < t.valid_cols; k += 32) {
                    const A d = to_acc(dy_tile[r * t.ncols + k]);
                    rw += d * ((to_acc(x_tile[r * t.ncols + k]) - column[k]) - part[k]) * column[TILE_THREADS + k];
                    rb += d;
                }
                rw = warp_sum(rw);
                rb = warp_sum(rb);
                if (lane == 0) {  // row r's accumulators: always this warp's lane 0
                    row_acc[r] += rw;
                    row_acc[t.nrows + r] += rb;
                }
            }
            __syncthreads();  // dx goes in place of dy next
        }
        if (t.valid) {
            if (mode == PARAM_COL && vdx > 1)
                write_dx<PARAM_COL, true>(dx, dy_tile, x_tile, t, base, inner, mu, c, rs, wc, mg, mgx, w);
            else if (mode == PARAM_COL)
                write_dx<PARAM_COL, false>(dx, dy_tile, x_tile, t, base, inner, mu, c, rs, wc, mg, mgx, w);
            else if (vdx > 1)
                write_dx<PARAM_ROW, true>(dx, dy_tile, x_tile, t, base, inner, mu, c, rs, wc, mg, mgx, w);
            else
                write_dx<PARAM_ROW, false>(dx, dy_tile, x_tile, t, base, inner, mu, c, rs, wc, mg, mgx, w);
        }
        if (vdx > 1) {  // dx staged in the dy tile: out in vectors
            __syncthreads();
            store_tile(vdx, dx, dy_tile, tile_base, inner, t);
        }
        __syncthreads();
    }
    if (part_w && param_rows) write_row_partials(row_acc, part_w, part_b, reduced);
}

// The tile backward's dynamic shared memory: the dy tile, the x tile, then (by_row: p = r with
// dweight/dbias) the block's sums per row, [r] and [reduced + r], zeroed here.
template <typename T> struct BwdSmem {
    T* dy;
    T* x;
    acc_t<T>* row_acc;
};

template <typename T>
__device__ __forceinline__ BwdSmem<T> bwd_smem(long long reduced, long long width, bool by_row) {
    BwdSmem<T> s;
    s.dy = dynamic_shared<T>();
    s.x = s.dy + reduced * width;
    s.row_acc = reinterpret_cast<acc_t<T>*>(s.x + reduced * width);
    if (by_row)
        for (int r = threadIdx.x; r < 2 * (int)reduced; r += TILE_THREADS) s.row_acc[r] = acc_t<T>(0);
    return s;
}

// Backward: g = dy * w, xhat = (x - mean) * rstd,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (RMS: no mean(g) term).
// The saved mean is the true mean rounded to A, half an ulp of the data's magnitude away:
// the tile gives back that rounding, c = sum(x - mean) / n (x - mean is exact near the
// mean), and xhat = ((x - mean) - c) * rstd. Where |c| exceeds a few ulps of the mean, the
// mean given is not this tile's and is taken as it is (c = 0).
//
// A persistent grid: the work is the outer * tiles items q = o * tiles + tile (tiles =
// ceil(inner / width)), and block b takes q = b, b + gridDim.x, ... in that fixed order
// (blocks running at once hold neighbouring tiles of one o, which share DRAM sectors).
// Any gridDim.x >= 1 is correct; the launcher takes the blocks resident at once.
//
// With part_w (nullable; part_b nullable too), also the parameter gradients' partial sums
// sum(dy * xhat) and sum(dy), for param_grad_finish, where the parameter index is the tile's
// row or column:
//   param_rows == 1: p = r (p_div == inner, p_len == reduced: channels-first layer norm).
//     Each item's per-row sums (one warp per row over the tile's columns) are added to the
//     block's float32 (float64: float64) accumulators, 2 * reduced values of A in dynamic
//     shared memory after the two tiles, in the block's fixed order of items; at the end
//     the block writes part[blockIdx.x * reduced + r] (nchunk = gridDim.x): the partial
//     rows scale with the blocks resident, not with the tiles (ConvNeXt's 64x384x14x14 in
//     bfloat16: 396 partial rows instead of 832). Deterministic: fixed orders, no atomics.
//   param_rows == 0: p = i (p_div == 1, p_len == inner: NHWC instance/group norm).
//     part[o * inner + i] per item (nchunk = outer), as the columns' sums come out of the
//     item. Kept so: a block whose items span several column tiles would need a partial
//     row of all p_len = inner columns, and gridDim.x such rows are more than outer of them
//     wherever the grid has more blocks than the batch has samples (every NHWC shape of
//     issue 15: outer 32 against 396 blocks). The per-o rows are 2 values of A per column
//     against reduced * 2 elements of dy and x read for it: 1/1568 of x's bytes for
//     32x56x56x64 bfloat16, 1/196 for 32x28x28x256, 1/12 for 32x7x7x2048 (49 rows).
// Dynamic smem 2 * reduced * width * sizeof(T) (dy tile, then x tile), + 2 * reduced *
// sizeof(A) with part_w and param_rows (the accumulators; 2 * sizeof(T) >= sizeof(A) keeps
// them aligned).
template <typename T>
__global__ void __launch_bounds__(TILE_THREADS, TILE_MIN_BLOCKS_BWD(T))
cols_bwd_tile(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
              const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
              acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long outer,
              long long reduced, long long inner, long long group, long long width, long long p_div,
              long long p_len, int param_rows, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    __shared__ A red[4 * TILE_THREADS];  // part and column of the scalar form
    const BwdSmem<T> sm = bwd_smem<T>(reduced, width, part_w && param_rows);
    bwd_tiles_scalar(dy, x, w, mean, rstd, dx, part_w, part_b, red, sm.dy, sm.x, sm.row_acc, outer, reduced, inner,
                     group, width, p_div, p_len, param_rows, center, param_mode(inner, p_div, p_len));
}

// cols_bwd_tile with the arithmetic in shared-memory vectors (bwd_tile_vec: fwd_tile_vec's
// geometry), a kernel of its own: in one kernel with the scalar form, ptxas spilled 12-28
// bytes at 80 registers where either alone spills nothing. The launcher takes it where
// tile_bwd_vector holds; it traps elsewhere.
template <typename T>
__global__ void __launch_bounds__(TILE_THREADS, TILE_MIN_BLOCKS_BWD(T))
cols_bwd_tile_vec(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
                  const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
                  acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long outer,
                  long long reduced, long long inner, long long group, long long width, long long p_div,
                  long long p_len, int param_rows, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    __shared__ __align__(16) A red[4 * TILE_THREADS];  // partials, then the columns' statistics
    const int mode = opaque(param_mode(inner, p_div, p_len));
    if (!tile_bwd_vector((int)width, TileCpt<T>::value, mode, part_w != 0, param_rows, p_div * p_len)) __trap();
    const BwdSmem<T> sm = bwd_smem<T>(reduced, width, part_w && param_rows);
    bwd_tiles_vec<T, TileCpt<T>::value>(dy, x, w, mean, rstd, dx, part_w, part_b, red, sm.dy, sm.x, sm.row_acc, outer,
                                        reduced, inner, group, width, p_div, p_len, param_rows, center, mode);
}
