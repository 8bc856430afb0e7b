/* What every fallible rr_* function of kernels.c, node.c and p2p.c returns. The statuses before
 * RR_BAD_DTYPE are outcomes a caller acts on; from RR_BAD_DTYPE on they are failures, and
 * rr_error() then says what failed (module.c's raise_status makes them Python exceptions, in
 * that one place). Values a function also produces (bytes received, ...) go through its
 * arguments. */
#ifndef RINGREDUCE_STATUS_H
#define RINGREDUCE_STATUS_H

typedef enum rr_status {
    RR_OK = 0,          /* done: ready, complete, agreed */
    RR_WAITING,         /* node: a peer's flag is not up yet: wait elsewhere, then call again */
    RR_PENDING,         /* MPI: an exchange still in flight: poll it, or resume */
    RR_BETWEEN_NODES,   /* rr_large_run: our chunk is reduced here: the ring between nodes
                           finishes it, then call again */
    RR_MISMATCH,        /* the signature digests differ (rr_doubling: or a message came
                           without data, or there was no data to reduce) */
    /* failures (RR_FAILED), rr_error() telling which call and why */
    RR_BAD_DTYPE,       /* no such element type code */
    RR_BAD_OP,          /* no elementwise kernel for this op (unknown, or Adasum) */
    RR_BAD_ARGUMENT,    /* sizes or ranks that cannot be right */
    RR_BAD_STATE,       /* called out of order: an exchange still in flight, no job begun */
    RR_NO_MEMORY,
    RR_MPI_ERROR,       /* an MPI call failed: rr_error() has MPI's own text */
} rr_status;

#define RR_FAILED(status) ((status) >= RR_BAD_DTYPE)

/* Records why (printf-style) for rr_error() and returns `status`: `return rr_fail(...)`.
 * (Defined in kernels.c, the layer every other file builds on.) */
rr_status rr_fail(rr_status status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

/* This thread's text of its last failure. */
const char *rr_error(void);

#endif
