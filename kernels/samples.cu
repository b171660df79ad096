// Columns (inner > 1) of small inner extent, a sample held across a thread-block cluster (sm_90).
//
// ConvNeXt's last stage normalizes 64 x 768 x 7 x 7 over the 768 channels at each of 49
// positions: a sample's (reduced, inner) block is 37632 contiguous elements, its rows 98 bytes
// apart. The tile kernels (tiles.cu) cut it into columns a few elements wide, each row of a
// tile a 2-byte-aligned piece of 8 or 16 bytes read element by element, and pay a tile's
// reductions for every few columns. Here a cluster of C blocks holds the whole sample instead:
// block k copies rows [k * part, (k + 1) * part) as one flat range (16-byte cp.async where the
// samples are whole vectors), sums its rows of every column, and the blocks add their columns'
// sums from each other's shared memory in rank order (the same bits in every block). x is read
// once and y written once, in whole vectors, and the C x outer blocks fill the GPU (64 samples
// x 8 blocks: 4 an SM on an H100).
//
// Layout (outer, reduced, inner), dense; one statistic per (o, i) (group 1); the parameter per
// column (p = (i / p_div) % p_len: NHWC instance norm) or per row (p = r:
// channels-first layer norm). Block of SAMPLE_THREADS: thread t owns column c = t % inner and
// the part's rows g, g + lanes, ... (g = t / inner, lanes = SAMPLE_THREADS / inner; inner <=
// SAMPLE_THREADS). The launcher takes these where the device has clusters and inner <= 64
// (_schedule._sample_cluster).
#include "common.cuh"

using namespace anynorm;

#define SAMPLE_THREADS 256
// Blocks an SM must hold by registers: 4 (64 registers a thread, 50% occupancy), float64 2
// (at 64 its backward spilled) (_schedule: _SAMPLE_BLOCKS_PER_SM).
#define SAMPLE_MIN_BLOCKS(T) (sizeof(T) == 8 ? 2 : 4)
// The adds over the cluster's blocks stay rolled (a chain in rank order either way): unrolled,
// their 2 x C remote loads in flight made ptxas spill the backward at 64 registers.
#ifdef ANYNORM_CUDA_EMU
#define SAMPLE_ROLLED
#else
#define SAMPLE_ROLLED _Pragma("unroll 1")
#endif
// Compiled for an architecture without clusters the kernels are a trap (the launcher never
// takes them there; their bodies, whose cluster calls trap, made ptxas spill on sm_80).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900 && !defined(ANYNORM_CUDA_EMU)
#define SAMPLE_CLUSTERS 0
#else
#define SAMPLE_CLUSTERS 1
#endif

// A block's part of a sample: its rows [r0, r0 + nrows), the flat range [lo, lo + len) of the
// sample's elements, and the thread's place in it.
struct SamplePart {
    int r0, nrows;  // 32-bit: a part fits in shared memory
    int inner, c, g, lanes;
    bool active;  // a thread of some column (t < lanes * inner)
    __device__ __forceinline__ int lo() const { return r0 * inner; }
    __device__ __forceinline__ int len() const { return nrows * inner; }
};

// Rows a part holds: ceil(reduced / C), rounded up to whole 16-byte vectors of elements
// (parts start aligned where the sample does). The launcher sizes shared memory by the same
// rule (_schedule.sample_part_rows).
template <typename T, int C> __device__ __forceinline__ int sample_part_rows(int reduced, int inner) {
    int align = 1;
    while ((align * inner * (int)sizeof(T)) % 16) align <<= 1;
    return ((reduced + C - 1) / C + align - 1) / align * align;
}

template <typename T, int C> __device__ __forceinline__ SamplePart sample_part(int reduced, int inner) {
    SamplePart p;
    const int rows = sample_part_rows<T, C>(reduced, inner);
    const int rank = cluster_rank();
    p.r0 = min(reduced, rank * rows);
    p.nrows = min(reduced, p.r0 + rows) - p.r0;
    p.inner = inner;
    p.lanes = SAMPLE_THREADS / inner;
    p.c = threadIdx.x % inner;
    p.g = threadIdx.x / inner;
    p.active = p.g < p.lanes;
    return p;
}

