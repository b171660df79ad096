// cuda_emu_types.h: __half / __nv_bfloat16, math and bit intrinsics, atomics and cache
// loads for the CPU emulation. Included by cuda_emu.h; not meant to be included alone.
#pragma once

namespace emu {

// Round a double to a binary16-like format with `mbits` stored mantissa bits, minimum normal
// exponent `emin`, maximum exponent `emax` and `ebits` exponent bits: round to nearest, ties
// to even, subnormals and overflow to infinity included. Bit-exact for every finite input.
inline uint16_t round_bits(double v, int mbits, int emin, int emax, int ebits) {
    const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
    const uint16_t exp_all = (uint16_t)(((1 << ebits) - 1) << mbits);
    if (std::isnan(v)) return 0x7fff;
    double a = std::fabs(v);
    if (std::isinf(a)) return sign | exp_all;
    if (a == 0) return sign;
    int e;
    std::frexp(a, &e);
    const int exp = std::max(e - 1, emin);
    const double ulp = std::ldexp(1.0, exp - mbits);
    const double r = std::nearbyint(a / ulp) * ulp;  // a / ulp is exact; nearbyint: ties to even
    if (r == 0) return sign;
    std::frexp(r, &e);
    const int rexp = e - 1;
    if (rexp > emax) return sign | exp_all;
    if (rexp < emin) return sign | (uint16_t)std::ldexp(r, mbits - emin);
    const int bias = (1 << (ebits - 1)) - 1;
    const uint16_t frac = (uint16_t)(std::ldexp(r, mbits - rexp) - std::ldexp(1.0, mbits));
    return sign | (uint16_t)((rexp + bias) << mbits) | frac;
}

inline uint16_t to_half_bits(double v) { return round_bits(v, 10, -14, 15, 5); }
inline uint16_t to_bf16_bits(double v) { return round_bits(v, 7, -126, 127, 8); }

inline float half_bits_to_float(uint16_t h) {
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float r;
    if (e == 0) r = std::ldexp((float)m, -24);
    else if (e == 31) r = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    else r = std::ldexp((float)(m | 0x400), e - 25);
    return (h & 0x8000) ? -r : r;
}

inline float bf16_bits_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

}  // namespace emu

// ---- __half ---------------------------------------------------------------------------------

struct __half_raw { unsigned short x; };

struct __half {
    unsigned short __x;
    __half() = default;
    constexpr __half(const __half_raw& r) : __x(r.x) {}
    __half(float f) : __x(emu::to_half_bits(f)) {}
    __half(double d) : __x(emu::to_half_bits(d)) {}
    __half(int v) : __x(emu::to_half_bits(v)) {}
    __half(unsigned int v) : __x(emu::to_half_bits(v)) {}
    __half(long long v) : __x(emu::to_half_bits((double)v)) {}
    __half(unsigned long long v) : __x(emu::to_half_bits((double)v)) {}
    __half(short v) : __x(emu::to_half_bits(v)) {}
    __half(unsigned short v) : __x(emu::to_half_bits(v)) {}
    __half& operator=(const __half_raw& r) { __x = r.x; return *this; }
    operator __half_raw() const { return __half_raw{__x}; }
    operator float() const { return emu::half_bits_to_float(__x); }
};

struct __nv_bfloat16_raw { unsigned short x; };

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
    __nv_bfloat16(float f) : __x(emu::to_bf16_bits(f)) {}
    __nv_bfloat16(double d) : __x(emu::to_bf16_bits(d)) {}
    __nv_bfloat16(int v) : __x(emu::to_bf16_bits(v)) {}
    __nv_bfloat16(unsigned int v) : __x(emu::to_bf16_bits(v)) {}
    __nv_bfloat16(long long v) : __x(emu::to_bf16_bits((double)v)) {}
    __nv_bfloat16(unsigned long long v) : __x(emu::to_bf16_bits((double)v)) {}
    __nv_bfloat16(short v) : __x(emu::to_bf16_bits(v)) {}
    __nv_bfloat16(unsigned short v) : __x(emu::to_bf16_bits(v)) {}
    __nv_bfloat16& operator=(const __nv_bfloat16_raw& r) { __x = r.x; return *this; }
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
    operator float() const { return emu::bf16_bits_to_float(__x); }
};

struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __half half;
typedef __half2 half2;
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

static_assert(sizeof(__half) == 2 && std::is_trivially_copyable<__half>::value, "__half layout");
static_assert(sizeof(__nv_bfloat16) == 2 && std::is_trivially_copyable<__nv_bfloat16>::value, "bf16 layout");

// Conversions.
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline float __half2float(__half h) { return (float)h; }
inline __half __ushort_as_half(unsigned short u) { return __half_raw{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __short_as_half(short s) { return __half_raw{(unsigned short)s}; }
inline __half2 __half2half2(__half h) { return __half2{h, h}; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return __half2{__half(a), __half(a)}; }
inline __half2 __float22half2_rn(float2 f) { return __half2{__half(f.x), __half(f.y)}; }
inline float2 __half22float2(__half2 h) { return float2{(float)h.x, (float)h.y}; }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline float __low2float(__half2 h) { return (float)h.x; }
inline float __high2float(__half2 h) { return (float)h.y; }

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16_raw{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 h) { return __nv_bfloat162{h, h}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162{a, b}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) {
    return __nv_bfloat162{__nv_bfloat16(f.x), __nv_bfloat16(f.y)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{(float)h.x, (float)h.y}; }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline float __low2float(__nv_bfloat162 h) { return (float)h.x; }
inline float __high2float(__nv_bfloat162 h) { return (float)h.y; }

// Arithmetic: one correctly rounded operation, as the hardware instructions.
#define EMU_LOWP_OPS(H)                                                                         \
    inline H operator+(const H& a, const H& b) { return H((float)a + (float)b); }               \
    inline H operator-(const H& a, const H& b) { return H((float)a - (float)b); }               \
    inline H operator*(const H& a, const H& b) { return H((float)a * (float)b); }               \
    inline H operator/(const H& a, const H& b) { return H((double)(float)a / (double)(float)b); } \
    inline H& operator+=(H& a, const H& b) { return a = a + b; }                                \
    inline H& operator-=(H& a, const H& b) { return a = a - b; }                                \
    inline H& operator*=(H& a, const H& b) { return a = a * b; }                                \
    inline H& operator/=(H& a, const H& b) { return a = a / b; }                                \
    inline H operator-(const H& a) { H r = a; r.__x ^= 0x8000; return r; }                      \
    inline H operator+(const H& a) { return a; }                                                \
    inline bool operator==(const H& a, const H& b) { return (float)a == (float)b; }             \
    inline bool operator!=(const H& a, const H& b) { return (float)a != (float)b; }             \
    inline bool operator<(const H& a, const H& b) { return (float)a < (float)b; }               \
    inline bool operator>(const H& a, const H& b) { return (float)a > (float)b; }               \
    inline bool operator<=(const H& a, const H& b) { return (float)a <= (float)b; }             \
    inline bool operator>=(const H& a, const H& b) { return (float)a >= (float)b; }             \
    inline H __hadd(H a, H b) { return a + b; }                                                 \
    inline H __hsub(H a, H b) { return a - b; }                                                 \
    inline H __hmul(H a, H b) { return a * b; }                                                 \
    inline H __hdiv(H a, H b) { return a / b; }                                                 \
    inline H __hneg(H a) { return -a; }                                                         \
    inline H __habs(H a) { H r = a; r.__x &= 0x7fff; return r; }                                \
    inline H __hfma(H a, H b, H c) { return H((double)(float)a * (double)(float)b + (double)(float)c); } \
    inline H __hmax(H a, H b) { return H(std::fmax((float)a, (float)b)); }                      \
    inline H __hmin(H a, H b) { return H(std::fmin((float)a, (float)b)); }                      \
    inline bool __hisnan(H a) { return std::isnan((float)a); }                                 \
    inline int __hisinf(H a) { float f = a; return std::isinf(f) ? (f > 0 ? 1 : -1) : 0; }      \
    inline bool __heq(H a, H b) { return a == b; }                                              \
    inline bool __hlt(H a, H b) { return a < b; }                                               \
    inline bool __hgt(H a, H b) { return a > b; }

EMU_LOWP_OPS(__half)
EMU_LOWP_OPS(__nv_bfloat16)
#undef EMU_LOWP_OPS

#define EMU_LOWP2_OPS(H2)                                                                       \
    inline H2 __hadd2(H2 a, H2 b) { return H2{a.x + b.x, a.y + b.y}; }                          \
    inline H2 __hsub2(H2 a, H2 b) { return H2{a.x - b.x, a.y - b.y}; }                          \
    inline H2 __hmul2(H2 a, H2 b) { return H2{a.x * b.x, a.y * b.y}; }                          \
    inline H2 __hfma2(H2 a, H2 b, H2 c) { return H2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; } \
    inline H2 operator+(const H2& a, const H2& b) { return __hadd2(a, b); }                     \
    inline H2 operator-(const H2& a, const H2& b) { return __hsub2(a, b); }                     \
    inline H2 operator*(const H2& a, const H2& b) { return __hmul2(a, b); }

EMU_LOWP2_OPS(__half2)
EMU_LOWP2_OPS(__nv_bfloat162)
#undef EMU_LOWP2_OPS

// ---- math ---------------------------------------------------------------------------------

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / std::cbrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline double __dsqrt_rn(double x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __saturatef(float x) { return x != x ? 0.0f : std::min(1.0f, std::max(0.0f, x)); }

// CUDA's global min/max overloads (std::min/max are templates with other rules).
#define EMU_MINMAX(T)                                  \
    inline T max(T a, T b) { return a > b ? a : b; } \
    inline T min(T a, T b) { return a < b ? a : b; }
EMU_MINMAX(int)
EMU_MINMAX(unsigned int)
EMU_MINMAX(long)
EMU_MINMAX(unsigned long)
EMU_MINMAX(long long)
EMU_MINMAX(unsigned long long)
#undef EMU_MINMAX
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }

// ---- bit reinterpretation and integer intrinsics --------------------------------------------

template <class To, class From> inline To emu_bitcast(From f) {
    static_assert(sizeof(To) == sizeof(From), "size mismatch");
    To t;
    std::memcpy(&t, &f, sizeof t);
    return t;
}
inline int __float_as_int(float f) { return emu_bitcast<int>(f); }
inline unsigned __float_as_uint(float f) { return emu_bitcast<unsigned>(f); }
inline float __int_as_float(int i) { return emu_bitcast<float>(i); }
inline float __uint_as_float(unsigned u) { return emu_bitcast<float>(u); }
inline long long __double_as_longlong(double d) { return emu_bitcast<long long>(d); }
inline double __longlong_as_double(long long i) { return emu_bitcast<double>(i); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
inline int __float2int_rz(float f) { return (int)f; }
inline float __int2float_rn(int i) { return (float)i; }
inline float __ll2float_rn(long long i) { return (float)i; }
inline double __ll2double_rn(long long i) { return (double)i; }

// ---- memory: cache-hinted loads/stores (alignment-checked) and atomics ----------------------

namespace emu {
template <class T> inline const T* checked(const T* p, const char* name) {
    if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0)
        rt.fail(std::string(name) + ": misaligned address for a " + std::to_string(alignof(T)) + "-byte type");
    return p;
}
}  // namespace emu
template <class T> inline T __ldg(const T* p) { return *emu::checked(p, "__ldg"); }
template <class T> inline T __ldcg(const T* p) { return *emu::checked(p, "__ldcg"); }
template <class T> inline T __ldca(const T* p) { return *emu::checked(p, "__ldca"); }
template <class T> inline T __ldcs(const T* p) { return *emu::checked(p, "__ldcs"); }
template <class T> inline T __ldlu(const T* p) { return *emu::checked(p, "__ldlu"); }
template <class T> inline void __stcg(T* p, T v) { *const_cast<T*>(emu::checked(p, "__stcg")) = v; }
template <class T> inline void __stcs(T* p, T v) { *const_cast<T*>(emu::checked(p, "__stcs")) = v; }
template <class T> inline void __stwb(T* p, T v) { *const_cast<T*>(emu::checked(p, "__stwb")) = v; }

// Fibers never run concurrently, so a plain read-modify-write is atomic.
template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T> inline T atomicAnd(T* p, T v) { T old = *p; *p = old & v; return old; }
template <class T> inline T atomicOr(T* p, T v) { T old = *p; *p = old | v; return old; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
