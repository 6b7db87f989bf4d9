/* What the decode attention's driver (attn.c) and its two passes over the cache
 * (attn_passes.c) share: the argument block and where a cache position's row is. */
#ifndef ATB_ATTN_H
#define ATB_ATTN_H

#include <stdint.h>

#include "common.h"

#define ATB_ATTN_MAX_D 512

typedef struct {
    int64_t q, k, v, y, mask;                /* addresses; mask 0 = absent (bool) */
    int64_t q_dt, kv_dt, y_dt;
    int64_t B, H, KV, D;
    int64_t q_sb, q_sh;                      /* element strides: batch row, head */
    int64_t k_sb, k_ss, k_sh;                /* batch row, cache position, kv head */
    int64_t v_sb, v_ss, v_sh;
    int64_t y_sb, y_sh;
    int64_t mask_sb, mask_ss;
    int64_t ends, ends_i32, window;          /* per-row key ends (0 = absent: n) */
    int64_t table, table_i32, table_sb, block_size;   /* paged cache (0 = contiguous) */
    int64_t threads;
    double scale;
    int64_t lo, n;                           /* keys [lo, n): last, as they change per step */
    /* int8 caches only (atb_decode_attention_i8): scale addresses, their dtype and
     * element strides (batch row or block, position, kv head) */
    int64_t ks, vs, s_dt, ks_sb, ks_ss, ks_sh, vs_sb, vs_ss, vs_sh;
} DecAttnArgs;

#define P(v) ((const void *)(intptr_t)(v))

static inline int64_t ival(int64_t addr, int i32, int64_t i) {
    return i32 ? ((const int32_t *)P(addr))[i] : ((const int64_t *)P(addr))[i];
}

/* block_size as a shift when it is a power of two (a division per key read cost
 * as much as the key's dot product), else -1 */
static inline int block_shift(int64_t bs) {
    int sh = 0;
    while (((int64_t)1 << sh) < bs) ++sh;
    return ((int64_t)1 << sh) == bs ? sh : -1;
}

/* element offset of cache position s of row b (before the head offset) */
static inline int64_t row_at(const DecAttnArgs *a, int sh, int64_t b, int64_t s, int64_t sb,
                             int64_t ss) {
    if (!a->table) return b * sb + s * ss;
    int64_t q = sh >= 0 ? s >> sh : s / a->block_size;
    int64_t r = sh >= 0 ? s & ((1 << sh) - 1) : s % a->block_size;
    return ival(a->table, (int)a->table_i32, b * a->table_sb + q) * sb + r * ss;
}

/* pass 1: sc[j * L + s] = qf[j] . k(lo + s) for the G heads of each of the nk kv
 * heads from kh of row b (head j of kv head kh + i at j = i * G + j; masked keys too:
 * the caller overwrites them); rows: scratch for 16 keys as fp32. Each head's sums
 * are the same whatever nk. */
void atb_attn_scores(const DecAttnArgs *a, int64_t b, int64_t kh, int64_t nk, int64_t lo,
                     int64_t L, const float *qf, int64_t G, float *sc, float *rows);
/* pass 2: acc[j] = sum_s sc[j * L + s] v(lo + s) over the unmasked keys, for the G
 * heads of each of the nk kv heads from kh (sh: block_shift of a paged cache's block
 * size); row: scratch for 16 keys */
void atb_attn_values(const DecAttnArgs *a, int sh, int64_t b, int64_t kh, int64_t nk, int64_t lo,
                     int64_t L, const uint8_t *mask, const float *sc, int64_t G, float *row,
                     float *acc);

#endif
