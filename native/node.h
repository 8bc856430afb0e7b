/* Allreduce through a node's shared memory (node.c), for module.c. */
#ifndef RINGREDUCE_NODE_H
#define RINGREDUCE_NODE_H
#include <stddef.h>
#include <stdint.h>

/* What a reduction sums (Sum, or Average through the divisor): as kernels.py's node_kind. */
enum { RR_KIND_F32 = 0, RR_KIND_F64 = 1, RR_KIND_I32_SUM = 2, RR_KIND_I64_SUM = 3,
       RR_KIND_BF16 = 4, RR_KIND_F16 = 5 /* needs F16C: rr_has_f16c() */ };

int rr_node_attach(int me, int n, const uintptr_t *bases, size_t slot_bytes,
                   size_t block_bytes);
void rr_node_detach(void);
int rr_node_ready(void);
int rr_small_begin(const void *src, size_t nbytes, int64_t digest, double spin_seconds);
int rr_small_end(void *dst, size_t count, int kind, double divisor, double scale);
size_t rr_kind_size(int kind);
int rr_large_begin(const void *src, void *dst, size_t count, int kind, double divisor,
                   double scale, int64_t digest, int between_nodes);
int rr_large_run(double spin_seconds);
void rr_large_chunk(size_t *first, size_t *count);
int64_t rr_allreduce_digest(const char *name, size_t name_len, const char *op, size_t op_len,
                            const char *dtype, size_t dtype_len, const int64_t *shape,
                            size_t ndim, double prescale, double postscale);
#endif
