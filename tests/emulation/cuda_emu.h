// cuda_emu.h: compile CUDA kernels with g++ and run them on the CPU, for tests.
//
// Model. One launch runs its blocks one after another. The threads of a block are fibers
// (ucontext): each has its own stack and program counter and runs until it reaches a
// barrier (__syncthreads, __syncwarp, a shuffle or vote), exits or fails. A scheduler
// picks the next ready thread in a chosen order (forward, reverse or seeded random), so a
// run is deterministic and a missing barrier shows up as a wrong result under some order.
// Fibers rather than OS threads: the same semantics (every CUDA thread keeps its own
// state between barriers) at a small fraction of the switch cost, and the scheduler sees
// the whole block, so a barrier that can never complete is reported instead of hanging.
//
// Checked, reported as a launch failure: __syncthreads not reached by every thread,
// warp operations whose mask names an exited/missing lane or a lane doing something else,
// shuffles reading a lane outside the mask, deadlocks, bad launch configurations.
// Static __shared__ memory persists between blocks (as on a GPU, it starts as garbage);
// the harness poisons it with 0xFF bytes before each block (see emu_set_shared_regions).
// Thread-block clusters (sm_90; `cluster` blocks along x, set per launch): a cluster's blocks
// run together, their threads all fibers of one scheduler, each block with its own dynamic
// shared memory and __syncthreads; emu_cluster_sync is the cluster's barrier and
// emu_cluster_shared maps an address of the caller's dynamic shared memory to the same offset
// in another block's (distributed shared memory). Static __shared__ variables are one per
// kernel here, so cluster kernels must keep all their shared memory dynamic.
// cp.async: a thread's copies land in shared memory only at the wait that covers their
// commit group (Runtime::async_wait), so a read before it sees the poison.
#pragma once
#ifndef ANYNORM_CUDA_EMU_H
#define ANYNORM_CUDA_EMU_H

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

// ---- CUDA keywords ----------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
// One block runs at a time, so a function-level static is exactly one block's shared memory.
#define __shared__ static

#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif
#define ANYNORM_CUDA_EMU 1

// ---- built-in vector types ----------------------------------------------------------------

struct uint3 { unsigned int x, y, z; };

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

#define EMU_VEC1(N, T, AL) \
    struct alignas(AL) N { T x; }; \
    inline N make_##N(T x) { return N{x}; }
#define EMU_VEC2(N, T, AL) \
    struct alignas(AL) N { T x, y; }; \
    inline N make_##N(T x, T y) { return N{x, y}; }
#define EMU_VEC3(N, T) \
    struct N { T x, y, z; }; \
    inline N make_##N(T x, T y, T z) { return N{x, y, z}; }
#define EMU_VEC4(N, T, AL) \
    struct alignas(AL) N { T x, y, z, w; }; \
    inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }

EMU_VEC2(char2, signed char, 2) EMU_VEC4(char4, signed char, 4)
EMU_VEC2(uchar2, unsigned char, 2) EMU_VEC4(uchar4, unsigned char, 4)
EMU_VEC2(short2, short, 4) EMU_VEC4(short4, short, 8)
EMU_VEC2(ushort2, unsigned short, 4) EMU_VEC4(ushort4, unsigned short, 8)
EMU_VEC1(int1, int, 4) EMU_VEC2(int2, int, 8) EMU_VEC3(int3, int) EMU_VEC4(int4, int, 16)
EMU_VEC1(uint1, unsigned int, 4) EMU_VEC2(uint2, unsigned int, 8) EMU_VEC4(uint4, unsigned int, 16)
EMU_VEC2(longlong2, long long, 16) EMU_VEC2(ulonglong2, unsigned long long, 16)
EMU_VEC1(float1, float, 4) EMU_VEC2(float2, float, 8) EMU_VEC3(float3, float) EMU_VEC4(float4, float, 16)
EMU_VEC1(double1, double, 8) EMU_VEC2(double2, double, 16)
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }

// ---- the block scheduler --------------------------------------------------------------------

// Per-thread built-ins; the scheduler sets threadIdx before resuming a fiber.
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
constexpr int warpSize = 32;

