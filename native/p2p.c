/* MPI point-to-point from C (see p2p.h). */
#include "p2p.h"

#include "clock.h"
#include "kernels.h"

#include <dlfcn.h>
#include <sched.h>
#include <string.h>

typedef int (*isend_fn)(const void *, int, intptr_t, int, int, intptr_t, void *);
typedef int (*irecv_fn)(void *, int, intptr_t, int, int, intptr_t, void *);
typedef int (*testall_fn)(int, void *, int *, void *);
typedef int (*test_fn)(void *, int *, void *);
typedef int (*cancel_fn)(void *);
typedef int (*wait_fn)(void *, void *);
typedef int (*get_count_fn)(const void *, intptr_t, int *);
typedef int (*error_string_fn)(int, char *, int *);

static struct {
    isend_fn isend;
    irecv_fn irecv;
    testall_fn testall;
    test_fn test;
    cancel_fn cancel;
    wait_fn wait;
    get_count_fn get_count;
    error_string_fn error_string;
    size_t request_size, status_size;
    intptr_t byte;
} mpi;

rr_status rr_mpi_bind(void *library, size_t request_size, size_t status_size,
                      intptr_t byte_type) {
    if (request_size > RR_MPI_HANDLE_MAX || status_size > RR_MPI_STATUS_MAX)
        return rr_fail(RR_MPI_ERROR, "MPI_Request (%zu bytes) or MPI_Status (%zu bytes) is "
                       "larger than ringreduce allows for", request_size, status_size);
    struct { const char *name; void **slot; } wanted[] = {
        {"MPI_Isend", (void **)&mpi.isend}, {"MPI_Irecv", (void **)&mpi.irecv},
        {"MPI_Testall", (void **)&mpi.testall}, {"MPI_Test", (void **)&mpi.test},
        {"MPI_Cancel", (void **)&mpi.cancel}, {"MPI_Wait", (void **)&mpi.wait},
        {"MPI_Get_count", (void **)&mpi.get_count},
        {"MPI_Error_string", (void **)&mpi.error_string}};
    for (size_t i = 0; i < sizeof wanted / sizeof wanted[0]; i++) {
        *wanted[i].slot = dlsym(library, wanted[i].name);
        if (*wanted[i].slot == NULL)
            return rr_fail(RR_MPI_ERROR, "%s not found beside mpi4py: %s", wanted[i].name,
                           dlerror());
    }
    mpi.request_size = request_size;
    mpi.status_size = status_size;
    mpi.byte = byte_type;
    return RR_OK;
}

static rr_status failed(const char *call, int code) {
    char text[1024];    /* MPI_MAX_ERROR_STRING: 512 in MPICH 5, 1024 in older MPICHs */
    int length = 0;
    if (mpi.error_string(code, text, &length) != 0) length = 0;
    text[length < (int)sizeof text ? length : (int)sizeof text - 1] = '\0';
    return rr_fail(RR_MPI_ERROR, "%s failed (MPI error %d: %s)", call, code, text);
}

/* After a failure: request i of x (0 the receive, 1 the send) completed or cancelled, and
 * freed, so that no receive stays posted to take a later message meant for someone else. A
 * request that is null (freed by a failed Testall) or complete is only freed; MPI_Wait on one
 * marked for cancellation returns whatever the peers do. Errors here leave the first one's
 * text: it is the one reported. */
static void withdraw(rr_exchange *x, int i) {
    void *request = x->requests + (size_t)i * mpi.request_size;
    void *status = x->statuses + (size_t)i * mpi.status_size;
    int done = 0;
    if (mpi.test(request, &done, status) != 0 || done) return;
    mpi.cancel(request);
    mpi.wait(request, status);
}

rr_status rr_mpi_test(rr_exchange *x) {
    if (!x->pending) return RR_OK;
    int done = 0, code = mpi.testall(2, x->requests, &done, x->statuses);
    if (code != 0) {
        rr_status status = failed("MPI_Testall", code);
        withdraw(x, 0);
        withdraw(x, 1);
        x->pending = 0;
        return status;
    }
    if (!done) return RR_PENDING;
    int count = 0;
    code = mpi.get_count(x->statuses, mpi.byte, &count);     /* the receive's status */
    x->pending = 0;
    if (code != 0) return failed("MPI_Get_count", code);
    x->received = count;
    return RR_OK;
}

/* Poll a pending exchange for up to spin_seconds (once when negative). */
static rr_status wait_for(rr_exchange *x, double spin_seconds) {
    double deadline = -1.0;
    for (unsigned polls = 0;; polls++) {
        rr_status result = rr_mpi_test(x);
        if (result != RR_PENDING || spin_seconds < 0) return result;
        if (polls % 16 == 15) {         /* reading the clock costs more than a poll */
            sched_yield();              /* a peer sharing our core (more ranks than cores) */
            double t = rr_now();
            if (deadline < 0) deadline = t + spin_seconds;
            else if (t > deadline) return RR_PENDING;
        }
    }
}

