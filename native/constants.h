/* The numbers that C (kernels.c, node.c) and Python share, in one place. Python reads them
 * from ringreduce._native (module.c exports each one); the CUDA kernels
 * (ringreduce/gpu/cuda_kernels/*.cu) get the op codes from Python as -D options at compile time. */
#ifndef RINGREDUCE_CONSTANTS_H
#define RINGREDUCE_CONSTANTS_H

/* Reduction ops, numbered as Horovod's ReduceOp (ringreduce.ReduceOp takes these values). */
#define RR_OP_AVERAGE 0
#define RR_OP_SUM 1
#define RR_OP_ADASUM 2
#define RR_OP_MIN 3
#define RR_OP_MAX 4
#define RR_OP_PRODUCT 5

/* Element types (ringreduce.buffers.CODES maps torch dtypes to these). */
#define RR_U8 0
#define RR_I8 1
#define RR_I16 2
#define RR_I32 3
#define RR_I64 4
#define RR_F16 5
#define RR_BF16 6
#define RR_F32 7
#define RR_F64 8
#define RR_DTYPES 9

/* The node's shared segments: flags and headers each on a cache line of their own, slots and
 * staging areas on whole pages with a page of room (data sits at its source's page offset). */
#define RR_LINE 64
#define RR_PAGE 4096
#define RR_HEADER_WORDS 4   /* digest, byte count, per-rank value, spare */

/* The phases of a large node allreduce, as rr_large_profile reports their times. */
#define RR_PHASE_COPY_IN 0      /* our input's peer-owned chunks into our area */
#define RR_PHASE_WAIT_IN 1      /* until every peer's area is filled */
#define RR_PHASE_REDUCE 2       /* our chunk: our input and the peers' areas into the output */
#define RR_PHASE_PUBLISH 3      /* our reduced chunk into our area */
#define RR_PHASE_WAIT_OUT 4     /* until every peer's chunk is reduced */
#define RR_PHASE_COPY_OUT 5     /* the peers' chunks from their areas into the output */
#define RR_PHASES 6

/* rr_copy_stream uses non-temporal stores from this many bytes on. */
#define RR_STREAM_MIN 65536

/* How a rank writes its staging area in a large node allreduce (node.c, write_way). */
#define RR_WRITE_PLAIN 0        /* plain stores: the lines stay in the cache for the peers */
#define RR_WRITE_STREAM 1       /* non-temporal stores (rr_copy_stream) */
#define RR_WRITE_WAYS 2
#define RR_PROBE_EVERY 64       /* writes between tries of the way not in use */

#endif