namespace emu {

// A launch that failed: the message says what, where and under which schedule.
struct Failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Thrown inside fibers to unwind them once the block is being abandoned.
struct Unwind {};

enum class St : unsigned char { Ready, Barrier, Warp, Done };
enum class WarpKind : unsigned char { Shfl, Vote, Sync };

struct WarpOp {
    WarpKind kind;
    const char* name;
    unsigned mask;
    int mode;  // shfl: 0 idx, 1 up, 2 down, 3 bfly; vote: 0 ballot, 1 any, 2 all
    int b, c;
    uint64_t value, result;
};

// A cp.async copy in flight: its source bytes (read at issue: the sources are inputs nothing
// writes during a launch) and where they land.
struct AsyncCopy {
    unsigned char* dst;
    unsigned char bytes[16];
    int n;
};

struct Fiber {
    ucontext_t ctx;
    St state = St::Ready;
    uint3 idx{0, 0, 0};
    uint3 bid{0, 0, 0};
    WarpOp op{};
    long long barrier_result = 0;
    // cp.async: copies since the last commit, then the committed groups, oldest first
    std::vector<AsyncCopy> async_open;
    std::deque<std::vector<AsyncCopy>> async_groups;
};

class Runtime {
  public:
    // Schedule: 0 forward, 1 reverse, >= 2 random with that seed. Also orders the blocks.
    int schedule = 0;
    int cluster = 1;  // blocks per cluster along x (the next launch's)
    size_t max_dynamic_smem = 48 * 1024;
    std::vector<std::pair<unsigned char*, size_t>> shared_regions;  // poisoned per block

    template <class F> void launch(dim3 grid, dim3 block, size_t smem, F&& body);

    // Called from inside fibers.
    unsigned char* dynamic_smem() { return dyn_.data() + (size_t)(cur_ / per_) * dyn_stride_; }
    unsigned dynamic_smem_bytes() const { return (unsigned)dyn_bytes_; }
    int cluster_rank() const { return cur_ / per_; }
    unsigned char* cluster_shared(const void* p, int rank);
    void sync_cluster();
    int current() const { return cur_; }
    // cp.async as PTX has it: a copy lands in shared memory only once a wait covers its group
    // (cp.async.wait_group n: all but the newest n committed groups; copies not yet committed
    // are in no group and stay in flight), so a read before the right wait sees the poison.
    void async_copy(void* dst, const void* src, int n) {
        AsyncCopy c;
        c.dst = static_cast<unsigned char*>(dst);
        std::memcpy(c.bytes, src, (size_t)n);
        c.n = n;
        th_[cur_].async_open.push_back(c);
    }
    void async_commit() {
        Fiber& f = th_[cur_];
        f.async_groups.push_back(std::move(f.async_open));
        f.async_open.clear();
    }
    void async_wait(int pending) {
        Fiber& f = th_[cur_];
        while ((int)f.async_groups.size() > pending) {
            for (const AsyncCopy& c : f.async_groups.front()) std::memcpy(c.dst, c.bytes, (size_t)c.n);
            f.async_groups.pop_front();
        }
    }
    [[noreturn]] void fail(const std::string& what);
    long long sync_block(long long pred, int how);  // how: 0 plain, 1 count, 2 and, 3 or
    uint64_t warp_op(WarpKind kind, const char* name, unsigned mask, int mode, int b, int c,
                     uint64_t value);
    unsigned active_mask() const;

  private:
    static void entry();
    void run_cluster(const uint3* bids);
    void park();
    void release(int t, long long result);
    void thread_exit(int me);
    void record(const std::string& what);
    void abort_all();
    int pick();
    std::string who(int t) const;
    std::string deadlock_report() const;
    void alloc_stacks(int n);

