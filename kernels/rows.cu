// Rows family (inner == 1): every normalized slice is `count` contiguous elements.
//
// Short rows (count <= 32 * ITEMS): one warp per row; medium rows (count <= blockDim.x *
// ITEMS): one block per row, sized to the row; short plain rows (rows_fwd_multi,
// rows_bwd_multi): several teams per block, each thread's weight and bias loaded once for all
// its rows (and the backward's dweight/dbias sums kept in its registers).
// Either way a "team" of threads holds the row
// in registers (ITEMS values per thread) and takes exact two-pass statistics of
// d = v - shift from them: x is read once, y written once. Long rows: rows_*_partial reduce
// chunks of a row per block; the chunks are merged by finish.cu (rows_stats_finalize /
// rows_grad_finalize) and applied by rows_apply_fwd / apply_bwd.
// rows_bwd_multi and the backward's *_params variants also add up dweight/dbias partial sums on
// the way (per position of plain rows, p = position in the row; per row where p is the row's
// channel), so dy and x are not read again for them; rows_bwd_smem does so per (row, parameter
// segment) for NCHW group/instance norm rows it holds in shared memory.
// Launch configurations: README.md.
#include "common.cuh"

using namespace anynorm;

// Largest block of the block-per-row kernels. Their launch bound caps ptxas at 64 registers
// (65536 / 1024), which keeps any power-of-two block of them at 32 warps per SM (50%).
#define ROW_BLOCK_MAX 1024

// The backward holds two values per item: float64 rows (not tuned for speed) stop at 256
// threads, which leaves ptxas all its registers (at 512 it spilled); the others take
// ROW_BLOCK_MAX at ITEMS=8 (and 16-bit types at 16). _compile's block_threads_max mirrors
// these bounds.
template <typename T> struct BwdBlockMax {
    static const int value = sizeof(T) == 8 ? 256 : ROW_BLOCK_MAX;
};

// The threads that share one row: a warp, or the whole block (any power of two of warps up
// to ROW_BLOCK_MAX: the launcher sizes it to the row).
struct WarpTeam {
    __device__ __forceinline__ static int size() { return 32; }
    __device__ __forceinline__ static int rank() { return threadIdx.x & 31; }
    // rows are dealt out warp by warp over the grid
    __device__ __forceinline__ static long long first_row() {
        return (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    }
    __device__ __forceinline__ static long long row_stride() {
        return (long long)gridDim.x * (blockDim.x >> 5);
    }
    template <bool EveryWarp = true, typename A>
    __device__ __forceinline__ static A allsum(A v, A*) { return warp_sum(v); }
    template <bool EveryWarp = true, typename A>
    __device__ __forceinline__ static void allsum2(A& a, A& b, A*) {
        a = warp_sum(a);
        b = warp_sum(b);
    }
};

struct BlockTeam {
    __device__ __forceinline__ static int size() { return blockDim.x; }
    __device__ __forceinline__ static int rank() { return threadIdx.x; }
    __device__ __forceinline__ static long long first_row() { return blockIdx.x; }
    __device__ __forceinline__ static long long row_stride() { return gridDim.x; }
    template <bool EveryWarp = true, typename A>
    __device__ __forceinline__ static A allsum(A v, A* smem) {
        return block_allsum<EveryWarp>(v, smem);
    }
    template <bool EveryWarp = true, typename A>
    __device__ __forceinline__ static void allsum2(A& a, A& b, A* smem) {
        block_allsum2<EveryWarp>(a, b, smem);
    }
};

// Offset in the row of (thread `rank` of a team of `size`, item k); 32-bit (rows here hold
// <= 1024 * 16 elements). Vector mode: each thread owns runs of V contiguous elements (one
// 16-byte access per run); scalar mode: rank + size * k, coalesced across the team.
template <int V>
__device__ __forceinline__ int team_item(int k, int rank, int size, bool vec) {
    return vec ? (k / V) * size * V + rank * V + (k % V) : k * size + rank;
}

// Parameter index of offset `idx` in the row starting at element `base`.
__device__ __forceinline__ long long row_param(long long base, int idx, bool plain, const IndexMap& map) {
    return plain ? (long long)idx : param_at(map, base + idx);
}

// The values a forward normalizes at position i of a row: x[i], or h[i] = x[i] + res[i] rounded to
// T (and written) where there is a residual; one element, or one 16-byte vector from i.
template <typename T>
__device__ __forceinline__ T input_value(const T* __restrict__ x, const T* __restrict__ res,
                                         T* __restrict__ h, long long i) {
    T v = x[i];
    if (res) {
        v = add_in_dtype(v, res[i]);
        h[i] = v;
    }
    return v;
}

template <typename T>
__device__ __forceinline__ Vec16<T> input_vec16(const T* __restrict__ x, const T* __restrict__ res,
                                                T* __restrict__ h, long long i) {
    Vec16<T> v = load16(x + i);
    if (res) {
        const Vec16<T> r = load16(res + i);
        ANYNORM_UNROLL
        for (int j = 0; j < VecLen<T>::value; ++j) v.v[j] = add_in_dtype(v.v[j], r.v[j]);
        store16(h + i, v);
    }
    return v;
}

// Read the row into v as v - shift (x, or h = x + res with h written); zeros past the end.
template <typename T, int ITEMS>
__device__ __forceinline__ void load_row(acc_t<T> (&v)[ITEMS], const T* __restrict__ x,
                                         const T* __restrict__ res, T* __restrict__ h, int count,
                                         int rank, int size, bool vec, acc_t<T> shift = acc_t<T>(0)) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    if (vec) {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; k += V) {
            const int idx = team_item<V>(k, rank, size, true);
            if (idx < count) {
                const Vec16<T> xv = input_vec16(x, res, h, idx);
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) v[k + j] = vec_acc(xv, j) - shift;
            } else {
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) v[k + j] = A(0);
            }
        }
    } else {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; ++k) {
            const int idx = team_item<V>(k, rank, size, false);
            if (idx < count) {
                v[k] = to_acc(input_value(x, res, h, idx)) - shift;
            } else {
                v[k] = A(0);
            }
        }
    }
}

// Write v (in the accumulation type) to the row of y.
template <typename T, int ITEMS>
__device__ __forceinline__ void store_row(T* __restrict__ y, const acc_t<T> (&v)[ITEMS], int count,
                                          int rank, int size, bool vec) {
    const int V = VecLen<T>::value;
    if (vec) {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; k += V) {
            const int idx = team_item<V>(k, rank, size, true);
            if (idx < count) {
                Vec16<T> out;
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) out.v[j] = from_acc<T>(v[k + j]);
                store16(y + idx, out);
            }
        }
    } else {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; ++k) {
            const int idx = team_item<V>(k, rank, size, false);
            if (idx < count) y[idx] = from_acc<T>(v[k]);
        }
    }
}

// The shift of a row's centred statistics: its first value (x[0], or h[0] = x[0] + res[0]
// rounded to T). For values near it (within a factor 2: a row far from zero) d = v - shift
// is exact in A, so mean(d) and d - mean(d) carry no rounding of the row's offset; the
// rounded mean, v - mean, would carry up to half an ulp of the offset into every output.
template <typename T>
__device__ __forceinline__ acc_t<T> row_shift(const T* __restrict__ x, const T* __restrict__ res) {
    return to_acc(res ? add_in_dtype(x[0], res[0]) : x[0]);
}

// A row a team takes: its index, first element, length (0 for a team past the last row: it
// reads and writes nothing) and whether it is a row at all.
struct TeamRow {
    long long row, base;
    int len;
    bool active;
};

// Row `row` of `rows` rows of `count` elements as a TeamRow.
__device__ __forceinline__ TeamRow team_row(long long row, long long rows, int count) {
    const TeamRow t = {row, row * count, count, row < rows};
    return t;
}

// A thread's ITEMS values added up in order.
template <typename A, int ITEMS> __device__ __forceinline__ A sum_items(const A (&v)[ITEMS]) {
    A s = A(0);
    ANYNORM_UNROLL
    for (int k = 0; k < ITEMS; ++k) s += v[k];
    return s;
}

// A row's statistics where they are wanted (mean/rstd nullable: inference without autograd
// writes y only): mean = shift + mean(d), rstd.
template <typename A>
__device__ __forceinline__ void store_row_stats(A* __restrict__ mean, A* __restrict__ rstd, long long row, A mean_row,
                                                A r) {
    if (rstd) rstd[row] = r;
    if (mean) mean[row] = mean_row;
}

// The forward of a row a team holds as v = x - shift (or h - shift) in registers: two passes
// of d = v - shift (mean(d), then sum((d - mean(d))^2)), the statistics (rank 0), and y = (v -
// mean) * rstd * w + b at the row starting at element `base`. `Stats`: common.cuh's RowStats
// (rows_fwd_warp takes the exact forms, see there).
template <typename T, int ITEMS, typename Team, typename Stats = RowStats<T>>
__device__ __forceinline__ void normalize_row(acc_t<T> (&v)[ITEMS], acc_t<T> shift, T* __restrict__ y,
                                              const Param<T>& w, const Param<T>& b,
                                              acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                                              long long row, long long base, int count, acc_t<T> inv_n,
                                              const IndexMap& map, bool plain, bool vec, int center,
                                              acc_t<T> eps, acc_t<T>* smem) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const int rank = Team::rank();
    const A n = A(count);
    A mu = A(0);
    if (center) mu = Stats::mean(Team::allsum(sum_items(v), smem), n, inv_n);
    A ss = A(0);
    ANYNORM_UNROLL
    for (int k = 0; k < ITEMS; ++k) {
        if (team_item<V>(k, rank, Team::size(), vec) < count) {
            const A d = v[k] - mu;
            ss += d * d;
        }
    }
    const A r = Stats::rstd(Stats::mean(Team::allsum(ss, smem), n, inv_n) + eps);
    if (rank == 0) store_row_stats(mean, rstd, row, shift + mu, r);
    if (y == 0) return;
    if (vec && plain && param_vec_ok(w) && param_vec_ok(b)) {  // w, b in 16-byte vectors too
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; k += V) {
            const int idx = team_item<V>(k, rank, Team::size(), true);
            if (idx < count) {
                A wv[V], bv[V];
                param_vec(w, idx, wv, A(1));
                param_vec(b, idx, bv, A(0));
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) v[k + j] = (v[k + j] - mu) * r * wv[j] + bv[j];
            }
        }
    } else {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; ++k) {
            const int idx = team_item<V>(k, rank, Team::size(), vec);
            if (idx < count) {
                const long long p = row_param(base, idx, plain, map);
                v[k] = (v[k] - mu) * r * weight_at(w, p) + bias_at(b, p);
            }
        }
    }
    store_row<T, ITEMS>(y + base, v, count, rank, Team::size(), vec);
}

// One row of the forward, read and normalized: y = (v - mean) * rstd * w + b, v = x (or h =
// x + res, written).
template <typename T, int ITEMS, typename Team, typename Stats = RowStats<T>>
__device__ __forceinline__ void forward_row(const T* __restrict__ x, const T* __restrict__ res,
                                            T* __restrict__ h, T* __restrict__ y,
                                            const Param<T> w,
                                            const Param<T> b, acc_t<T>* __restrict__ mean,
                                            acc_t<T>* __restrict__ rstd, long long row, int count,
                                            acc_t<T> inv_n, const IndexMap& map, bool plain, int center,
                                            acc_t<T> eps, acc_t<T>* smem) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const long long base = row * count;
    x += base;
    if (res) {
        res += base;
        h += base;
    }
    const bool vec = (ITEMS % V == 0) && (count % V == 0) && aligned16(x) &&
                     (res == 0 || (aligned16(res) && aligned16(h))) && (y == 0 || aligned16(y + base));
    const A shift = center ? row_shift(x, res) : A(0);
    A v[ITEMS];
    load_row<T, ITEMS>(v, x, res, h, count, Team::rank(), Team::size(), vec, shift);
    normalize_row<T, ITEMS, Team, Stats>(v, shift, y, w, b, mean, rstd, row, base, count, inv_n, map, plain,
                                         vec, center, eps, smem);
}

// Where the backward adds up dy * xhat and dy for dweight/dbias: `add` per item, `end_row`
// after each row (every thread of the team calls both). Plain rows (p = position in the row)
// add per position: a thread meets the same positions in every row its team runs.
struct NoRowEnd {
    template <typename Team, typename A> __device__ __forceinline__ void end_row(long long, A*) {}
};

struct NoSums : NoRowEnd {
    template <typename A> __device__ __forceinline__ void add(int, int, A, A) {}
};

// In shared memory, a block team's thread at its own slots (2 * ITEMS * blockDim.x values): no
// register is spent, so the block kernels keep their plain occupancy. Slot s = k * blockDim.x +
// thread of item k, so a warp's 32 threads meet consecutive slots (by position, a vector
// thread's V positions apart, they met 2 of the 32 banks). Interleaved, wb[2s] = sum
// dy * xhat, wb[2s + 1] = sum dy: one 8-byte access, one pointer (on sm_80 a second one made
// ptxas spill at ITEMS=16 under the 64-register bound).
template <typename A> struct SharedSums : NoRowEnd {
    A* wb;
    __device__ __forceinline__ void add(int k, int, A d, A xhat) {
        const int s = k * blockDim.x + threadIdx.x;
        wb[2 * s] += d * xhat;
        wb[2 * s + 1] += d;
    }
};

