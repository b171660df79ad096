// Kernels that prove the emulation harness itself: a correct block reduction (shared memory
// and warp shuffles), shuffle/vote probes, half/bfloat16 conversions, and deliberately
// broken kernels the harness must report (race, out-of-bounds write, divergent barrier,
// exited shuffle lane, misaligned vector load, read of uninitialized shared memory).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename A> __device__ __forceinline__ A warp_reduce(A v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// out[row] = sum(x[row, :n]); one block per row (grid-stride over rows), blockDim.x % 32 == 0.
template <typename T, typename A, bool SYNC>
__global__ void block_sum(const T* __restrict__ x, A* __restrict__ out, long long rows, long long n) {
    __shared__ A partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        A s = A(0);
        for (long long j = threadIdx.x; j < n; j += blockDim.x) s += A(x[row * n + j]);
        s = warp_reduce(s);
        if (lane == 0) partial[warp] = s;
        if (SYNC) __syncthreads();
        if (warp == 0) {
            s = lane < nwarps ? partial[lane] : A(0);
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            if (lane == 0) out[row] = s;
        }
        __syncthreads();
    }
}

// out[lane] = the shuffle of value lane * 10 under (mode, arg, width); mode 0 idx, 1 up,
// 2 down, 3 xor, 4 ballot of (lane % arg == 0), 5 any(lane == arg), 6 all(lane < arg).
__global__ void warp_probe(int* out, int mode, int arg, int width) {
    const int lane = threadIdx.x & 31;
    const int v = lane * 10;
    int r = 0;
    switch (mode) {
        case 0: r = __shfl_sync(0xffffffffu, v, arg, width); break;
        case 1: r = __shfl_up_sync(0xffffffffu, v, arg, width); break;
        case 2: r = __shfl_down_sync(0xffffffffu, v, arg, width); break;
        case 3: r = __shfl_xor_sync(0xffffffffu, v, arg, width); break;
        case 4: r = (int)__ballot_sync(0xffffffffu, lane % arg == 0); break;
        case 5: r = __any_sync(0xffffffffu, lane == arg); break;
        case 6: r = __all_sync(0xffffffffu, lane < arg); break;
    }
    out[threadIdx.x] = r;
}

// Round float and double inputs to __half and __nv_bfloat16 bits and back.
__global__ void convert(const float* f, const double* d, unsigned short* h_f, unsigned short* b_f,
                        unsigned short* h_d, unsigned short* b_d, float* back_h, float* back_b, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const __half h = __float2half_rn(f[i]);
        const __nv_bfloat16 b = __float2bfloat16_rn(f[i]);
        h_f[i] = __half_as_ushort(h);
        b_f[i] = __bfloat16_as_ushort(b);
        h_d[i] = __half_as_ushort(__double2half(d[i]));
        b_d[i] = __bfloat16_as_ushort(__double2bfloat16(d[i]));
        back_h[i] = __half2float(h);
        back_b[i] = __bfloat162float(b);
    }
}

// Bug: writes one element past the end.
__global__ void oob_write(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 1.0f;
}

// Bug: __syncthreads() inside a branch taken by half the block.
__global__ void divergent_barrier(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// Bug: a lane leaves before a full-mask shuffle.
__global__ void exited_lane(float* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// Bug: 16-byte load from an address that is only 4-byte aligned.
struct alignas(16) Quad { float v[4]; };
__global__ void misaligned_load(const float* x, float* out) {
    const Quad q = *reinterpret_cast<const Quad*>(x + 1);
    out[threadIdx.x] = q.v[0];
}

// Bug: thread 0 reads a shared slot nobody wrote.
__global__ void uninit_shared(float* out) {
    __shared__ float s[64];
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = s[0] + s[blockDim.x];
}
