// Rows family (inner == 1): every normalized slice is `count` contiguous elements.
//
// Short rows (count <= 32 * ITEMS): one warp per row, the row held in registers, exact
// two-pass statistics. Medium rows (count <= 256 * ITEMS): the same with one 256-thread
// block per row. Long rows: rows_*_partial reduce chunks of a row per block; the chunks are
// merged by finish.cu (stats_finalize / grad_finalize) and applied by apply_fwd / apply_bwd.
// Launch configurations: README.md.
#include "common.cuh"

using namespace anynorm;

// Element of the row owned by (lane, item k). Vector mode: lanes own runs of V contiguous
// elements (one 16-byte access per run); scalar mode: lane + 32 * k.
template <int V>
__device__ __forceinline__ long long warp_item(int k, int lane, bool vec) {
    return vec ? (long long)(k / V) * 32 * V + (long long)lane * V + (k % V) : (long long)k * 32 + lane;
}

// y = (v - mean) * rstd * w + b for one row; v = x, or h = x + res (h written).
template <typename T, int ITEMS>
__global__ void rows_fwd_warp(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                              T* __restrict__ y, const acc_t<T>* __restrict__ w,
                              const acc_t<T>* __restrict__ b, acc_t<T>* __restrict__ mean,
                              acc_t<T>* __restrict__ rstd, long long rows, long long count,
                              long long p_div, long long p_len, int center, double eps) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const int lane = threadIdx.x & 31;
    const long long warps_per_block = blockDim.x >> 5;
    const long long nwarps = (long long)gridDim.x * warps_per_block;
    const A n = A(count);
    for (long long row = (long long)blockIdx.x * warps_per_block + (threadIdx.x >> 5); row < rows;
         row += nwarps) {
        const long long base = row * count;
        const bool vec = (ITEMS % V == 0) && (count % V == 0) && aligned16(x + base) &&
                         (res == 0 || (aligned16(res + base) && aligned16(h + base))) &&
                         (y == 0 || aligned16(y + base));
        A v[ITEMS];
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = warp_item<V>(k, lane, true);
                if (idx < count) {
                    Vec16<T> xv = load16(x + base + idx);
                    if (res) {
                        Vec16<T> rv = load16(res + base + idx);
                        for (int j = 0; j < V; ++j) xv.v[j] = add_in_dtype(xv.v[j], rv.v[j]);
                        store16(h + base + idx, xv);
                    }
                    for (int j = 0; j < V; ++j) v[k + j] = to_acc(xv.v[j]);
                } else {
                    for (int j = 0; j < V; ++j) v[k + j] = A(0);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = warp_item<V>(k, lane, false);
                if (idx < count) {
                    T xv = x[base + idx];
                    if (res) {
                        xv = add_in_dtype(xv, res[base + idx]);
                        h[base + idx] = xv;
                    }
                    v[k] = to_acc(xv);
                } else {
                    v[k] = A(0);
                }
            }
        }
        // Two passes over the registers: mean, then the centred sum of squares.
        A mu = A(0);
        if (center) {
            A s = A(0);
            for (int k = 0; k < ITEMS; ++k) s += v[k];
            mu = warp_sum(s) / n;
        }
        A ss = A(0);
        for (int k = 0; k < ITEMS; ++k) {
            if (warp_item<V>(k, lane, vec) < count) {
                const A d = v[k] - mu;
                ss += d * d;
            }
        }
        const A r = inv_sqrt(warp_sum(ss) / n + A(eps));
        if (lane == 0) {
            rstd[row] = r;
            if (mean) mean[row] = mu;
        }
        if (y == 0) continue;
        const bool plain_params = (p_div == 1 && p_len == count);
        for (int k = 0; k < ITEMS; ++k) {
            const long long idx = warp_item<V>(k, lane, vec);
            if (idx < count) {
                const long long p = plain_params ? idx : param_of(base + idx, p_div, p_len);
                v[k] = (v[k] - mu) * r * weight_at(w, p) + bias_at(b, p);
            }
        }
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = warp_item<V>(k, lane, true);
                if (idx < count) {
                    Vec16<T> yv;
                    for (int j = 0; j < V; ++j) yv.v[j] = from_acc<T>(v[k + j]);
                    store16(y + base + idx, yv);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = warp_item<V>(k, lane, false);
                if (idx < count) y[base + idx] = from_acc<T>(v[k]);
            }
        }
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w, for one row per warp.
template <typename T, int ITEMS>
__global__ void rows_bwd_warp(const T* __restrict__ dy, const T* __restrict__ x,
                              const acc_t<T>* __restrict__ w, const acc_t<T>* __restrict__ mean,
                              const acc_t<T>* __restrict__ rstd, T* __restrict__ dx, long long rows,
                              long long count, long long p_div, long long p_len, int center) {
    typedef acc_t<T> A;
    const int V = VecLen<T>::value;
    const int lane = threadIdx.x & 31;
    const long long warps_per_block = blockDim.x >> 5;
    const long long nwarps = (long long)gridDim.x * warps_per_block;
    const A n = A(count);
    const bool plain_params = (p_div == 1 && p_len == count);
    for (long long row = (long long)blockIdx.x * warps_per_block + (threadIdx.x >> 5); row < rows;
         row += nwarps) {
        const long long base = row * count;
        const bool vec = (ITEMS % V == 0) && (count % V == 0) && aligned16(x + base) &&
                         aligned16(dy + base) && aligned16(dx + base);
        const A mu = center ? mean[row] : A(0);
        const A r = rstd[row];
        A g[ITEMS], xh[ITEMS];
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = warp_item<V>(k, lane, true);
                if (idx < count) {
                    const Vec16<T> xv = load16(x + base + idx);
                    const Vec16<T> dv = load16(dy + base + idx);
                    for (int j = 0; j < V; ++j) {
                        xh[k + j] = to_acc(xv.v[j]);
                        g[k + j] = to_acc(dv.v[j]);
                    }
                } else {
                    for (int j = 0; j < V; ++j) xh[k + j] = g[k + j] = A(0);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = warp_item<V>(k, lane, false);
                xh[k] = idx < count ? to_acc(x[base + idx]) : A(0);
                g[k] = idx < count ? to_acc(dy[base + idx]) : A(0);
            }
        }
        A sg = A(0), sgx = A(0);
        for (int k = 0; k < ITEMS; ++k) {
            const long long idx = warp_item<V>(k, lane, vec);
            if (idx < count) {
                const long long p = plain_params ? idx : param_of(base + idx, p_div, p_len);
                xh[k] = (xh[k] - mu) * r;
                g[k] *= weight_at(w, p);
                sg += g[k];
                sgx += g[k] * xh[k];
            }
        }
        const A mg = center ? warp_sum(sg) / n : A(0);
        const A mgx = warp_sum(sgx) / n;
        for (int k = 0; k < ITEMS; ++k) g[k] = r * (g[k] - mg - xh[k] * mgx);
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = warp_item<V>(k, lane, true);
                if (idx < count) {
                    Vec16<T> out;
                    for (int j = 0; j < V; ++j) out.v[j] = from_acc<T>(g[k + j]);
                    store16(dx + base + idx, out);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = warp_item<V>(k, lane, false);
                if (idx < count) dx[base + idx] = from_acc<T>(g[k]);
            }
        }
    }
}