// Per row, where p is the same all along a row (NCHW instance norm: p = row % C): the team
// adds its threads' sums at the row's end and writes part_w/part_b[row] (part_b nullable).
template <typename A> struct RowSums {
    A* part_w;
    A* part_b;
    A w, b;
    __device__ __forceinline__ void add(int, int, A d, A xhat) {
        w += d * xhat;
        b += d;
    }
    template <typename Team> __device__ __forceinline__ void end_row(long long row, A* smem) {
        Team::template allsum2<false>(w, b, smem);  // by warp 0, as backward_held_row's
        if (Team::rank() == 0) {
            part_w[row] = w;
            if (part_b) part_b[row] = b;
        }
        w = b = A(0);
    }
};

// Whether backward_row reads the weight of plain rows in 16-byte vectors (param_vec): everywhere
// but the 16-bit block kernel with its sums in shared memory at ITEMS=16, which spilled on
// sm_80 under its 64-register bound with them (scalar weight loads there, as before).
template <typename Sums, int ITEMS> struct WeightVec { static const bool value = true; };
template <typename A> struct WeightVec<SharedSums<A>, 16> { static const bool value = false; };

// Whether a launch's rows run on 16-byte vectors: rows are `count` elements apart, so when
// count is whole vectors every row is aligned as the first.
template <typename T, int ITEMS>
__device__ __forceinline__ bool rows_vec(int count, const T* a, const T* b, const T* c) {
    const int V = VecLen<T>::value;
    return (ITEMS % V == 0) && (count % V == 0) && aligned16(a) && aligned16(b) && aligned16(c);
}

// rows_vec for a forward launch: x, res and y (a null pointer counts as aligned), h with res.
template <typename T, int ITEMS>
__device__ __forceinline__ bool rows_fwd_vec(int count, const T* x, const T* res, const T* h, const T* y) {
    return rows_vec<T, ITEMS>(count, x, res, y) && aligned16_or_null(res ? h : 0);
}

// A row's 16-byte vectors (ITEMS / V a thread) of one or two arrays, copied ahead into this
// thread's slots of a stage by cp.async (the copies fly while earlier rows are summed, in no
// register), one commit group a row (an empty one past the last row, so that every thread
// counts the same groups). Slots [a, b][vector k][thread], `stride` (the block's threads)
// apart: (b ? 2 : 1) * ITEMS / V * stride uint4. A thread reads back only the slots it copied
// into, after waiting for its own copies, so no barrier is needed between its copy and its
// read.
template <typename T, int ITEMS>
__device__ __forceinline__ void stage_vectors(uint4* stage, int stride, const T* __restrict__ a,
                                              const T* __restrict__ b, const TeamRow& at, int rank, int size) {
    const int V = VecLen<T>::value, K = ITEMS / V;
    if (at.active) {
        ANYNORM_UNROLL
        for (int k = 0; k < K; ++k) {
            const int idx = team_item<V>(k * V, rank, size, true);
            if (idx < at.len) {
                cp_async16(stage + k * stride + threadIdx.x, a + at.base + idx);
                if (b) cp_async16(stage + (K + k) * stride + threadIdx.x, b + at.base + idx);
            }
        }
    }
    cp_async_commit();
}

// A thread's place in a ring of `depth` slots of `vecs` 16-byte vectors each (stage_vectors'
// layout), through which a kernel reads rows (or groups of rows) ahead: the one it sums is in
// slot at(); before waiting for it (wait(): the depth - 1 after it fly on), the kernel copies
// the one depth - 1 ahead into refill(), the slot it read a row earlier (the barriers since
// have ordered that read).
struct Ring {
    uint4* base;
    int vecs, depth, slot;
    __device__ __forceinline__ uint4* operator[](int s) const { return base + s * vecs; }
    __device__ __forceinline__ uint4* at() const { return (*this)[slot]; }
    __device__ __forceinline__ uint4* refill() const { return (*this)[slot == 0 ? depth - 1 : slot - 1]; }
    __device__ __forceinline__ void wait() const { cp_async_wait_pending(depth - 1); }
    __device__ __forceinline__ void advance() { slot = slot + 1 == depth ? 0 : slot + 1; }
};

// A staged backward row's rstd and first 4 bytes (its first value, the shift, in the low half
// for 16-bit types), copied by cp.async into this thread's places of the 2 x `stride` 32-bit
// words past the first `vecs` 16-byte vectors of `slot`, in the row's commit group: call
// before stage_vectors, read back after the wait (staged_scalars). Loaded at use time instead,
// their L2 latency opened every row: ncu on an H100 put 15% (rows_bwd_block_params) and 21%
// (rows_bwd_multi) of the warps' stall samples on their first use.
template <typename T>
__device__ __forceinline__ void stage_scalars(uint4* slot, int vecs, int stride, const acc_t<T>* __restrict__ rstd,
                                              const T* __restrict__ x, const TeamRow& at) {
    if (!at.active) return;
    unsigned* const words = reinterpret_cast<unsigned*>(slot + vecs);
    cp_async<4>(words + threadIdx.x, rstd + at.row);
    cp_async<4>(words + stride + threadIdx.x, x + at.base);
}

template <typename T>
__device__ __forceinline__ void staged_scalars(const uint4* slot, int vecs, int stride, acc_t<T>& r, T& x0) {
    const unsigned* const words = reinterpret_cast<const unsigned*>(slot + vecs);
    const unsigned rbits = words[threadIdx.x], xbits = words[stride + threadIdx.x];
    memcpy(&r, &rbits, 4);
    memcpy(&x0, &xbits, sizeof(T));
}

// A backward's staged row: x and dy (stage_vectors), with the row's rstd and first value (the
// shift) in registers, for the BwdOneSlot block backwards, one row ahead: they copy the
// following row over a row's slots right after reading them (a thread's copy over its own
// slots follows its read of them in program order).
template <typename T> struct StagedRow {
    acc_t<T> r;
    T x0;
};

template <typename T, int ITEMS>
__device__ __forceinline__ void stage_row(uint4* stage, int stride, StagedRow<T>& s, const T* __restrict__ x,
                                          const T* __restrict__ dy, const acc_t<T>* __restrict__ rstd,
                                          const TeamRow& at, int rank, int size) {
    if (!at.active) return;
    stage_vectors<T, ITEMS>(stage, stride, x, dy, at, rank, size);
    s.r = rstd[at.row];
    s.x0 = x[at.base];
}

// v = (the staged vectors of `slot` as A, or, given `res`, h = slot + the residual's vectors
// after them rounded to T and written to h) - shift; zeros past the row.
template <typename T, int ITEMS>
__device__ __forceinline__ void unstage_row(acc_t<T> (&v)[ITEMS], const uint4* slot, int stride,
                                            const TeamRow& at, int rank, int size, acc_t<T> shift,
                                            const T* __restrict__ res = 0, T* __restrict__ h = 0) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value, K = ITEMS / V;
    ANYNORM_UNROLL
    for (int k = 0; k < K; ++k) {
        const int idx = team_item<V>(k * V, rank, size, true);
        const bool in = idx < at.len;
        // a vector past the row reads as zeros less a zero shift: one select a vector, where a
        // select of every value made the compiler wrap each pair of them in a branch
        uint4 bits = make_uint4(0u, 0u, 0u, 0u);
        if (in) bits = slot[k * stride + threadIdx.x];
        Vec16<T> t;
        memcpy(&t, &bits, 16);
        if (res && in) {
            const uint4 rbits = slot[(K + k) * stride + threadIdx.x];
            Vec16<T> r;
            memcpy(&r, &rbits, 16);
            ANYNORM_UNROLL
            for (int j = 0; j < V; ++j) t.v[j] = add_in_dtype(t.v[j], r.v[j]);
            store16(h + at.base + idx, t);
        }
        const A sh = in ? shift : A(0);
        ANYNORM_UNROLL
        for (int j = 0; j < V; ++j) v[k * V + j] = vec_acc(t, j) - sh;
    }
}

// One row of the backward once its team holds it: xh = x - shift (shift: the row's first
// value where centred) and g = dy, rstd r. dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
// g = dy * w, written at the row starting at element `base`; dy * xhat and dy go to `sums`
// (plain rows only, unless NoSums).
template <typename T, int ITEMS, typename Team, typename Sums>
__device__ __forceinline__ void backward_held_row(acc_t<T> (&xh)[ITEMS], acc_t<T> (&g)[ITEMS], acc_t<T> r,
                                                  const Param<T> w, T* __restrict__ dx, long long base,
                                                  int count, const IndexMap& map, bool plain, bool vec,
                                                  int center, acc_t<T>* smem, Sums& sums) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const int rank = Team::rank();
    // xhat = (d - mean(d)) * rstd, d = x - shift, mean(d) taken again from the row in the
    // registers: x - mean from the saved mean (float32, rounded) would put half an ulp of
    // the row's offset into every xhat, and through mean(g * xhat) into dx (as in the forward).
    A mu = A(0);
    // block sums added by warp 0 (EveryWarp false: block_allsums_by_warp0): fewer instructions
    // a thread than every warp's butterfly over the warps' sums, which also made ptxas spill
    // the 16-bit block kernels at ITEMS=16 on sm_80 with x and dy held
    if (center) mu = Team::template allsum<false>(sum_items(xh), smem) / A(count);
    A sg = A(0), sgx = A(0);
    if (WeightVec<Sums, ITEMS>::value && vec && plain && param_vec_ok(w)) {  // w in 16-byte vectors too
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; k += V) {
            const int idx = team_item<V>(k, rank, Team::size(), true);
            if (idx < count) {
                A wv[V];
                param_vec(w, idx, wv, A(1));
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) {
                    xh[k + j] = (xh[k + j] - mu) * r;
                    sums.add(k + j, idx + j, g[k + j], xh[k + j]);  // g is still dy here
                    g[k + j] *= wv[j];
                    sg += g[k + j];
                    sgx += g[k + j] * xh[k + j];
                }
            }
        }
    } else {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; ++k) {
            const int idx = team_item<V>(k, rank, Team::size(), vec);
            if (idx < count) {
                xh[k] = (xh[k] - mu) * r;
                sums.add(k, idx, g[k], xh[k]);  // g is still dy here
                g[k] *= weight_at(w, row_param(base, idx, plain, map));
                sg += g[k];
                sgx += g[k] * xh[k];
            }
        }
    }
    Team::template allsum2<false>(sg, sgx, smem);  // as the mean's above
    const A n = A(count);
    const A mg = center ? sg / n : A(0);
    const A mgx = sgx / n;
    ANYNORM_UNROLL
    for (int k = 0; k < ITEMS; ++k) g[k] = r * (g[k] - mg - xh[k] * mgx);
    store_row<T, ITEMS>(dx + base, g, count, rank, Team::size(), vec);
}

// One row of the backward, read as it goes (backward_held_row).
template <typename T, int ITEMS, typename Team, typename Sums>
__device__ __forceinline__ void backward_row(const T* __restrict__ dy, const T* __restrict__ x,
                                             const Param<T> w, const acc_t<T>* __restrict__ rstd,
                                             T* __restrict__ dx, long long row, int count,
                                             const IndexMap& map, bool plain, bool vec, int center,
                                             acc_t<T>* smem, Sums& sums) {
    typedef acc_t<T> A;
    const long long base = row * count;
    const A shift = center ? row_shift(x + base, (const T*)0) : A(0);
    A xh[ITEMS], g[ITEMS];
    load_row<T, ITEMS>(xh, x + base, (const T*)0, (T*)0, count, Team::rank(), Team::size(), vec, shift);
    load_row<T, ITEMS>(g, dy + base, (const T*)0, (T*)0, count, Team::rank(), Team::size(), vec);
    backward_held_row<T, ITEMS, Team, Sums>(xh, g, rstd[row], w, dx, base, count, map, plain, vec, center,
                                            smem, sums);
}

// The block backwards' stage: at most BWD_STAGES row slots (_schedule's _BWD_STAGES).
#define BWD_STAGES 4

// A ring of `depth` row slots in shared memory (depth 0, slots null: rows read as they go).
struct Stage {
    uint4* slots;
    int depth;
};

// Whether a block backward keeps one row in flight, copied over the slot it has just read
// (float32 and 16-bit ITEMS=16: two vectors a thread of x and of dy, one row ahead is 64 KiB
// in flight an SM at every block size the launcher takes, and rows_bwd_block_params<16-bit,
// 16>'s dweight sums leave room for no second slot), or a ring of up to BWD_STAGES slots,
// refilled a row after they are read (16-bit ITEMS=8: one vector a thread, one row ahead is
// 32 KiB an SM). With one loop or the other compiled in, not both, ptxas fits them all.
template <typename T, int ITEMS> struct BwdOneSlot {
    static const bool value = !(sizeof(T) == 2 && ITEMS == 8);
};

