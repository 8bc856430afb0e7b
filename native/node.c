/* Allreduce among the ranks of one node through their shared memory: the only implementation
 * of the node protocol (tests/mpi/node_oracle.py restates it in Python, as a test oracle). Each
 * rank's segment of a process set's shared window is
 *     [flag | header slot x2 | small slot x2 | block area x2], each starting on a 64-byte line,
 * and a rank's flag counts the flags it has raised: flag % 2 selects the header and small
 * slots, flag / 2 % 2 the block area. A slot written before flag f is read between flags f and
 * f+1 and rewritten no sooner than before flag f+2, once every peer has finished reading it.
 *
 * Small: copy our data into our slot, write the header (signature digest, byte count, where in
 * the slot the data starts), fence, raise the flag; wait for every flag; compare digests;
 * reduce every slot in rank order into the output. Every rank runs the same arithmetic in the
 * same order, so the results are bitwise identical.
 *
 * Large, block by block: copy into our area the chunks our peers own; flag; reduce our chunk
 * from our input and every peer's area into the output and our area; flag; copy every peer's
 * finished chunk out of its area. Each chunk is computed by one rank and copied, so results are
 * bitwise identical. Blocks are small enough that the areas stay in the shared cache, so the
 * only traffic to memory is reading the input and writing the output, unless writing the
 * areas with non-temporal stores measures faster (write_way). Staged data sits at the
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

#include "clock.h"
#include "constants.h"
#include "kernels.h"
#include "node.h"

enum { COPY_IN, REDUCE, PUBLISH, COPY_OUT };

struct rr_node {
    int me, n;
    size_t slot_bytes, block_bytes;     /* a small slot, a block: whole pages */
    char **base;                        /* each local rank's segment, mapped here */
    size_t *shift;                      /* each rank's offset of its data in its slot or area */
    struct {                            /* the large allreduce under way */
        const char *src;
        char *dst;
        size_t count, size, block;      /* elements, bytes per element, elements per block */
        int dtype, op;
        double divisor, scale;
        int64_t digest, flag;           /* flag: the first of the current block's two */
        size_t start;                   /* the current block's first element */
        int phase;
        int between_nodes;              /* stop after reducing our chunk: Python runs the ring */
        int begun;                      /* a begin checked this job (and no run failed it) */
        int way;                        /* how the current block is written: RR_WRITE_* */
    } job;
    double seconds[RR_PHASES];          /* time in each phase of large allreduces, summed */
    double write_cost[RR_WRITE_WAYS];   /* seconds per byte each way last took; 0: untried */
    int64_t blocks[RR_WRITE_WAYS];      /* slots and blocks written each way (and measured) */
};

static size_t round_up(size_t value, size_t multiple) {
    return (value + multiple - 1) / multiple * multiple;
}

size_t rr_node_layout(size_t small_bytes, size_t block_bytes, size_t *slot_bytes,
                      size_t *block_rounded) {
    *slot_bytes = round_up(small_bytes, RR_PAGE) + RR_PAGE;
    *block_rounded = round_up(block_bytes ? block_bytes : 1, RR_PAGE);
    return 3 * RR_LINE + 2 * *slot_bytes + 2 * (*block_rounded + RR_PAGE);
}

/* n >= 2: a rank alone on its node has no window. */
rr_status rr_node_attach(int me, int n, const uintptr_t *bases, size_t slot_bytes,
                         size_t block_bytes, rr_node **attached) {
    *attached = NULL;
    if (n < 2 || me < 0 || me >= n)
        return rr_fail(RR_BAD_ARGUMENT, "local rank %d of %d: a node's window needs 2 or more "
                       "ranks, ours among them", me, n);
    for (int r = 0; r < n; r++)
        if (bases[r] == 0)
            return rr_fail(RR_BAD_ARGUMENT, "local rank %d's segment is at address 0", r);
    rr_node *node = calloc(1, sizeof *node);
    if (node == NULL) return rr_fail(RR_NO_MEMORY, "no memory for a node of %d ranks", n);
    node->base = malloc(sizeof(char *) * (size_t)n);
    node->shift = calloc((size_t)n, sizeof(size_t));
    if (node->base == NULL || node->shift == NULL) {
        rr_node_detach(node);
        return rr_fail(RR_NO_MEMORY, "no memory for a node of %d ranks", n);
    }
    for (int r = 0; r < n; r++) node->base[r] = (char *)bases[r];
    node->me = me;
    node->n = n;
    node->slot_bytes = slot_bytes;
    node->block_bytes = block_bytes;
    __atomic_store_n((int64_t *)node->base[me], 0, __ATOMIC_SEQ_CST);     /* our flag */
    *attached = node;
    return RR_OK;
}

