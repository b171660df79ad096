// Shared device code for anynorm's kernels: element conversions, 16-byte vector access,
// Welford/Chan statistics, warp and block reductions, and the index maps of the
// (outer, reduced, inner) layout. Plain CUDA C++ only (see README.md): the CPU emulation
// harness compiles this file with g++.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Full unrolling of the per-thread item loops keeps register-cached rows in registers
// (an array indexed by a run-time loop counter would live in local memory).
#ifdef ANYNORM_CUDA_EMU
#define ANYNORM_UNROLL
#else
#define ANYNORM_UNROLL _Pragma("unroll")
#endif

namespace anynorm {

// ---- types and conversions -------------------------------------------------------------

// Accumulation type: float for __half/__nv_bfloat16/float, double for double.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };
template <typename T> using acc_t = typename Acc<T>::type;

__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }

// 1 / sqrt(v), correctly rounded sqrt then division (matches the reference's 1 / sqrt).
__device__ __forceinline__ float inv_sqrt(float v) { return 1.0f / sqrtf(v); }
__device__ __forceinline__ double inv_sqrt(double v) { return 1.0 / sqrt(v); }

// A row's statistics from its sums where x (so y) is T: mean = sum / n, rstd = 1 / sqrt(v).
// float32 and float64 take the correctly rounded forms above. 16-bit types take the hardware's
// approximations, a multiply by 1 / n (the caller's, made once) and rsqrtf (rsqrt.approx: within
// 2 ulp of float32, the CUDA guide's bound; 0, Inf and NaN as 1 / sqrt gives them): their
// outputs round to 2^-9 (bfloat16) or 2^-12 (float16) of themselves, thousands of times
// coarser, and the IEEE division and 1 / sqrt cost ~30 instructions a row, where the row
// kernels are bound by the instructions they issue. Kernels whose registers do not allow the
// approximations' code (rows.cu: rows_fwd_warp, the block and warp backwards) name
// ExactRowStats, or divide.
template <typename T> struct ExactRowStats {
    typedef acc_t<T> A;
    __device__ __forceinline__ static A mean(A sum, A n, A) { return sum / n; }
    __device__ __forceinline__ static A rstd(A v) { return inv_sqrt(v); }
};
template <typename T> struct RowStats : ExactRowStats<T> {};
struct RowStatsApprox {
    __device__ __forceinline__ static float mean(float sum, float, float inv_n) { return sum * inv_n; }
    __device__ __forceinline__ static float rstd(float v) { return rsqrtf(v); }
};
template <> struct RowStats<__half> : RowStatsApprox {};
template <> struct RowStats<__nv_bfloat16> : RowStatsApprox {};

// h = x + residual rounded to T, as the caller's library adds two arrays of dtype T.
template <typename T> __device__ __forceinline__ T add_in_dtype(T a, T b) {
    return from_acc<T>(to_acc(a) + to_acc(b));
}

// ---- 16-byte vectors ----------------------------------------------------------------------

template <typename T> struct VecLen { static const int value = 16 / (int)sizeof(T); };

template <typename T> struct alignas(16) Vec16 { T v[16 / sizeof(T)]; };

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// A null pointer counts as aligned, so optional arrays do not veto vector access.
__device__ __forceinline__ bool aligned16_or_null(const void* p) { return p == 0 || aligned16(p); }

template <typename T> __device__ __forceinline__ Vec16<T> load16(const T* p) {
    return *reinterpret_cast<const Vec16<T>*>(p);
}

template <typename T> __device__ __forceinline__ void store16(T* p, const Vec16<T>& v) {
    *reinterpret_cast<Vec16<T>*>(p) = v;
}