// Bytes of one slot of the stage the block backward kernels read rows ahead into: a row's x
// and dy, ITEMS / V vectors a thread each, and in a ring (not BwdOneSlot) the row's rstd and
// first value, a 32-bit word each a thread (stage_scalars).
template <typename T, int ITEMS> __device__ __forceinline__ unsigned block_stage_bytes() {
    return 2u * (ITEMS / VecLen<T>::value) * blockDim.x * 16u + (BwdOneSlot<T, ITEMS>::value ? 0u : 8u * blockDim.x);
}

// The stage at byte `offset` of the block's dynamic shared memory: one slot (BwdOneSlot) or as
// many (at most BWD_STAGES) as the launch gave room for (the launcher does for 16-bit and
// float32 rows: _schedule's _block_bwd).
template <typename T, int ITEMS> __device__ __forceinline__ Stage block_stage(unsigned offset) {
    const unsigned room = dynamic_smem_bytes(), bytes = block_stage_bytes<T, ITEMS>();
    int depth = room >= offset + bytes ? 1 : 0;
    if (!BwdOneSlot<T, ITEMS>::value && depth) depth = min(BWD_STAGES, (int)((room - offset) / bytes));
    const Stage s = {depth ? reinterpret_cast<uint4*>(dynamic_shared<unsigned char>() + offset) : (uint4*)0, depth};
    return s;
}

// The row loop of every backward row kernel. `stage` (block teams; none elsewhere): where it
// has slots and the rows are whole 16-byte vectors in 16-bit and float32 types, the block
// keeps rows' x and dy in flight ahead of the one it sums (stage_vectors, a commit group a
// row), as rows_fwd_block does: with depth >= 2 slots the next depth - 1, each copied into the
// slot read a row earlier before the wait (no row's values live then); BwdOneSlot kernels the
// next row, copied over this one right after reading it (a thread's copy over its own slots
// follows its read of them). The ring also carries each row's rstd and first value (the
// shift: stage_scalars; held a row ahead in registers, they made ptxas spill the kernels at
// ITEMS=8); BwdOneSlot kernels hold them a row ahead in registers (StagedRow). Without a stage
// a block waits out the DRAM latency of every row at its sums (one or two blocks of the block
// kernels fit an SM).
template <typename T, int ITEMS, typename Team, typename Sums>
__device__ __forceinline__ void backward_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                              const Param<T> w, const acc_t<T>* __restrict__ rstd,
                                              T* __restrict__ dx, long long rows, int count, long long p_div,
                                              long long p_len, int center, acc_t<T>* smem, Sums& sums,
                                              Stage stage = Stage()) {
    typedef acc_t<T> A;
    const IndexMap& map = block_index_map(count, 1, 1, p_div, p_len);
    const bool plain = (p_div == 1 && p_len == count);
    const bool vec = rows_vec<T, ITEMS>(count, x, dy, dx);
    const bool one = BwdOneSlot<T, ITEMS>::value;
    if (!(stage.slots && (one || stage.depth > 1) && vec && sizeof(T) < 8)) {
        for (long long row = Team::first_row(); row < rows; row += Team::row_stride()) {
            backward_row<T, ITEMS, Team, Sums>(dy, x, w, rstd, dx, row, count, map, plain, vec, center, smem,
                                               sums);
            sums.template end_row<Team>(row, smem);
        }
        return;
    }
    const int K = ITEMS / VecLen<T>::value;
    const int rank = Team::rank(), size = Team::size();
    const long long stride = Team::row_stride();
    long long row = Team::first_row();
    if (one) {  // the next row over the slot just read; its rstd and shift a row ahead in registers
        StagedRow<T> next;
        stage_row<T, ITEMS>(stage.slots, size, next, x, dy, rstd, team_row(row, rows, count), rank, size);
        while (row < rows) {
            const StagedRow<T> now = next;
            const TeamRow at = team_row(row, rows, count);
            cp_async_wait_all();  // this row's copies (the only ones in flight)
            const A shift = center ? to_acc(now.x0) : A(0);
            A xh[ITEMS], g[ITEMS];
            unstage_row<T, ITEMS>(xh, stage.slots, size, at, rank, size, shift);
            unstage_row<T, ITEMS>(g, stage.slots + K * size, size, at, rank, size, A(0));
            stage_row<T, ITEMS>(stage.slots, size, next, x, dy, rstd, team_row(row + stride, rows, count), rank,
                                size);
            backward_held_row<T, ITEMS, Team, Sums>(xh, g, now.r, w, dx, at.base, count, map, plain, true, center,
                                                    smem, sums);
            sums.template end_row<Team>(row, smem);
            row += stride;
        }
        return;
    }
    // a slot: [x, dy][vector][thread], then [rstd, first value][thread] (stage_scalars)
    Ring ring = {stage.slots, 2 * K * size + size / 2, stage.depth, 0};
#pragma unroll 1
    for (int s = 0; s + 1 < ring.depth; ++s) {
        const TeamRow ahead = team_row(row + s * stride, rows, count);
        stage_scalars<T>(ring[s], 2 * K * size, size, rstd, x, ahead);
        stage_vectors<T, ITEMS>(ring[s], size, x, dy, ahead, rank, size);
    }
#pragma unroll 1
    while (row < rows) {
        const TeamRow ahead = team_row(row + (ring.depth - 1) * stride, rows, count);
        stage_scalars<T>(ring.refill(), 2 * K * size, size, rstd, x, ahead);
        stage_vectors<T, ITEMS>(ring.refill(), size, x, dy, ahead, rank, size);
        ring.wait();
        A r;
        T x0;
        staged_scalars<T>(ring.at(), 2 * K * size, size, r, x0);
        const A shift = center ? to_acc(x0) : A(0);
        const TeamRow at = team_row(row, rows, count);
        A xh[ITEMS], g[ITEMS];
        unstage_row<T, ITEMS>(xh, ring.at(), size, at, rank, size, shift);
        unstage_row<T, ITEMS>(g, ring.at() + K * size, size, at, rank, size, A(0));
        backward_held_row<T, ITEMS, Team, Sums>(xh, g, r, w, dx, at.base, count, map, plain, true, center,
                                                smem, sums);
        sums.template end_row<Team>(row, smem);
        ring.advance();
        row += stride;
    }
}

// Short rows: one warp per row, several warps per block, grid-stride over rows. The statistics
// in their exact forms (ExactRowStats): with RowStats' approximations ptxas took 76 registers
// for 16-bit ITEMS=16 (37.5% occupancy at the launcher's 128 threads; 60 with the exact forms),
// and a launch bound of 64 made them spill.
template <typename T, int ITEMS>
__global__ void rows_fwd_warp(
        const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
        const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
        acc_t<T>* __restrict__ rstd, long long rows, long long count, long long p_div,
        long long p_len, int center, double eps, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    const IndexMap& map = block_index_map(count, 1, 1, p_div, p_len);
    const bool plain = (p_div == 1 && p_len == count);
    for (long long row = WarpTeam::first_row(); row < rows; row += WarpTeam::row_stride())
        forward_row<T, ITEMS, WarpTeam, ExactRowStats<T>>(x, res, h, y, w, b, mean, rstd, row, (int)count,
                                                          acc_t<T>(0), map, plain, center, acc_t<T>(eps),
                                                          (acc_t<T>*)0);
}

template <typename T, int ITEMS>
__global__ void rows_bwd_warp(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        long long rows, long long count, long long p_div, long long p_len, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    NoSums none;
    backward_rows<T, ITEMS, WarpTeam>(dy, x, w, rstd, dx, rows, (int)count, p_div, p_len, center,
                                      (acc_t<T>*)0, none);
}

// Rows whose parameter is the same all along the row (p = row % p_len: NCHW instance norm),
// with dweight/dbias partial sums per row: part_w/part_b[row] (part_b nullable), for
// param_grad_finish (nchunk = rows / p_len).
template <typename T, int ITEMS>
__global__ void rows_bwd_warp_row_params(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long rows, long long count,
        long long p_len, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    RowSums<acc_t<T> > sums = {part_w, part_b, acc_t<T>(0), acc_t<T>(0)};
    backward_rows<T, ITEMS, WarpTeam>(dy, x, w, rstd, dx, rows, (int)count, count, p_len, center,
                                      (acc_t<T>*)0, sums);
}

// rows_fwd_block's stage: at most FWD_STAGES row slots, FWD_STAGES - 1 rows in flight ahead
// of the one being summed (_schedule's _FWD_STAGES).
#define FWD_STAGES 4

// Bytes of one slot of rows_fwd_block's stage: a row's vectors of x (and of the residual),
// ITEMS / V a thread.
template <typename T, int ITEMS> __device__ __forceinline__ unsigned fwd_slot_bytes(bool residual) {
    return (residual ? 2u : 1u) * (ITEMS / VecLen<T>::value) * blockDim.x * 16u;
}

// Which rows_fwd_block instantiations stage: 16-bit and float32 ones, but 16-bit ITEMS=8,
// which the launcher never takes (two vectors a thread are ITEMS=16 there) and which spilled
// on sm_90 with both loops compiled in (each alone fits: 45 and 56 registers).
template <typename T, int ITEMS> struct FwdStaged {
    static const bool value = sizeof(T) == 4 || (sizeof(T) == 2 && ITEMS == 16);
};

// Which of this thread's 16-byte vectors (vector k at element (k * size + rank) * V, team_item's
// vector mode) lie in a row of `count` elements: the same for every row of a launch.
template <typename T, int ITEMS>
__device__ __forceinline__ void live_vectors(bool (&live)[ITEMS / VecLen<T>::value], int count, int rank,
                                             int size) {
    const int V = VecLen<T>::value;
    ANYNORM_UNROLL
    for (int k = 0; k < ITEMS / V; ++k) live[k] = team_item<V>(k * V, rank, size, true) < count;
}

// normalize_row for the rows rows_fwd_block stages (16-byte vectors, unstage_row's zeros past
// the row; p = the position in the row where `plain`, else one parameter a vector): the
// variance pass and y skip this thread's vectors past the row by `live` (known before the row
// loop) where normalize_row tests every element's index, and the block sums alternate between
// the two halves of `smem` (64 values; `phase` counts the sums), one barrier a sum
// (block_allsum_open) where block_allsum takes two. `params_vec`: plain rows whose w and b
// take 16-byte loads.
// On an H100 (ncu, 2026-11-26) normalize_row's staged bfloat16 rows issued 41 instructions an
// element, the SM's issue slots 72% busy and the scheduler's warps mostly ready ("not
// selected"): the kernel was bound by what it issued, not by DRAM.
template <typename T, int ITEMS>
__device__ __forceinline__ void normalize_live_row(acc_t<T> (&v)[ITEMS], const bool (&live)[ITEMS / VecLen<T>::value],
                                                   acc_t<T> shift, T* __restrict__ y, const Param<T>& w,
                                                   const Param<T>& b, bool params_vec, acc_t<T>* __restrict__ mean,
                                                   acc_t<T>* __restrict__ rstd, long long row, long long base,
                                                   int count, acc_t<T> inv_n, const IndexMap& map, bool plain,
                                                   int center, acc_t<T> eps, acc_t<T>* smem, int& phase) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value, K = ITEMS / V;
    const int rank = threadIdx.x, size = blockDim.x;
    const A n = A(count);
    A mu = A(0);
    if (center) mu = RowStats<T>::mean(block_allsum_open(sum_items(v), smem + 32 * (phase++ & 1)), n, inv_n);
    A ss = A(0);
    ANYNORM_UNROLL
    for (int k = 0; k < K; ++k) {
        if (live[k]) {
            ANYNORM_UNROLL
            for (int j = 0; j < V; ++j) {
                v[k * V + j] -= mu;  // kept for y: recomputed there, it cost an add an element
                ss += v[k * V + j] * v[k * V + j];
            }
        }
    }
    const A var = RowStats<T>::mean(block_allsum_open(ss, smem + 32 * (phase++ & 1)), n, inv_n);
    const A r = RowStats<T>::rstd(var + eps);
    if (rank == 0) store_row_stats(mean, rstd, row, shift + mu, r);
    if (y == 0) return;
    ANYNORM_UNROLL
    for (int k = 0; k < K; ++k) {
        if (live[k]) {
            const int idx = team_item<V>(k * V, rank, size, true);
            A wv[V], bv[V];
            if (params_vec) {
                param_vec(w, idx, wv, A(1));
                param_vec(b, idx, bv, A(0));
            } else {
                // plain rows: the parameter of each element; the others (rows_fwd_block stages
                // them only where p_div is whole vectors) one parameter a vector
                const long long p = plain ? (long long)idx : param_at(map, base + idx);
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) {
                    wv[j] = weight_at(w, p + (plain ? j : 0));
                    bv[j] = bias_at(b, p + (plain ? j : 0));
                }
            }
            Vec16<T> out;
            ANYNORM_UNROLL
            for (int j = 0; j < V; ++j) out.v[j] = from_acc<T>(v[k * V + j] * r * wv[j] + bv[j]);
            store16(y + base + idx, out);
        }
    }
}

