/* The thread pool of pool.h.
 *
 * Workers start on first use (grown when a later call asks for more), wait for
 * a new job generation (polling with sched_yield for a short while, then on a
 * condition variable), and claim chunks from g_work = (generation << 32) |
 * next chunk with a compare-and-swap, so a worker that wakes late can never
 * claim a chunk of a finished job: the generation in the word has moved on.
 * The caller claims chunks too and returns when g_done reaches the chunk count.
 * A job's fn/ctx stay valid while any of its chunks is unclaimed or running,
 * because the next job cannot start before this one's chunks are all done.
 * A fork() child starts with no workers (pthread_atfork resets the pool).
 */
#define _GNU_SOURCE
#include "pool.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "common.h"

/* how long an idle worker polls before it sleeps: a decode step calls a matmul
 * every few tens of microseconds, so a short poll keeps the hand-off cheap */
#define ATB_SPIN_NS 200000
/* A worker that claimed a chunk and then lost its core (the machine is busy)
 * makes the caller wait for a whole time slice. When the caller waits longer
 * than ATB_LATE_NS (or 3 of its own chunks' time) for others' chunks, the next
 * jobs run on the caller alone, then threads are tried again (measured on a
 * 2-core machine with two other busy processes: 60 ms decode steps with two
 * threads, 6 ms with this back-off). The back-off starts at ATB_BACKOFF_MIN
 * jobs, so one hiccup costs little, doubles while workers keep coming late (up
 * to ATB_BACKOFF_MAX) and halves again with each job they are on time for. */
#define ATB_LATE_NS 300000
#define ATB_BACKOFF_MIN 16
#define ATB_BACKOFF_MAX 4096

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call_mu = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static atomic_uint_fast64_t g_gen;    /* job generation, bumped per job */
static atomic_uint_fast64_t g_work;   /* (generation << 32) | next unclaimed chunk */
static atomic_int_fast64_t g_done;    /* chunks finished in the current job */
static int64_t g_total;               /* chunks in the current job */
static atb_chunk_fn g_fn;
static void *g_ctx;
static int g_workers;
static int g_atfork;
static int g_backoff;                 /* jobs left to run single-threaded */
static int g_backoff_len = ATB_BACKOFF_MIN; /* the next back-off's length */
/* counters for atb_pool_stats (read without the lock: diagnostics only) */
static int64_t g_n_parallel, g_n_backoff_jobs, g_n_backoffs, g_n_team;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* claim and run chunks of job `gen` until none is left; returns how many ran here */
static int64_t run_chunks(uint_fast64_t gen) {
    int64_t ran = 0;
    for (;; ++ran) {
        uint_fast64_t w = atomic_load_explicit(&g_work, memory_order_acquire);
        if ((w >> 32) != (gen & 0xffffffffu)) return ran;      /* a finished job */
        int64_t c = (int64_t)(w & 0xffffffffu);
        if (c >= g_total) return ran;
        if (!atomic_compare_exchange_weak_explicit(&g_work, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire)) {
            --ran;
            continue;
        }
        g_fn(g_ctx, c);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint_fast64_t seen = 0;
    for (;;) {
        uint_fast64_t gen = atomic_load_explicit(&g_gen, memory_order_acquire);
        if (gen == seen) {
            int64_t t0 = now_ns();
            while ((gen = atomic_load_explicit(&g_gen, memory_order_acquire)) == seen &&
                   now_ns() - t0 < ATB_SPIN_NS)
                sched_yield();
            if (gen == seen) {
                pthread_mutex_lock(&g_mu);
                while ((gen = atomic_load(&g_gen)) == seen) pthread_cond_wait(&g_cv, &g_mu);
                pthread_mutex_unlock(&g_mu);
            }
        }
        seen = gen;
        run_chunks(gen);
    }
    return NULL;
}

static void after_fork_child(void) {
    /* the workers did not survive the fork: start afresh */
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
    pthread_mutex_init(&g_call_mu, NULL);
    g_workers = 0;
}

static int grow(int want) {
    if (!g_atfork) {
        pthread_atfork(NULL, NULL, after_fork_child);
        g_atfork = 1;
    }
    while (g_workers < want) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        ++g_workers;
    }
    return g_workers;
}