// bfloat16 element j of the 32-bit words at `words` (2 a word, little-endian) as float: one bit
// operation on its word (the low half shifted up, the high half masked), where
// __bfloat162float of a high half took two (a byte permute to the low half, then the shift).
// 16-bit kernels widen every element they read, in every pass that reads it.
__device__ __forceinline__ float bf16_of_words(const void* words, int j) {
    unsigned word;
    memcpy(&word, static_cast<const char*>(words) + 4 * (j >> 1), 4);
    const unsigned bits = (j & 1) ? (word & 0xffff0000u) : (word << 16);
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

// Element j of a 16-byte vector in the accumulation type: to_acc(t.v[j]) (bf16_of_words).
template <typename T> __device__ __forceinline__ acc_t<T> vec_acc(const Vec16<T>& t, int j) {
    return to_acc(t.v[j]);
}
template <> __device__ __forceinline__ float vec_acc<__nv_bfloat16>(const Vec16<__nv_bfloat16>& t, int j) {
    return bf16_of_words(&t, j);
}

// A vector a thread holds across a loop, marked as changed at this point of each turn: the
// compiler then cannot hoist what the loop computes from it (16-bit weights widened once, before
// the loop, take twice the registers: lean_fwd_rows spilled at 64).
template <typename T> __device__ __forceinline__ void keep_packed(Vec16<T>& t) {
#ifndef ANYNORM_CUDA_EMU
    uint4 bits;
    memcpy(&bits, &t, 16);
    asm volatile("" : "+r"(bits.x), "+r"(bits.y), "+r"(bits.z), "+r"(bits.w));
    memcpy(&t, &bits, 16);
#endif
}

// store16 to global memory in one st.global.v4: where the compiler split a Vec16 built element
// by element into four scalar stores (rows_bwd_smem's dx, seen in its PTX), the bits still go
// out as one 16-byte store (p: 16-byte aligned global memory).
template <typename T> __device__ __forceinline__ void store16_global(T* p, const Vec16<T>& v) {
#ifdef ANYNORM_CUDA_EMU
    store16(p, v);
#else
    unsigned int bits[4];
    memcpy(bits, &v, 16);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(bits[0]), "r"(bits[1]),
                 "r"(bits[2]), "r"(bits[3]) : "memory");
#endif
}

// ---- dynamic shared memory -------------------------------------------------------------

// The block's dynamic shared memory (the launch's shared_mem bytes, 16-byte aligned) as T[].
#ifdef ANYNORM_CUDA_EMU
template <typename T> __device__ __forceinline__ T* dynamic_shared() { return EMU_DYNAMIC_SHARED(T); }
#else
template <typename T> __device__ __forceinline__ T* dynamic_shared() {
    extern __shared__ __align__(16) unsigned char anynorm_dynamic_smem[];
    return reinterpret_cast<T*>(anynorm_dynamic_smem);
}
#endif

// The launch's dynamic shared memory in bytes (kernels that use extra room where given).
#ifdef ANYNORM_CUDA_EMU
__device__ __forceinline__ unsigned dynamic_smem_bytes() { return EMU_DYNAMIC_SMEM_BYTES(); }
#else
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
#endif

// ---- thread-block clusters (sm_90) -------------------------------------------------------

// A kernel whose blocks run in clusters of `c` along x (compiled in: CuPy launches it as any
// kernel, grid.x a multiple of c). Compiled for an older architecture it is an ordinary
// kernel, and the launcher never picks it there (_schedule: DeviceInfo.cluster_max).
#if defined(ANYNORM_CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900)
#define ANYNORM_CLUSTER(c)
#else
#define ANYNORM_CLUSTER(c) __cluster_dims__(c, 1, 1)
#endif