// rows_fwd_block's row loop through its ring of `depth` slots (see rows_fwd_block).
template <typename T, int ITEMS>
__device__ __forceinline__ void staged_fwd_rows(const T* __restrict__ x, const T* __restrict__ res,
                                                T* __restrict__ h, T* __restrict__ y, const Param<T>& w,
                                                const Param<T>& b, acc_t<T>* __restrict__ mean,
                                                acc_t<T>* __restrict__ rstd, long long rows, int n,
                                                acc_t<T> inv_n, const IndexMap& map, bool plain, int center,
                                                acc_t<T> eps, acc_t<T>* smem, int depth, unsigned slot_bytes) {
    typedef acc_t<T> A;
    const int rank = threadIdx.x, size = blockDim.x;
    Ring ring = {dynamic_shared<uint4>(), (int)(slot_bytes / 16u), depth, 0};
    const long long stride = gridDim.x;
    long long row = blockIdx.x;
    bool live[ITEMS / VecLen<T>::value];
    live_vectors<T, ITEMS>(live, n, rank, size);
    const bool params_vec = plain && param_vec_ok(w) && param_vec_ok(b);
    int phase = 0;
#pragma unroll 1
    for (int s = 0; s + 1 < depth; ++s)
        stage_vectors<T, ITEMS>(ring[s], size, x, res, team_row(row + s * stride, rows, n), rank, size);
    T x0 = T(0), r0 = T(0);  // the first values of `row`
    if (center && row < rows) {
        x0 = x[row * n];
        if (res) r0 = res[row * n];
    }
#pragma unroll 1
    while (row < rows) {
        stage_vectors<T, ITEMS>(ring.refill(), size, x, res, team_row(row + (depth - 1) * stride, rows, n), rank,
                                size);
        const A shift = center ? to_acc(res ? add_in_dtype(x0, r0) : x0) : A(0);
        const long long next = row + stride;
        if (center && next < rows) {
            x0 = x[next * n];
            if (res) r0 = res[next * n];
        }
        ring.wait();
        A v[ITEMS];
        unstage_row<T, ITEMS>(v, ring.at(), size, team_row(row, rows, n), rank, size, shift, res, h);
        normalize_live_row<T, ITEMS>(v, live, shift, y, w, b, params_vec, mean, rstd, row, row * n, n, inv_n, map,
                                     plain, center, eps, smem, phase);
        ring.advance();
        row = next;
    }
}

// Whether staged plain rows may take lean_fwd_rows with parameter `q`: none, or 16-byte
// vectors of x's own type T (float32 rows: float32), which a thread then holds in registers
// (K vectors of weight and bias: 8 registers each at K = 2).
template <typename T> __device__ __forceinline__ bool lean_param_ok(const Param<T>& q) {
    return !q.ptr || ((q.in_t || sizeof(T) == sizeof(acc_t<T>)) && aligned16(q.ptr));
}

// Whether staged plain 16-bit rows may take lean_fwd_rows<STASH> with parameter `q`: none, or
// 16-byte aligned in either type; a thread keeps its vectors of them in float32 in shared memory
// (stash_bytes past the ring: ITEMS weights and ITEMS biases of 4 bytes a thread), where they
// would take twice the registers of 16-bit ones.
template <typename T> __device__ __forceinline__ bool stash_param_ok(const Param<T>& q) {
    return !q.ptr || aligned16(q.ptr);
}

template <typename T, int ITEMS> __device__ __forceinline__ unsigned stash_bytes() {
    return 2u * ITEMS * (unsigned)sizeof(acc_t<T>) * blockDim.x;
}

// Which instantiations compile lean_fwd_rows: the staged ones of at most two vectors a thread
// (the weight and bias a thread holds cost 4 registers a vector each; at four float32 vectors
// they would not fit the 64 that ROW_BLOCK_MAX leaves).
template <typename T, int ITEMS> struct FwdLean {
    static const bool value = FwdStaged<T, ITEMS>::value && ITEMS / VecLen<T>::value <= 2;
};

// A row of lean_fwd_rows as stage_vectors and unstage_row take it (team_row without its 64-bit
// product: `base` the row's first element, which the loop advances by its step).
__device__ __forceinline__ TeamRow lean_row(int row, int rows, long long base, int count) {
    const TeamRow t = {row, base, count, row < rows};
    return t;
}

// rows_fwd_block's row loop for plain rows (p = the position in the row): what staged_fwd_rows
// does, with what is the same in every row of a block worked out once. A thread's weight and bias
// vectors are the same in every row it meets, so it loads them once: into registers where they
// pass lean_param_ok (in T: one conversion an element a row), else (STASH: 16-bit rows, float32
// parameters) in float32 into its own words of shared memory past the ring, read back a row at a
// time, where staged_fwd_rows loaded, converted and tested them for every row; its offsets in the row it stages, the row it
// sums and the next row's first value advance by the block's row step instead of being
// recomputed from the row index (64-bit products); eps is converted once. On an H200 (ncu,
// 2026-11-27) staged_fwd_rows issued 33 instructions an element for bfloat16 rows of 4096 (16
// a thread): about 100 a row staged the next row, 30 loaded its first value and 100 loaded
// and converted the parameters, with the SM's issue slots the bound.
template <typename T, int ITEMS, bool STASH>
__device__ __forceinline__ void lean_fwd_rows(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                                              T* __restrict__ y, const Param<T>& w, const Param<T>& b,
                                              acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                                              int rows, int n, acc_t<T> inv_n, int center, acc_t<T> eps,
                                              acc_t<T>* smem, int depth, unsigned slot_bytes) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value, K = ITEMS / V;
    const int rank = threadIdx.x, size = blockDim.x;
    uint4* const ring = dynamic_shared<uint4>();
    const int vecs = (int)(slot_bytes / 16u);
    const int stride = gridDim.x;
    const long long step = (long long)stride * n;
    bool live[K];
    Vec16<T> wq[K], bq[K];
    const T* const wp = static_cast<const T*>(w.ptr);
    const T* const bp = static_cast<const T*>(b.ptr);
    // STASH: this thread's weight and bias in A, 2 * V / VA 16-byte words a vector each, in its
    // own words past the ring ([vector k][word q][thread], read back by this thread alone)
    uint4* const stash = ring + depth * vecs;
    const int VA = VecLen<A>::value, Q = 2 * V / VA;
    ANYNORM_UNROLL
    for (int k = 0; k < K; ++k) {
        const int idx = (k * size + rank) * V;
        live[k] = idx < n;
        if (STASH) {
            A wv[V], bv[V];
            param_vec(w, live[k] ? idx : 0, wv, A(1));
            param_vec(b, live[k] ? idx : 0, bv, A(0));
            ANYNORM_UNROLL
            for (int q = 0; q < Q; ++q) {
                Vec16<A> t;
                ANYNORM_UNROLL
                for (int j = 0; j < VA; ++j) t.v[j] = q < Q / 2 ? wv[q * VA + j] : bv[(q - Q / 2) * VA + j];
                memcpy(&stash[(k * Q + q) * size + rank], &t, 16);
            }
        } else {
            ANYNORM_UNROLL
            for (int j = 0; j < V; ++j) {
                wq[k].v[j] = from_acc<T>(A(1));
                bq[k].v[j] = from_acc<T>(A(0));
            }
            if (live[k] && wp) wq[k] = load16(wp + idx);
            if (live[k] && bp) bq[k] = load16(bp + idx);
        }
    }
    int row = blockIdx.x;
    const int lead = rank * V;
    long long at = (long long)row * n + lead;  // this thread's first element in `row`
    const int lag = (depth - 1) * stride;      // the row staged while `row` is summed: row + lag
    const long long ahead = (long long)lag * n, next = step - lead;  // from `at`: that row's, the next row's first
    uint4* const last = ring + (depth - 1) * vecs;
    uint4* slot = ring;                        // `row`'s slot
    uint4* refill = last;                      // the slot read a row earlier
    int phase = 0;
#pragma unroll 1
    for (int s = 0; s + 1 < depth; ++s)
        stage_vectors<T, ITEMS>(ring + s * vecs, size, x, res, lean_row(row + s * stride, rows, at - lead + s * step, n),
                                rank, size);
    T x0 = T(0), r0 = T(0);  // the first values of `row`
    if (center && row < rows) {
        x0 = x[at - lead];
        if (res) r0 = res[at - lead];
    }
#pragma unroll 1
    while (row < rows) {
        stage_vectors<T, ITEMS>(refill, size, x, res, lean_row(row + lag, rows, at - lead + ahead, n), rank, size);
        const A shift = center ? to_acc(res ? add_in_dtype(x0, r0) : x0) : A(0);
        if (center && row < rows - stride) {
            x0 = x[at + next];
            if (res) r0 = res[at + next];
        }
        cp_async_wait_pending(depth - 1);
        A v[ITEMS];
        unstage_row<T, ITEMS>(v, slot, size, lean_row(row, rows, at - lead, n), rank, size, shift, res, h);
        const A count = A(n);
        A mu = A(0);
        if (center) mu = RowStats<T>::mean(block_allsum_open(sum_items(v), smem + 32 * (phase++ & 1)), count, inv_n);
        A ss = A(0);
        ANYNORM_UNROLL
        for (int k = 0; k < K; ++k) {
            if (live[k]) {
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) {
                    v[k * V + j] -= mu;
                    ss += v[k * V + j] * v[k * V + j];
                }
            }
        }
        const A r = RowStats<T>::rstd(RowStats<T>::mean(block_allsum_open(ss, smem + 32 * (phase++ & 1)), count,
                                                        inv_n) + eps);
        if (rank == 0) store_row_stats(mean, rstd, row, shift + mu, r);
        if (y) {
            ANYNORM_UNROLL
            for (int k = 0; k < K; ++k) {
                if (live[k]) {
                    A wv[V], bv[V];
                    if (STASH) {
                        ANYNORM_UNROLL
                        for (int q = 0; q < Q; ++q) {
                            Vec16<A> t;
                            memcpy(&t, &stash[(k * Q + q) * size + rank], 16);
                            ANYNORM_UNROLL
                            for (int j = 0; j < VA; ++j) (q < Q / 2 ? wv[q * VA + j] : bv[(q - Q / 2) * VA + j]) = t.v[j];
                        }
                    } else {
                        if (sizeof(T) < sizeof(A)) {
                            keep_packed(wq[k]);
                            keep_packed(bq[k]);
                        }
                        ANYNORM_UNROLL
                        for (int j = 0; j < V; ++j) {
                            wv[j] = vec_acc(wq[k], j);
                            bv[j] = vec_acc(bq[k], j);
                        }
                    }
                    Vec16<T> out;
                    ANYNORM_UNROLL
                    for (int j = 0; j < V; ++j) out.v[j] = from_acc<T>(v[k * V + j] * r * wv[j] + bv[j]);
                    store16(y + at + k * size * V, out);
                }
            }
        }
        refill = slot;
        slot = slot == last ? ring : slot + vecs;
        row += stride;
        at += step;
    }
}

// The block-per-row forward of rows read as they go (forward_row), a block a row over the grid:
// rows_fwd_block's and rows_fwd_lean's rows that are not staged.
template <typename T, int ITEMS>
__device__ __forceinline__ void read_fwd_rows(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                                              T* __restrict__ y, const Param<T>& w, const Param<T>& b,
                                              acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                                              long long rows, int n, acc_t<T> inv_n, const IndexMap& map, bool plain,
                                              int center, acc_t<T> eps, acc_t<T>* smem) {
#pragma unroll 1
    for (long long row = BlockTeam::first_row(); row < rows; row += BlockTeam::row_stride())
        forward_row<T, ITEMS, BlockTeam>(x, res, h, y, w, b, mean, rstd, row, n, inv_n, map, plain, center, eps, smem);
}