// Welford state of row[c*chunk : (c+1)*chunk] for block (c, row); h = x + res written once.
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
        Welford<A> s = welford_empty<A>();
        for (long long j = (long long)threadIdx.x * V; j < vlen; j += (long long)blockDim.x * V) {
            Vec16<T> xv = load16(x + base + j);
            if (res) {
                const Vec16<T> rv = load16(res + base + j);
                for (int q = 0; q < V; ++q) xv.v[q] = add_in_dtype(xv.v[q], rv.v[q]);
                store16(h + base + j, xv);
            }
            for (int q = 0; q < V; ++q) welford_push(s, to_acc(xv.v[q]));
        }
        for (long long j = vlen + threadIdx.x; j < len; j += blockDim.x) {
            T xv = x[base + j];
            if (res) {
                xv = add_in_dtype(xv, res[base + j]);
                h[base + j] = xv;
            }
            welford_push(s, to_acc(xv));
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

// sum(g) and sum(g * xhat) over row[c*chunk : (c+1)*chunk] for block (c, row).
template <typename T>
__global__ void rows_grad_partial(const T* __restrict__ dy, const T* __restrict__ x,
                                  const acc_t<T>* __restrict__ w, const acc_t<T>* __restrict__ mean,
                                  const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ ws_g,
                                  acc_t<T>* __restrict__ ws_gx, long long rows, long long count,
                                  long long chunk, long long p_div, long long p_len, int center) {
    typedef acc_t<T> A;
    __shared__ A smem[64];
    const int V = VecLen<T>::value;
    const long long nchunk = gridDim.x;
    const long long start = (long long)blockIdx.x * chunk;
    const long long end = start + chunk < count ? start + chunk : count;
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long base = row * count + start;
        const long long len = end - start;
        const A mu = center ? mean[row] : A(0);
        const A r = rstd[row];
        const bool vec = aligned16(x + base) && aligned16(dy + base);
        const long long vlen = vec ? (len / V) * V : 0;
        A sg = A(0), sgx = A(0);
        for (long long j = (long long)threadIdx.x * V; j < vlen; j += (long long)blockDim.x * V) {
            const Vec16<T> xv = load16(x + base + j);
            const Vec16<T> dv = load16(dy + base + j);
            for (int q = 0; q < V; ++q) {
                const A g = to_acc(dv.v[q]) * weight_at(w, param_of(base + j + q, p_div, p_len));
                sg += g;
                sgx += g * (to_acc(xv.v[q]) - mu) * r;
            }
        }
        for (long long j = vlen + threadIdx.x; j < len; j += blockDim.x) {
            const A g = to_acc(dy[base + j]) * weight_at(w, param_of(base + j, p_div, p_len));
            sg += g;
            sgx += g * (to_acc(x[base + j]) - mu) * r;
        }
        block_sum2(sg, sgx, smem);
        if (threadIdx.x == 0) {
            const long long k = row * nchunk + blockIdx.x;
            ws_g[k] = sg;
            ws_gx[k] = sgx;
        }
    }
}