// The block's rank in its cluster; the cluster's barrier (all threads of all its blocks, with
// release/acquire of shared and global memory); a value of another block's shared memory at
// the address `p` has in this block's (distributed shared memory).
#ifdef ANYNORM_CUDA_EMU
__device__ __forceinline__ int cluster_rank() { return (int)emu_cluster_rank(); }
__device__ __forceinline__ void cluster_sync() { emu_cluster_sync(); }
template <typename A> __device__ __forceinline__ A cluster_load(const A* p, int rank) {
    return emu_cluster_load(p, rank);
}
#elif __CUDA_ARCH__ >= 900
__device__ __forceinline__ int cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_address(const void* p, int rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    return remote;
}
template <typename A> __device__ __forceinline__ A cluster_load(const A* p, int rank);
template <> __device__ __forceinline__ float cluster_load<float>(const float* p, int rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_address(p, rank)) : "memory");
    return v;
}
template <> __device__ __forceinline__ double cluster_load<double>(const double* p, int rank) {
    double v;
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(cluster_address(p, rank)) : "memory");
    return v;
}
#else
__device__ __forceinline__ int cluster_rank() { return 0; }
__device__ __forceinline__ void cluster_sync() { __trap(); }
template <typename A> __device__ __forceinline__ A cluster_load(const A* p, int) {
    __trap();
    return *p;
}
#endif

// ---- asynchronous copies into shared memory (sm_80) ----------------------------------------

// cp.async of one 16-byte vector from global memory (16-byte aligned) to this thread's shared
// memory, bypassing registers (and L1): a row can be read ahead at no register cost. Each
// thread waits for its own copies (cp_async_wait_all) and then reads only what it copied, so no
// barrier is needed. The emulator lands a copy at the wait that covers its group.
// cp_async<B>: B = 4 or 8 bytes (through L1), 16 (cp_async16).
#ifdef ANYNORM_CUDA_EMU
template <int B> __device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
    emu::rt.async_copy(smem, gmem, B);
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) { emu::rt.async_copy(smem, gmem, 16); }
__device__ __forceinline__ void cp_async_commit() { emu::rt.async_commit(); }
__device__ __forceinline__ void cp_async_wait_all() { emu::rt.async_wait(0); }
__device__ __forceinline__ void cp_async_wait_pending(int n) { emu::rt.async_wait(n < 0 ? 0 : n); }
#else
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(smem)),
                 "l"(gmem) : "memory");
}
template <int B> __device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
    if (B == 16) {
        cp_async16(smem, gmem);
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"((unsigned)__cvta_generic_to_shared(smem)),
                     "l"(gmem), "n"(B) : "memory");
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Wait until at most n (0-3, the same in every thread) of this thread's commit groups are
// still in flight: the instruction takes n as an immediate, so a branch picks it.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
    if (n <= 0) {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    } else if (n == 1) {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else if (n == 2) {
        asm volatile("cp.async.wait_group 2;" ::: "memory");
    } else {
        asm volatile("cp.async.wait_group 3;" ::: "memory");
    }
}
#endif

// ---- Welford / Chan -------------------------------------------------------------------

// Running (count, mean, sum of squared deviations); var = m2 / n. Never E[x^2] - E[x]^2.
template <typename A> struct Welford {
    A n, mean, m2;
};

template <typename A> __device__ __forceinline__ Welford<A> welford_empty() {
    Welford<A> s;
    s.n = A(0);
    s.mean = A(0);
    s.m2 = A(0);
    return s;
}

template <typename A> __device__ __forceinline__ void welford_push(Welford<A>& s, A v) {
    s.n += A(1);
    A d = v - s.mean;
    s.mean += d / s.n;
    s.m2 += d * (v - s.mean);
}

// Chan et al.: merge two disjoint partial states.
template <typename A> __device__ __forceinline__ Welford<A> welford_merge(const Welford<A>& a,
                                                                         const Welford<A>& b) {
    A n = a.n + b.n;
    if (n == A(0)) return a;
    A wb = b.n / n;
    A d = b.mean - a.mean;
    Welford<A> s;
    s.n = n;
    s.mean = a.mean + d * wb;
    s.m2 = a.m2 + b.m2 + d * d * a.n * wb;
    return s;
}

// rstd from a finished state: centred 1/sqrt(m2/n + eps); RMS 1/sqrt(m2/n + mean^2 + eps).
template <typename A> __device__ __forceinline__ A welford_rstd(const Welford<A>& s, int center, A eps) {
    A var = s.m2 / s.n;
    if (!center) var += s.mean * s.mean;
    return inv_sqrt(var + eps);
}