    std::vector<Fiber> th_;
    std::vector<uint64_t> ready_;
    std::vector<char*> stacks_;
    std::vector<unsigned char> dyn_;  // each block's dynamic shared memory, dyn_stride_ apart
    size_t dyn_stride_ = 0;
    size_t dyn_bytes_ = 0;  // the launch's dynamic shared memory
    // per block of the cluster: threads exited, at __syncthreads, and that barrier's kind/value
    std::vector<int> done_b_, at_barrier_b_, barrier_how_b_;
    std::vector<long long> barrier_acc_b_;
    int at_cluster_ = 0;
    ucontext_t sched_{};
    std::function<void()> body_;
    std::mt19937_64 rng_;
    std::string error_;
    int n_ = 0, per_ = 1, cur_ = -1, done_ = 0;  // fibers of the cluster, per block, current, exited
    bool aborting_ = false, running_ = false;
    static constexpr size_t kStack = 256 * 1024;
};

inline Runtime rt;

inline std::string Runtime::who(int t) const {
    const uint3& i = th_[t].idx;
    std::string s = "thread (" + std::to_string(i.x) + "," + std::to_string(i.y) + "," + std::to_string(i.z) + ")";
    if (n_ > per_) s += " of block (" + std::to_string(th_[t].bid.x) + "," + std::to_string(th_[t].bid.y) + "," +
                        std::to_string(th_[t].bid.z) + ")";
    return s;
}

inline void Runtime::record(const std::string& what) {
    if (error_.empty()) error_ = what;
}

inline void Runtime::abort_all() {
    aborting_ = true;
    for (int t = 0; t < n_; ++t) {
        if (th_[t].state != St::Done) {
            th_[t].state = St::Ready;
            ready_[t >> 6] |= 1ull << (t & 63);
        }
    }
}

inline void Runtime::fail(const std::string& what) {
    record(who(cur_) + ": " + what);
    abort_all();
    throw Unwind{};
}

inline void Runtime::release(int t, long long result) {
    th_[t].state = St::Ready;
    th_[t].barrier_result = result;
    ready_[t >> 6] |= 1ull << (t & 63);
}

// Back to the scheduler; returns when this fiber is picked again.
inline void Runtime::park() {
    const int me = cur_;
    swapcontext(&th_[me].ctx, &sched_);
    if (aborting_) throw Unwind{};
}

inline int Runtime::pick() {
    const int words = (int)ready_.size();
    if (schedule == 0) {
        for (int w = 0; w < words; ++w)
            if (ready_[w]) return w * 64 + __builtin_ctzll(ready_[w]);
        return -1;
    }
    if (schedule == 1) {
        for (int w = words - 1; w >= 0; --w)
            if (ready_[w]) return w * 64 + 63 - __builtin_clzll(ready_[w]);
        return -1;
    }
    int total = 0;
    for (int w = 0; w < words; ++w) total += __builtin_popcountll(ready_[w]);
    if (total == 0) return -1;
    int k = (int)(rng_() % (uint64_t)total);
    for (int w = 0; w < words; ++w) {
        int c = __builtin_popcountll(ready_[w]);
        if (k < c) {
            uint64_t bits = ready_[w];
            for (; k > 0; --k) bits &= bits - 1;
            return w * 64 + __builtin_ctzll(bits);
        }
        k -= c;
    }
    return -1;
}

inline void Runtime::entry() {
    Runtime& r = rt;
    const int me = r.cur_;
    if (!r.aborting_) {
        try {
            r.body_();
        } catch (Unwind&) {
        } catch (std::exception& e) {
            r.record(r.who(me) + ": exception: " + e.what());
            r.abort_all();
        }
    }
    r.thread_exit(me);
    setcontext(&r.sched_);
}

inline void Runtime::thread_exit(int me) {
    th_[me].state = St::Done;
    ready_[me >> 6] &= ~(1ull << (me & 63));  // abort_all may have marked it ready again
    ++done_;
    ++done_b_[me / per_];
    if (aborting_) return;
    if (at_barrier_b_[me / per_] > 0) {
        record(who(me) + " exited while " + std::to_string(at_barrier_b_[me / per_]) +
               " thread(s) wait at __syncthreads() (barrier in divergent code)");
        abort_all();
        return;
    }
    if (at_cluster_ > 0) {
        record(who(me) + " exited while " + std::to_string(at_cluster_) +
               " thread(s) of its cluster wait at the cluster barrier");
        abort_all();
        return;
    }
    const int base = me & ~31, lane = me & 31;
    for (int l = 0; l < 32 && base + l < n_; ++l) {
        const Fiber& f = th_[base + l];
        if (f.state == St::Warp && (f.op.mask >> lane & 1u)) {
            record(who(me) + " exited while " + who(base + l) + " waits in " + f.op.name +
                   " with a mask naming it");
            abort_all();
            return;
        }
    }
}

inline std::string Runtime::deadlock_report() const {
    std::string s = "deadlock: no thread can proceed (";
    int nb = 0, nw = 0;
    for (int t = 0; t < n_; ++t) {
        if (th_[t].state == St::Barrier) ++nb;  // __syncthreads or the cluster barrier
        if (th_[t].state == St::Warp) ++nw;
    }
    s += std::to_string(nb) + " at __syncthreads, " + std::to_string(nw) + " in warp operations, " +
         std::to_string(done_) + " exited)";
    for (int t = 0; t < n_; ++t) {
        if (th_[t].state == St::Warp) {
            char buf[96];
            std::snprintf(buf, sizeof buf, "; e.g. %s in %s mask 0x%08x", who(t).c_str(), th_[t].op.name,
                          th_[t].op.mask);
            s += buf;
            break;
        }
    }
    return s;
}

inline void Runtime::alloc_stacks(int n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    while ((int)stacks_.size() < n) {
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED) throw Failure("emulator: cannot allocate a fiber stack");
        mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
        stacks_.push_back(static_cast<char*>(p));
    }
}

