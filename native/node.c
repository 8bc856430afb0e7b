/* Allreduce among the ranks of one node, in C: the same protocols and memory layout as
 * NodeShm.small_allreduce and NodeShm.large_allreduce in ringreduce/shm.py (keep them in
 * step), without the Python around every step. Each rank's segment of the shared window is
 *     [flag | header slot x2 | small slot x2 | block area x2], each starting on a 64-byte line,
 * and a rank's flag counts the flags it has raised: flag % 2 selects the header and small
 * slots, flag / 2 % 2 the block area.
 *
 * Small: copy our data into our slot, write the header (signature digest, byte count, where
 * in the slot the data starts), fence, raise the flag; wait for every flag; compare digests;
 * reduce every slot in rank order into the output. Every rank runs the same arithmetic in the
 * same order, so the results are bitwise identical.
 *
 * Large, block by block: copy into our area the chunks our peers own; flag; reduce our chunk
 * from our input and every peer's area into the output and our area; flag; copy every peer's
 * finished chunk out of its area. Each chunk is computed by one rank and copied, so results are
 * bitwise identical. Blocks are small enough that the areas stay in the shared cache, so the
 * only traffic to memory is reading the input and writing the output. Staged data sits at the
 * same offset within a page as the rank's input (the header's per-rank word tells the peers
 * where): copies between addresses a little apart modulo 4 KiB run several times slower, as
 * loads falsely wait on stores ("4K aliasing"). A wait that outlasts the spin returns to
 * Python (the stall watch waits there), which calls rr_large_run again; so does each reduced
 * chunk when ranks span several nodes: Python runs our ring between nodes on it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#include "node.h"

#define LINE 64
#define PAGE 4096

/* kernels.c */
void rr_sum_f32(const float *a, const float *b, float *out, size_t n, float divisor,
                float scale);
void rr_sum_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n, float divisor,
                 float scale);
#if defined(__x86_64__) || defined(__i386__)
void rr_sum_f16(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n, float divisor,
                float scale);
#endif

static struct {
    int me, n;
    size_t slot_bytes, block_bytes;     /* as NodeShm's: a small slot, a block (whole pages) */
    char **base;            /* each local rank's segment, mapped into this process */
    size_t *shift;          /* each rank's offset of its data in its slot or area */
} node;

int rr_node_attach(int me, int n, const uintptr_t *bases, size_t slot_bytes,
                   size_t block_bytes) {
    rr_node_detach();
    node.base = malloc(sizeof(char *) * (size_t)n);
    node.shift = calloc((size_t)n, sizeof(size_t));
    if (node.base == NULL || node.shift == NULL) return -1;
    for (int r = 0; r < n; r++) node.base[r] = (char *)bases[r];
    node.me = me;
    node.n = n;
    node.slot_bytes = slot_bytes;
    node.block_bytes = block_bytes;
    return 0;
}

void rr_node_detach(void) {
    free(node.base);
    free(node.shift);
    node.base = NULL;
    node.shift = NULL;
    node.n = 0;
}

static int64_t *flag_of(int r) { return (int64_t *)node.base[r]; }

static int64_t *header_of(int r, int64_t flag) {
    return (int64_t *)(node.base[r] + LINE + (flag % 2) * LINE);
}

static char *slot_of(int r, int64_t flag) {
    return node.base[r] + 3 * LINE + (size_t)(flag % 2) * node.slot_bytes;
}

/* Slots and areas have a page of room beyond their data: see `shift`. */
static char *area_of(int r, int64_t flag) {
    return node.base[r] + 3 * LINE + 2 * node.slot_bytes +
           (size_t)(flag / 2 % 2) * (node.block_bytes + PAGE);
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

/* A polling loop's pause: leaves the core's resources to a sibling hyperthread (a peer rank
 * doing the copies we wait for may be running there) and saves power. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Our writes before the flag, then the flag. */
static void raise_flag(int64_t flag) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(flag_of(node.me), flag, __ATOMIC_SEQ_CST);
}

/* Poll every flag flat out for up to spin_seconds: 1 when all are up (and their writes
 * visible), 0 when the caller should wait elsewhere. */
