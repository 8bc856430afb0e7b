/* ringreduce CPU kernels: every reduction op on every dtype, for the node's shared-memory
 * allreduce (node.c), recursive doubling between nodes (p2p.c) and the ring over MPI
 * (ringreduce/kernels/ops.py, through the C extension's combine and finish, which release the
 * GIL); the compression casts; and the failure text every rr_* function reports (rr_fail).
 *
 * The 16-bit floats compute in float32 and round once to nearest even, as torch does; out may
 * alias a or b. Sums of float32, bfloat16 and float16 have fused kernels that also scale in the
 * same pass (AVX2 / F16C where the CPU has them, checked at run time, so the build needs no
 * special flags); everything else is one plain loop, then rr_finish. Scaling is Horovod's
 * (ScaleBufferCPUImpl): one multiply by the factor scale / divisor, computed in float64 and cast
 * to float32 for float32 and the 16-bit floats, after the sum is rounded to the element type.
 * Integer sums and products wrap around, as NumPy's do; Min and Max propagate NaN, as
 * torch.minimum does.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "constants.h"
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RR_X86 1
#endif

/* ------------------------------------------------------------------ failures */

static _Thread_local char error[1536];     /* room for MPI's text (MPI_MAX_ERROR_STRING) */

rr_status rr_fail(rr_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(error, sizeof error, format, args);
    va_end(args);
    return status;
}

const char *rr_error(void) { return error; }

/* ------------------------------------------------------------------ 16-bit float conversions */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return ((u & 0x7fffffffu) > 0x7f800000u) ? (uint16_t)0x7fc0 : rounded;  /* NaN as torch */
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu,
             mantissa = h & 0x3ffu, u;
    if (exponent == 0) {                        /* zero or subnormal: mantissa * 2^-24 */
        float f = (float)mantissa * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (exponent == 31) {
        u = sign | 0x7f800000u | (mantissa << 13);
    } else {
        u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;                 /* NaN: quiet, as torch */
    if (a >= 0x477ff000u) return sign | 0x7c00u;                /* rounds past 65504: inf */
    if (a < 0x38800000u) {          /* below 2^-14: subnormal; adding 0.5 rounds to 2^-24 */
        float t, v;
        memcpy(&v, &a, sizeof v);
        t = v + 0.5f;
        memcpy(&u, &t, sizeof u);
        return sign | (uint16_t)(u - 0x3f000000u);
    }
    a -= 0x38000000u;                                           /* rebias 127 -> 15 */
    a += 0xfffu + ((a >> 13) & 1u);                             /* round to nearest even */
    return sign | (uint16_t)(a >> 13);
}

/* What the CPU can run, checked once at run time (the build needs no special flags). */
enum { CPU_AVX = 1, CPU_AVX2 = 2, CPU_F16C = 4 };

static int cpu_has(int features) {
#ifdef RR_X86
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = (__builtin_cpu_supports("avx") ? CPU_AVX : 0) |
                (__builtin_cpu_supports("avx2") ? CPU_AVX2 : 0) |
                (__builtin_cpu_supports("f16c") ? CPU_F16C : 0);
    }
    return (known & features) == features;
#else
    (void)features;
    return 0;
#endif
}

/* ------------------------------------------------------------------ fused sums */

/* A 16-bit float times a float32 factor, rounded once (Horovod's ScaleBufferCPUImpl). */
static inline uint16_t scale_f16(uint16_t h, float factor) {
    return f32_to_f16(f16_to_f32(h) * factor);
}

static inline uint16_t scale_bf16(uint16_t h, float factor) {
    return f32_to_bf16(bf16_to_f32(h) * factor);
}

/* out = a + b, then, where `scaled`, out *= factor: the sum rounded to the element type first,
 * so that the result equals Horovod's sum followed by its scaling pass bit for bit. */
static void sum_f32(const float *a, const float *b, float *out, size_t n, int scaled,
                    float factor) {
    if (!scaled) {
        for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
    } else {
        for (size_t i = 0; i < n; i++) out[i] = factor * (a[i] + b[i]);
    }
}

