/* RoPE on q and k in one call, optionally writing rotated k and v into a
 * contiguous KV cache at the token positions.
 *
 * Tensors are addressed as [B, S, H, D] with element strides per (b, s, h)
 * (so BSH, BSND and BNSD are all just strides; D is contiguous). Outputs may be
 * the inputs themselves (in place). cos/sin are full-width rows of rd values:
 * row(b, s) = pos[b, s] when positions are given, else s + tab_offset, read at
 * cos + b * cs_sb + row * cs_row (cs_sb = 0: one table for every batch entry).
 * With cache_len > 0, k/v outputs are caches [B, cache_len, Hk, D] (any
 * strides) and token (b, s) lands in row pos[b, s] (or s + cache_offset); with
 * slot != 0 they are caches of cache_len rows [cache_len, Hk, D] (paged blocks
 * seen flat, ko_ss apart) and token (b, s) lands in row slot[b * S + s].
 *
 * Every position is checked before anything is written, so a failed call
 * leaves its outputs untouched.
 */
#include "common.h"

#define ATB_ROPE_MAX_RD 1024

typedef struct {
    int64_t q, qo, k, ko, v, vo, cos, sin, pos;  /* addresses; 0 = absent */
    int64_t dt, cs_dt, pos_i32, interleave;
    int64_t B, S, D, rd, hq, hk;
    int64_t q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh;
    int64_t k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh;
    int64_t v_sb, v_ss, v_sh, vo_sb, vo_ss, vo_sh;
    int64_t cs_sb, cs_row, table_len, tab_offset;
    int64_t pos_sb, cache_len, cache_offset;
    int64_t slot, slot_i32;                      /* per-token cache rows; 0 = absent */
} RopeArgs;

#define P(v) ((void *)(intptr_t)(v))

static inline int64_t position(const RopeArgs *a, int64_t b, int64_t s) {
    if (!a->pos) return -1;
    if (a->pos_i32) return ((const int32_t *)P(a->pos))[b * a->pos_sb + s];
    return ((const int64_t *)P(a->pos))[b * a->pos_sb + s];
}

/* the cache row of token (b, s): its slot, its position, or s + cache_offset */
static inline int64_t cache_row(const RopeArgs *a, int64_t b, int64_t s, int64_t p) {
    if (a->slot) {
        int64_t i = b * a->S + s;
        return a->slot_i32 ? ((const int32_t *)P(a->slot))[i] : ((const int64_t *)P(a->slot))[i];
    }
    return a->pos ? p : s + a->cache_offset;
}

/* y[yo .. yo+D) = rotate(x[xo .. xo+D)) with fp32 cos/sin rows c, s */
static void rotate_head(const void *x, int64_t xo, void *y, int64_t yo, int dt, int64_t D,
                        int64_t rd, int inter, const float *c, const float *s, float *bx,
                        float *by) {
    const float *v = atb_load(x, dt, xo, rd, bx);
    const int64_t h = rd / 2;
    if (!inter) {
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) {
            by[i] = v[i] * c[i] - v[i + h] * s[i];
            by[i + h] = v[i + h] * c[i + h] + v[i] * s[i + h];
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) {
            by[2 * i] = v[2 * i] * c[2 * i] - v[2 * i + 1] * s[2 * i];
            by[2 * i + 1] = v[2 * i + 1] * c[2 * i + 1] + v[2 * i] * s[2 * i + 1];
        }
    }
    atb_store(y, dt, yo, rd, by);
    if (rd < D && (y != x || yo != xo)) { /* partial rotary: the tail passes through */
        const int64_t e = atb_dt_size(dt);
        memmove((char *)y + (yo + rd) * e, (const char *)x + (xo + rd) * e, (size_t)((D - rd) * e));
    }
}

ATB_API int64_t atb_rope(const void *args) {
    RopeArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.q || !a.qo || a.rd <= 0 || a.rd % 2 || a.rd > a.D || a.rd > ATB_ROPE_MAX_RD ||
        (a.v && !a.k) || (a.k && !a.ko) || (a.v && !a.vo) || !a.cos || !a.sin ||
        (a.slot && a.cache_len <= 0))
        return ATB_ERR_ARGS;
    const int dt = (int)a.dt;
    /* check every position before writing anything */
    int64_t need = 0;
    for (int64_t b = 0; b < a.B; ++b)
        for (int64_t s = 0; s < a.S; ++s) {
            int64_t p = position(&a, b, s);
            int64_t row = a.pos ? p : s + a.tab_offset;
            int64_t crow = cache_row(&a, b, s, p);
            if (a.pos && p < 0) return ATB_ERR_NEG_POSITION;
            if (row >= a.table_len && row + 1 > need) need = row + 1;
            if (a.cache_len > 0 && (crow >= a.cache_len || crow < 0)) return ATB_ERR_CACHE_OVERFLOW;
        }
    if (need) return need; /* the caller grows its table to `need` rows and calls again */

    float bx[ATB_ROPE_MAX_RD], by[ATB_ROPE_MAX_RD], bc[ATB_ROPE_MAX_RD], bs[ATB_ROPE_MAX_RD];
    const int64_t esz = atb_dt_size(dt);
    for (int64_t b = 0; b < a.B; ++b)
        for (int64_t s = 0; s < a.S; ++s) {
            int64_t p = position(&a, b, s);
            int64_t row = a.pos ? p : s + a.tab_offset;
            int64_t off = b * a.cs_sb + row * a.cs_row;
            const float *c = atb_load(P(a.cos), (int)a.cs_dt, off, a.rd, bc);
            const float *sn = atb_load(P(a.sin), (int)a.cs_dt, off, a.rd, bs);
            for (int64_t h = 0; h < a.hq; ++h)
                rotate_head(P(a.q), b * a.q_sb + s * a.q_ss + h * a.q_sh, P(a.qo),
                            b * a.qo_sb + s * a.qo_ss + h * a.qo_sh, dt, a.D, a.rd,
                            (int)a.interleave, c, sn, bx, by);
            if (!a.k) continue;
            /* k/v output row: the token's slot or position in a cache, else its own s */
            int64_t orow = a.cache_len > 0 ? cache_row(&a, b, s, p) : s;
            const int64_t kb = a.slot ? 0 : b * a.ko_sb, vb = a.slot ? 0 : b * a.vo_sb;
            for (int64_t h = 0; h < a.hk; ++h)
                rotate_head(P(a.k), b * a.k_sb + s * a.k_ss + h * a.k_sh, P(a.ko),
                            kb + orow * a.ko_ss + h * a.ko_sh, dt, a.D, a.rd,
                            (int)a.interleave, c, sn, bx, by);
            if (!a.v) continue;
            for (int64_t h = 0; h < a.hk; ++h)
                memmove((char *)P(a.vo) + (vb + orow * a.vo_ss + h * a.vo_sh) * esz,
                        (const char *)P(a.v) + (b * a.v_sb + s * a.v_ss + h * a.v_sh) * esz,
                        (size_t)(a.D * esz));
        }
    return 0;
}