void rr_node_detach(rr_node *node) {
    if (node == NULL) return;
    free(node->base);
    free(node->shift);
    free(node);
}

static int64_t *flag_of(rr_node *node, int r) { return (int64_t *)node->base[r]; }

static int64_t *header_of(rr_node *node, int r, int64_t flag) {
    return (int64_t *)(node->base[r] + RR_LINE + (flag % 2) * RR_LINE);
}

static char *slot_of(rr_node *node, int r, int64_t flag) {
    return node->base[r] + 3 * RR_LINE + (size_t)(flag % 2) * node->slot_bytes;
}

/* Slots and areas have a page of room beyond their data: see `shift`. */
static char *area_of(rr_node *node, int r, int64_t flag) {
    return node->base[r] + 3 * RR_LINE + 2 * node->slot_bytes +
           (size_t)(flag / 2 % 2) * (node->block_bytes + RR_PAGE);
}

static int64_t raised(rr_node *node) {
    return __atomic_load_n(flag_of(node, node->me), __ATOMIC_RELAXED);
}

int rr_node_ready(rr_node *node) {
    int64_t flag = raised(node);
    for (int r = 0; r < node->n; r++)
        if (__atomic_load_n(flag_of(node, r), __ATOMIC_ACQUIRE) < flag) return 0;
    return 1;
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
static void raise_flag(rr_node *node, int64_t flag) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(flag_of(node, node->me), flag, __ATOMIC_SEQ_CST);
}

/* Poll every flag flat out for up to spin_seconds (once when negative): RR_OK when all are up
 * (and their writes visible), RR_WAITING when the caller should wait elsewhere. */
static rr_status spin_until_ready(rr_node *node, double spin_seconds) {
    double deadline = -1.0;
    for (unsigned spins = 0;; spins++) {
        if (rr_node_ready(node)) {
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            return RR_OK;
        }
        if (spin_seconds < 0) return RR_WAITING;
        cpu_relax();
        if (spins % 64 == 63) {         /* reading the clock costs more than a poll */
            sched_yield();              /* free at once on an idle core; lets a peer that
                                           shares ours (more ranks than cores) run */
            double t = rr_now();
            if (deadline < 0) deadline = t + spin_seconds;
            else if (t > deadline) return RR_WAITING;
        }
    }
}

rr_status rr_node_wait(rr_node *node, double spin_seconds) {
    return spin_until_ready(node, spin_seconds);
}

static int digests_agree(rr_node *node, int64_t flag) {
    int64_t digest = header_of(node, 0, flag)[0];
    for (int r = 1; r < node->n; r++)
        if (header_of(node, r, flag)[0] != digest) return 0;
    return 1;
}

/* How to write our slot or area next (small allreduces and blocks alike). Plain stores leave
 * the lines in the cache, where the peers read them fastest; but writing a line that a peer's
 * cache holds first takes it back from there, and where that is slow (seen on a VM now and
 * then, for seconds to minutes: plain copies into the area 4-6x slower than out of it),
 * non-temporal stores, which skip that round trip, make the whole allreduce up to 4x faster.
 * Where plain stores are quick, non-temporal ones make it 1.7x slower (the peers then read
 * from memory). So each rank measures: it writes the way that cost less per byte when last
 * used, and every RR_PROBE_EVERY writes the other way (each way is tried early). Streaming
 * must cost under a third as much, as the writer does not see what it costs the readers. Either
 * way the flag's fence orders the stores, so the way changes the speed only. */
static int write_way(rr_node *node) {
    const double *cost = node->write_cost;
    if (cost[RR_WRITE_PLAIN] == 0) return RR_WRITE_PLAIN;
    if (cost[RR_WRITE_STREAM] == 0) return RR_WRITE_STREAM;
    int cheaper = 3 * cost[RR_WRITE_STREAM] < cost[RR_WRITE_PLAIN] ? RR_WRITE_STREAM
                                                                   : RR_WRITE_PLAIN;
    int64_t written = node->blocks[RR_WRITE_PLAIN] + node->blocks[RR_WRITE_STREAM];
    return written % RR_PROBE_EVERY == RR_PROBE_EVERY - 1 ? !cheaper : cheaper;
}

static void write_area(int way, char *dst, const char *src, size_t bytes) {
    if (way == RR_WRITE_STREAM) rr_copy_stream(dst, src, bytes);
    else memcpy(dst, src, bytes);
}

/* Before writing `bytes` into our slot or area: the way, and in *start the time, where the
 * write is measured (RR_STREAM_MIN bytes or more: smaller ones are plain either way). */
static int begin_write(rr_node *node, size_t bytes, double *start) {
    if (bytes < RR_STREAM_MIN) return RR_WRITE_PLAIN;
    *start = rr_now();
    return write_way(node);
}