inline void Runtime::run_cluster(const uint3* bids) {
    for (auto& region : shared_regions) std::memset(region.first, 0xFF, region.second);
    std::fill(dyn_.begin(), dyn_.end(), (unsigned char)0xFF);
    std::fill(ready_.begin(), ready_.end(), 0ull);
    for (int t = 0; t < n_; ++t) {
        Fiber& f = th_[t];
        const int u = t % per_;
        f.state = St::Ready;
        f.idx = uint3{(unsigned)(u % blockDim.x), (unsigned)(u / blockDim.x % blockDim.y),
                      (unsigned)(u / (blockDim.x * blockDim.y))};
        f.bid = bids[t / per_];
        f.async_open.clear();
        f.async_groups.clear();
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks_[t];
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, &Runtime::entry, 0);
        ready_[t >> 6] |= 1ull << (t & 63);
    }
    const int nblocks = n_ / per_;
    done_b_.assign(nblocks, 0);
    at_barrier_b_.assign(nblocks, 0);
    barrier_how_b_.assign(nblocks, 0);
    barrier_acc_b_.assign(nblocks, 0);
    done_ = at_cluster_ = 0;
    aborting_ = false;
    for (;;) {
        const int t = pick();
        if (t < 0) {
            if (done_ == n_) break;
            record(deadlock_report());
            abort_all();
            continue;
        }
        ready_[t >> 6] &= ~(1ull << (t & 63));
        cur_ = t;
        threadIdx = th_[t].idx;
        blockIdx = th_[t].bid;
        swapcontext(&sched_, &th_[t].ctx);
    }
    cur_ = -1;
}

template <class F> void Runtime::launch(dim3 grid, dim3 block, size_t smem, F&& body) {
    if (running_) throw Failure("emulator: kernel launched from inside a kernel");
    const unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
    if (!nthreads || !grid.x || !grid.y || !grid.z)
        throw Failure("invalid launch: zero-sized grid or block");
    if (block.x > 1024 || block.y > 1024 || block.z > 64 || nthreads > 1024)
        throw Failure("invalid launch: block (" + std::to_string(block.x) + "," + std::to_string(block.y) +
                      "," + std::to_string(block.z) + ") exceeds 1024 threads or the per-axis limits");
    if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u)
        throw Failure("invalid launch: grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
                      std::to_string(grid.z) + ") exceeds the limits (2^31-1, 65535, 65535)");
    if (smem > max_dynamic_smem)
        throw Failure("invalid launch: " + std::to_string(smem) + " bytes of dynamic shared memory (limit " +
                      std::to_string(max_dynamic_smem) + ")");
    const int cl = cluster;
    if (cl < 1 || cl > 8 || grid.x % (unsigned)cl)
        throw Failure("invalid launch: cluster of " + std::to_string(cl) + " blocks for grid.x " +
                      std::to_string(grid.x) + " (1..8 blocks, grid.x a multiple)");
    if (cl > 1 && nthreads % 32)
        throw Failure("emulator: a cluster's blocks must be whole warps");
    per_ = (int)nthreads;
    n_ = cl * per_;
    th_.assign(n_, Fiber{});
    ready_.assign((n_ + 63) / 64, 0ull);
    alloc_stacks(n_);
    dyn_bytes_ = smem;
    dyn_stride_ = ((smem ? smem : 16) + 255) / 256 * 256;
    dyn_.assign(dyn_stride_ * cl, 0);
    blockDim = block;
    gridDim = grid;
    body_ = std::forward<F>(body);
    rng_.seed((uint64_t)schedule * 0x9E3779B97F4A7C15ull + 12345);
    error_.clear();
    std::vector<uint3> blocks;  // each cluster's first block (rank 0)
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; x += (unsigned)cl) blocks.push_back(uint3{x, y, z});
    if (schedule == 1) std::reverse(blocks.begin(), blocks.end());
    if (schedule >= 2) std::shuffle(blocks.begin(), blocks.end(), rng_);
    running_ = true;
    std::vector<uint3> members(cl);
    for (const uint3& b : blocks) {
        for (int r = 0; r < cl; ++r) members[r] = uint3{b.x + (unsigned)r, b.y, b.z};
        run_cluster(members.data());
        if (!error_.empty()) {
            running_ = false;
            body_ = nullptr;
            throw Failure(error_ + " [block (" + std::to_string(b.x) + "," + std::to_string(b.y) + "," +
                          std::to_string(b.z) + "), schedule " + std::to_string(schedule) + "]");
        }
    }
    running_ = false;
    body_ = nullptr;
}