#ifdef RR_X86
/* float32 lanes rounded to bfloat16 (nearest even; NaN as torch's), one per 32-bit lane. */
__attribute__((target("avx2")))
static inline __m256i bf16_lanes(__m256 s) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    const __m256i qnan = _mm256_set1_epi32(0x7fc0);
    __m256i u = _mm256_castps_si256(s);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, qnan, nan);
}

/* 8 values at a time: widen to float32 (a shift), add, round to nearest even (where `scaled`,
 * widen again, multiply, round again), narrow. */
__attribute__((target("avx2")))
static size_t sum_bf16_avx2(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n,
                            int scaled, float factor) {
    const __m256 vf = _mm256_set1_ps(factor);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i xa = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256i xb = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i)));
        __m256i r = bf16_lanes(_mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(xa, 16)),
                                             _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16))));
        if (scaled)
            r = bf16_lanes(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(r, 16)), vf));
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                          _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(out + i), packed);
    }
    return i;
}

__attribute__((target("avx,f16c")))
static size_t sum_f16_f16c(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n,
                           int scaled, float factor) {
    const __m256 vf = _mm256_set1_ps(factor);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        __m128i h = _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT);
        if (scaled)
            h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_cvtph_ps(h), vf), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(out + i), h);
    }
    return i;
}
#endif

static void sum_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n,
                     int scaled, float factor) {
    size_t i = 0;
#ifdef RR_X86
    if (cpu_has(CPU_AVX2)) i = sum_bf16_avx2(a, b, out, n, scaled, factor);
#endif
    for (; i < n; i++) {
        uint16_t s = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
        out[i] = scaled ? scale_bf16(s, factor) : s;
    }
}

/* The F16C path rounds as f32_to_f16 does, except for the payload bits of NaNs. */
static void sum_f16(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n,
                    int scaled, float factor) {
    size_t i = 0;
#ifdef RR_X86
    if (cpu_has(CPU_F16C | CPU_AVX)) i = sum_f16_f16c(a, b, out, n, scaled, factor);
#endif
    for (; i < n; i++) {
        uint16_t s = f32_to_f16(f16_to_f32(a[i]) + f16_to_f32(b[i]));
        out[i] = scaled ? scale_f16(s, factor) : s;
    }
}

/* ------------------------------------------------------------------ every op, every dtype */

#define MINIMUM(p, q) (((p) < (q) || (p) != (p)) ? (p) : (q))
#define MAXIMUM(p, q) (((p) > (q) || (p) != (p)) ? (p) : (q))

#define LOOP(T, EXPR)                                                                  \
    do {                                                                               \
        const T *x = a, *y = b;                                                        \
        T *z = out;                                                                    \
        for (size_t i = 0; i < n; i++) {                                               \
            const T p = x[i], q = y[i];                                                \
            z[i] = (EXPR);                                                             \
        }                                                                              \
    } while (0)

/* W: an unsigned type wide enough that sums and products wrap instead of overflowing. */
#define INTEGER_OPS(T, W)                                                              \
    switch (op) {                                                                      \
    case RR_OP_SUM: case RR_OP_AVERAGE: LOOP(T, (T)((W)p + (W)q)); return RR_OK;      \
    case RR_OP_PRODUCT: LOOP(T, (T)((W)p * (W)q)); return RR_OK;                      \
    case RR_OP_MIN: LOOP(T, MINIMUM(p, q)); return RR_OK;                             \
    case RR_OP_MAX: LOOP(T, MAXIMUM(p, q)); return RR_OK;                             \
    default: return rr_check(dtype, op);                                               \
    }

#define FLOAT_OPS(T)                                                                   \
    switch (op) {                                                                      \
    case RR_OP_SUM: case RR_OP_AVERAGE: LOOP(T, p + q); return RR_OK;                 \
    case RR_OP_PRODUCT: LOOP(T, p * q); return RR_OK;                                 \
    case RR_OP_MIN: LOOP(T, MINIMUM(p, q)); return RR_OK;                             \
    case RR_OP_MAX: LOOP(T, MAXIMUM(p, q)); return RR_OK;                             \
    default: return rr_check(dtype, op);                                               \
    }