static int spin_until_ready(double spin_seconds) {
    double deadline = -1.0;
    for (unsigned spins = 0;; spins++) {
        if (rr_node_ready()) {
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            return 1;
        }
        cpu_relax();
        if (spins % 64 == 63) {         /* reading the clock costs more than a poll */
            sched_yield();              /* free at once on an idle core; lets a peer that
                                           shares ours (more ranks than cores) run */
            double t = now();
            if (deadline < 0) deadline = t + spin_seconds;
            else if (t > deadline) return 0;
        }
    }
}

static int digests_agree(int64_t flag) {
    int64_t digest = header_of(0, flag)[0];
    for (int r = 1; r < node.n; r++)
        if (header_of(r, flag)[0] != digest) return 0;
    return 1;
}

static void publish_header(int64_t flag, int64_t digest, size_t nbytes, int64_t per_rank) {
    int64_t *header = header_of(node.me, flag);
    header[0] = digest;
    header[1] = (int64_t)nbytes;
    header[2] = per_rank;
}

size_t rr_kind_size(int kind) {
    switch (kind) {
    case RR_KIND_BF16: return 2;
#if defined(__x86_64__) || defined(__i386__)
    case RR_KIND_F16: return 2;
#endif
    case RR_KIND_F32: case RR_KIND_I32_SUM: return 4;
    case RR_KIND_F64: case RR_KIND_I64_SUM: return 8;
    default: return 0;
    }
}

/* out = a + b; the last step of a reduction also divides and scales, as the Python kernels
 * do: float32 through rr_sum_f32 (NumPy's adds, then the fused last step), half precision
 * through our kernels, float64 as NumPy's adds then torch's division and multiplication,
 * integers wrapping around as NumPy's do. */
#define ADD(type)                                                                      \
    do {                                                                               \
        const type *x = a, *y = b;                                                     \
        type *z = out;                                                                 \
        for (size_t i = 0; i < count; i++) z[i] = x[i] + y[i];                         \
    } while (0)

static void combine(int kind, const void *a, const void *b, void *out, size_t count, int last,
                    double divisor, double scale) {
    const float d = last ? (float)divisor : 1.0f, s = last ? (float)scale : 1.0f;
    switch (kind) {
    case RR_KIND_F32: rr_sum_f32(a, b, out, count, d, s); break;
    case RR_KIND_BF16: rr_sum_bf16(a, b, out, count, d, s); break;
#if defined(__x86_64__) || defined(__i386__)
    case RR_KIND_F16: rr_sum_f16(a, b, out, count, d, s); break;
#endif
    case RR_KIND_F64: {
        ADD(double);
        double *z = out;
        if (last && divisor != 1.0) for (size_t i = 0; i < count; i++) z[i] = z[i] / divisor;
        if (last && scale != 1.0) for (size_t i = 0; i < count; i++) z[i] = z[i] * scale;
        break;
    }
    case RR_KIND_I32_SUM: ADD(uint32_t); break;
    case RR_KIND_I64_SUM: ADD(uint64_t); break;
    }
}

/* ------------------------------------------------------------------------------ small */

int rr_small_begin(const void *src, size_t nbytes, int64_t digest, double spin_seconds) {
    int64_t flag = raised() + 1;
    size_t shift = ((uintptr_t)src - (uintptr_t)slot_of(node.me, 0)) % PAGE;
    memcpy(slot_of(node.me, flag) + shift, src, nbytes);
    publish_header(flag, digest, nbytes, (int64_t)shift);
    raise_flag(flag);
    return spin_until_ready(spin_seconds);
}

int rr_small_end(void *dst, size_t count, int kind, double divisor, double scale) {
    int64_t flag = raised();
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* peers' slots after their flags */
    if (!digests_agree(flag)) return -1;
    if (rr_kind_size(kind) == 0) return -2;
    for (int r = 0; r < node.n; r++) node.shift[r] = (size_t)header_of(r, flag)[2];
    for (int r = 1; r < node.n; r++)
        combine(kind, r == 1 ? slot_of(0, flag) + node.shift[0] : dst,
                slot_of(r, flag) + node.shift[r], dst, count, r == node.n - 1, divisor, scale);
    return 0;
}

/* ------------------------------------------------------------------------------ large */

static struct {
    const char *src;
    char *dst;
    size_t count, size, block;      /* elements, bytes per element, elements per block */
    int kind;
    double divisor, scale;
    int64_t digest, flag;           /* flag: the first of the current block's two */
    size_t start;                   /* the current block's first element */
    int phase;
    int between_nodes;              /* stop after reducing our chunk: Python runs the ring */
} job;