inline long long Runtime::sync_block(long long pred, int how) {
    const int b = cur_ / per_;
    if (done_b_[b] > 0)
        fail("reached __syncthreads() after " + std::to_string(done_b_[b]) +
             " thread(s) of the block exited (barrier in divergent code)");
    Fiber& f = th_[cur_];
    if (at_barrier_b_[b] == 0) {
        barrier_how_b_[b] = how;
        barrier_acc_b_[b] = how == 2 ? 1 : 0;
    } else if (barrier_how_b_[b] != how) {
        fail("__syncthreads variants differ across the block");
    }
    long long& acc = barrier_acc_b_[b];
    if (how == 1) acc += pred != 0;
    if (how == 2) acc &= pred != 0;
    if (how == 3) acc |= pred != 0;
    f.state = St::Barrier;
    if (++at_barrier_b_[b] == per_) {
        at_barrier_b_[b] = 0;
        for (int t = b * per_; t < (b + 1) * per_; ++t) release(t, acc);
    }
    park();
    return th_[cur_].barrier_result;
}

inline void Runtime::sync_cluster() {
    if (done_ > 0)
        fail("reached the cluster barrier after " + std::to_string(done_) + " thread(s) of the cluster exited");
    th_[cur_].state = St::Barrier;
    if (++at_cluster_ == n_) {
        at_cluster_ = 0;
        for (int t = 0; t < n_; ++t) release(t, 0);
    }
    park();
}

inline unsigned char* Runtime::cluster_shared(const void* p, int rank) {
    const unsigned char* mine = dynamic_smem();
    const unsigned char* q = static_cast<const unsigned char*>(p);
    if (q < mine || q >= mine + dyn_stride_)
        fail("distributed shared memory: the address is not in the block's dynamic shared memory");
    if (rank < 0 || rank >= n_ / per_)
        fail("distributed shared memory: block rank " + std::to_string(rank) + " is not in the cluster");
    if (done_b_[rank] == per_)  // on a GPU its shared memory is gone (undefined)
        fail("distributed shared memory: block rank " + std::to_string(rank) + " has exited");
    return dyn_.data() + (size_t)rank * dyn_stride_ + (size_t)(q - mine);
}

inline unsigned Runtime::active_mask() const {
    const int base = cur_ & ~31;
    unsigned m = 0;
    for (int l = 0; l < 32 && base + l < n_; ++l)
        if (th_[base + l].state != St::Done) m |= 1u << l;
    return m;
}

// Source lane of a shfl, following PTX shfl.sync: c packs the segment mask (bits 8-12) and
// the clamp value (bits 0-4); an out-of-segment source yields the caller's own value.
inline int shfl_source(int lane, int mode, int b, int c) {
    const int segmask = (c >> 8) & 0x1f, cval = c & 0x1f;
    const int min_lane = lane & segmask;
    const int max_lane = min_lane | (cval & ~segmask);
    int j;
    bool ok;
    switch (mode) {
        case 1: j = lane - b; ok = j >= max_lane; break;
        case 2: j = lane + b; ok = j <= max_lane; break;
        case 3: j = lane ^ b; ok = j <= max_lane; break;
        default: j = min_lane | (b & ~segmask); ok = j <= max_lane; break;
    }
    return ok ? j : lane;
}

