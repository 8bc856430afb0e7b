/* The CPU reduction kernels of kernels.c, for node.c, p2p.c and module.c (whose _native.combine,
 * finish and cast ringreduce/kernels/ops.py calls). dtype and op codes are constants.h's RR_*
 * values. */
#ifndef RINGREDUCE_KERNELS_H
#define RINGREDUCE_KERNELS_H
#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* Whether rr_combine has a kernel for (dtype, op): RR_OK, RR_BAD_DTYPE or RR_BAD_OP (Adasum
 * included: it is no elementwise op). Every entry point that takes a dtype and an op checks
 * them with this before it writes or publishes anything. */
rr_status rr_check(int dtype, int op);

/* out = a op b over n elements (out may alias a or b). With `last`, the result is finished as
 * rr_finish does, in the same pass where a fused kernel exists (a sum rounded to the element
 * type before it is scaled, as rr_finish would find it). RR_OK, or rr_check's failure (out
 * untouched). */
rr_status rr_combine(int dtype, int op, const void *a, const void *b, void *out, size_t n,
                     int last, double divisor, double scale);

/* In place: x = x * (scale / divisor), Horovod's scaling (Average's postscale_factor / size,
 * then ScaleBufferCPUImpl): the factor computed in float64, nothing done when it is 1, then one
 * multiply per element: float64 by the factor, float32 and the 16-bit floats by the factor cast
 * to float32 (the 16-bit ones widened to float32 and rounded back once), integers in float64
 * and truncated toward zero. RR_OK, or RR_BAD_DTYPE (x untouched). */
rr_status rr_finish(int dtype, void *x, size_t n, double divisor, double scale);

/* Bytes per element; 0 for an unknown dtype code. */
size_t rr_dtype_size(int dtype);

/* memcpy with non-temporal stores from RR_STREAM_MIN bytes on (where the CPU has AVX): the
 * fastest single-thread copy of a large buffer to memory, which bench_allreduce.py uses as its
 * yardstick, and one of the two ways the node allreduce writes its staging areas (node.c,
 * write_way). Complete (fenced) when it returns. */
void rr_copy_stream(void *dst, const void *src, size_t bytes);

/* The compression casts. */
void rr_f32_to_bf16(const float *in, uint16_t *out, size_t n);
void rr_bf16_to_f32(const uint16_t *in, float *out, size_t n);
void rr_f32_to_f16(const float *in, uint16_t *out, size_t n);
void rr_f16_to_f32(const uint16_t *in, float *out, size_t n);
#endif