// Copy the part of the sample starting at element `base` of `src` into `dst` (16-byte
// cp.async where `vec`; the caller waits and syncs).
template <typename T>
__device__ __forceinline__ void load_part(T* dst, const T* __restrict__ src, long long base, const SamplePart& p,
                                          bool vec) {
    const int V = VecLen<T>::value;
    if (vec) {
        for (int f = threadIdx.x * V; f < p.len(); f += SAMPLE_THREADS * V) cp_async16(dst + f, src + base + p.lo() + f);
        cp_async_commit();
    } else {
        for (int f = threadIdx.x; f < p.len(); f += SAMPLE_THREADS) dst[f] = src[base + p.lo() + f];
    }
}

// The cluster's totals of two per-column sums: each thread's sums over its rows (a, b),
// added up over the block's lanes, then over the C blocks' partials from a slot (2 * inner
// values of A in each block's shared memory) in rank order, into out_a/out_b[c] of every
// block. Every thread of every block calls it, counting its calls in `phase`: calls
// alternate between two slots, so a block writes a slot again only past the next call's
// cluster barrier, which every block reaches after reading that slot (as rows.cu's
// span_allsum).
template <int C, typename A>
__device__ __forceinline__ void cluster_column_sums(A a, A b, const SamplePart& p, A* red, A* slots, int& phase,
                                                    A* out_a, A* out_b) {
    const int t = threadIdx.x, inner = p.inner;
    A* const slot = slots + (phase++ & 1) * 2 * inner;
    if (p.active) {
        red[p.g * inner + p.c] = a;
        red[(p.lanes + p.g) * inner + p.c] = b;
    }
    __syncthreads();
    if (t < inner) {
        A ta = A(0), tb = A(0);
        for (int g = 0; g < p.lanes; ++g) {
            ta += red[g * inner + t];
            tb += red[(p.lanes + g) * inner + t];
        }
        slot[t] = ta;
        slot[inner + t] = tb;
    }
    cluster_sync();
    if (t < inner) {
        A sa = A(0), sb = A(0);
        SAMPLE_ROLLED
        for (int k = 0; k < C; ++k) {
            sa += cluster_load(slot + t, k);
            sb += cluster_load(slot + inner + t, k);
        }
        out_a[t] = sa;
        out_b[t] = sb;
    }
    __syncthreads();
}

// Bytes of a part of `nrows` rows in T, rounded up to 16.
template <typename T> __device__ __forceinline__ int part_bytes(int nrows, int inner) {
    return (nrows * inner * (int)sizeof(T) + 15) / 16 * 16;
}

// The A arrays of a block past its parts (dynamic smem, _schedule.sample_smem mirrors it):
// per column the shift, four statistics (m, rs, ka, kb: forward c and rstd; backward mu,
// rstd, mean(g), mean(g * xhat)) and the cluster's totals of two sums; the block's parameters
// (npar: inner per column, the part's rows per row); the lanes' partials (2 x SAMPLE_THREADS)
// and two cluster slots (2 x 2 x inner).
template <typename A> struct SampleSmem {
    A* at;  // one pointer, the arrays at offsets from it (eleven kept apart spilled)
    int inner, npar;
    __device__ __forceinline__ SampleSmem(unsigned char* base, int inner_, int npar_)
        : at(reinterpret_cast<A*>(base)), inner(inner_), npar(npar_) {}
    __device__ __forceinline__ A* shift() const { return at; }
    __device__ __forceinline__ A* m() const { return at + inner; }
    __device__ __forceinline__ A* rs() const { return at + 2 * inner; }
    __device__ __forceinline__ A* ka() const { return at + 3 * inner; }
    __device__ __forceinline__ A* kb() const { return at + 4 * inner; }
    __device__ __forceinline__ A* tot_a() const { return at + 5 * inner; }
    __device__ __forceinline__ A* tot_b() const { return at + 6 * inner; }
    __device__ __forceinline__ A* pw() const { return at + 7 * inner; }
    __device__ __forceinline__ A* pb() const { return at + 7 * inner + npar; }
    __device__ __forceinline__ A* red() const { return at + 7 * inner + 2 * npar; }
    __device__ __forceinline__ A* slots() const { return at + 7 * inner + 2 * npar + 2 * SAMPLE_THREADS; }
};

