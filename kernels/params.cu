// dweight[p] = sum(dy * xhat), dbias[p] = sum(dy) over every element with parameter index p.
//
// The (outer, reduced, inner) buffer is viewed as (a_len, p_len, b_len), element
// e = (a * p_len + p) * b_len + b; xhat = (x - mean[s]) * rstd[s] with s = slice_at(e).
// Stage 1 writes per-chunk partials part[c * p_len + p] (chunks of the a axis); stage 2
// (param_grad_finish) sums the chunks.
#include "common.cuh"

using namespace anynorm;

#define PG_X 32
#define PG_Y 8

template <typename A>
__device__ __forceinline__ A xhat_at(A xv, const A* mean, const A* rstd, long long s, int center) {
    return (xv - (center ? mean[s] : A(0))) * rstd[s];
}

// b_len == 1: columns p of an (a_len, p_len) matrix; block (32, 8), grid (ceil(p_len/32), nchunk).
template <typename T>
__global__ void param_grad_cols(const T* __restrict__ dy, const T* __restrict__ x,
                                const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                                acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b,
                                long long a_len, long long p_len, long long reduced, long long inner,
                                long long group, long long chunk, int center) {
    typedef acc_t<T> A;
    __shared__ A sw[PG_Y][PG_X], sb[PG_Y][PG_X];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const IndexMap map = block_index_map(reduced, inner, group, 1, 1);
    const long long p = (long long)blockIdx.x * PG_X + tx;
    const long long start = (long long)blockIdx.y * chunk;
    const long long end = start + chunk < a_len ? start + chunk : a_len;
    A dw = A(0), db = A(0);
    if (p < p_len) {
        for (long long a = start + ty; a < end; a += PG_Y) {
            const long long e = a * p_len + p;
            const A d = to_acc(dy[e]);
            dw += d * xhat_at(to_acc(x[e]), mean, rstd, slice_at(map, e), center);
            db += d;
        }
    }
    sw[ty][tx] = dw;
    sb[ty][tx] = db;
    __syncthreads();
    if (ty == 0 && p < p_len) {
        for (int k = 1; k < PG_Y; ++k) {
            dw += sw[k][tx];
            db += sb[k][tx];
        }
        part_w[blockIdx.y * p_len + p] = dw;
        if (part_b) part_b[blockIdx.y * p_len + p] = db;
    }
}

// b_len > 1: block (p, c) sums a in chunk c and every b (contiguous, coalesced); block 256.
template <typename T>
__global__ void param_grad_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                                acc_t<T>* __restrict__ part_w, acc_t<T>* __restrict__ part_b,
                                long long a_len, long long p_len, long long b_len, long long reduced,
                                long long inner, long long group, long long chunk, int center) {
    typedef acc_t<T> A;
    __shared__ A smem[64];
    // b_len rides in the map's p_div slot: (a, b) of the chunk's q-th element by one Divider
    const IndexMap map = block_index_map(reduced, inner, group, b_len, 1);
    const long long p = blockIdx.x;
    const long long start = (long long)blockIdx.y * chunk;
    const long long end = start + chunk < a_len ? start + chunk : a_len;
    const long long len = (end - start) * b_len;
    A dw = A(0), db = A(0);
    for (long long q = threadIdx.x; q < len; q += blockDim.x) {
        const long long qa = div_by(q, map.p_div);
        const long long a = start + qa, bb = q - qa * b_len;
        const long long e = (a * p_len + p) * b_len + bb;
        const A d = to_acc(dy[e]);
        dw += d * xhat_at(to_acc(x[e]), mean, rstd, slice_at(map, e), center);
        db += d;
    }
    block_allsum2(dw, db, smem);
    if (threadIdx.x == 0) {
        part_w[blockIdx.y * p_len + p] = dw;
        if (part_b) part_b[blockIdx.y * p_len + p] = db;
    }
}

// One dweight or dbias value, in the accumulation type or (`in_t`) in T itself: a float16/
// bfloat16 model's parameters take their gradients in their own dtype, rounded once here
// rather than by a conversion kernel after every backward.
template <typename T>
__device__ __forceinline__ void store_param_grad(void* out, int in_t, long long p, acc_t<T> v) {
    if (in_t) static_cast<T*>(out)[p] = from_acc<T>(v);
    else static_cast<acc_t<T>*>(out)[p] = v;
}

// dweight[p] = sum_c part_w[c * p_len + p] (dbias likewise). Block (32, FINISH_LANES): the
// block's 32 consecutive p, each summed by FINISH_LANES threads over every FINISH_LANES-th
// chunk (loads of many chunks in flight), then added up in shared memory in a fixed order.
// Grid-stride over groups of 32 p. `grad_in_t`: bit 0 dweight, bit 1 dbias hold T.
#define FINISH_LANES 16
template <typename T>
__global__ void param_grad_finish(const acc_t<T>* __restrict__ part_w, const acc_t<T>* __restrict__ part_b,
                                  void* __restrict__ dweight, void* __restrict__ dbias,
                                  long long p_len, long long nchunk, int grad_in_t) {
    typedef acc_t<T> A;
    __shared__ A sw[FINISH_LANES][33], sb[FINISH_LANES][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (long long p0 = (long long)blockIdx.x * 32; p0 < p_len; p0 += (long long)gridDim.x * 32) {
        const long long p = p0 + tx;
        A dw = A(0), db = A(0);
        if (p < p_len) {
#pragma unroll 4
            for (long long c = ty; c < nchunk; c += FINISH_LANES) {
                dw += part_w[c * p_len + p];
                if (part_b) db += part_b[c * p_len + p];
            }
        }
        sw[ty][tx] = dw;
        sb[ty][tx] = db;
        __syncthreads();
        if (ty == 0 && p < p_len) {
            for (int q = 1; q < FINISH_LANES; ++q) {
                dw += sw[q][tx];
                db += sb[q][tx];
            }
            store_param_grad<T>(dweight, grad_in_t & 1, p, dw);
            if (dbias) store_param_grad<T>(dbias, grad_in_t & 2, p, db);
        }
        __syncthreads();
    }
}
