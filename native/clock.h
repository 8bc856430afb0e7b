/* The monotonic clock the polling loops of node.c and p2p.c read, in seconds. */
#ifndef RINGREDUCE_CLOCK_H
#define RINGREDUCE_CLOCK_H
#include <time.h>

static inline double rr_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#endif