/* (Sum and Average of the 16-bit floats are rr_combine's fused kernels.) */
#define HALF_OPS(TO, FROM)                                                             \
    switch (op) {                                                                      \
    case RR_OP_PRODUCT: LOOP(uint16_t, FROM(TO(p) * TO(q))); return RR_OK;            \
    case RR_OP_MIN: LOOP(uint16_t, FROM(MINIMUM(TO(p), TO(q)))); return RR_OK;        \
    case RR_OP_MAX: LOOP(uint16_t, FROM(MAXIMUM(TO(p), TO(q)))); return RR_OK;        \
    default: return rr_check(dtype, op);                                               \
    }

rr_status rr_check(int dtype, int op) {
    if (rr_dtype_size(dtype) == 0) return rr_fail(RR_BAD_DTYPE, "unknown dtype code %d", dtype);
    switch (op) {
    case RR_OP_SUM: case RR_OP_AVERAGE: case RR_OP_PRODUCT: case RR_OP_MIN: case RR_OP_MAX:
        return RR_OK;
    case RR_OP_ADASUM:
        return rr_fail(RR_BAD_OP, "reduction op %d (Adasum) has no elementwise kernel: "
                       "Adasum runs in ringreduce/transport/adasum.py", op);
    default:
        return rr_fail(RR_BAD_OP, "unknown reduction op %d", op);
    }
}

/* The unfused kernels: out untouched when (dtype, op) has none (the defaults: rr_check). */
static rr_status combine_plain(int dtype, int op, const void *a, const void *b, void *out,
                               size_t n) {
    switch (dtype) {
    case RR_U8: INTEGER_OPS(uint8_t, uint32_t)
    case RR_I8: INTEGER_OPS(int8_t, uint32_t)
    case RR_I16: INTEGER_OPS(int16_t, uint32_t)
    case RR_I32: INTEGER_OPS(int32_t, uint32_t)
    case RR_I64: INTEGER_OPS(int64_t, uint64_t)
    case RR_F32: FLOAT_OPS(float)
    case RR_F64: FLOAT_OPS(double)
    case RR_F16: HALF_OPS(f16_to_f32, f32_to_f16)
    case RR_BF16: HALF_OPS(bf16_to_f32, f32_to_bf16)
    default: return rr_check(dtype, op);
    }
}

rr_status rr_combine(int dtype, int op, const void *a, const void *b, void *out, size_t n,
                     int last, double divisor, double scale) {
    const int sum = op == RR_OP_SUM || op == RR_OP_AVERAGE;
    const double factor = last ? scale / divisor : 1.0;     /* Horovod's: in float64 */
    const int scaled = factor != 1.0;
    if (sum && dtype == RR_F32) {
        sum_f32(a, b, out, n, scaled, (float)factor);
        return RR_OK;
    }
    if (sum && dtype == RR_BF16) {
        sum_bf16(a, b, out, n, scaled, (float)factor);
        return RR_OK;
    }
    if (sum && dtype == RR_F16) {
        sum_f16(a, b, out, n, scaled, (float)factor);
        return RR_OK;
    }
    rr_status status = combine_plain(dtype, op, a, b, out, n);
    if (status != RR_OK) return status;
    return last ? rr_finish(dtype, out, n, divisor, scale) : RR_OK;
}

/* ------------------------------------------------------------------ finishing */

/* x *= factor, as Horovod's ScaleBufferCPUImpl: integers in float64, truncated toward zero
 * (through int64, so that no float outside the narrower types' range is converted to them);
 * float64 in float64; float32 and the 16-bit floats times the factor cast to float32. */
#define FINISH_INTEGER(T)                                                              \
    do {                                                                               \
        T *v = x;                                                                      \
        for (size_t i = 0; i < n; i++) v[i] = (T)(int64_t)(factor * (double)v[i]);     \
    } while (0)

#define FINISH_FLOAT(T)                                                                \
    do {                                                                               \
        T *v = x;                                                                      \
        const T f = (T)factor;                                                         \
        for (size_t i = 0; i < n; i++) v[i] = f * v[i];                                \
    } while (0)

#define FINISH_HALF(SCALE)                                                             \
    do {                                                                               \
        uint16_t *v = x;                                                               \
        for (size_t i = 0; i < n; i++) v[i] = SCALE(v[i], (float)factor);              \
    } while (0)