// Whether the samples move in 16-byte vectors: every sample starts aligned as the buffers.
template <typename T>
__device__ __forceinline__ bool sample_vec(long long reduced, long long inner, const T* a, const T* b, const T* c) {
    return (reduced * inner * (long long)sizeof(T)) % 16 == 0 && aligned16_or_null(a) && aligned16_or_null(b) &&
           aligned16_or_null(c);
}

// The block's weights and biases, once: per column (p = (i / p_div) % p_len) or per row of its
// part (p = r0 + r).
template <typename T>
__device__ __forceinline__ void load_part_params(SampleSmem<acc_t<T> >& s, const Param<T>& w, const Param<T>& b,
                                                 const SamplePart& p, bool per_col, long long p_div,
                                                 long long p_len) {
    const int npar = per_col ? p.inner : p.nrows;
    for (int k = threadIdx.x; k < npar; k += SAMPLE_THREADS) {
        const long long q = per_col ? (k / p_div) % p_len : p.r0 + k;
        s.pw()[k] = weight_at(w, q);
        s.pb()[k] = bias_at(b, q);
    }
}

// Element (r, c) of the part for its flat offset f (from the part's start).
struct PartAt {
    int r, c;
    __device__ __forceinline__ PartAt(int f, int inner) : r(f / inner), c(f - (f / inner) * inner) {}
    __device__ __forceinline__ void next(int inner) {
        if (++c == inner) {
            c = 0;
            ++r;
        }
    }
};

// Sample o's part (x, and dy where given) into shared memory, the columns' shifts beside it
// (x[o, 0, i]; 0 without center), and the cluster's mean of x - shift in the thread's column
// (0 without center): the first statistic of both kernels.
template <typename T, int C>
__device__ __forceinline__ acc_t<T> load_sample(T* xs, T* gs, const T* __restrict__ x, const T* __restrict__ dy,
                                                long long base, const SamplePart& p, bool vec, int center,
                                                acc_t<T> n, const SampleSmem<acc_t<T> >& s, int& phase) {
    typedef acc_t<T> A;
    const int I = p.inner;
    load_part(xs, x, base, p, vec);
    if (dy) load_part(gs, dy, base, p, vec);
    if (threadIdx.x < I) s.shift()[threadIdx.x] = center ? to_acc(x[base + threadIdx.x]) : A(0);
    cp_async_wait_all();
    __syncthreads();
    if (!center) return A(0);
    const A shift = s.shift()[p.c];
    A a = A(0);
    if (p.active)
        for (int r = p.g; r < p.nrows; r += p.lanes) a += to_acc(xs[r * I + p.c]) - shift;
    cluster_column_sums<C>(a, A(0), p, s.red(), s.slots(), phase, s.tot_a(), s.tot_b());
    return s.tot_a()[p.c] / n;
}

