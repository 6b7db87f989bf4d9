/* A tiny persistent thread pool for the few kernels that need every core (the
 * few-row matmuls of decoding, which are memory bound: one core cannot pull the
 * weights at the machine's read bandwidth).
 *
 * Why not OpenMP: torch ships its own OpenMP runtime; a second one in the same
 * process keeps its own spinning workers and the two fight for the cores.
 *
 * Work is handed out in chunks that threads claim one at a time, and the caller
 * claims chunks too: when the machine is busy and a worker is not scheduled, the
 * caller simply does all the chunks instead of waiting a whole time slice for
 * the worker's static share (measured: a static split ran 6x slower than one
 * thread on an oversubscribed 2-core machine).
 */
#ifndef ATB_POOL_H
#define ATB_POOL_H

#include <stdint.h>

typedef void (*atb_chunk_fn)(void *ctx, int64_t chunk);

/* Run fn(ctx, c) for every c in [0, nchunks) on up to nth threads (the caller
 * is one of them) and return when all are done. nth is clamped to
 * [1, ATB_POOL_MAX]; calls from several threads are serialised. */
void atb_parallel_chunks(atb_chunk_fn fn, void *ctx, int64_t nchunks, int nth);

/* atb_parallel_chunks for jobs of milliseconds (prefill-sized): run on the
 * OpenMP team of the libgomp already loaded in the process (torch's), whose
 * workers spin for milliseconds after each torch parallel op and would otherwise
 * hold the cores this pool's workers need (measured: the C prefill attention
 * right after a GEMM ran at about one core's speed). Falls back to
 * atb_parallel_chunks when no libgomp is loaded. */
void atb_parallel_chunks_big(atb_chunk_fn fn, void *ctx, int64_t nchunks, int nth);

/* Rows [0, rows) in ranges fn(ctx, r0, r1): one call on the caller when the
 * work (elements touched) is under ATB_ROWS_MIN_WORK or nth is 1, else about
 * four ranges per thread (a busy thread's share is picked up by the others). */
typedef void (*atb_rows_fn)(void *ctx, int64_t r0, int64_t r1);
void atb_parallel_rows(atb_rows_fn fn, void *ctx, int64_t rows, int64_t work, int nth);

#define ATB_ROWS_MIN_WORK (64 << 10)
/* from this much work atb_parallel_rows runs on atb_parallel_chunks_big */
#define ATB_ROWS_BIG_WORK (1 << 20)
#define ATB_POOL_MAX 64

#endif