rr_status rr_finish(int dtype, void *x, size_t n, double divisor, double scale) {
    const double factor = scale / divisor;      /* Horovod's postscale_factor /= size */
    if (factor == 1.0)
        return rr_dtype_size(dtype) ? RR_OK : rr_check(dtype, RR_OP_SUM);
    switch (dtype) {
    case RR_U8: FINISH_INTEGER(uint8_t); break;
    case RR_I8: FINISH_INTEGER(int8_t); break;
    case RR_I16: FINISH_INTEGER(int16_t); break;
    case RR_I32: FINISH_INTEGER(int32_t); break;
    case RR_I64: FINISH_INTEGER(int64_t); break;
    case RR_F32: FINISH_FLOAT(float); break;
    case RR_F64: FINISH_FLOAT(double); break;
    case RR_F16: FINISH_HALF(scale_f16); break;
    case RR_BF16: FINISH_HALF(scale_bf16); break;
    default: return rr_check(dtype, RR_OP_SUM);
    }
    return RR_OK;
}

size_t rr_dtype_size(int dtype) {
    switch (dtype) {
    case RR_U8: case RR_I8: return 1;
    case RR_I16: case RR_F16: case RR_BF16: return 2;
    case RR_I32: case RR_F32: return 4;
    case RR_I64: case RR_F64: return 8;
    default: return 0;
    }
}

/* ------------------------------------------------------------------ streaming copy */

#ifdef RR_X86
/* 32-byte non-temporal stores from an aligned destination on: the data goes to memory
 * without first reading the destination's lines into the cache (a plain store reads each
 * line before writing it) and without evicting what the cache holds. Returns bytes done. */
__attribute__((target("avx")))
static size_t copy_stream_avx(char *dst, const char *src, size_t bytes) {
    size_t i = 0;
    for (; i + 128 <= bytes; i += 128) {
        __m256 w = _mm256_loadu_ps((const float *)(src + i));
        __m256 x = _mm256_loadu_ps((const float *)(src + i + 32));
        __m256 y = _mm256_loadu_ps((const float *)(src + i + 64));
        __m256 z = _mm256_loadu_ps((const float *)(src + i + 96));
        _mm256_stream_ps((float *)(dst + i), w);
        _mm256_stream_ps((float *)(dst + i + 32), x);
        _mm256_stream_ps((float *)(dst + i + 64), y);
        _mm256_stream_ps((float *)(dst + i + 96), z);
    }
    _mm_sfence();   /* the stores are weakly ordered: complete them before any flag */
    return i;
}

#endif

void rr_copy_stream(void *dst, const void *src, size_t bytes) {
    char *d = dst;
    const char *s = src;
#ifdef RR_X86
    if (bytes >= RR_STREAM_MIN && cpu_has(CPU_AVX)) {
        size_t head = (32 - (uintptr_t)d % 32) % 32;
        memcpy(d, s, head);
        size_t done = head + copy_stream_avx(d + head, s + head, bytes - head);
        memcpy(d + done, s + done, bytes - done);
        return;
    }
#endif
    memcpy(d, s, bytes);
}

/* ------------------------------------------------------------------ casts */

void rr_f32_to_bf16(const float *in, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = f32_to_bf16(in[i]);
}

void rr_bf16_to_f32(const uint16_t *in, float *out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}

#ifdef RR_X86
__attribute__((target("avx,f16c")))
static size_t f32_to_f16_f16c(const float *in, uint16_t *out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

__attribute__((target("avx,f16c")))
static size_t f16_to_f32_f16c(const uint16_t *in, float *out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    return i;
}
#endif

void rr_f32_to_f16(const float *in, uint16_t *out, size_t n) {
    size_t i = 0;
#ifdef RR_X86
    if (cpu_has(CPU_F16C | CPU_AVX)) i = f32_to_f16_f16c(in, out, n);
#endif
    for (; i < n; i++) out[i] = f32_to_f16(in[i]);
}

void rr_f16_to_f32(const uint16_t *in, float *out, size_t n) {
    size_t i = 0;
#ifdef RR_X86
    if (cpu_has(CPU_F16C | CPU_AVX)) i = f16_to_f32_f16c(in, out, n);
#endif
    for (; i < n; i++) out[i] = f16_to_f32(in[i]);
}