// y = ((x - shift) - c) * rstd * w + b, mean = shift + c: the forward of clusters of C blocks
// over samples o = cluster, + clusters, ... (grid.x = C x clusters). Statistics as tiles.cu's
// cols_fwd_tile: shift = x[o, 0, i], c1 = mean(x - shift), d = (x - shift) - c1, c2 = mean(d),
// var = mean(d^2) - c2^2, c = c1 + c2 (RMS: shift = c = 0); mean/rstd[o * inner + i]
// (nullable) from rank 0; y nullable. Dynamic smem: the part (part_bytes), then SampleSmem
// (11 * inner + 2 * npar + 2 * SAMPLE_THREADS values of A).
template <typename T, int C>
__global__ void ANYNORM_CLUSTER(C) __launch_bounds__(SAMPLE_THREADS, SAMPLE_MIN_BLOCKS(T))
cols_fwd_cluster(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ w_arg,
                 const void* __restrict__ b_arg, acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                 long long outer, long long reduced, long long inner, long long p_div, long long p_len,
                 int center, double eps, int param_in_t) {
#if SAMPLE_CLUSTERS
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> b = {b_arg, (param_in_t >> 1) & 1};
    const int R = (int)reduced, I = (int)inner, rows = sample_part_rows<T, C>(R, I);
    const SamplePart p = sample_part<T, C>(R, I);
    const bool per_col = inner % (p_div * p_len) == 0;  // else p = r
    T* xs = dynamic_shared<T>();
    SampleSmem<A> s(dynamic_shared<unsigned char>() + part_bytes<T>(rows, I), I, per_col ? I : rows);
    load_part_params(s, w, b, p, per_col, p_div, p_len);
    const bool vec = sample_vec(reduced, inner, x, y, (const T*)0);
    const A n = A(R);
    int phase = 0;  // cluster_column_sums' calls
    for (long long o = blockIdx.x / C; o < outer; o += gridDim.x / C) {
        const long long base = o * reduced * inner;
        const A c1 = load_sample<T, C>(xs, (T*)0, x, (const T*)0, base, p, vec, center, n, s, phase);
        const A shift = s.shift()[p.c];
        A sd = A(0), ss = A(0);
        if (p.active)
            for (int r = p.g; r < p.nrows; r += p.lanes) {
                const A d = (to_acc(xs[r * I + p.c]) - shift) - c1;
                sd += d;
                ss += d * d;
            }
        cluster_column_sums<C>(sd, ss, p, s.red(), s.slots(), phase, s.tot_a(), s.tot_b());
        if (threadIdx.x < I) {  // thread t < inner: column t (g = 0)
            const A c2 = center ? s.tot_a()[p.c] / n : A(0);
            const A var = s.tot_b()[p.c] / n - c2 * c2;
            const A rs = inv_sqrt((var < A(0) ? A(0) : var) + A(eps));
            s.m()[p.c] = c1 + c2;
            s.rs()[p.c] = rs;
            if (cluster_rank() == 0) {
                if (rstd) rstd[o * inner + p.c] = rs;
                if (mean) mean[o * inner + p.c] = shift + (c1 + c2);
            }
        }
        __syncthreads();
        if (y && vec) {
            for (int f = threadIdx.x * V; f < p.len(); f += SAMPLE_THREADS * V) {
                const Vec16<T> v = load16(xs + f);
                PartAt at(f, I);
                Vec16<T> out;
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j, at.next(I)) {
                    const int q = per_col ? at.c : at.r;
                    out.v[j] = from_acc<T>(((vec_acc(v, j) - s.shift()[at.c]) - s.m()[at.c]) * s.rs()[at.c] * s.pw()[q] +
                                           s.pb()[q]);
                }
                store16_global(y + base + p.lo() + f, out);
            }
        } else if (y) {
            for (int f = threadIdx.x; f < p.len(); f += SAMPLE_THREADS) {
                const PartAt at(f, I);
                const int q = per_col ? at.c : at.r;
                y[base + p.lo() + f] = from_acc<T>(((to_acc(xs[f]) - s.shift()[at.c]) - s.m()[at.c]) * s.rs()[at.c] * s.pw()[q] +
                                                 s.pb()[q]);
            }
        }
        __syncthreads();  // the part and the columns' statistics are refilled for the next sample
    }
    cluster_sync();  // no block leaves while another may still read its slots
#else
    __trap();