static void end_write(rr_node *node, int way, size_t bytes, double start) {
    if (bytes < RR_STREAM_MIN) return;
    double cost = (rr_now() - start) / (double)bytes;
    double *last = &node->write_cost[way];
    *last = *last == 0 ? cost : (*last + cost) / 2;
    node->blocks[way]++;
}

static void publish_header(rr_node *node, int64_t flag, int64_t digest, size_t nbytes,
                           int64_t per_rank) {
    int64_t *header = header_of(node, node->me, flag);
    header[0] = digest;
    header[1] = (int64_t)nbytes;
    header[2] = per_rank;
}

/* ------------------------------------------------------------------------------ headers */

rr_status rr_headers_begin(rr_node *node, int64_t digest, int64_t per_rank,
                           double spin_seconds) {
    int64_t flag = raised(node) + 1;
    publish_header(node, flag, digest, 0, per_rank);
    raise_flag(node, flag);
    return spin_until_ready(node, spin_seconds);
}

rr_status rr_headers_read(rr_node *node, int64_t *digests, int64_t *per_rank, size_t stride) {
    int64_t flag = raised(node);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int r = 0; r < node->n; r++) {
        digests[(size_t)r * stride] = header_of(node, r, flag)[0];
        per_rank[(size_t)r * stride] = header_of(node, r, flag)[2];
    }
    return digests_agree(node, flag) ? RR_OK : RR_MISMATCH;
}

/* ------------------------------------------------------------------------------ small */

rr_status rr_small_begin(rr_node *node, const void *src, size_t nbytes, int64_t digest,
                         double spin_seconds) {
    int64_t flag = raised(node) + 1;
    size_t shift = ((uintptr_t)src - (uintptr_t)slot_of(node, node->me, 0)) % RR_PAGE;
    double start = 0;
    int way = begin_write(node, nbytes, &start);
    write_area(way, slot_of(node, node->me, flag) + shift, src, nbytes);
    end_write(node, way, nbytes, start);
    publish_header(node, flag, digest, nbytes, (int64_t)shift);
    raise_flag(node, flag);
    return spin_until_ready(node, spin_seconds);
}

rr_status rr_small_end(rr_node *node, void *dst, size_t count, int dtype, int op,
                       double divisor, double scale) {
    int64_t flag = raised(node);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* peers' slots after their flags */
    if (!digests_agree(node, flag)) return RR_MISMATCH;
    rr_status status = rr_check(dtype, op);    /* before dst is written */
    if (status != RR_OK) return status;
    for (int r = 0; r < node->n; r++) node->shift[r] = (size_t)header_of(node, r, flag)[2];
    const char *first = slot_of(node, 0, flag) + node->shift[0];
    for (int r = 1; r < node->n && status == RR_OK; r++)
        status = rr_combine(dtype, op, r == 1 ? first : dst,
                            slot_of(node, r, flag) + node->shift[r], dst, count,
                            r == node->n - 1, divisor, scale);
    return status;
}

/* ------------------------------------------------------------------------------ large */

rr_status rr_large_begin(rr_node *node, const void *src, void *dst, size_t count, int dtype,
                         int op, double divisor, double scale, int64_t digest,
                         int between_nodes) {
    node->job.begun = 0;
    rr_status status = rr_check(dtype, op);    /* before any flag: the peers see nothing */
    if (status != RR_OK) return status;
    size_t size = rr_dtype_size(dtype);
    node->job.src = src;
    node->job.dst = dst;
    node->job.count = count;
    node->job.size = size;
    node->job.block = node->block_bytes / size > 0 ? node->block_bytes / size : 1;
    node->job.dtype = dtype;
    node->job.op = op;
    node->job.divisor = divisor;
    node->job.scale = scale;
    node->job.digest = digest;
    node->job.start = 0;
    node->job.phase = COPY_IN;
    node->job.between_nodes = between_nodes;
    node->job.begun = 1;
    return RR_OK;
}

/* Chunk c of m elements split over the ranks as ring.balanced_counts does: the first m % n
 * chunks one element longer. */
static size_t chunk_lo(rr_node *node, size_t m, int c) {
    size_t base = m / (size_t)node->n, extra = m % (size_t)node->n;
    return (size_t)c * base + ((size_t)c < extra ? (size_t)c : extra);
}

static size_t block_length(rr_node *node) {
    size_t left = node->job.count - node->job.start;
    return left < node->job.block ? left : node->job.block;
}

/* Where our chunk of the current block lies in the buffer, in elements. */
void rr_large_chunk(rr_node *node, size_t *first, size_t *count) {
    size_t m = block_length(node);
    *first = node->job.start + chunk_lo(node, m, node->me);
    *count = chunk_lo(node, m, node->me + 1) - chunk_lo(node, m, node->me);
}