// ---- warp and block reductions (warp = 32 lanes, full mask) ----------------------------

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

template <typename A> __device__ __forceinline__ Welford<A> warp_welford(Welford<A> s) {
    for (int off = 16; off > 0; off >>= 1) {
        Welford<A> o;
        o.n = __shfl_xor_sync(0xffffffffu, s.n, off);
        o.mean = __shfl_xor_sync(0xffffffffu, s.mean, off);
        o.m2 = __shfl_xor_sync(0xffffffffu, s.m2, off);
        s = welford_merge(s, o);
    }
    return s;
}

// Block-wide merge for a 1-D block of nthreads (a multiple of 32, <= 1024). Every thread
// must call it; the result is valid in thread 0. smem: 3 * 32 values of A. Ends with a
// barrier so smem may be reused.
template <typename A> __device__ __forceinline__ Welford<A> block_welford(Welford<A> s, A* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    s = warp_welford(s);
    if (lane == 0) {
        smem[warp] = s.n;
        smem[32 + warp] = s.mean;
        smem[64 + warp] = s.m2;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < nwarps; ++k) {
            Welford<A> o;
            o.n = smem[k];
            o.mean = smem[32 + k];
            o.m2 = smem[64 + k];
            s = welford_merge(s, o);
        }
    }
    __syncthreads();
    return s;
}

// The sum of the per-warp values sums[0 .. nwarps), in order, by a loop in every thread:
// nwarps shared loads a thread, in few registers.
template <typename A> __device__ __forceinline__ A sum_of_warps(const A* sums, int nwarps) {
    A v = sums[0];
    for (int k = 1; k < nwarps; ++k) v += sums[k];
    return v;
}

// The sum of the per-warp values sums[0 .. nwarps) (nwarps <= 32), in every thread. Up to 4
// warps the loop (sum_of_warps); past that each warp adds them up itself (lane k takes
// sums[k], zero past nwarps, then a butterfly): one shared load and 5 shuffles a thread where
// the loop took nwarps loads (32 in a block of 1024). Every lane ends with the same bits: a
// butterfly step adds the same two values on both of its lanes.
template <typename A> __device__ __forceinline__ A cross_warp_sum(const A* sums, int nwarps) {
    if (nwarps <= 4) return sum_of_warps(sums, nwarps);
    const int lane = threadIdx.x & 31;
    return warp_sum(lane < nwarps ? sums[lane] : A(0));
}

// block_allsum without its closing barrier: `smem` may be written again only past a later
// barrier of every thread (a caller alternating two areas between consecutive sums has one:
// the other sum's), one barrier a sum where block_allsum takes two. The warps' sums added by
// cross_warp_sum in every warp.
template <typename A> __device__ __forceinline__ A block_allsum_open(A a, A* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    a = warp_sum(a);
    if (lane == 0) smem[warp] = a;
    __syncthreads();
    return cross_warp_sum(smem, nwarps);
}

// The W block-wide sums of a[j] (1-D block), returned to every thread, where the warps' sums
// are added by warp 0 alone (lane k takes warp k's, zero past nwarps, then a butterfly) and
// read back by all from smem[64 + j]: between the block's two barriers a thread issues ~5
// instructions a sum past its own warp's butterfly, where every thread's loop over the warps'
// sums took 2 * nwarps (64 at 1024 threads, a quarter of a 16-element row's instructions)
// and cross_warp_sum in every warp makes ptxas spill the kernels that hold x and dy at
// ITEMS=16 (sm_80). smem: 66 values of A. No closing barrier is needed before the next such
// sum on the same smem (its writes of smem[0 .. 64) wait for this one's second barrier, its
// totals for its first, which every thread reaches only after reading these).
template <int W, typename A> __device__ __forceinline__ void block_allsums_by_warp0(A (&a)[W], A* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    ANYNORM_UNROLL
    for (int j = 0; j < W; ++j) a[j] = warp_sum(a[j]);
    if (lane == 0) {
        ANYNORM_UNROLL
        for (int j = 0; j < W; ++j) smem[32 * j + warp] = a[j];
    }
    __syncthreads();
    if (warp == 0) {
        ANYNORM_UNROLL
        for (int j = 0; j < W; ++j) {
            const A v = warp_sum(lane < nwarps ? smem[32 * j + lane] : A(0));
            if (lane == 0) smem[64 + j] = v;
        }
    }
    __syncthreads();
    ANYNORM_UNROLL
    for (int j = 0; j < W; ++j) a[j] = smem[64 + j];
}