void atb_parallel_chunks(atb_chunk_fn fn, void *ctx, int64_t nchunks, int nth) {
    if (nchunks <= 0) return;
    if (nth > ATB_POOL_MAX) nth = ATB_POOL_MAX;
    if (nth <= 1 || nchunks == 1) {
        for (int64_t c = 0; c < nchunks; ++c) fn(ctx, c);
        return;
    }
    pthread_mutex_lock(&g_call_mu);
    if (g_backoff > 0 || grow(nth - 1) == 0) {
        if (g_backoff > 0) {
            --g_backoff;
            ++g_n_backoff_jobs;
        }
        pthread_mutex_unlock(&g_call_mu);
        for (int64_t c = 0; c < nchunks; ++c) fn(ctx, c);
        return;
    }
    ++g_n_parallel;
    g_fn = fn;
    g_ctx = ctx;
    g_total = nchunks;
    atomic_store_explicit(&g_done, 0, memory_order_relaxed);
    pthread_mutex_lock(&g_mu);
    uint_fast64_t gen = atomic_load(&g_gen) + 1;
    /* publish the job's chunks (release: fn/ctx/total above are visible first) */
    atomic_store_explicit(&g_work, (gen & 0xffffffffu) << 32, memory_order_release);
    atomic_store_explicit(&g_gen, gen, memory_order_release);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    int64_t t_run = now_ns();
    int64_t ran = run_chunks(gen);
    /* a worker is late when the caller waits well past one chunk's time for it
     * (its last chunk may simply still be running) */
    int64_t late = ATB_LATE_NS;
    if (ran > 0) {
        int64_t per = (now_ns() - t_run) / ran;
        if (3 * per > late) late = 3 * per;
    }
    int64_t t0 = 0;
    for (unsigned spins = 0; atomic_load_explicit(&g_done, memory_order_acquire) < nchunks;
         ++spins) {
        if ((spins & 63u) == 63u) {
            sched_yield();  /* the worker running a chunk may need this core */
            int64_t t = now_ns();
            if (!t0) t0 = t;
            else if (t - t0 > late && g_backoff == 0) {
                g_backoff = g_backoff_len;
                if (g_backoff_len < ATB_BACKOFF_MAX) g_backoff_len *= 2;
                ++g_n_backoffs;
            }
        }
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
    if (g_backoff == 0 && g_backoff_len > ATB_BACKOFF_MIN) g_backoff_len /= 2; /* on time */
    pthread_mutex_unlock(&g_call_mu);
}

/* libgomp's entry for `#pragma omp parallel` (its ABI since GCC 4.9) */
typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
static _Atomic(gomp_parallel_t) g_gomp;

/* GOMP_parallel of the libgomp already in the process (torch's), else NULL: looked
 * up with RTLD_NOLOAD, so no OpenMP runtime is ever loaded by this library */
static gomp_parallel_t gomp_parallel(void) {
    gomp_parallel_t f = atomic_load_explicit(&g_gomp, memory_order_acquire);
    if (f) return f;
    void *h = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return NULL;
    void *sym = dlsym(h, "GOMP_parallel");
    dlclose(h);  /* only drops the reference NOLOAD took: the runtime stays loaded */
    memcpy(&f, &sym, sizeof f);
    atomic_store_explicit(&g_gomp, f, memory_order_release);
    return f;
}

typedef struct {
    atb_chunk_fn fn;
    void *ctx;
    int64_t n;
    atomic_int_fast64_t next;
} TeamJob;

static void team_body(void *arg) {
    TeamJob *j = (TeamJob *)arg;
    for (int64_t c; (c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < j->n;)
        j->fn(j->ctx, c);
}

/* whether big jobs may run on torch's OpenMP team (atb_pool_use_omp_team): off in a
 * process whose framework is not torch, where that team is idle and waking it costs
 * a whole time slice whenever the framework's own threads hold the cores */
static atomic_int g_use_team = 1;

ATB_API int64_t atb_pool_use_omp_team(int64_t on) {  /* returns the previous setting */
    return atomic_exchange(&g_use_team, on ? 1 : 0);
}

void atb_parallel_chunks_big(atb_chunk_fn fn, void *ctx, int64_t nchunks, int nth) {
    if (nchunks <= 0) return;
    if (nth > ATB_POOL_MAX) nth = ATB_POOL_MAX;
    gomp_parallel_t team = nth > 1 && nchunks > 1 && atomic_load(&g_use_team)
                               ? gomp_parallel() : NULL;
    if (!team) {
        atb_parallel_chunks(fn, ctx, nchunks, nth);
        return;
    }
    TeamJob j = {fn, ctx, nchunks, 0};
    ++g_n_team;
    team(team_body, &j, (unsigned)(nth < nchunks ? nth : nchunks), 0);
}

typedef struct {
    atb_rows_fn fn;
    void *ctx;
    int64_t rows, per;
} RowsJob;

static void rows_chunk(void *ctx, int64_t c) {
    const RowsJob *j = (const RowsJob *)ctx;
    int64_t r0 = c * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    j->fn(j->ctx, r0, r1);
}

void atb_parallel_rows(atb_rows_fn fn, void *ctx, int64_t rows, int64_t work, int nth) {
    if (rows <= 0) return;
    if (nth <= 1 || rows == 1 || work < ATB_ROWS_MIN_WORK) {
        fn(ctx, 0, rows);
        return;
    }
    RowsJob j = {fn, ctx, rows, (rows + 4 * (int64_t)nth - 1) / (4 * (int64_t)nth)};
    if (work >= ATB_ROWS_BIG_WORK)
        atb_parallel_chunks_big(rows_chunk, &j, (rows + j.per - 1) / j.per, nth);
    else
        atb_parallel_chunks(rows_chunk, &j, (rows + j.per - 1) / j.per, nth);
}

ATB_API int64_t atb_pool_stats(int64_t *out) {
    if (!out) return ATB_ERR_ARGS;
    out[0] = g_n_parallel;
    out[1] = g_n_backoff_jobs;
    out[2] = g_n_backoffs;
    out[3] = g_workers;
    out[4] = g_n_team;
    return 0;
}
