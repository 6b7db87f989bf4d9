/* ReshapeAndCache: tokens' keys and values into a paged cache, in place; and the
 * row gather an Embedding is (atb_gather_rows, below).
 *
 *   kc[slot / block_size, slot % block_size] = k[t]   (and v into vc)
 *
 * for every token t whose slot_mapping entry is >= 0 (-1 marks padding that is
 * not stored). A token row is `row` contiguous elements (KV heads x head_dim), at
 * the same dtype in the inputs and the caches (a plain copy). Every slot is
 * checked before anything is written, so a bad mapping leaves the caches as they
 * were.
 */
#include "common.h"

typedef struct {
    int64_t k, v, kc, vc, slots;          /* addresses */
    int64_t slots_i32, elem_size, tokens, row;
    int64_t k_stride, v_stride;           /* elements between tokens */
    int64_t block_size, num_blocks;
    int64_t kc_block, kc_slot, vc_block, vc_slot;  /* cache element strides */
} CacheArgs;

#define P(v) ((void *)(intptr_t)(v))

static inline int64_t slot_at(const CacheArgs *a, int64_t t) {
    return a->slots_i32 ? ((const int32_t *)P(a->slots))[t] : ((const int64_t *)P(a->slots))[t];
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_CACHE_OVERFLOW for a slot past
 * the cache (nothing written). */
ATB_API int64_t atb_reshape_and_cache(const void *args) {
    CacheArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.k || !a.v || !a.kc || !a.vc || !a.slots || a.tokens < 0 || a.row <= 0 ||
        a.block_size <= 0 || a.num_blocks < 0 || (a.elem_size != 1 && a.elem_size != 2 &&
                                                  a.elem_size != 4 && a.elem_size != 8))
        return ATB_ERR_ARGS;
    const int64_t cap = a.block_size * a.num_blocks;
    for (int64_t t = 0; t < a.tokens; ++t) {
        int64_t s = slot_at(&a, t);
        if (s < -1 || s >= cap) return ATB_ERR_CACHE_OVERFLOW;
    }
    const size_t bytes = (size_t)(a.row * a.elem_size);
    for (int64_t t = 0; t < a.tokens; ++t) {
        int64_t s = slot_at(&a, t);
        if (s < 0) continue;
        int64_t blk = s / a.block_size, off = s % a.block_size;
        memcpy((char *)P(a.kc) + (blk * a.kc_block + off * a.kc_slot) * a.elem_size,
               (const char *)P(a.k) + t * a.k_stride * a.elem_size, bytes);
        memcpy((char *)P(a.vc) + (blk * a.vc_block + off * a.vc_slot) * a.elem_size,
               (const char *)P(a.v) + t * a.v_stride * a.elem_size, bytes);
    }
    return 0;
}

typedef struct {
    int64_t table, ids, out;              /* addresses */
    int64_t ids_i32, elem_size, count, row, table_rows;
} GatherArgs;

/* out[i] = table[ids[i]] for `count` ids, rows of `row` contiguous elements (an
 * Embedding lookup). Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_CACHE_OVERFLOW
 * for an id outside [0, table_rows) (nothing written). */
ATB_API int64_t atb_gather_rows(const void *args) {
    GatherArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.table || !a.ids || !a.out || a.count < 0 || a.row <= 0 || a.table_rows < 0 ||
        (a.elem_size != 1 && a.elem_size != 2 && a.elem_size != 4 && a.elem_size != 8))
        return ATB_ERR_ARGS;
    for (int64_t i = 0; i < a.count; ++i) {
        int64_t id = a.ids_i32 ? ((const int32_t *)P(a.ids))[i] : ((const int64_t *)P(a.ids))[i];
        if (id < 0 || id >= a.table_rows) return ATB_ERR_CACHE_OVERFLOW;
    }
    const size_t bytes = (size_t)(a.row * a.elem_size);
    for (int64_t i = 0; i < a.count; ++i) {
        int64_t id = a.ids_i32 ? ((const int32_t *)P(a.ids))[i] : ((const int64_t *)P(a.ids))[i];
        memcpy((char *)P(a.out) + i * (int64_t)bytes, (const char *)P(a.table) + id * (int64_t)bytes,
               bytes);
    }
    return 0;
}

/* ReshapeAndCacheInt8: each token's key/value heads quantized into int8 caches and
 * their scale caches (atbcore.ops.paged_int8): per head of D values, in float64,
 * s = absmax / 127 rounded to the scale dtype, q = round_half_even(x / s) clipped to
 * +-127 (0 where s is 0 or not finite, or x / s is NaN). Token rows are KV x D
 * contiguous (x_dt fp32/bf16/fp16), cache rows KV x D int8 and KV scales (s_dt). */