#define ROW_BLOCK 256

// Element of the row owned by (thread t of ROW_BLOCK, item k); as warp_item, 256 wide.
template <int V>
__device__ __forceinline__ long long block_item(int k, int t, bool vec) {
    return vec ? (long long)(k / V) * ROW_BLOCK * V + (long long)t * V + (k % V)
               : (long long)k * ROW_BLOCK + t;
}

// rows_fwd_warp for medium rows: one block of ROW_BLOCK threads per row, row in registers.
template <typename T, int ITEMS>
__global__ void rows_fwd_block(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ h,
                               T* __restrict__ y, const acc_t<T>* __restrict__ w,
                               const acc_t<T>* __restrict__ b, acc_t<T>* __restrict__ mean,
                               acc_t<T>* __restrict__ rstd, long long rows, long long count,
                               long long p_div, long long p_len, int center, double eps) {
    typedef acc_t<T> A;
    __shared__ A smem[64];
    const int V = VecLen<T>::value;
    const int t = threadIdx.x;
    const A n = A(count);
    const bool plain_params = (p_div == 1 && p_len == count);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * count;
        const bool vec = (ITEMS % V == 0) && (count % V == 0) && aligned16(x + base) &&
                         (res == 0 || (aligned16(res + base) && aligned16(h + base))) &&
                         (y == 0 || aligned16(y + base));
        A v[ITEMS];
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = block_item<V>(k, t, true);
                if (idx < count) {
                    Vec16<T> xv = load16(x + base + idx);
                    if (res) {
                        const Vec16<T> rv = load16(res + base + idx);
                        for (int j = 0; j < V; ++j) xv.v[j] = add_in_dtype(xv.v[j], rv.v[j]);
                        store16(h + base + idx, xv);
                    }
                    for (int j = 0; j < V; ++j) v[k + j] = to_acc(xv.v[j]);
                } else {
                    for (int j = 0; j < V; ++j) v[k + j] = A(0);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = block_item<V>(k, t, false);
                if (idx < count) {
                    T xv = x[base + idx];
                    if (res) {
                        xv = add_in_dtype(xv, res[base + idx]);
                        h[base + idx] = xv;
                    }
                    v[k] = to_acc(xv);
                } else {
                    v[k] = A(0);
                }
            }
        }
        A s = A(0), unused = A(0);
        if (center) {
            for (int k = 0; k < ITEMS; ++k) s += v[k];
        }
        block_allsum2(s, unused, smem);
        const A mu = center ? s / n : A(0);
        A ss = A(0);
        for (int k = 0; k < ITEMS; ++k) {
            if (block_item<V>(k, t, vec) < count) {
                const A d = v[k] - mu;
                ss += d * d;
            }
        }
        block_allsum2(ss, unused, smem);
        const A r = inv_sqrt(ss / n + A(eps));
        if (t == 0) {
            rstd[row] = r;
            if (mean) mean[row] = mu;
        }
        if (y == 0) continue;
        for (int k = 0; k < ITEMS; ++k) {
            const long long idx = block_item<V>(k, t, vec);
            if (idx < count) {
                const long long p = plain_params ? idx : param_of(base + idx, p_div, p_len);
                v[k] = (v[k] - mu) * r * weight_at(w, p) + bias_at(b, p);
            }
        }
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = block_item<V>(k, t, true);
                if (idx < count) {
                    Vec16<T> yv;
                    for (int j = 0; j < V; ++j) yv.v[j] = from_acc<T>(v[k + j]);
                    store16(y + base + idx, yv);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = block_item<V>(k, t, false);
                if (idx < count) y[base + idx] = from_acc<T>(v[k]);
            }
        }
    }
}