// Medium rows: one block per row (blockDim.x threads, a power of two up to ROW_BLOCK_MAX),
// grid-stride over rows on a persistent grid (the blocks resident). Where every row is whole
// 16-byte vectors (16-bit and float32 types), each vector of one parameter (plain rows, or
// NCHW rows of HW % V == 0) and the launch gives room for depth >= 2 slots
// of fwd_slot_bytes (the launcher gives up to FWD_STAGES: _schedule's _block_fwd_stage), the
// block keeps its next depth - 1 rows in flight in a ring of slots (stage_vectors): before
// each row it copies the row depth - 1 ahead into the slot it read a row earlier (refilling
// it before the wait, not right after the read, leaves ptxas the registers: right after
// the read the row's values are live and 16-bit ITEMS=16 spilled), then waits for this row's.
// A row's first values (the shift) are loaded a row ahead into registers. Reading one row
// ahead in registers (the kernel before) kept 1-2 vectors a thread in flight, about 32 KiB an
// SM at 50% occupancy: bfloat16 rows of 512-16384 reached 0.46-0.66 of a copy on an H200,
// where Triton's (Liger's), at 100% occupancy and twice the rows in flight, reached 0.59-0.97;
// on an H100 the ring reached 0.78-0.84 with 2 slots (a deeper ring was slower), bound then by
// the instructions it issued (normalize_live_row).
template <typename T, int ITEMS>
__global__ void __launch_bounds__(ROW_BLOCK_MAX, 1) rows_fwd_block(
        const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
        const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
        acc_t<T>* __restrict__ rstd, long long rows, long long count, long long p_div,
        long long p_len, int center, double eps, int param_in_t) {
    typedef acc_t<T> A;
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    __shared__ A smem[64];
    const IndexMap& map = block_index_map(count, 1, 1, p_div, p_len);
    // rows without parameters count as plain whatever their map (p_len 1): nothing is indexed,
    // and they are staged (only where the kernel stages: float64 spilled on sm_80 with it)
    const bool plain = (p_div == 1 && p_len == count) || (FwdStaged<T, ITEMS>::value && !w_arg && !b_arg);
    const int n = (int)count;
    // staged: rows of whole vectors whose parameter is one a vector (plain rows, or segments of
    // whole vectors: NCHW instance and group norm rows of HW % V == 0)
    const bool staged = FwdStaged<T, ITEMS>::value && rows_fwd_vec<T, ITEMS>(n, x, res, h, y) &&
                        (plain || p_div % VecLen<T>::value == 0);
    const unsigned slot_bytes = fwd_slot_bytes<T, ITEMS>(res != 0);
    const int depth = staged ? min(FWD_STAGES, (int)(dynamic_smem_bytes() / slot_bytes)) : 0;
    const A inv_n = A(1) / A(n);  // RowStats' of 16-bit rows, once
    if (depth < 2) {
        read_fwd_rows<T, ITEMS>(x, res, h, y, w, b, mean, rstd, rows, n, inv_n, map, plain, center, A(eps), smem);
        return;
    }
    staged_fwd_rows<T, ITEMS>(x, res, h, y, w, b, mean, rstd, rows, n, inv_n, map, plain, center, A(eps), smem,
                              depth, slot_bytes);
}

// rows_fwd_block for plain rows whose weight and bias are none or x's own type (the launcher's
// choice: _schedule's _lean_rows), by lean_fwd_rows; rows it cannot stage or whose parameters
// turn out misaligned are read as they go (forward_row). A kernel of its own: beside
// staged_fwd_rows in one function, ptxas spilled every path at the 64 registers of the launch
// bound, where lean_fwd_rows and forward_row together fit.
template <typename T, int ITEMS>
__global__ void __launch_bounds__(ROW_BLOCK_MAX, 1) rows_fwd_lean(
        const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
        const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
        acc_t<T>* __restrict__ rstd, long long rows, long long count, long long p_div,
        long long p_len, int center, double eps, int param_in_t) {
    typedef acc_t<T> A;
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    __shared__ A smem[64];
    const IndexMap& map = block_index_map(count, 1, 1, p_div, p_len);
    const bool plain = (p_div == 1 && p_len == count) || (!w_arg && !b_arg);  // as rows_fwd_block's
    const int n = (int)count;
    const unsigned slot_bytes = fwd_slot_bytes<T, ITEMS>(res != 0);
    const A inv_n = A(1) / A(n);
    if (FwdLean<T, ITEMS>::value && plain && rows <= 2147483647LL && rows_fwd_vec<T, ITEMS>(n, x, res, h, y)) {
        // parameters in x's type held in registers; or (16-bit rows, param_in_t's bit 2: the
        // launch gave the room, _schedule's _lean_stash) in float32 in shared memory past the ring
        const unsigned room = dynamic_smem_bytes();
        const bool stash = sizeof(T) < sizeof(A) && ((param_in_t >> 2) & 1);
        if (!stash && lean_param_ok(w) && lean_param_ok(b)) {
            const int depth = min(FWD_STAGES, (int)(room / slot_bytes));
            if (depth >= 2) {
                lean_fwd_rows<T, ITEMS, false>(x, res, h, y, w, b, mean, rstd, (int)rows, n, inv_n, center, A(eps),
                                               smem, depth, slot_bytes);
                return;
            }
        } else if (stash && stash_param_ok(w) && stash_param_ok(b) && room >= stash_bytes<T, ITEMS>()) {
            const int depth = min(FWD_STAGES, (int)((room - stash_bytes<T, ITEMS>()) / slot_bytes));
            if (depth >= 2) {
                lean_fwd_rows<T, ITEMS, true>(x, res, h, y, w, b, mean, rstd, (int)rows, n, inv_n, center, A(eps),
                                              smem, depth, slot_bytes);
                return;
            }
        }
    }
    read_fwd_rows<T, ITEMS>(x, res, h, y, w, b, mean, rstd, rows, n, inv_n, map, plain, center, A(eps), smem);
}

// The part of a row each of the C blocks of a cluster holds: ceil(count / C) rounded up to
// whole 16-byte vectors (every part starts aligned as the row).
template <typename T> __device__ __forceinline__ int cluster_segment(int count, int c) {
    const int V = VecLen<T>::value;
    return ((count + c - 1) / c + V - 1) / V * V;
}

// Sum over the threads that hold a row: the block (C == 1), or the C blocks of a cluster, each
// block's sum through a slot in its shared memory (every block adds the C values in rank order:
// the same bits everywhere). Every thread of every block calls it, counting its calls in
// `phase`: calls alternate between two slots (`slots[0]`, `slots[1]`; pairs for
// span_allsum2), so a block writes a slot again only past the next call's cluster barrier,
// which every block reaches after reading that slot.
template <int C, typename A> __device__ __forceinline__ A span_allsum(A v, A* smem, A* slots, int& phase) {
    v = BlockTeam::allsum(v, smem);
    if (C == 1) return v;
    A* const slot = slots + (phase++ & 1);
    if (threadIdx.x == 0) *slot = v;
    cluster_sync();
    A t = A(0);
    ANYNORM_UNROLL
    for (int r = 0; r < C; ++r) t += cluster_load(slot, r);
    return t;
}

template <int C, typename A>
__device__ __forceinline__ void span_allsum2(A& a, A& b, A* smem, A* slots, int& phase) {
    BlockTeam::allsum2(a, b, smem);
    if (C == 1) return;
    A* const slot = slots + 2 * (phase++ & 1);
    if (threadIdx.x == 0) {
        slot[0] = a;
        slot[1] = b;
    }
    cluster_sync();
    a = b = A(0);
    ANYNORM_UNROLL
    for (int r = 0; r < C; ++r) {
        a += cluster_load(slot, r);
        b += cluster_load(slot + 1, r);
    }
}

// This thread's sum of v[j] - shift over the 16-byte vectors it holds of a part [lo, len)
// in shared memory (vector j = lo + V * (threadIdx.x + k * blockDim.x)).
template <typename T>
__device__ __forceinline__ acc_t<T> held_sum(const T* v, int lo, int len, acc_t<T> shift) {
    const int V = VecLen<T>::value;
    acc_t<T> s = acc_t<T>(0);
    for (int j = lo + threadIdx.x * V; j < len; j += blockDim.x * V) {
        const Vec16<T> a = load16(v + j);
        ANYNORM_UNROLL
        for (int k = 0; k < V; ++k) s += vec_acc(a, k) - shift;
    }
    return s;
}

// Long rows held in shared memory: rows past the register kernels (16384) that fit a block's
// opt-in shared memory (an H100: 113K 16-bit or 56K float32 elements). The row (h = x + res,
// rounded to T as the register kernels do) is read once into dynamic shared memory, in
// 16-byte vectors where aligned (without a residual by cp.async, every vector of a thread in
// flight at once); the two passes of d = v - shift (mean(d), then
// sum((d - mean(d))^2)) and y are taken from there: one read of x, where the split path
// (rows_stats_partial -> rows_stats_finalize -> rows_apply_fwd) reads it twice. The statistics
// passes read back the elements each thread wrote; the y pass of parameter segments that are
// not whole vectors reads others', so a barrier opens every row.
// C > 1: the row spread over a cluster's blocks (rows_fwd_cluster).
// Launch: block (ROW_BLOCK_MAX), grid min(rows, blocks resident), dynamic shared memory
// count * sizeof(T) rounded up to 16 bytes; grid-stride over rows.
template <typename T, int C>
__device__ __forceinline__ void forward_rows_held(
        const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
        const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
        acc_t<T>* __restrict__ rstd, long long rows, long long count, long long p_div,
        long long p_len, int center, double eps, int param_in_t, T* __restrict__ v,
        acc_t<T>* smem, acc_t<T>* slots) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    const IndexMap& map = block_index_map(count, 1, 1, p_div, p_len);
    // parameters by position in the row (or none): w and b read in vectors with the row
    const bool plain = (p_div == 1 && p_len == count) || (!w_arg && !b_arg);
    const int tid = threadIdx.x, threads = blockDim.x;
    // this block's part of every row: [lo, len), v[j - lo] (a whole row where C == 1)
    const int rank = C == 1 ? 0 : cluster_rank();
    const int seg = C == 1 ? (int)count : cluster_segment<T>((int)count, C);
    const int lo = rank * seg, len = min((int)count, lo + seg);
    v -= lo;
    int phase = 0;  // span_allsum's calls
    const A n = A(count);
    for (long long row = blockIdx.x / C; row < rows; row += gridDim.x / C) {
        // the previous row's y pass may read elements other threads load now (its scalar
        // path, for segments of parameters that are not whole vectors)
        __syncthreads();
        const long long base = row * count;
        const T* xr = x + base;
        const T* rr = res ? res + base : (const T*)0;
        T* hr = res ? h + base : (T*)0;
        T* yr = y ? y + base : (T*)0;
        const bool vec = (count % V == 0) && aligned16(xr) && (rr == 0 || (aligned16(rr) && aligned16(hr))) &&
                         (yr == 0 || aligned16(yr));
        const A shift = center ? row_shift(xr, rr) : A(0);
        A s = A(0);
        if (vec && !rr) {  // every vector of the part in flight at once, in no register
            for (int j = lo + tid * V; j < len; j += threads * V) cp_async16(v + j, xr + j);
            cp_async_commit();
            cp_async_wait_all();  // this thread's copies: it reads back only those here
            s = held_sum(v, lo, len, shift);
        } else if (vec) {
            for (int j = lo + tid * V; j < len; j += threads * V) {
                const Vec16<T> a = input_vec16(xr, rr, hr, j);
                store16(v + j, a);
                ANYNORM_UNROLL
                for (int k = 0; k < V; ++k) s += vec_acc(a, k) - shift;
            }
        } else {
            for (int j = lo + tid; j < len; j += threads) {
                const T a = input_value(xr, rr, hr, j);
                v[j] = a;
                s += to_acc(a) - shift;
            }
        }
        const A mu = center ? span_allsum<C>(s, smem, slots, phase) / n : A(0);
        A ss = A(0);
        if (vec) {
            for (int j = lo + tid * V; j < len; j += threads * V) {
                const Vec16<T> a = load16(v + j);
                ANYNORM_UNROLL
                for (int k = 0; k < V; ++k) {
                    const A d = (vec_acc(a, k) - shift) - mu;
                    ss += d * d;
                }
            }
        } else {
            for (int j = lo + tid; j < len; j += threads) {
                const A d = (to_acc(v[j]) - shift) - mu;
                ss += d * d;
            }
        }
        const A r = inv_sqrt(span_allsum<C>(ss, smem, slots, phase) / n + A(eps));
        if (tid == 0 && rank == 0) store_row_stats(mean, rstd, row, shift + mu, r);
        if (yr == 0) continue;
        if (vec && plain && param_vec_ok(w) && param_vec_ok(b)) {  // w, b in 16-byte vectors too
            for (int j = lo + tid * V; j < len; j += threads * V) {
                const Vec16<T> a = load16(v + j);
                A wv[V], bv[V];
                param_vec(w, j, wv, A(1));
                param_vec(b, j, bv, A(0));
                Vec16<T> o;
                ANYNORM_UNROLL
                for (int k = 0; k < V; ++k) o.v[k] = from_acc<T>(((vec_acc(a, k) - shift) - mu) * r * wv[k] + bv[k]);
                store16(yr + j, o);
            }
        } else if (vec && !plain && p_div % V == 0) {  // segments of whole vectors: one p a vector
            for (int j = lo + tid * V; j < len; j += threads * V) {
                const Vec16<T> a = load16(v + j);
                const long long p = param_at(map, base + j);
                const A wk = weight_at(w, p) * r, bk = bias_at(b, p);
                Vec16<T> o;
                ANYNORM_UNROLL
                for (int k = 0; k < V; ++k) o.v[k] = from_acc<T>(((vec_acc(a, k) - shift) - mu) * wk + bk);
                store16(yr + j, o);
            }
        } else {
            for (int j = lo + tid; j < len; j += threads) {
                const long long p = plain ? (long long)j : param_at(map, base + j);
                yr[j] = from_acc<T>(((to_acc(v[j]) - shift) - mu) * r * weight_at(w, p) + bias_at(b, p));
            }
        }
    }
    // no block leaves while another may still read its slots
    if (C > 1) cluster_sync();
}