#endif
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w, xhat = ((x - shift) - mu) *
// rstd with rstd saved and mu = mean(x - shift) taken again from the sample (as rows.cu's
// backward_row: x - the saved, rounded mean would carry its rounding into every xhat). The
// dweight/dbias partials (part_w nullable: dx only; part_b nullable) per sample: p = i at
// part[o * inner + i] (rank 0), p = r at part[o * reduced + r] (each block its rows), for
// param_grad_finish (nchunk = outer). Launch as cols_fwd_cluster; dynamic smem: the x part,
// the dy part, then SampleSmem.
template <typename T, int C>
__global__ void ANYNORM_CLUSTER(C) __launch_bounds__(SAMPLE_THREADS, SAMPLE_MIN_BLOCKS(T))
cols_bwd_cluster(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w_arg,
                 const acc_t<T>* __restrict__ rstd, T* __restrict__ dx, acc_t<T>* __restrict__ part_w,
                 acc_t<T>* __restrict__ part_b, long long outer, long long reduced, long long inner,
                 long long p_div, long long p_len, int center, int param_in_t) {
#if SAMPLE_CLUSTERS
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const Param<T> w = {w_arg, param_in_t & 1};
    const Param<T> none = {0, 0};
    const int R = (int)reduced, I = (int)inner, rows = sample_part_rows<T, C>(R, I);
    const SamplePart p = sample_part<T, C>(R, I);
    const bool per_col = inner % (p_div * p_len) == 0;  // else p = r
    T* xs = dynamic_shared<T>();
    T* gs = xs + part_bytes<T>(rows, I) / (int)sizeof(T);
    SampleSmem<A> s(dynamic_shared<unsigned char>() + 2 * part_bytes<T>(rows, I), I, per_col ? I : rows);
    load_part_params(s, w, none, p, per_col, p_div, p_len);
    const bool vec = sample_vec(reduced, inner, x, dy, dx);
    const A n = A(R);
    int phase = 0;  // cluster_column_sums' calls
    for (long long o = blockIdx.x / C; o < outer; o += gridDim.x / C) {
        const long long base = o * reduced * inner;
        const A mu = load_sample<T, C>(xs, gs, x, dy, base, p, vec, center, n, s, phase);
        const A shift = s.shift()[p.c];
        const A rs = rstd[o * inner + p.c];
        // per column: sum(g), sum(g * xhat); with p = i the weight is the column's, applied
        // after the sums, which are then also its dweight/dbias partials
        A sa = A(0), sb = A(0);
        if (p.active)
            for (int r = p.g; r < p.nrows; r += p.lanes) {
                const A g = to_acc(gs[r * I + p.c]) * (per_col ? A(1) : s.pw()[r]);
                sa += g;
                sb += g * (((to_acc(xs[r * I + p.c]) - shift) - mu) * rs);
            }
        cluster_column_sums<C>(sa, sb, p, s.red(), s.slots(), phase, s.tot_a(), s.tot_b());
        if (threadIdx.x < I) {  // thread t < inner: column t
            const A wc = per_col ? s.pw()[p.c] : A(1);
            s.m()[p.c] = mu;
            s.rs()[p.c] = rs;
            s.ka()[p.c] = center ? wc * s.tot_a()[p.c] / n : A(0);  // mean(g)
            s.kb()[p.c] = wc * s.tot_b()[p.c] / n;                  // mean(g * xhat)
            if (per_col && part_w && cluster_rank() == 0) {
                part_w[o * inner + p.c] = s.tot_b()[p.c];
                if (part_b) part_b[o * inner + p.c] = s.tot_a()[p.c];
            }
        }
        __syncthreads();
        if (!per_col && part_w) {  // the part's rows: sum over the columns of dy * xhat, dy
            for (int r = threadIdx.x; r < p.nrows; r += SAMPLE_THREADS) {
                A tw = A(0), tb = A(0);
                for (int c = 0; c < I; ++c) {
                    const A d = to_acc(gs[r * I + c]);
                    tw += d * (((to_acc(xs[r * I + c]) - s.shift()[c]) - s.m()[c]) * s.rs()[c]);
                    tb += d;
                }
                part_w[o * reduced + p.r0 + r] = tw;
                if (part_b) part_b[o * reduced + p.r0 + r] = tb;
            }
        }
        if (vec) {
            for (int f = threadIdx.x * V; f < p.len(); f += SAMPLE_THREADS * V) {
                const Vec16<T> xv = load16(xs + f), dv = load16(gs + f);
                PartAt at(f, I);
                Vec16<T> out;
                ANYNORM_UNROLL
                for (int j = 0; j < V; ++j, at.next(I)) {
                    const A xh = ((vec_acc(xv, j) - s.shift()[at.c]) - s.m()[at.c]) * s.rs()[at.c];
                    const A g = vec_acc(dv, j) * s.pw()[per_col ? at.c : at.r];
                    out.v[j] = from_acc<T>(s.rs()[at.c] * (g - s.ka()[at.c] - xh * s.kb()[at.c]));
                }
                store16_global(dx + base + p.lo() + f, out);
            }
        } else {
            for (int f = threadIdx.x; f < p.len(); f += SAMPLE_THREADS) {
                const PartAt at(f, I);
                const A xh = ((to_acc(xs[f]) - s.shift()[at.c]) - s.m()[at.c]) * s.rs()[at.c];
                const A g = to_acc(gs[f]) * s.pw()[per_col ? at.c : at.r];
                dx[base + p.lo() + f] = from_acc<T>(s.rs()[at.c] * (g - s.ka()[at.c] - xh * s.kb()[at.c]));
            }
        }
        __syncthreads();  // the parts and the columns' statistics are refilled for the next sample
    }
    cluster_sync();  // no block leaves while another may still read its slots
#else
    __trap();
#endif
}
