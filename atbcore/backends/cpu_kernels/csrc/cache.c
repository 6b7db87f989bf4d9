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
