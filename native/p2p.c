/* MPI point-to-point from C (see p2p.h). */
#include "p2p.h"

#include "clock.h"
#include "kernels.h"

#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

typedef int (*isend_fn)(const void *, int, intptr_t, int, int, intptr_t, void *);
typedef int (*irecv_fn)(void *, int, intptr_t, int, int, intptr_t, void *);
typedef int (*testall_fn)(int, void *, int *, void *);
typedef int (*get_count_fn)(const void *, intptr_t, int *);
typedef int (*error_string_fn)(int, char *, int *);

static struct {
    isend_fn isend;
    irecv_fn irecv;
    testall_fn testall;
    get_count_fn get_count;
    error_string_fn error_string;
    size_t request_size, status_size;
    intptr_t byte;
} mpi;

static _Thread_local char error[512];

const char *rr_mpi_error(void) { return error; }

int rr_mpi_bind(void *library, size_t request_size, size_t status_size, intptr_t byte_type) {
    if (request_size > RR_MPI_HANDLE_MAX || status_size > RR_MPI_STATUS_MAX) {
        snprintf(error, sizeof error, "MPI_Request (%zu bytes) or MPI_Status (%zu bytes) is "
                 "larger than ringreduce allows for", request_size, status_size);
        return -1;
    }
    struct { const char *name; void **slot; } wanted[] = {
        {"MPI_Isend", (void **)&mpi.isend}, {"MPI_Irecv", (void **)&mpi.irecv},
        {"MPI_Testall", (void **)&mpi.testall}, {"MPI_Get_count", (void **)&mpi.get_count},
        {"MPI_Error_string", (void **)&mpi.error_string}};
    for (size_t i = 0; i < sizeof wanted / sizeof wanted[0]; i++) {
        *wanted[i].slot = dlsym(library, wanted[i].name);
        if (*wanted[i].slot == NULL) {
            snprintf(error, sizeof error, "%s not found beside mpi4py: %s", wanted[i].name,
                     dlerror());
            return -1;
        }
    }
    mpi.request_size = request_size;
    mpi.status_size = status_size;
    mpi.byte = byte_type;
    return 0;
}

static long failed(const char *call, int code) {
    char text[1024];    /* MPI_MAX_ERROR_STRING: 512 in MPICH 5, 1024 in older MPICHs */
    int length = 0;
    if (mpi.error_string(code, text, &length) != 0) length = 0;
    text[length < (int)sizeof text ? length : (int)sizeof text - 1] = '\0';
    snprintf(error, sizeof error, "%s failed (MPI error %d: %s)", call, code, text);
    return RR_MPI_FAILED;
}

long rr_mpi_test(rr_exchange *x) {
    if (!x->pending) return x->received;
    int done = 0, code = mpi.testall(2, x->requests, &done, x->statuses);
    if (code != 0) {
        x->pending = 0;
        return failed("MPI_Testall", code);
    }
    if (!done) return RR_PENDING;
    int count = 0;
    code = mpi.get_count(x->statuses, mpi.byte, &count);     /* the receive's status */
    x->pending = 0;
    if (code != 0) return failed("MPI_Get_count", code);
    x->received = count;
    return count;
}

/* Poll a pending exchange for up to spin_seconds (once when negative). */
static long wait_for(rr_exchange *x, double spin_seconds) {
    double deadline = -1.0;
    for (unsigned polls = 0;; polls++) {
        long result = rr_mpi_test(x);
        if (result != RR_PENDING || spin_seconds < 0) return result;
        if (polls % 16 == 15) {         /* reading the clock costs more than a poll */
            sched_yield();              /* a peer sharing our core (more ranks than cores) */
            double t = rr_now();
            if (deadline < 0) deadline = t + spin_seconds;
            else if (t > deadline) return RR_PENDING;
        }
    }
}

long rr_mpi_exchange(rr_exchange *x, intptr_t comm, int partner, int tag, const void *send,
                     int send_bytes, void *recv, int recv_bytes, double spin_seconds) {
    if (x->pending) {   /* a wait that ended in an exception left one in flight */
        snprintf(error, sizeof error, "an earlier exchange between nodes never completed");
        return RR_MPI_FAILED;
    }
    int code = mpi.irecv(recv, recv_bytes, mpi.byte, partner, tag, comm, x->requests);
    if (code != 0) return failed("MPI_Irecv", code);
    code = mpi.isend(send, send_bytes, mpi.byte, partner, tag, comm,
                     x->requests + mpi.request_size);
    if (code != 0) return failed("MPI_Isend", code);
    x->pending = 1;
    long result = wait_for(x, spin_seconds);
    /* Posted only (a negative spin): pending whatever the one test found, so MPI has moved our
     * send and a completion is kept (rr_mpi_test stores it) for the resume to find. */
    return spin_seconds < 0 && result != RR_MPI_FAILED ? RR_PENDING : result;
}

static long unknown(const rr_reduction *reduction) {
    snprintf(error, sizeof error, "no kernel for dtype code %lld, op %lld",
             (long long)reduction->dtype, (long long)reduction->op);
    return RR_MPI_FAILED;
}

static int digests_agree(const int64_t *gathered, int members) {
    for (int i = 1; i < members; i++)
        if (gathered[2 * i] != gathered[0]) return 0;
    return 1;
}

long rr_doubling(rr_exchange *x, int resume, intptr_t comm, int tag, const rr_round *rounds,
                 int nrounds, const rr_reduction *reduction, void *incoming, int capacity,
                 const int64_t *gathered, int members, double spin_seconds) {
    int64_t nbytes = reduction != NULL ? reduction->nbytes : 0;
    if (!resume) {
        x->round = 0;
        x->complete = reduction != NULL;
        if (reduction != NULL && reduction->src != 0)
            memcpy((void *)(intptr_t)reduction->data, (const void *)(intptr_t)reduction->src,
                   (size_t)nbytes);
    }
    for (; x->round < nrounds; x->round++) {
        const rr_round *r = &rounds[x->round];
        long received;
        if (resume) {
            received = wait_for(x, spin_seconds);
            resume = 0;
        } else {
            memcpy((void *)(intptr_t)r->headers, (const void *)(intptr_t)r->ours,
                   (size_t)r->size);
            received = rr_mpi_exchange(x, comm, (int)r->partner, tag,
                                       (const void *)(intptr_t)r->headers,
                                       (int)(r->size + nbytes), incoming, capacity,
                                       spin_seconds);
        }
        if (received < 0) return received;      /* pending, or failed */
        memcpy((void *)(intptr_t)r->theirs, incoming, (size_t)r->size);
        if (reduction == NULL) continue;
        if (received - r->size != nbytes) {
            x->complete = 0;    /* headers only: a joined rank, or one in another collective */
        } else if (x->complete) {
            void *data = (void *)(intptr_t)reduction->data;
            const void *other = (const char *)incoming + r->size;
            if (rr_combine((int)reduction->dtype, (int)reduction->op, r->lower ? data : other,
                           r->lower ? other : data, data, (size_t)reduction->count, 0, 1.0,
                           1.0) != 0)
                return unknown(reduction);
        }
    }
    if (!x->complete || !digests_agree(gathered, members)) return 0;
    if (reduction->dst != 0) {
        void *data = (void *)(intptr_t)reduction->data;
        if (rr_finish((int)reduction->dtype, data, (size_t)reduction->count,
                      reduction->divisor, reduction->scale) != 0)
            return unknown(reduction);
        memcpy((void *)(intptr_t)reduction->dst, data, (size_t)nbytes);
    }
    return 1;
}
