/* MPI point-to-point from C, through the MPI library that mpi4py loaded: a small exchange
 * between nodes posts, polls and completes without returning to Python. The functions are
 * looked up at run time (rr_mpi_bind), so building needs no MPI headers and one build works
 * with any MPI that mpi4py works with. Handles travel as integers (mpi4py's _handleof), which
 * the calling conventions of x86-64 and AArch64 pass alike whether the MPI declares them int
 * (MPICH) or pointers (Open MPI, the standard ABI). */
#ifndef RINGREDUCE_P2P_H
#define RINGREDUCE_P2P_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define RR_MPI_HANDLE_MAX 16    /* room for one MPI_Request */
#define RR_MPI_STATUS_MAX 64    /* room for one MPI_Status */

/* One exchange in flight: a receive and a send with one partner; and where a run of
 * recursive-doubling rounds (rr_doubling) stands. */
typedef struct rr_exchange {
    unsigned char requests[2 * RR_MPI_HANDLE_MAX];      /* receive, send */
    unsigned char statuses[2 * RR_MPI_STATUS_MAX];
    long received;                                      /* bytes, once complete */
    int pending;
    int round;          /* the round rr_doubling waits in */
    int complete;       /* every message so far carried data */
} rr_exchange;

/* One round of recursive doubling between nodes (crossnode.py builds them, as int64 words). */
typedef struct rr_round {
    int64_t partner, lower;     /* the partner's cross rank; whether our half comes first */
    int64_t size;               /* header bytes each side sends */
    int64_t ours, headers;      /* our half's headers; where they go, just before the data */
    int64_t theirs;             /* where their headers (arriving at `incoming`) are kept */
} rr_round;

/* What rr_doubling reduces: `nbytes` of `data` (count elements of dtype, op), in place,
 * copied in from `src` first and, once complete and agreed, scaled by scale / divisor
 * (rr_finish) and copied out to `dst` (addresses; 0: no such copy). */
typedef struct rr_reduction {
    int64_t nbytes, count, dtype, op, src, dst;
    double divisor, scale;
    int64_t data;
} rr_reduction;

/* Look up the MPI functions in `library` (a dlopen handle of mpi4py's extension: its
 * dependencies hold libmpi). RR_OK, or RR_MPI_ERROR. */
rr_status rr_mpi_bind(void *library, size_t request_size, size_t status_size,
                      intptr_t byte_type);

/* Receive up to recv_bytes from `partner` and send send_bytes to it (tag `tag` on `comm`),
 * then poll both for up to spin_seconds (a negative one: test once, so MPI moves our send,
 * and return RR_PENDING; rr_mpi_test then returns what that test found). RR_OK (x->received:
 * the bytes received), RR_PENDING, RR_BAD_STATE (an earlier exchange is still in flight), or
 * RR_MPI_ERROR. A failure withdraws whatever it had posted (a receive is cancelled, or
 * completed if a message had matched it already, and freed), so no receive stays posted to
 * swallow a later message. */
rr_status rr_mpi_exchange(rr_exchange *x, intptr_t comm, int partner, int tag,
                          const void *send, int send_bytes, void *recv, int recv_bytes,
                          double spin_seconds);

/* Poll a pending exchange once: RR_OK (x->received), RR_PENDING, or RR_MPI_ERROR (both
 * requests withdrawn, as above). */
rr_status rr_mpi_test(rr_exchange *x);

/* Run the rounds from the first (resume 0) or from the one that was pending (polled for up
 * to spin_seconds before it counts as still pending; a negative spin_seconds posts the first
 * round and returns, so the caller can work while it travels): in each, our
 * half's headers (and, with a reduction, the data after them) go to the partner, theirs are
 * kept, and their data is combined with ours, the lower half first, so both sides compute
 * the same bits. Returns RR_OK when every message carried data and every digest of
 * `gathered` (`members` (digest, word) pairs) agrees (the result is then finished and copied
 * to the reduction's dst), RR_MISMATCH when not (dst untouched; always so without a
 * reduction), RR_PENDING, or a failure: the reduction's dtype and op (rr_check) and its
 * sizes are checked before the first round is posted; RR_MPI_ERROR as rr_mpi_exchange's. */
rr_status rr_doubling(rr_exchange *x, int resume, intptr_t comm, int tag,
                      const rr_round *rounds, int nrounds, const rr_reduction *reduction,
                      void *incoming, int capacity, const int64_t *gathered, int members,
                      double spin_seconds);

#endif