rr_status rr_mpi_exchange(rr_exchange *x, intptr_t comm, int partner, int tag,
                          const void *send, int send_bytes, void *recv, int recv_bytes,
                          double spin_seconds) {
    if (x->pending)     /* a wait that ended in an exception left one in flight */
        return rr_fail(RR_BAD_STATE, "an earlier exchange between nodes never completed");
    int code = mpi.irecv(recv, recv_bytes, mpi.byte, partner, tag, comm, x->requests);
    if (code != 0) return failed("MPI_Irecv", code);
    code = mpi.isend(send, send_bytes, mpi.byte, partner, tag, comm,
                     x->requests + mpi.request_size);
    if (code != 0) {
        rr_status status = failed("MPI_Isend", code);
        withdraw(x, 0);     /* the receive is posted: take it back */
        return status;
    }
    x->pending = 1;
    rr_status result = wait_for(x, spin_seconds);
    /* Posted only (a negative spin): pending whatever the one test found, so MPI has moved our
     * send and a completion is kept (rr_mpi_test stores it) for the resume to find. */
    return spin_seconds < 0 && !RR_FAILED(result) ? RR_PENDING : result;
}

/* rr_doubling's checks before its first round is posted: a kernel for the reduction, a data
 * size its count fills, and messages that fit the partner's receive (as large as ours). */
static rr_status check_reduction(const rr_reduction *reduction, const rr_round *rounds,
                                 int nrounds, int capacity) {
    rr_status status = rr_check((int)reduction->dtype, (int)reduction->op);
    if (status != RR_OK) return status;
    if (reduction->count < 0 ||
        reduction->nbytes != reduction->count * (int64_t)rr_dtype_size((int)reduction->dtype))
        return rr_fail(RR_BAD_ARGUMENT, "%lld bytes of data are not %lld elements "
                       "of dtype code %lld", (long long)reduction->nbytes,
                       (long long)reduction->count, (long long)reduction->dtype);
    for (int i = 0; i < nrounds; i++)
        if (rounds[i].size < 0 || rounds[i].size + reduction->nbytes > capacity)
            return rr_fail(RR_BAD_ARGUMENT, "a message of %lld header and %lld data "
                           "bytes is larger than the %d bytes a receive holds",
                           (long long)rounds[i].size, (long long)reduction->nbytes, capacity);
    return RR_OK;
}

static int digests_agree(const int64_t *gathered, int members) {
    for (int i = 1; i < members; i++)
        if (gathered[2 * i] != gathered[0]) return 0;
    return 1;
}

rr_status rr_doubling(rr_exchange *x, int resume, intptr_t comm, int tag,
                      const rr_round *rounds, int nrounds, const rr_reduction *reduction,
                      void *incoming, int capacity, const int64_t *gathered, int members,
                      double spin_seconds) {
    int64_t nbytes = reduction != NULL ? reduction->nbytes : 0;
    if (!resume) {
        if (reduction != NULL) {
            rr_status status = check_reduction(reduction, rounds, nrounds, capacity);
            if (status != RR_OK) return status;
        }
        x->round = 0;
        x->complete = reduction != NULL;
        if (reduction != NULL && reduction->src != 0)
            memcpy((void *)(intptr_t)reduction->data, (const void *)(intptr_t)reduction->src,
                   (size_t)nbytes);
    }
    for (; x->round < nrounds; x->round++) {
        const rr_round *r = &rounds[x->round];
        rr_status status;
        if (resume) {
            status = wait_for(x, spin_seconds);
            resume = 0;
        } else {
            memcpy((void *)(intptr_t)r->headers, (const void *)(intptr_t)r->ours,
                   (size_t)r->size);
            status = rr_mpi_exchange(x, comm, (int)r->partner, tag,
                                     (const void *)(intptr_t)r->headers,
                                     (int)(r->size + nbytes), incoming, capacity,
                                     spin_seconds);
        }
        if (status != RR_OK) return status;     /* pending, or failed */
        long received = x->received;
        memcpy((void *)(intptr_t)r->theirs, incoming, (size_t)r->size);
        if (reduction == NULL) continue;
        if (received - r->size != nbytes) {
            x->complete = 0;    /* headers only: a joined rank, or one in another collective */
        } else if (x->complete) {
            void *data = (void *)(intptr_t)reduction->data;
            const void *other = (const char *)incoming + r->size;
            status = rr_combine((int)reduction->dtype, (int)reduction->op,
                                r->lower ? data : other, r->lower ? other : data, data,
                                (size_t)reduction->count, 0, 1.0, 1.0);
            if (status != RR_OK) return status;     /* the check above makes it unreachable */
        }
    }
    if (!x->complete || !digests_agree(gathered, members)) return RR_MISMATCH;
    if (reduction->dst != 0) {
        void *data = (void *)(intptr_t)reduction->data;
        rr_status status = rr_finish((int)reduction->dtype, data, (size_t)reduction->count,
                                     reduction->divisor, reduction->scale);
        if (status != RR_OK) return status;
        memcpy((void *)(intptr_t)reduction->dst, data, (size_t)nbytes);
    }
    return RR_OK;
}
