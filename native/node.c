/* The small allreduce among the ranks of one node, in C: the same protocol and memory layout
 * as NodeShm.small_allreduce in ringreduce/shm.py (keep the two in step), without the
 * Python around every step. Each rank's segment of the shared window is
 *     [flag | header slot x2 | small slot x2 | ...], each piece starting on a 64-byte line,
 * and a rank's flag counts the flags it has raised, so parity = flag % 2 selects the slots.
 *
 * One collective: copy our data into our slot, write the header (signature digest, byte
 * count, 0), fence, raise the flag; wait for every flag; compare digests; reduce every slot in
 * rank order into the output. Every rank runs the same arithmetic in the same order, so the
 * results are bitwise identical.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "node.h"

#define LINE 64

void rr_sum_f32(const float *a, const float *b, float *out, size_t n, float divisor,
                float scale);

static struct {
    int me, n;
    size_t small_bytes;
    char **base;            /* each local rank's segment, mapped into this process */
} node;

int rr_node_attach(int me, int n, const uintptr_t *bases, size_t small_bytes) {
    rr_node_detach();
    node.base = malloc(sizeof(char *) * (size_t)n);
    if (node.base == NULL) return -1;
    for (int r = 0; r < n; r++) node.base[r] = (char *)bases[r];
    node.me = me;
    node.n = n;
    node.small_bytes = small_bytes;
    return 0;
}

void rr_node_detach(void) {
    free(node.base);
    node.base = NULL;
    node.n = 0;
}

static int64_t *flag_of(int r) { return (int64_t *)node.base[r]; }

static int64_t *header_of(int r, int64_t flag) {
    return (int64_t *)(node.base[r] + LINE + (flag % 2) * LINE);
}

static char *slot_of(int r, int64_t flag) {
    return node.base[r] + 3 * LINE + (size_t)(flag % 2) * node.small_bytes;
}

static int64_t raised(void) { return __atomic_load_n(flag_of(node.me), __ATOMIC_RELAXED); }

int rr_node_ready(void) {
    int64_t flag = raised();
    for (int r = 0; r < node.n; r++)
        if (__atomic_load_n(flag_of(r), __ATOMIC_ACQUIRE) < flag) return 0;
    return 1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int rr_small_begin(const void *src, size_t nbytes, int64_t digest, double spin_seconds) {
    int64_t flag = raised() + 1;
    memcpy(slot_of(node.me, flag), src, nbytes);
    int64_t *header = header_of(node.me, flag);
    header[0] = digest;
    header[1] = (int64_t)nbytes;
    header[2] = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* slot and header before the flag */
    __atomic_store_n(flag_of(node.me), flag, __ATOMIC_SEQ_CST);
    double deadline = -1.0;
    for (unsigned spins = 0;; spins++) {
        if (rr_node_ready()) return 1;
        if (spins % 64 == 63) {         /* reading the clock costs more than a poll */
            double t = now();
            if (deadline < 0) deadline = t + spin_seconds;
            else if (t > deadline) return 0;
        }
    }
}

/* out = slot_0 op slot_1 op ... in rank order; the last step divides and scales. */
#define SUM_IN_ORDER(type)                                                              \
    do {                                                                               \
        type *out = dst;                                                               \
        for (int r = 1; r < node.n; r++) {                                             \
            const type *a = r == 1 ? (const type *)slot_of(0, flag) : out;             \
            const type *b = (const type *)slot_of(r, flag);                            \
            for (size_t i = 0; i < count; i++) out[i] = a[i] + b[i];                   \
        }                                                                              \
    } while (0)

int rr_small_end(void *dst, size_t count, int kind, double divisor, double scale) {
    int64_t flag = raised();
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* peers' slots after their flags */
    int64_t digest = header_of(0, flag)[0];
    for (int r = 1; r < node.n; r++)
        if (header_of(r, flag)[0] != digest) return -1;
    switch (kind) {
    case RR_KIND_F32: {     /* as the Python path: NumPy adds, then our fused last step */
        float *out = dst;
        for (int r = 1; r < node.n; r++) {
            const float *a = r == 1 ? (const float *)slot_of(0, flag) : out;
            int last = r == node.n - 1;
            rr_sum_f32(a, (const float *)slot_of(r, flag), out, count,
                       last ? (float)divisor : 1.0f, last ? (float)scale : 1.0f);
        }
        break;
    }
    case RR_KIND_F64: {     /* as NumPy adds, then torch's division and scaling */
        SUM_IN_ORDER(double);
        double *out = dst;
        if (divisor != 1.0) for (size_t i = 0; i < count; i++) out[i] = out[i] / divisor;
        if (scale != 1.0) for (size_t i = 0; i < count; i++) out[i] = out[i] * scale;
        break;
    }
    case RR_KIND_I32_SUM:   /* unsigned: wraps around as NumPy's integer add does */
        SUM_IN_ORDER(uint32_t);
        break;
    case RR_KIND_I64_SUM:
        SUM_IN_ORDER(uint64_t);
        break;
    default:
        return -2;
    }
    return 0;
}

/* FNV-1a, 64 bits, over an allreduce's signature fields: equal across ranks exactly when the
 * fields are (up to a 2^-64 chance), and computed in well under a microsecond. */
static uint64_t fnv(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

int64_t rr_allreduce_digest(const char *name, size_t name_len, const char *op, size_t op_len,
                            const char *dtype, size_t dtype_len, const int64_t *shape,
                            size_t ndim, double prescale, double postscale) {
    static const char zero = 0;
    uint64_t h = fnv(0xcbf29ce484222325ull, "allreduce", 10);
    h = fnv(fnv(h, name, name_len), &zero, 1);
    h = fnv(fnv(h, op, op_len), &zero, 1);
    h = fnv(fnv(h, dtype, dtype_len), &zero, 1);
    h = fnv(h, &ndim, sizeof ndim);
    h = fnv(h, shape, ndim * sizeof *shape);
    h = fnv(h, &prescale, sizeof prescale);
    h = fnv(h, &postscale, sizeof postscale);
    return (int64_t)h;
}