inline uint64_t Runtime::warp_op(WarpKind kind, const char* name, unsigned mask, int mode, int b, int c,
                                 uint64_t value) {
    const int me = cur_, base = me & ~31, lane = me & 31;
    if (!(mask >> lane & 1u)) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "mask 0x%08x does not include the calling lane %d", mask, lane);
        fail(std::string(name) + ": " + buf);
    }
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        if (base + l >= n_)
            fail(std::string(name) + ": mask names lane " + std::to_string(l) +
                 ", which does not exist (blockDim not a multiple of 32)");
        if (th_[base + l].state == St::Done)
            fail(std::string(name) + ": mask names lane " + std::to_string(l) + ", which has exited");
    }
    Fiber& self = th_[me];
    self.op = WarpOp{kind, name, mask, mode, b, c, value, 0};
    self.state = St::Warp;
    bool complete = true;
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        const Fiber& f = th_[base + l];
        if (f.state != St::Warp) {
            complete = false;
            continue;
        }
        if (f.op.mask != mask || f.op.kind != kind || (kind != WarpKind::Sync && f.op.mode != mode)) {
            char buf[160];
            std::snprintf(buf, sizeof buf, "%s (mask 0x%08x) meets lane %d in %s (mask 0x%08x)", name, mask, l,
                          f.op.name, f.op.mask);
            fail(std::string("divergent warp operations: ") + buf);
        }
    }
    if (complete) {
        uint64_t ballot = 0;
        for (int l = 0; l < 32; ++l)
            if ((mask >> l & 1u) && th_[base + l].op.value) ballot |= 1ull << l;
        for (int l = 0; l < 32; ++l) {
            if (!(mask >> l & 1u)) continue;
            WarpOp& op = th_[base + l].op;
            if (kind == WarpKind::Shfl) {
                const int src = shfl_source(l, op.mode, op.b, op.c);
                if (!(mask >> src & 1u))
                    fail(std::string(name) + ": lane " + std::to_string(l) + " reads lane " + std::to_string(src) +
                         ", which is not in the mask");
                op.result = th_[base + src].op.value;
            } else if (kind == WarpKind::Vote) {
                op.result = op.mode == 0 ? ballot : op.mode == 1 ? (ballot != 0) : (ballot == mask);
            }
        }
        for (int l = 0; l < 32; ++l)
            if (mask >> l & 1u) release(base + l, th_[base + l].barrier_result);
    }
    park();
    return th_[cur_].op.result;
}

}  // namespace emu

// ---- synchronization, warp shuffles and votes --------------------------------------------

inline void __syncthreads() { emu::rt.sync_block(0, 0); }
inline int __syncthreads_count(int p) { return (int)emu::rt.sync_block(p, 1); }
inline int __syncthreads_and(int p) { return (int)emu::rt.sync_block(p, 2); }
inline int __syncthreads_or(int p) { return (int)emu::rt.sync_block(p, 3); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu::rt.warp_op(emu::WarpKind::Sync, "__syncwarp", mask, 0, 0, 0, 0);
}
inline unsigned __activemask() { return emu::rt.active_mask(); }
// Thread-block clusters (the kernels' sm_90 PTX has these as inline assembly).
inline unsigned emu_cluster_rank() { return (unsigned)emu::rt.cluster_rank(); }
inline void emu_cluster_sync() { emu::rt.sync_cluster(); }
template <class T> inline T emu_cluster_load(const T* p, int rank) {
    return *reinterpret_cast<const T*>(emu::rt.cluster_shared(p, rank));
}
// Integer intrinsics.
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline void __threadfence() {}
inline void __threadfence_block() {}
// A kernel's own check failed (as the GPU's trap: the launch fails).
[[noreturn]] inline void __trap() { emu::rt.fail("__trap(): a kernel's precondition does not hold"); }
inline void __threadfence_system() {}