template <typename T>
__global__ void __launch_bounds__(ROW_BLOCK_MAX, 1) rows_fwd_smem(
        const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
        const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
        acc_t<T>* __restrict__ rstd, long long rows, long long count, long long p_div,
        long long p_len, int center, double eps, int param_in_t) {
    __shared__ acc_t<T> smem[64];
    forward_rows_held<T, 1>(x, res, h, y, w_arg, b_arg, mean, rstd, rows, count, p_div, p_len, center, eps,
                            param_in_t, dynamic_shared<T>(), smem, (acc_t<T>*)0);
}

// Rows longer than one block's shared memory holds (sm_90): held by a cluster of C blocks
// (C = ITEMS in {2, 4, 8}), block `rank` elements [rank * seg, (rank + 1) * seg) of each row
// (cluster_segment), the statistics added up across the cluster through distributed shared
// memory (span_allsum): x still read once. Launch: block as rows_fwd_smem, grid a multiple
// of C (C blocks a row, grid-stride over rows by clusters); dynamic smem round16(seg *
// sizeof(T)) + 72 A (the block sums and the cluster slots: all of a cluster kernel's shared
// memory is dynamic).
template <typename T, int C>
__global__ void ANYNORM_CLUSTER(C) __launch_bounds__(ROW_BLOCK_MAX, 1) rows_fwd_cluster(
        const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
        const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
        acc_t<T>* __restrict__ rstd, long long rows, long long count, long long p_div,
        long long p_len, int center, double eps, int param_in_t) {
    typedef acc_t<T> A;
    T* const v = dynamic_shared<T>();
    const int held = (cluster_segment<T>((int)count, C) * (int)sizeof(T) + 15) / 16 * 16;
    A* const smem = reinterpret_cast<A*>(reinterpret_cast<unsigned char*>(v) + held);
    forward_rows_held<T, C>(x, res, h, y, w_arg, b_arg, mean, rstd, rows, count, p_div, p_len, center, eps,
                            param_in_t, v, smem, smem + 64);
}

// The backward of rows held in shared memory (rows_fwd_smem's rows, and float32 rows past the
// register backward's 8192): x and dy read once into dynamic shared memory (two arrays of
// count * sizeof(T), each rounded up to 16 bytes), then as backward_row: mean(d) of
// d = x - x[0] again (xhat about the exact mean), sum(g) and sum(g * xhat) with g = dy * w,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)). 3 transfers of x's size where the split
// path (rows_grad_partial -> rows_grad_finalize -> apply_bwd) moves 5. Every pass runs on the
// elements its thread loaded (16-byte vectors where the row, dy, dx and the parameter pattern
// allow, else element by element).
// With part_w (nullable; part_b nullable too), rows of whole parameter segments (NCHW group
// norm: C/G segments of p_div = HW; instance norm: one, p_div = count; the caller checks
// count % p_div == 0) also give their dweight/dbias partials while the row is in shared memory:
// part_w[row * per_row + s] = sum over segment s of dy * xhat, part_b[...] = sum of dy
// (per_row = count / p_div; the layout of segment_grad_finalize's, so param_grad_finish adds
// them over the batch as it does those), xhat as for dx with mu's own rounding taken out of
// the sums (below). That pass replaces the sum(g), sum(g * xhat) pass: g's weight is one per
// segment, so sum(g) = sum_s w_s * sum_s(dy), likewise g * xhat. Scheme:
// warps take whole segments rather than the block reducing each segment in turn (a barrier
// pair per segment, up to hundreds a row): warp u sums piece u % ways of segment u / ways (lanes
// striding the segment by `ways` warps), ways = nwarps / per_row warps a segment where the row has
// fewer segments than warps (instance norm: the whole block on its one segment; Stable
// Diffusion's 10 segments on 32 warps: 3 each), else ways = 1 and each warp takes segments
// nwarps apart and writes them out itself. Pieces meet in static smem (seg_sums, at most one
// a warp), read after the block sum's barrier and added in piece order: no extra barrier, no
// atomics, a fixed order (deterministic).
// Launch: as rows_fwd_smem, dynamic smem 2 * round16(count * sizeof(T)).
template <typename T, int C>
__device__ __forceinline__ void backward_rows_held(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long rows, long long count,
        long long p_div, long long p_len, int center, int param_in_t, T* __restrict__ xs,
        acc_t<T>* smem, acc_t<T>* seg_sums, acc_t<T>* slots) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const Param<T> w = {w_arg, param_in_t & 1};
    const int tid = threadIdx.x, threads = blockDim.x;
    // this block's part of every row: [lo, len), xs[j - lo] and gs[j - lo] (C == 1: the row)
    const int rank = C == 1 ? 0 : cluster_rank();
    const int part = C == 1 ? (int)count : cluster_segment<T>((int)count, C);
    const int lo = rank * part, len = min((int)count, lo + part);
    T* const gs = xs + ((part + V - 1) / V) * V - lo;  // dy, from the next 16-byte boundary
    xs -= lo;
    int phase = 0;  // span_allsum's calls
    const IndexMap& map = block_index_map(count, 1, 1, p_div, p_len);
    const bool plain = (p_div == 1 && p_len == count) || !w_arg;
    const A n = A(count);
    for (long long row = blockIdx.x / C; row < rows; row += gridDim.x / C) {
        __syncthreads();  // the previous row's last pass is done with the arrays
        const long long base = row * count;
        const T* xr = x + base;
        const T* dyr = dy + base;
        T* dxr = dx + base;
        // segment sums walk segments in vectors: whole vectors a segment then
        const bool vec = (count % V == 0) && aligned16(xr) && aligned16(dyr) && aligned16(dxr) &&
                         (plain && !part_w ? param_vec_ok(w) : p_div % V == 0);
        const A shift = center ? row_shift(xr, (const T*)0) : A(0);
        const A r = rstd[row];
        A s = A(0);
        if (vec) {  // every vector of the part in flight at once, in no register
            for (int j = lo + tid * V; j < len; j += threads * V) {
                cp_async16(xs + j, xr + j);
                cp_async16(gs + j, dyr + j);
            }
            cp_async_commit();
            cp_async_wait_all();  // this thread's copies: it reads back only those here
            s = held_sum(xs, lo, len, shift);
        } else {
            for (int j = lo + tid; j < len; j += threads) {
                const T a = xr[j];
                xs[j] = a;
                gs[j] = dyr[j];
                s += to_acc(a) - shift;
            }
        }
        s = center ? span_allsum<C>(s, smem, slots, phase) : A(0);  // sum(d)
        if (!center && C == 1 && part_w) __syncthreads();  // segment sums read others' vectors
        const A mu = s / n;
        A sg = A(0), sgx = A(0);
        // per segment: sum(dy), sum(dy * xhat); the weighted ones into sg, sgx. Sizes made
        // here, not kept live through the row's passes (the dx pass has no registers to spare)
        // (the sums per segment are C == 1's: a cluster's launches give no part_w)
        const int seg = (int)p_div, per_row = C == 1 && part_w ? len / seg : 0, nwarps = threads >> 5;
        const int ways = per_row && per_row < nwarps ? nwarps / per_row : 1;  // warps a segment
        if (C == 1 && part_w) {
            const int lane = tid & 31;
            // mu's rounding, sum(d) / n - mu (exact by the fma): dweight's sums are about
            // sum(d) / n. Near an offset mu is rounded to A at the size of the row's offset from
            // x[0], and that times rstd * sum(dy) would stay in each (float32 instance norm at
            // 1e6: 4.4e-4 of a dweight of 110, 1.8e-4 with it); dx's sums stay about mu, as its pass
            const A lo_r = fma(-n, mu, s) / n * r;
            for (int u = tid >> 5; u < per_row * ways; u += nwarps) {
                const int sgm = u / ways, first = sgm * seg, end = first + seg;
                A sd = A(0), sdx = A(0);
                if (vec) {
                    for (int j = first + ((u - sgm * ways) * 32 + lane) * V; j < end; j += ways * 32 * V) {
                        const Vec16<T> a = load16(xs + j), d = load16(gs + j);
                        ANYNORM_UNROLL
                        for (int q = 0; q < V; ++q) {
                            const A dv = vec_acc(d, q);
                            sd += dv;
                            sdx += dv * (((vec_acc(a, q) - shift) - mu) * r);
                        }
                    }
                } else {
                    for (int j = first + (u - sgm * ways) * 32 + lane; j < end; j += ways * 32) {
                        const A dv = to_acc(gs[j]);
                        sd += dv;
                        sdx += dv * (((to_acc(xs[j]) - shift) - mu) * r);
                    }
                }
                sd = warp_sum(sd);
                sdx = warp_sum(sdx);
                if (lane == 0) {
                    const A wk = weight_at(w, param_at(map, base + first));
                    sg += wk * sd;
                    sgx += wk * sdx;
                    if (ways == 1) {
                        part_w[row * per_row + sgm] = sdx - lo_r * sd;
                        if (part_b) part_b[row * per_row + sgm] = sd;
                    } else {
                        seg_sums[u] = sdx - lo_r * sd;
                        seg_sums[32 + u] = sd;
                    }
                }
            }
        } else if (vec) {
            for (int j = lo + tid * V; j < len; j += threads * V) {
                const Vec16<T> a = load16(xs + j), d = load16(gs + j);
                A wv[V];
                if (plain) {
                    param_vec(w, j, wv, A(1));
                } else {
                    const A wk = weight_at(w, param_at(map, base + j));
                    ANYNORM_UNROLL
                    for (int k = 0; k < V; ++k) wv[k] = wk;
                }
                ANYNORM_UNROLL
                for (int k = 0; k < V; ++k) {
                    const A g = vec_acc(d, k) * wv[k];
                    sg += g;
                    sgx += g * (((vec_acc(a, k) - shift) - mu) * r);
                }
            }
        } else {
            for (int j = lo + tid; j < len; j += threads) {
                const A g = to_acc(gs[j]) * weight_at(w, plain ? (long long)j : param_at(map, base + j));
                sg += g;
                sgx += g * (((to_acc(xs[j]) - shift) - mu) * r);
            }
        }
        span_allsum2<C>(sg, sgx, smem, slots + 2, phase);  // its barrier: seg_sums are written
        if (ways > 1 && tid < per_row) {  // a segment's pieces, in order
            A sdx = seg_sums[tid * ways], sd = seg_sums[32 + tid * ways];
            for (int q = 1; q < ways; ++q) {
                sdx += seg_sums[tid * ways + q];
                sd += seg_sums[32 + tid * ways + q];
            }
            part_w[row * per_row + tid] = sdx;
            if (part_b) part_b[row * per_row + tid] = sd;
        }
        const A mg = center ? sg / n : A(0);
        const A mgx = sgx / n;
        if (vec && plain) {
            for (int j = lo + tid * V; j < len; j += threads * V) {
                const Vec16<T> a = load16(xs + j), d = load16(gs + j);
                A wv[V];
                param_vec(w, j, wv, A(1));
                Vec16<T> o;
                ANYNORM_UNROLL
                for (int k = 0; k < V; ++k) {
                    const A xh = ((vec_acc(a, k) - shift) - mu) * r;
                    o.v[k] = from_acc<T>(r * (vec_acc(d, k) * wv[k] - mg - xh * mgx));
                }
                store16_global(dxr + j, o);
            }
        } else if (vec) {  // segments of whole vectors: one parameter a vector
            for (int j = lo + tid * V; j < len; j += threads * V) {
                const Vec16<T> a = load16(xs + j), d = load16(gs + j);
                const A wk = weight_at(w, param_at(map, base + j));
                Vec16<T> o;
                ANYNORM_UNROLL
                for (int k = 0; k < V; ++k) {
                    const A xh = ((vec_acc(a, k) - shift) - mu) * r;
                    o.v[k] = from_acc<T>(r * (vec_acc(d, k) * wk - mg - xh * mgx));
                }
                store16_global(dxr + j, o);
            }
        } else {
            for (int j = lo + tid; j < len; j += threads) {
                const A g = to_acc(gs[j]) * weight_at(w, plain ? (long long)j : param_at(map, base + j));
                const A xh = ((to_acc(xs[j]) - shift) - mu) * r;
                dxr[j] = from_acc<T>(r * (g - mg - xh * mgx));
            }
        }
    }
    // no block leaves while another may still read its slots
    if (C > 1) cluster_sync();
}

template <typename T>
__global__ void __launch_bounds__(ROW_BLOCK_MAX, 1) rows_bwd_smem(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long rows, long long count,
        long long p_div, long long p_len, int center, int param_in_t) {
    __shared__ acc_t<T> smem[64];
    __shared__ acc_t<T> seg_sums[64];  // per piece u of a segment: [u] sum(dy * xhat), [32 + u] sum(dy)
    backward_rows_held<T, 1>(dy, x, w_arg, mean, rstd, dx, part_w, part_b, rows, count, p_div, p_len, center,
                             param_in_t, dynamic_shared<T>(), smem, seg_sums, (acc_t<T>*)0);
}