// rows_bwd_warp for medium rows: one block of ROW_BLOCK threads per row.
template <typename T, int ITEMS>
__global__ void rows_bwd_block(const T* __restrict__ dy, const T* __restrict__ x,
                               const acc_t<T>* __restrict__ w, const acc_t<T>* __restrict__ mean,
                               const acc_t<T>* __restrict__ rstd, T* __restrict__ dx, long long rows,
                               long long count, long long p_div, long long p_len, int center) {
    typedef acc_t<T> A;
    __shared__ A smem[64];
    const int V = VecLen<T>::value;
    const int t = threadIdx.x;
    const A n = A(count);
    const bool plain_params = (p_div == 1 && p_len == count);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * count;
        const bool vec = (ITEMS % V == 0) && (count % V == 0) && aligned16(x + base) &&
                         aligned16(dy + base) && aligned16(dx + base);
        const A mu = center ? mean[row] : A(0);
        const A r = rstd[row];
        A g[ITEMS], xh[ITEMS];
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = block_item<V>(k, t, true);
                if (idx < count) {
                    const Vec16<T> xv = load16(x + base + idx);
                    const Vec16<T> dv = load16(dy + base + idx);
                    for (int j = 0; j < V; ++j) {
                        xh[k + j] = to_acc(xv.v[j]);
                        g[k + j] = to_acc(dv.v[j]);
                    }
                } else {
                    for (int j = 0; j < V; ++j) xh[k + j] = g[k + j] = A(0);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = block_item<V>(k, t, false);
                xh[k] = idx < count ? to_acc(x[base + idx]) : A(0);
                g[k] = idx < count ? to_acc(dy[base + idx]) : A(0);
            }
        }
        A sg = A(0), sgx = A(0);
        for (int k = 0; k < ITEMS; ++k) {
            const long long idx = block_item<V>(k, t, vec);
            if (idx < count) {
                const long long p = plain_params ? idx : param_of(base + idx, p_div, p_len);
                xh[k] = (xh[k] - mu) * r;
                g[k] *= weight_at(w, p);
                sg += g[k];
                sgx += g[k] * xh[k];
            }
        }
        block_allsum2(sg, sgx, smem);
        const A mg = center ? sg / n : A(0);
        const A mgx = sgx / n;
        for (int k = 0; k < ITEMS; ++k) g[k] = r * (g[k] - mg - xh[k] * mgx);
        if (vec) {
            for (int k = 0; k < ITEMS; k += V) {
                const long long idx = block_item<V>(k, t, true);
                if (idx < count) {
                    Vec16<T> out;
                    for (int j = 0; j < V; ++j) out.v[j] = from_acc<T>(g[k + j]);
                    store16(dx + base + idx, out);
                }
            }
        } else {
            for (int k = 0; k < ITEMS; ++k) {
                const long long idx = block_item<V>(k, t, false);
                if (idx < count) dx[base + idx] = from_acc<T>(g[k]);
            }
        }
    }
}
