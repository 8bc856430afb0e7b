/* ringreduce CPU kernels: what NumPy lacks (bfloat16) or does slowly (float16), and a fused
 * last reduction step. Plain C functions called through ctypes (which releases the GIL), built
 * by `pip install` into ringreduce/_native*.so together with module.c.
 *
 * Every kernel computes in float32 and rounds once, with round-to-nearest-even like torch.
 * out may alias a or b. Half-precision conversions use F16C when the CPU has it (checked at
 * run time), so the build needs no special flags.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RR_X86 1
#endif

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

/* out = ((a + b) / divisor) * scale, divisor/scale of 1 skipped, so float32 results equal
 * those of separate add, divide and multiply passes bit for bit. */
static inline float finish(float sum, float divisor, float scale) {
    if (divisor != 1.0f) sum = sum / divisor;
    if (scale != 1.0f) sum = sum * scale;
    return sum;
}

void rr_sum_f32(const float *a, const float *b, float *out, size_t n, float divisor,
                float scale) {
    if (divisor == 1.0f && scale == 1.0f) {
        for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
    } else {
        for (size_t i = 0; i < n; i++) out[i] = finish(a[i] + b[i], divisor, scale);
    }
}

#ifdef RR_X86
/* 8 values at a time: widen to float32 (a shift), add, round to nearest even, narrow. */
__attribute__((target("avx2")))
static size_t sum_bf16_avx2(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n,
                            float divisor, float scale) {
    const __m256 vd = _mm256_set1_ps(divisor), vs = _mm256_set1_ps(scale);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    const __m256i qnan = _mm256_set1_epi32(0x7fc0);
    const int div = divisor != 1.0f, mul = scale != 1.0f;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i xa = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256i xb = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i)));
        __m256 s = _mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(xa, 16)),
                                 _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16)));
        if (div) s = _mm256_div_ps(s, vd);
        if (mul) s = _mm256_mul_ps(s, vs);
        __m256i u = _mm256_castps_si256(s);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), lsb), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, qnan, nan);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                          _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(out + i), packed);
    }
    return i;
}
#endif

void rr_sum_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n,
                 float divisor, float scale) {
    size_t i = 0;
#ifdef RR_X86
    if (__builtin_cpu_supports("avx2")) i = sum_bf16_avx2(a, b, out, n, divisor, scale);
#endif
    for (; i < n; i++)
        out[i] = f32_to_bf16(finish(bf16_to_f32(a[i]) + bf16_to_f32(b[i]), divisor, scale));
}

void rr_f32_to_bf16(const float *in, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = f32_to_bf16(in[i]);
}

void rr_bf16_to_f32(const uint16_t *in, float *out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}

int rr_has_f16c(void) {
#ifdef RR_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#else
    return 0;
#endif
}

#ifdef RR_X86
__attribute__((target("avx,f16c")))
void rr_sum_f16(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n,
                float divisor, float scale) {
    const __m256 vd = _mm256_set1_ps(divisor), vs = _mm256_set1_ps(scale);
    const int div = divisor != 1.0f, mul = scale != 1.0f;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        __m256 s = _mm256_add_ps(x, y);
        if (div) s = _mm256_div_ps(s, vd);
        if (mul) s = _mm256_mul_ps(s, vs);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) {
        float x = _cvtsh_ss(a[i]), y = _cvtsh_ss(b[i]);
        out[i] = _cvtss_sh(finish(x + y, divisor, scale), _MM_FROUND_TO_NEAREST_INT);
    }
}

__attribute__((target("avx,f16c")))
void rr_f32_to_f16(const float *in, uint16_t *out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = _cvtss_sh(in[i], _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("avx,f16c")))
void rr_f16_to_f32(const uint16_t *in, float *out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(in[i]);
}
#endif