// The backward of rows_fwd_cluster's rows: as rows_bwd_smem (dx only: dweight/dbias by
// param_grad_cols/rows), each of C blocks of a cluster holding its part of x and dy, the
// sums (mean(d); sum(g), sum(g * xhat)) added up across the cluster (span_allsum). Launch as
// rows_fwd_cluster; dynamic smem 2 * round16(seg * sizeof(T)) + 72 A (the parts, the block
// sums, the cluster slots: 2 for mean(d), 2 pairs for the two sums).
template <typename T, int C>
__global__ void ANYNORM_CLUSTER(C) __launch_bounds__(ROW_BLOCK_MAX, 1) rows_bwd_cluster(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        long long rows, long long count, long long p_div, long long p_len, int center, int param_in_t) {
    typedef acc_t<T> A;
    T* const xs = dynamic_shared<T>();
    const int held = (cluster_segment<T>((int)count, C) * (int)sizeof(T) + 15) / 16 * 16;
    A* const smem = reinterpret_cast<A*>(reinterpret_cast<unsigned char*>(xs) + 2 * held);
    backward_rows_held<T, C>(dy, x, w_arg, mean, rstd, dx, (A*)0, (A*)0, rows, count, p_div, p_len, center,
                             param_in_t, xs, smem, (A*)0, smem + 64);
}

// Short rows, several per block (plain rows, p = position in the row, or no parameters):
// teams of `size` threads, the smallest power of two that holds the row at ITEMS per thread,
// MULTI_BLOCK / size rows at a time per block, grid-stride over those groups of rows. A thread
// meets the same positions in every row its team takes, so it loads its weight and bias once
// (16-byte vectors where the row is) and keeps them in registers for all its rows. The launch
// bound caps ptxas at 64 registers: 4 blocks, 32 warps per SM (50%).
#define MULTI_BLOCK 256

// A thread's place in the multi-row kernels: its team of `size` threads (the smallest power of
// two that holds a row at ITEMS values a thread), its rank there, and the row its team takes
// in each group of `teams` rows. Every thread of the block runs every group (the team sums
// meet at barriers); a team past the last row gets len 0 at base 0: it reads and writes
// nothing.
template <int ITEMS> struct MultiTeam {
    int size, rank, teams, team;
    __device__ __forceinline__ explicit MultiTeam(int n) {
        const int need = (n + ITEMS - 1) / ITEMS;
        size = 1;
        while (size < need) size <<= 1;
        rank = threadIdx.x & (size - 1);
        teams = blockDim.x / size;
        team = threadIdx.x / size;
    }
    __device__ __forceinline__ long long groups(long long rows) const { return (rows + teams - 1) / teams; }
    __device__ __forceinline__ TeamRow row_in(long long g, long long rows, int n) const {
        TeamRow t;
        t.row = g * teams + team;
        t.active = t.row < rows;
        t.len = t.active ? n : 0;
        t.base = t.active ? t.row * n : 0;
        return t;
    }
};

// The W interleaved sums of the warps' values s[W * k + j] (k < PER warps of a team, j < W) in
// out[j], added in warp order: one or two 16-byte shared loads (8 bytes for two floats) where
// a loop over PER took a load each behind a generic unrolled loop's setup and branches. s is
// aligned to its W * PER values (the team's first warp is a multiple of PER; smem 16-byte
// aligned).
template <int PER, int W, typename A>
__device__ __forceinline__ void sum_team_warps(const A* s, A (&out)[W]) {
    const int N = PER * W;
    struct alignas(N * sizeof(A) < 16 ? N * sizeof(A) : 16) Run { A v[N]; };
    const Run t = *reinterpret_cast<const Run*>(s);
    ANYNORM_UNROLL
    for (int j = 0; j < W; ++j) {
        A acc = t.v[j];
        ANYNORM_UNROLL
        for (int k = 1; k < PER; ++k) acc += t.v[k * W + j];
        out[j] = acc;
    }
}

// Sums of W values over the team of `size` threads (a power of two, at most MULTI_BLOCK) that
// holds threads [t * size, (t + 1) * size), returned to all of them. Every thread of the block
// must call it with the same size: a full warp's butterfly takes no branch (teams of 32 or
// more, every row of 256 16-bit elements or more); teams wider than a warp then meet in
// `smem` (W * blockDim.x / 32 values of A, 16-byte aligned, between two barriers).
template <int W, typename A>
__device__ __forceinline__ void team_sums(A (&v)[W], int size, A* smem) {
    if (size >= 32) {
        ANYNORM_UNROLL
        for (int j = 0; j < W; ++j) v[j] = warp_sum(v[j]);
    } else {
        ANYNORM_UNROLL  // the warp's lanes all take or skip each step (size is the block's)
        for (int off = 16; off > 0; off >>= 1) {
            if (off < size) {
                ANYNORM_UNROLL
                for (int j = 0; j < W; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], off);
            }
        }
    }
    if (size > 32) {
        const int warp = threadIdx.x >> 5, per = size >> 5;
        if ((threadIdx.x & 31) == 0) {
            ANYNORM_UNROLL
            for (int j = 0; j < W; ++j) smem[W * warp + j] = v[j];
        }
        __syncthreads();
        const A* first = smem + W * (warp & ~(per - 1));
        if (per == 2) sum_team_warps<2, W>(first, v);
        else if (per == 4) sum_team_warps<4, W>(first, v);
        else sum_team_warps<8, W>(first, v);  // MULTI_BLOCK / 32
        __syncthreads();
    }
}

template <typename A>
__device__ __forceinline__ A team_sum(A v, int size, A* smem) {
    A t[1] = {v};
    team_sums<1>(t, size, smem);
    return t[0];
}

template <typename A>
__device__ __forceinline__ void team_sum2(A& a, A& b, int size, A* smem) {
    A t[2] = {a, b};
    team_sums<2>(t, size, smem);
    a = t[0];
    b = t[1];
}

// One parameter (w, or b: `none` where absent) at the positions a thread of a multi-row team
// meets in every row (16-byte vectors where `vec` and the parameter allow), `none` past the row.
template <typename T, int ITEMS>
__device__ __forceinline__ void team_param(acc_t<T> (&out)[ITEMS], const Param<T>& q, acc_t<T> none,
                                           int n, int rank, int size, bool vec) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    if (vec && param_vec_ok(q)) {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; k += V) {
            const int idx = team_item<V>(k, rank, size, true);
            A t[V];
            if (idx < n) {
                param_vec(q, idx, t, none);
            } else {
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j) t[j] = none;
            }
            ANYNORM_UNROLL
            for (int j = 0; j < V; ++j) out[k + j] = t[j];
        }
    } else {
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; ++k) {
            const int idx = team_item<V>(k, rank, size, vec);
            out[k] = idx < n ? param_value(q, idx, none) : none;
        }
    }
}

template <typename T, int ITEMS>
__global__ void __launch_bounds__(MULTI_BLOCK, 4) rows_fwd_multi(
        const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h, T* __restrict__ y,
        const void* __restrict__ w_arg, const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean,
        acc_t<T>* __restrict__ rstd, long long rows, long long count, int center, double eps,
        int param_in_t) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    __shared__ __align__(16) A smem[MULTI_BLOCK / 32];
    const int n = (int)count;
    const MultiTeam<ITEMS> mt(n);
    const int size = mt.size, rank = mt.rank;
    const bool vec = rows_fwd_vec<T, ITEMS>(n, x, res, h, y);
    // this thread's weights and biases, for every row it takes
    A wv[ITEMS], bv[ITEMS];
    team_param<T, ITEMS>(wv, w, A(1), n, rank, size, vec);
    team_param<T, ITEMS>(bv, b, A(0), n, rank, size, vec);
    const A fn = A(n), inv_n = A(1) / fn, e = A(eps);  // inv_n: RowStats' of 16-bit rows
    const long long groups = mt.groups(rows);
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        const TeamRow at = mt.row_in(g, rows, n);
        const long long row = at.row, base = at.base;
        const bool active = at.active;
        const int len = at.len;
        const T* xr = x + base;
        const T* rr = res ? res + base : res;
        T* hr = res ? h + base : h;
        const A shift = center && active ? row_shift(xr, rr) : A(0);
        A v[ITEMS];
        load_row<T, ITEMS>(v, xr, rr, hr, len, rank, size, vec, shift);
        A mu = A(0);
        if (center) mu = RowStats<T>::mean(team_sum(sum_items(v), size, smem), fn, inv_n);
        A ss = A(0);
        if (vec && ITEMS == V) {  // one vector a thread (MULTI_ITEMS): in the row or not as a whole
            ANYNORM_UNROLL
            for (int k = 0; k < ITEMS; ++k) {
                v[k] -= mu;  // kept for y (as normalize_live_row)
                ss += v[k] * v[k];
            }
            if (team_item<V>(0, rank, size, true) >= len) ss = A(0);  // its zeros would add mu^2
        } else {
            ANYNORM_UNROLL
            for (int k = 0; k < ITEMS; ++k) {
                v[k] -= mu;  // past the row too: never stored
                if (team_item<V>(k, rank, size, vec) < len) ss += v[k] * v[k];
            }
        }
        const A r = RowStats<T>::rstd(RowStats<T>::mean(team_sum(ss, size, smem), fn, inv_n) + e);
        if (active && rank == 0) store_row_stats(mean, rstd, row, shift + mu, r);
        if (y) {
            ANYNORM_UNROLL
            for (int k = 0; k < ITEMS; ++k) v[k] = v[k] * r * wv[k] + bv[k];
            store_row<T, ITEMS>(y + base, v, len, rank, size, vec);
        }
    }
}

// The backward of rows_fwd_multi's rows (plain, or without parameters), as backward_row with
// teams of `size` threads: each thread's weight loaded once, and its dweight/dbias partial
// sums (dy * xhat, dy) kept in registers for every row it takes. At the end the block's
// teams (each over the same positions) add theirs up in shared memory in team order, and the
// block writes part_w/part_b[blockIdx.x * count + p] (part_b nullable; part_w null: dx only)
// for param_grad_finish (nchunk = gridDim.x): deterministic, no atomics. Launch as
// rows_fwd_multi; the grid is persistent (about the resident blocks) so the partial rows
// stay few. Resident blocks per SM (the launch bound): 16-bit types 3 (80 registers, 24 warps,
// 37.5%: at 64 their 3 x 8 values a thread of x, dy, w and 2 x 8 sums spill), the others 4
// (64 registers, 50%). Where the launch gives dynamic shared memory for depth >= 2 slots of
// 2 * MULTI_BLOCK 16-byte vectors (the launcher gives up to BWD_STAGES: _schedule's
// _multi_bwd_stage) and the rows are whole vectors (16-bit, float32), a thread copies its
// vectors of x and dy of the group depth - 1 ahead into the slot it read a group earlier
// (cp.async, as backward_rows' ring), so that depth - 1 groups are in flight while it sums one:
// one group ahead (the kernel before) kept 24 KiB an SM in flight in 16-bit types.
template <typename T> struct MultiBwdBlocks { static const int value = sizeof(T) == 2 ? 3 : 4; };