namespace emu {
template <class T> inline T shfl(const char* name, unsigned mask, T v, int mode, int b, int width, bool up) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of an unsupported type");
    if (width <= 0 || width > 32 || (width & (width - 1)))
        rt.fail(std::string(name) + ": width " + std::to_string(width) + " is not a power of two <= 32");
    const int c = ((32 - width) << 8) | (up ? 0 : 0x1f);
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = rt.warp_op(WarpKind::Shfl, name, mask, mode, b, c, bits);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace emu

template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = warpSize) {
    return emu::shfl("__shfl_sync", mask, v, 0, src, width, false);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    return emu::shfl("__shfl_up_sync", mask, v, 1, (int)delta, width, true);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    return emu::shfl("__shfl_down_sync", mask, v, 2, (int)delta, width, false);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
    return emu::shfl("__shfl_xor_sync", mask, v, 3, lane_mask, width, false);
}
inline unsigned __ballot_sync(unsigned mask, int p) {
    return (unsigned)emu::rt.warp_op(emu::WarpKind::Vote, "__ballot_sync", mask, 0, 0, 0, p != 0);
}
inline int __any_sync(unsigned mask, int p) {
    return (int)emu::rt.warp_op(emu::WarpKind::Vote, "__any_sync", mask, 1, 0, 0, p != 0);
}
inline int __all_sync(unsigned mask, int p) {
    return (int)emu::rt.warp_op(emu::WarpKind::Vote, "__all_sync", mask, 2, 0, 0, p != 0);
}

#include "cuda_emu_types.h"

// ---- launching --------------------------------------------------------------------------------

// emu_launch(kernel, grid, block, shared_bytes, args...): run a kernel; throws emu::Failure.
template <class... P, class... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, A&&... args) {
    static_assert(sizeof...(P) == sizeof...(A), "wrong number of kernel arguments");
    std::tuple<std::decay_t<P>...> packed(std::forward<A>(args)...);
    emu::rt.launch(grid, block, shared_bytes, [kernel, packed]() { std::apply(kernel, packed); });
}

namespace emu {

// Kernel parameter codes for the Python harness: p pointer, i/u signed/unsigned integer,
// f floating, h __half, b __nv_bfloat16, s other (by value), each followed by its size;
// a pointer is p followed by its pointee's code.
template <class T> std::string code() {
    using U = std::decay_t<T>;
    if constexpr (std::is_pointer<U>::value) {
        using E = std::remove_cv_t<std::remove_pointer_t<U>>;
        if constexpr (std::is_void<E>::value) return "pv";
        else return "p" + code<E>();
    }
    std::string n = std::to_string(sizeof(U));
    if (std::is_same<U, bool>::value) return "u" + n;
    if (std::is_integral<U>::value) return (std::is_signed<U>::value ? "i" : "u") + n;
    if (std::is_floating_point<U>::value) return "f" + n;
    if (std::is_same<U, __half>::value) return "h" + n;
    if (std::is_same<U, __nv_bfloat16>::value) return "b" + n;
    return "s" + n;
}

template <class... P> std::string signature(void (*)(P...)) {
    std::string s;
    ((s += code<P>() + ","), ...);
    return s;
}

template <class... P, size_t... I>
void launch_packed(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, void** args,
                   std::index_sequence<I...>) {
    emu_launch(kernel, grid, block, smem, *static_cast<std::decay_t<P>*>(args[I])...);
}

// The extern "C" entry point behind every wrapper: cfg = grid xyz, block xyz, cluster (x).
template <class... P>
int launch_c(void (*kernel)(P...), const unsigned* cfg, unsigned long long smem, int schedule, void** args,
             char* err, int errlen) {
    try {
        rt.schedule = schedule;
        rt.cluster = (int)cfg[6];
        launch_packed(kernel, dim3(cfg[0], cfg[1], cfg[2]), dim3(cfg[3], cfg[4], cfg[5]), (size_t)smem, args,
                      std::index_sequence_for<P...>{});
        return 0;
    } catch (std::exception& e) {
        std::snprintf(err, (size_t)errlen, "%s", e.what());
        return 1;
    }
}

}  // namespace emu

// Dynamic shared memory for code that declares it as a pointer (see emu_harness.py).
#define EMU_DYNAMIC_SHARED(T) (reinterpret_cast<T*>(emu::rt.dynamic_smem()))
#define EMU_DYNAMIC_SMEM_BYTES() (emu::rt.dynamic_smem_bytes())

#endif  // ANYNORM_CUDA_EMU_H