enum { COPY_IN, REDUCE, PUBLISH, COPY_OUT };

int rr_large_begin(const void *src, void *dst, size_t count, int kind, double divisor,
                   double scale, int64_t digest, int between_nodes) {
    size_t size = rr_kind_size(kind), block_bytes = node.block_bytes;
    if (size == 0) return -2;
    job.src = src;
    job.dst = dst;
    job.count = count;
    job.size = size;
    job.block = block_bytes / size > 0 ? block_bytes / size : 1;
    job.kind = kind;
    job.divisor = divisor;
    job.scale = scale;
    job.digest = digest;
    job.start = 0;
    job.phase = COPY_IN;
    job.between_nodes = between_nodes;
    return 0;
}

/* Chunk c of m elements split over the ranks as ring.balanced_counts does: the first m % n
 * chunks one element longer. */
static size_t chunk_lo(size_t m, int c) {
    size_t base = m / (size_t)node.n, extra = m % (size_t)node.n;
    return (size_t)c * base + ((size_t)c < extra ? (size_t)c : extra);
}

/* Where our chunk of the current block lies in the buffer, in elements. */
void rr_large_chunk(size_t *first, size_t *count) {
    size_t m = job.count - job.start < job.block ? job.count - job.start : job.block;
    *first = job.start + chunk_lo(m, node.me);
    *count = chunk_lo(m, node.me + 1) - chunk_lo(m, node.me);
}

int rr_large_run(double spin_seconds) {
    const int me = node.me, n = node.n;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* resumed after a wait in Python */
    const size_t size = job.size;
    while (job.start < job.count) {     /* nothing to do, no flags, for 0 elements (as Python) */
        size_t m = job.count - job.start < job.block ? job.count - job.start : job.block;
        size_t lo = chunk_lo(m, me), hi = chunk_lo(m, me + 1);
        const char *src = job.src + job.start * size;
        char *dst = job.dst + job.start * size;
        switch (job.phase) {
        case COPY_IN: {
            job.flag = raised() + 1;
            if (job.start == 0) {
                node.shift[me] = ((uintptr_t)job.src - (uintptr_t)area_of(me, 0)) % PAGE;
                publish_header(job.flag, job.digest, job.count * size, (int64_t)node.shift[me]);
            }
            char *mine = area_of(me, job.flag) + node.shift[me];
            for (int c = 0; c < n; c++) {
                size_t clo = chunk_lo(m, c), chi = chunk_lo(m, c + 1);
                if (c != me) memcpy(mine + clo * size, src + clo * size, (chi - clo) * size);
            }
            raise_flag(job.flag);
            job.phase = REDUCE;
            if (!spin_until_ready(spin_seconds)) return 0;
        }   /* fall through */
        case REDUCE: {
            if (job.start == 0) {
                if (!digests_agree(job.flag)) return -1;
                for (int r = 0; r < n; r++) node.shift[r] = (size_t)header_of(r, job.flag)[2];
            }
            /* our own input first: the output may be that very memory (in place) */
            const char *a = src + lo * size;
            int remaining = n - 1;
            for (int r = 0; r < n; r++) {
                if (r == me) continue;
                remaining--;
                combine(job.kind, a, area_of(r, job.flag) + node.shift[r] + lo * size,
                        dst + lo * size, hi - lo, remaining == 0, job.divisor, job.scale);
                a = dst + lo * size;
            }
            job.phase = PUBLISH;
            if (job.between_nodes) return 2;
        }   /* fall through */
        case PUBLISH:
            memcpy(area_of(me, job.flag) + node.shift[me] + lo * size, dst + lo * size,
                   (hi - lo) * size);
            raise_flag(job.flag + 1);
            job.phase = COPY_OUT;
            if (!spin_until_ready(spin_seconds)) return 0;
            /* fall through */
        case COPY_OUT:
            for (int c = 0; c < n; c++) {
                size_t clo = chunk_lo(m, c), chi = chunk_lo(m, c + 1);
                if (c != me) memcpy(dst + clo * size, area_of(c, job.flag) + node.shift[c] +
                                    clo * size, (chi - clo) * size);
            }
            job.phase = COPY_IN;
            job.start += m;
        }
    }
    return 1;
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
