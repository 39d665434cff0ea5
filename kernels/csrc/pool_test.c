/* The pool's hand-over between loops with late workers (tests/test_kernels_cpu_threads.py,
 * test_late_worker_never_ends_a_loop_early): a worker that has seen a loop's generation is held
 * (POOL_WORKER_HOOK) until the caller is writing the next loop's descriptor, and the caller lingers
 * between writing a descriptor and publishing it (POOL_PUBLISH_HOOK), so a worker reads the next
 * loop's descriptor while the word still holds the old generation, the case a descheduled worker
 * meets now and then on a busy machine. Loops alternate between few and many chunks. Every loop
 * must have done every item when dsq_parallel_for returns.
 *
 *   pool_test LOOPS THREADS   prints "N of LOOPS loops returned early", exits 1 if N > 0 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static _Atomic int publishing; /* the caller is between writing a descriptor and publishing it */
#define HOLD_SPINS 1000000
#define POOL_WORKER_HOOK(seen)                                                                  \
    do {                                                                                        \
        for (long i_ = 0; id == 1 && i_ < HOLD_SPINS && !atomic_load(&publishing); i_++) pool_relax(); \
        (void)(seen);                                                                           \
    } while (0)
#define POOL_PUBLISH_HOOK()                                                                     \
    do {                                                                                        \
        atomic_store(&publishing, 1);                                                           \
        for (volatile int i_ = 0; i_ < 20000; i_++) {}                                          \
        atomic_store(&publishing, 0);                                                           \
    } while (0)
#include "pool.inc"

typedef struct {
    int *y;
    int v;
} task;

static void fill(void *p, int64_t a, int64_t b, int tid) {
    const task *t = (const task *)p;
    for (int64_t i = a; i < b; i++) {
        if (tid > 1) /* the other workers are slow: the caller finishes its own chunks first */
            for (volatile int d = 0; d < 200; d++) {}
        t->y[i] = t->v;
    }
}

int main(int argc, char **argv) {
    const long loops = argc > 1 ? atol(argv[1]) : 20000;
    dsq_set_threads(argc > 2 ? atoi(argv[2]) : 3);
    static int y[8192];
    long early = 0;
    for (long it = 0; it < loops; it++) {
        const int64_t n = it & 1 ? 8192 : 16; /* few chunks, then many */
        task t = {y, (int)it};
        dsq_parallel_for(n, 1, fill, &t);
        for (int64_t i = 0; i < n; i++)
            if (y[i] != (int)it) {
                early++;
                break;
            }
    }
    printf("%ld of %ld loops returned early\n", early, loops);
    return early != 0;
}