typedef struct {
    int64_t k, v, kc, vc, ks, vs, slots;   /* addresses */
    int64_t slots_i32, x_dt, s_dt, tokens, KV, D;
    int64_t k_stride, v_stride;            /* elements between tokens */
    int64_t block_size, num_blocks;
    int64_t kc_block, kc_slot, vc_block, vc_slot;  /* int8 cache element strides */
    int64_t ks_block, ks_slot, vs_block, vs_slot;  /* scale element strides */
} QCacheArgs;

static inline double x_at(const void *src, int dt, int64_t i) {
    if (dt == ATB_F32) return (double)((const float *)src)[i];
    const uint16_t h = ((const uint16_t *)src)[i];
    return (double)(dt == ATB_BF16 ? atb_bf16_to_f32(h) : atb_f16_to_f32(h));
}

/* d rounded to dtype dt (stored at dst[i]); returns the stored value as a double */
static inline double store_scale(void *dst, int dt, int64_t i, double d) {
    if (dt == ATB_F32) {
        ((float *)dst)[i] = (float)d;
        return (double)((float *)dst)[i];
    }
    uint16_t h;
#if defined(__FLT16_MANT_DIG__) && (defined(__x86_64__) || defined(__aarch64__))
    if (dt == ATB_F16) { /* one rounding from double, as NumPy and torch do */
        _Float16 f = (_Float16)d;
        memcpy(&h, &f, 2);
    } else
#endif
        h = dt == ATB_BF16 ? atb_f32_to_bf16((float)d) : atb_f32_to_f16((float)d);
    ((uint16_t *)dst)[i] = h;
    return (double)(dt == ATB_BF16 ? atb_bf16_to_f32(h) : atb_f16_to_f32(h));
}

static void quantize_head(const void *x, int xdt, int64_t off, int64_t D, int8_t *q,
                          void *s, int sdt, int64_t soff) {
    double m = 0.0;
    int nan = 0;
    for (int64_t d = 0; d < D; ++d) {
        const double a = fabs(x_at(x, xdt, off + d));
        if (a != a) nan = 1;
        else if (a > m) m = a;
    }
    const double sf = store_scale(s, sdt, soff, nan ? NAN : m / 127.0);
    const int ok = isfinite(sf) && sf > 0.0;
    for (int64_t d = 0; d < D; ++d) {
        double r = ok ? nearbyint(x_at(x, xdt, off + d) / sf) : 0.0;
        if (r != r) r = 0.0;
        q[d] = (int8_t)(r > 127.0 ? 127.0 : (r < -127.0 ? -127.0 : r));
    }
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_CACHE_OVERFLOW for a slot past
 * the cache (nothing written). */
ATB_API int64_t atb_reshape_and_cache_i8(const void *args) {
    QCacheArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.k || !a.v || !a.kc || !a.vc || !a.ks || !a.vs || !a.slots || a.tokens < 0 ||
        a.KV <= 0 || a.D <= 0 || a.block_size <= 0 || a.num_blocks < 0 || a.x_dt < 0 ||
        a.x_dt > ATB_F16 || a.s_dt < 0 || a.s_dt > ATB_F16)
        return ATB_ERR_ARGS;
    const int64_t cap = a.block_size * a.num_blocks;
    for (int64_t t = 0; t < a.tokens; ++t) {
        int64_t s = a.slots_i32 ? ((const int32_t *)P(a.slots))[t] : ((const int64_t *)P(a.slots))[t];
        if (s < -1 || s >= cap) return ATB_ERR_CACHE_OVERFLOW;
    }
    for (int64_t t = 0; t < a.tokens; ++t) {
        int64_t s = a.slots_i32 ? ((const int32_t *)P(a.slots))[t] : ((const int64_t *)P(a.slots))[t];
        if (s < 0) continue;
        const int64_t blk = s / a.block_size, off = s % a.block_size;
        for (int64_t h = 0; h < a.KV; ++h) {
            quantize_head(P(a.k), (int)a.x_dt, t * a.k_stride + h * a.D, a.D,
                          (int8_t *)P(a.kc) + blk * a.kc_block + off * a.kc_slot + h * a.D,
                          P(a.ks), (int)a.s_dt, blk * a.ks_block + off * a.ks_slot + h);
            quantize_head(P(a.v), (int)a.x_dt, t * a.v_stride + h * a.D, a.D,
                          (int8_t *)P(a.vc) + blk * a.vc_block + off * a.vc_slot + h * a.D,
                          P(a.vs), (int)a.s_dt, blk * a.vs_block + off * a.vs_slot + h);
        }
    }
    return 0;
}