template <typename T, int ITEMS>
__global__ void __launch_bounds__(MULTI_BLOCK, MultiBwdBlocks<T>::value) rows_bwd_multi(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long rows, long long count,
        int center, int param_in_t) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const Param<T> w = {w_arg, param_in_t & 1};
    __shared__ __align__(16) A smem[2 * MULTI_BLOCK / 32];
    __shared__ A sums[2 * ITEMS * MULTI_BLOCK];  // [2][ITEMS][thread]: the teams' sums at the end
    const int n = (int)count;
    const MultiTeam<ITEMS> mt(n);
    const int size = mt.size, rank = mt.rank;
    const bool vec = rows_vec<T, ITEMS>(n, x, dy, dx);
    // the ring: [slot][x, dy][thread], then [rstd, first value][thread] (stage_scalars); one
    // vector of x and of dy a thread (float64, not tuned, would spill its 64 registers)
    Ring ring = {dynamic_shared<uint4>(), 2 * MULTI_BLOCK + MULTI_BLOCK / 2, 0, 0};
    ring.depth = min(BWD_STAGES, (int)(dynamic_smem_bytes() / (16u * ring.vecs)));
    const bool ahead = vec && ITEMS == V && sizeof(T) < 8 && ring.depth >= 2;
    const long long groups = mt.groups(rows);
    if (ahead) {
#pragma unroll 1
        for (int s = 0; s + 1 < ring.depth; ++s) {
            const TeamRow ahead = mt.row_in(blockIdx.x + (long long)s * gridDim.x, rows, n);
            stage_scalars<T>(ring[s], 2 * MULTI_BLOCK, MULTI_BLOCK, rstd, x, ahead);
            stage_vectors<T, ITEMS>(ring[s], MULTI_BLOCK, x, dy, ahead, rank, size);
        }
    }
    A wv[ITEMS], sw[ITEMS], sb[ITEMS];
    team_param<T, ITEMS>(wv, w, A(1), n, rank, size, vec);
    ANYNORM_UNROLL
    for (int k = 0; k < ITEMS; ++k) sw[k] = sb[k] = A(0);
    const A fn = A(n), inv_n = A(1) / fn;  // inv_n: RowStats' of 16-bit rows
    for (long long grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        const TeamRow at = mt.row_in(grp, rows, n);
        const long long row = at.row, base = at.base;
        const bool active = at.active;
        const int len = at.len;
        A xh[ITEMS], g[ITEMS];
        A shift = A(0), r = A(0);
        if (ahead) {
            // the group depth - 1 ahead into the slot this thread read a group ago (its own
            // slots: its copy follows its read of them)
            const TeamRow ahead = mt.row_in(grp + (long long)(ring.depth - 1) * gridDim.x, rows, n);
            stage_scalars<T>(ring.refill(), 2 * MULTI_BLOCK, MULTI_BLOCK, rstd, x, ahead);
            stage_vectors<T, ITEMS>(ring.refill(), MULTI_BLOCK, x, dy, ahead, rank, size);
            ring.wait();
            if (active) {
                T x0;
                staged_scalars<T>(ring.at(), 2 * MULTI_BLOCK, MULTI_BLOCK, r, x0);
                if (center) shift = to_acc(x0);
            }
            unstage_row<T, ITEMS>(xh, ring.at(), MULTI_BLOCK, at, rank, size, shift);
            unstage_row<T, ITEMS>(g, ring.at() + MULTI_BLOCK, MULTI_BLOCK, at, rank, size, A(0));
            ring.advance();
        } else {
            const T* xr = x + base;
            if (active) {
                r = rstd[row];
                if (center) shift = row_shift(xr, (const T*)0);
            }
            load_row<T, ITEMS>(xh, xr, (const T*)0, (T*)0, len, rank, size, vec, shift);
            load_row<T, ITEMS>(g, dy + base, (const T*)0, (T*)0, len, rank, size, vec);
        }
        // xhat about the row's exact mean, as backward_row: mean(d) of d = x - shift again
        A mu = A(0);
        if (center) mu = RowStats<T>::mean(team_sum(sum_items(xh), size, smem), fn, inv_n);
        A sg = A(0), sgx = A(0);
        // one vector a thread (MULTI_ITEMS): no bounds per item, as past the row its dy is zero
        // and so is every term it adds (past the row nothing it holds is written)
        const bool whole = vec && ITEMS == V;
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; ++k) {
            if (whole || team_item<V>(k, rank, size, vec) < len) {
                xh[k] = (xh[k] - mu) * r;
                sw[k] += g[k] * xh[k];  // g is still dy here
                sb[k] += g[k];
                g[k] *= wv[k];
                sg += g[k];
                sgx += g[k] * xh[k];
            }
        }
        team_sum2(sg, sgx, size, smem);
        const A mg = center ? RowStats<T>::mean(sg, fn, inv_n) : A(0);
        const A mgx = RowStats<T>::mean(sgx, fn, inv_n);
        ANYNORM_UNROLL
        for (int k = 0; k < ITEMS; ++k) g[k] = r * (g[k] - mg - xh[k] * mgx);
        store_row<T, ITEMS>(dx + base, g, len, rank, size, vec);
    }
    if (part_w == 0) return;
    ANYNORM_UNROLL
    for (int k = 0; k < ITEMS; ++k) {
        sums[k * MULTI_BLOCK + threadIdx.x] = sw[k];
        sums[(ITEMS + k) * MULTI_BLOCK + threadIdx.x] = sb[k];
    }
    __syncthreads();
    // slot s = (item k, rank q) of a team: every position of the row is one slot's
    const long long out = (long long)blockIdx.x * count;
    for (int s = threadIdx.x; s < size * ITEMS; s += blockDim.x) {
        const int k = s / size, q = s - k * size;
        const int idx = team_item<V>(k, q, size, vec);
        if (idx < n) {
            A tw = A(0), tb = A(0);
            for (int t = 0; t < mt.teams; ++t) {
                tw += sums[k * MULTI_BLOCK + t * size + q];
                tb += sums[(ITEMS + k) * MULTI_BLOCK + t * size + q];
            }
            part_w[out + idx] = tw;
            if (part_b) part_b[out + idx] = tb;
        }
    }
}

// Whether rows_bwd_block (`Sums` NoSums) and rows_bwd_block_row_params read rows ahead where the
// launch gives them room: not at ITEMS=16 in 16-bit types, nor rows_bwd_block in float32 before
// sm_90, where the staged loop spilled under the 64-register bound (rows_bwd_block_params, its
// sums in shared memory, does everywhere). The launcher gives the room regardless: unused, it
// costs no occupancy (a block of 1024 threads, or two of 512, fill an SM's registers first).
template <typename Sums> struct IsNoSums { static const bool value = false; };
template <> struct IsNoSums<NoSums> { static const bool value = true; };
template <typename T, int ITEMS, typename Sums> struct BlockAhead {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static const bool before_sm90_f32 = sizeof(T) == 4 && IsNoSums<Sums>::value;
#else
    static const bool before_sm90_f32 = false;
#endif
    static const bool value = !(sizeof(T) == 2 && ITEMS == 16) && !before_sm90_f32;
};

template <typename T, int ITEMS>
__global__ void __launch_bounds__(BwdBlockMax<T>::value, 1) rows_bwd_block(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        long long rows, long long count, long long p_div, long long p_len, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    __shared__ acc_t<T> smem[66];  // block_allsums_by_warp0
    NoSums none;
    backward_rows<T, ITEMS, BlockTeam>(dy, x, w, rstd, dx, rows, (int)count, p_div, p_len, center, smem, none,
                                       BlockAhead<T, ITEMS, NoSums>::value ? block_stage<T, ITEMS>(0) : Stage());
}

// As rows_bwd_warp_row_params, one block per row.
template <typename T, int ITEMS>
__global__ void __launch_bounds__(BwdBlockMax<T>::value, 1) rows_bwd_block_row_params(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long rows, long long count,
        long long p_len, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    __shared__ acc_t<T> smem[66];  // block_allsums_by_warp0
    RowSums<acc_t<T> > sums = {part_w, part_b, acc_t<T>(0), acc_t<T>(0)};
    backward_rows<T, ITEMS, BlockTeam>(dy, x, w, rstd, dx, rows, (int)count, count, p_len, center, smem, sums,
                                       BlockAhead<T, ITEMS, RowSums<acc_t<T> > >::value ? block_stage<T, ITEMS>(0) : Stage());
}

// Whether rows_bwd_block_params reads rows ahead: not float32 at ITEMS=16, whose stage (128 KiB
// past 128 KiB of sums) no SM holds; compiled out there, ptxas fits it in 64 registers.
template <typename T, int ITEMS> struct ParamsAhead {
    static const bool value = !(sizeof(T) == 4 && ITEMS == 16);
};

// Plain rows (layer/RMS norm over trailing axes) past rows_bwd_multi's, one block per row, with
// dweight/dbias partial sums on the way: they wait in dynamic shared memory (2 * count values
// of A), then the block writes part_w/part_b[blockIdx.x * count + p] (part_b nullable) for
// param_grad_finish.
template <typename T, int ITEMS>
__global__ void __launch_bounds__(BwdBlockMax<T>::value, 1) rows_bwd_block_params(
        const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
        const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
        acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b, long long rows, long long count,
        int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    __shared__ A smem[66];  // block_allsums_by_warp0
    const int n = (int)count;
    SharedSums<A> sums;
    sums.wb = dynamic_shared<A>();
    const int slots = ITEMS * blockDim.x;
    for (int i = threadIdx.x; i < 2 * slots; i += blockDim.x) sums.wb[i] = A(0);
    __syncthreads();
    backward_rows<T, ITEMS, BlockTeam>(dy, x, w, rstd, dx, rows, n, 1, count, center, smem, sums,
                                       ParamsAhead<T, ITEMS>::value ? block_stage<T, ITEMS>(2 * slots * sizeof(A))
                                                                   : Stage());
    __syncthreads();
    // slot s = (item k, thread t) holds position team_item(k, t): each position is one slot's
    const bool vec = rows_vec<T, ITEMS>(n, x, dy, dx);
    const long long base = (long long)blockIdx.x * count;
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const int k = s / blockDim.x, t = s - k * blockDim.x;
        const int idx = team_item<VecLen<T>::value>(k, t, blockDim.x, vec);
        if (idx < n) {
            part_w[base + idx] = sums.wb[2 * s];
            if (part_b) part_b[base + idx] = sums.wb[2 * s + 1];
        }
    }
}

// Welford state of d = v - shift over row[c*chunk : (c+1)*chunk] for block (c, row), shift
// the row's first value (row_shift; rows_stats_finalize adds it back); h = x + res written once.
template <typename T>
__global__ void rows_stats_partial(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                                   acc_t<T>* __restrict__ ws_n, acc_t<T>* __restrict__ ws_mean,
                                   acc_t<T>* __restrict__ ws_m2, long long rows, long long count,
                                   long long chunk) {
    typedef acc_t<T> A;
    __shared__ A smem[96];
    const int V = VecLen<T>::value;
    const long long nchunk = gridDim.x;
    const long long start = (long long)blockIdx.x * chunk;
    const long long end = start + chunk < count ? start + chunk : count;
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long base = row * count + start;
        const long long len = end - start;
        const bool vec = aligned16(x + base) && aligned16_or_null(res ? res + base : 0) &&
                         aligned16_or_null(res ? h + base : 0);
        const long long vlen = vec ? (len / V) * V : 0;
        const A shift = row_shift(x + row * count, res ? res + row * count : res);
        Welford<A> s = welford_empty<A>();
        for (long long j = (long long)threadIdx.x * V; j < vlen; j += (long long)blockDim.x * V) {
            const Vec16<T> xv = input_vec16(x, res, h, base + j);
            for (int q = 0; q < V; ++q) welford_push(s, vec_acc(xv, q) - shift);
        }
        for (long long j = vlen + threadIdx.x; j < len; j += blockDim.x) {
            welford_push(s, to_acc(input_value(x, res, h, base + j)) - shift);
        }
        s = block_welford(s, smem);
        if (threadIdx.x == 0) {
            const long long k = row * nchunk + blockIdx.x;
            ws_n[k] = s.n;
            ws_mean[k] = s.mean;
            ws_m2[k] = s.m2;
        }
    }
}

// sum(g) and sum(g * xhat) over row[c*chunk : (c+1)*chunk] for block (c, row), xhat from
// the saved mean, (x - mean) * rstd; ws_d (nullable) takes sum(x - mean), from which
// rows_grad_finalize finds the saved mean's rounding (x - mean is exact near the mean). Row
// `row` uses the statistics of slice row / stats_div (1; or, for the rows of segments that
// NCHW group norm's backward sums, the segments per slice).
template <typename T>
__global__ void rows_grad_partial(const T* __restrict__ dy, const T* __restrict__ x,
                                  const void* __restrict__ w_arg, const acc_t<T>* __restrict__ mean,
                                  const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ ws_g,
                                  acc_t<T>* __restrict__ ws_gx, acc_t<T>* __restrict__ ws_d,
                                  long long rows, long long count,
                                  long long chunk, long long p_div, long long p_len,
                                  long long stats_div, int center, int param_in_t) {
    const Param<T> w = {w_arg, param_in_t & 1};
    typedef acc_t<T> A;
    __shared__ A smem[64];
    const IndexMap map = block_index_map(count, 1, 1, p_div, p_len);
    const int V = VecLen<T>::value;
    const long long nchunk = gridDim.x;
    const long long start = (long long)blockIdx.x * chunk;
    const long long end = start + chunk < count ? start + chunk : count;
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long base = row * count + start;
        const long long len = end - start;
        const long long s = stats_div == 1 ? row : row / stats_div;  // once per row, not per element
        const A mu = center ? mean[s] : A(0);
        const A r = rstd[s];
        const bool vec = aligned16(x + base) && aligned16(dy + base);
        const long long vlen = vec ? (len / V) * V : 0;
        A sg = A(0), sgx = A(0), sd = A(0);
        for (long long j = (long long)threadIdx.x * V; j < vlen; j += (long long)blockDim.x * V) {
            const Vec16<T> xv = load16(x + base + j);
            const Vec16<T> dv = load16(dy + base + j);
            for (int q = 0; q < V; ++q) {
                const A g = vec_acc(dv, q) * weight_at(w, param_at(map, base + j + q));
                const A d = vec_acc(xv, q) - mu;
                sg += g;
                sgx += g * d * r;
                sd += d;
            }
        }
        for (long long j = vlen + threadIdx.x; j < len; j += blockDim.x) {
            const A g = to_acc(dy[base + j]) * weight_at(w, param_at(map, base + j));
            const A d = to_acc(x[base + j]) - mu;
            sg += g;
            sgx += g * d * r;
            sd += d;
        }
        block_allsum2(sg, sgx, smem);
        if (ws_d) sd = block_allsum(sd, smem);  // uniform over the block
        if (threadIdx.x == 0) {
            const long long k = row * nchunk + blockIdx.x;
            ws_g[k] = sg;
            ws_gx[k] = sgx;
            if (ws_d) ws_d[k] = sd;
        }
    }
}