// Block-wide sum, returned to every thread (1-D block, as block_welford). EveryWarp: the warps'
// sums added up by cross_warp_sum in every warp (smem: 32 values of A; ends with a barrier so
// smem may be reused); else by warp 0 (block_allsums_by_warp0; smem: 66 values).
template <bool EveryWarp = true, typename A> __device__ __forceinline__ A block_allsum(A a, A* smem) {
    if (!EveryWarp) {
        A t[1] = {a};
        block_allsums_by_warp0<1>(t, smem);
        return t[0];
    }
    a = block_allsum_open(a, smem);
    __syncthreads();
    return a;
}

// Block-wide sums of two values, returned to every thread (1-D block, as block_welford).
// EveryWarp: the warps' sums added up by cross_warp_sum (smem: 2 * 32 values of A; ends with a
// barrier so smem may be reused); else by warp 0 (block_allsums_by_warp0; smem: 66 values).
template <bool EveryWarp = true, typename A>
__device__ __forceinline__ void block_allsum2(A& a, A& b, A* smem) {
    if (!EveryWarp) {
        A t[2] = {a, b};
        block_allsums_by_warp0<2>(t, smem);
        a = t[0];
        b = t[1];
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
        smem[warp] = a;
        smem[32 + warp] = b;
    }
    __syncthreads();
    a = cross_warp_sum(smem, nwarps);
    b = cross_warp_sum(smem + 32, nwarps);
    __syncthreads();
}

// ---- layout maps --------------------------------------------------------------------------

// Division by a divisor fixed for a whole launch. The GPU has no integer divider: a 64-bit
// `/` or `%` costs tens of instructions, more than an element's share of memory time. A
// Divider pays one division when made; each use is a multiply-high and one correction
// (m = floor((2^64 - 1) / d) gives n / d or one less for every n < 2^64).
struct Divider {
    unsigned long long d, m;
};

__device__ __forceinline__ Divider make_divider(long long d) {
    Divider v;
    v.d = (unsigned long long)d;
    v.m = ~0ull / v.d;
    return v;
}

__device__ __forceinline__ long long div_by(long long n, const Divider& v) {
    unsigned long long q = __umul64hi((unsigned long long)n, v.m);
    if ((unsigned long long)n - q * v.d >= v.d) ++q;
    return (long long)q;
}

__device__ __forceinline__ long long mod_by(long long n, const Divider& v) {
    return n - div_by(n, v) * (long long)v.d;
}

// The index maps of one launch over the (outer, reduced, inner) buffer:
// slice s = (e / (reduced*inner)) * (inner/group) + (e % inner) / group (rows: e / reduced),
// parameter index p = (e / p_div) % p_len.
struct IndexMap {
    Divider block, inner, group, p_div, p_len;
    long long per_outer;
};

__device__ __forceinline__ IndexMap make_index_map(long long reduced, long long inner, long long group,
                                                   long long p_div, long long p_len) {
    IndexMap map;
    map.block = make_divider(reduced * inner);
    map.inner = make_divider(inner);
    map.group = make_divider(group);
    map.p_div = make_divider(p_div);
    map.p_len = make_divider(p_len);
    map.per_outer = inner / group;
    return map;
}

