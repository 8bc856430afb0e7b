/* Allreduce through a node's shared memory (node.c), for module.c. One rr_node per process
 * set's window: sets progress independently, each on its own thread. */
#ifndef RINGREDUCE_NODE_H
#define RINGREDUCE_NODE_H
#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct rr_node rr_node;

/* The layout of one rank's segment for slots of `small_bytes` and blocks of `block_bytes`:
 * both rounded up to whole pages; returns the segment's size in bytes. */
size_t rr_node_layout(size_t small_bytes, size_t block_bytes, size_t *slot_bytes,
                      size_t *block_rounded);
/* *node for local rank `me` of n (2 or more: a rank alone on its node has no window) over every
 * rank's segment at bases[r]: RR_OK, RR_BAD_ARGUMENT or RR_NO_MEMORY. Zeroes our flag. */
rr_status rr_node_attach(int me, int n, const uintptr_t *bases, size_t slot_bytes,
                         size_t block_bytes, rr_node **node);
void rr_node_detach(rr_node *node);
int rr_node_ready(rr_node *node);     /* whether every flag is up, as a truth value */

/* The waits: each polls the flags for up to spin_seconds (once when negative), then returns
 * RR_OK when every flag is up, or RR_WAITING to wait elsewhere (rr_node_ready tells when).
 * rr_node_wait is the *_begin functions' wait, for a caller that passed them a negative spin:
 * publish only, then work, then wait. */
rr_status rr_node_wait(rr_node *node, double spin_seconds);

/* The signature check alone (for collectives whose data goes over MPI). rr_headers_read copies
 * every local rank's digest and per-rank word of the last exchange (this one, or a small or
 * large allreduce whose digests differed): RR_OK when the digests agree, else RR_MISMATCH. */
rr_status rr_headers_begin(rr_node *node, int64_t digest, int64_t per_rank, double spin_seconds);
rr_status rr_headers_read(rr_node *node, int64_t *digests, int64_t *per_rank, size_t stride);

/* Small: publish (RR_OK or RR_WAITING, as the waits), then, every flag up, reduce every slot
 * in rank order into dst: RR_OK, RR_MISMATCH (dst untouched), or rr_check's failure (dst
 * untouched; the exchange itself is complete, so the next one starts cleanly). */
rr_status rr_small_begin(rr_node *node, const void *src, size_t nbytes, int64_t digest,
                         double spin_seconds);
rr_status rr_small_end(rr_node *node, void *dst, size_t count, int dtype, int op,
                       double divisor, double scale);

/* Large: rr_large_begin checks dtype and op (RR_OK, or rr_check's failure before any flag,
 * and then rr_large_run refuses with RR_BAD_STATE until a begin succeeds); rr_large_run runs it
 * to RR_OK (done), RR_WAITING (call again once rr_node_ready), RR_BETWEEN_NODES (our chunk,
 * rr_large_chunk, is reduced on this node: finish it between nodes, then call again),
 * RR_MISMATCH, or a failure of its kernel. */
rr_status rr_large_begin(rr_node *node, const void *src, void *dst, size_t count, int dtype,
                         int op, double divisor, double scale, int64_t digest,
                         int between_nodes);
rr_status rr_large_run(rr_node *node, double spin_seconds);
void rr_large_chunk(rr_node *node, size_t *first, size_t *count);
/* Seconds spent in each RR_PHASE_* of large allreduces since the last reset, and the blocks
 * this rank has written its area each RR_WRITE_* way (since attaching: not reset). */
void rr_large_profile(rr_node *node, double *seconds, int64_t *blocks, int reset);

int64_t rr_allreduce_digest(const char *name, size_t name_len, const char *op, size_t op_len,
                            const char *dtype, size_t dtype_len, const int64_t *shape,
                            size_t ndim, double prescale, double postscale);
#endif