/* Adds the time since *t to phase p's total and restarts *t. */
static void lap(rr_node *node, int p, double *t) {
    double t1 = rr_now();
    node->seconds[p] += t1 - *t;
    *t = t1;
}

void rr_large_profile(rr_node *node, double *seconds, int64_t *blocks, int reset) {
    for (int p = 0; p < RR_PHASES; p++) seconds[p] = node->seconds[p];
    for (int w = 0; w < RR_WRITE_WAYS; w++) blocks[w] = node->blocks[w];
    if (reset) memset(node->seconds, 0, sizeof node->seconds);
}

rr_status rr_large_run(rr_node *node, double spin_seconds) {
    const int me = node->me, n = node->n;
    if (!node->job.begun)
        return rr_fail(RR_BAD_STATE, "no large allreduce begun (large_begin refused it, or "
                       "its run failed)");
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* resumed after a wait in Python */
    const size_t size = node->job.size;
    double t = rr_now();
    while (node->job.start < node->job.count) {   /* 0 elements: nothing, no flags */
        size_t m = block_length(node);
        size_t lo = chunk_lo(node, m, me), hi = chunk_lo(node, m, me + 1);
        const char *src = node->job.src + node->job.start * size;
        char *dst = node->job.dst + node->job.start * size;
        switch (node->job.phase) {
        case COPY_IN: {
            int64_t flag = node->job.flag = raised(node) + 1;
            if (node->job.start == 0) {
                node->shift[me] = ((uintptr_t)node->job.src - (uintptr_t)area_of(node, me, 0))
                                  % RR_PAGE;
                publish_header(node, flag, node->job.digest, node->job.count * size,
                               (int64_t)node->shift[me]);
            }
            char *mine = area_of(node, me, flag) + node->shift[me];
            size_t bytes = (m - (hi - lo)) * size;
            double start = 0;
            int way = node->job.way = begin_write(node, bytes, &start);
            for (int c = 0; c < n; c++) {
                size_t clo = chunk_lo(node, m, c), chi = chunk_lo(node, m, c + 1);
                if (c != me)
                    write_area(way, mine + clo * size, src + clo * size, (chi - clo) * size);
            }
            end_write(node, way, bytes, start);
            raise_flag(node, flag);
            lap(node, RR_PHASE_COPY_IN, &t);
            node->job.phase = REDUCE;
            rr_status ready = spin_until_ready(node, spin_seconds);
            lap(node, RR_PHASE_WAIT_IN, &t);
            if (ready != RR_OK) return ready;
        }   /* fall through */
        case REDUCE: {
            int64_t flag = node->job.flag;
            if (node->job.start == 0) {
                if (!digests_agree(node, flag)) return RR_MISMATCH;
                for (int r = 0; r < n; r++)
                    node->shift[r] = (size_t)header_of(node, r, flag)[2];
            }
            /* our own input first: the output may be that very memory (in place) */
            const char *a = src + lo * size;
            int remaining = n - 1;
            for (int r = 0; r < n; r++) {
                if (r == me) continue;
                remaining--;
                rr_status status = rr_combine(node->job.dtype, node->job.op, a,
                                              area_of(node, r, flag) + node->shift[r] +
                                                  lo * size,
                                              dst + lo * size, hi - lo, remaining == 0,
                                              node->job.divisor, node->job.scale);
                if (status != RR_OK) {      /* the begin's check makes this unreachable */
                    node->job.begun = 0;
                    return status;
                }
                a = dst + lo * size;
            }
            lap(node, RR_PHASE_REDUCE, &t);
            node->job.phase = PUBLISH;
            if (node->job.between_nodes) return RR_BETWEEN_NODES;
        }   /* fall through */
        case PUBLISH: {
            write_area(node->job.way,
                       area_of(node, me, node->job.flag) + node->shift[me] + lo * size,
                       dst + lo * size, (hi - lo) * size);
            raise_flag(node, node->job.flag + 1);
            lap(node, RR_PHASE_PUBLISH, &t);
            node->job.phase = COPY_OUT;
            rr_status ready = spin_until_ready(node, spin_seconds);
            lap(node, RR_PHASE_WAIT_OUT, &t);
            if (ready != RR_OK) return ready;
        }   /* fall through */
        case COPY_OUT:
            for (int c = 0; c < n; c++) {
                size_t clo = chunk_lo(node, m, c), chi = chunk_lo(node, m, c + 1);
                if (c != me)
                    memcpy(dst + clo * size,
                           area_of(node, c, node->job.flag) + node->shift[c] + clo * size,
                           (chi - clo) * size);
            }
            lap(node, RR_PHASE_COPY_OUT, &t);
            node->job.phase = COPY_IN;
            node->job.start += m;
        }
    }
    return RR_OK;
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