// The block's IndexMap in shared memory, made once by its first thread and read by all (every
// thread of the block must call it, before any divergence). Kernels short of registers keep
// the reference; the others copy it.
__device__ __forceinline__ const IndexMap& block_index_map(long long reduced, long long inner,
                                                           long long group, long long p_div,
                                                           long long p_len) {
    __shared__ IndexMap map;
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0)
        map = make_index_map(reduced, inner, group, p_div, p_len);
    __syncthreads();
    return map;
}

__device__ __forceinline__ long long slice_at(const IndexMap& map, long long e) {
    return div_by(e, map.block) * map.per_outer + div_by(mod_by(e, map.inner), map.group);
}

__device__ __forceinline__ long long param_at(const IndexMap& map, long long e) {
    return mod_by(div_by(e, map.p_div), map.p_len);
}

// An optional weight or bias as the caller stored it: null (identity), in the accumulation
// type, or in the input's own type T (`in_t`: a float16/bfloat16 model's parameters, widened
// here rather than by a conversion kernel before every call). Kernels take the pointer as
// `const void*` and the flags as their last argument `param_in_t` (bit 0 weight, bit 1 bias).
template <typename T> struct Param {
    const void* ptr;
    int in_t;
};

template <typename T> __device__ __forceinline__ acc_t<T> param_value(const Param<T>& q, long long p,
                                                                      acc_t<T> none) {
    if (!q.ptr) return none;
    return q.in_t ? to_acc(static_cast<const T*>(q.ptr)[p]) : static_cast<const acc_t<T>*>(q.ptr)[p];
}
template <typename T> __device__ __forceinline__ acc_t<T> weight_at(const Param<T>& w, long long p) {
    return param_value(w, p, acc_t<T>(1));
}
template <typename T> __device__ __forceinline__ acc_t<T> bias_at(const Param<T>& b, long long p) {
    return param_value(b, p, acc_t<T>(0));
}

// V = 16 / sizeof(T) consecutive weights (or biases) from position p (a multiple of V) in
// 16-byte loads: one for parameters in T, sizeof(A) / sizeof(T) in A. The caller checks
// param_vec_ok (16-byte aligned, or null: `none` everywhere).
template <typename T> __device__ __forceinline__ bool param_vec_ok(const Param<T>& q) {
    return aligned16_or_null(q.ptr);
}

template <typename T>
__device__ __forceinline__ void param_vec(const Param<T>& q, int p, acc_t<T> (&out)[VecLen<T>::value],
                                          acc_t<T> none) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value, VA = VecLen<A>::value;
    if (!q.ptr) {
        for (int j = 0; j < V; ++j) out[j] = none;
    } else if (q.in_t) {
        const Vec16<T> t = load16(static_cast<const T*>(q.ptr) + p);
        for (int j = 0; j < V; ++j) out[j] = vec_acc(t, j);
    } else {
        for (int h = 0; h < V; h += VA) {
            const Vec16<A> t = load16(static_cast<const A*>(q.ptr) + p + h);
            for (int j = 0; j < VA; ++j) out[h + j] = t.v[j];
        }
    }
}

// Relative size of a mean's rounding to A, with a little room (4 ulps): a correction c of the
// saved mean larger than this times |mean| means the mean is not this data's (given by the
// caller), and is used as given.
template <typename A> __device__ __forceinline__ A mean_rounding() { return A(4) * A(1.1920928955078125e-7); }
template <> __device__ __forceinline__ double mean_rounding<double>() { return 4 * 2.220446049250313e-16; }

// The saved mean's rounding c = mean(x - mean) of slice s to take out of a backward's sums, or
// 0 where there is no mean (RMS norm: mean null) or c is larger than a rounding (the caller's
// mean, not this data's: used as given; also NaN, which then stays in dx through the sums).
template <typename A>
__device__ __forceinline__ A mean_correction(A c, const A* __restrict__ mean, long long s) {
    if (!mean) return A(0);
    return fabs(c) <= mean_rounding<A>() * fabs(mean[s]) ? c : A(0);
}

}  // namespace anynorm
