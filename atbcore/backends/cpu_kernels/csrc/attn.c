/* Decode attention: one query token per batch row against a KV cache.
 *
 *   y[b, h] = sum_s softmax_s(scale * q[b, h] . k[b, s, h / G]) v[b, s, h / G]
 *
 * over the cache positions s in [lo, n) whose key_mask[b, s] is set (no mask:
 * all of them); G = H / KV query heads share a KV head (GQA/MQA). With `ends`
 * (int64/int32 [B]) row b attends [lo, ends[b]) instead, narrowed to the last
 * `window` positions when window > 0. With a block `table` (int64/int32 [B, *],
 * rows table_sb apart) the cache is paged: position s of row b is slot s %
 * block_size of block table[b, s / block_size], and k_sb/v_sb are the block
 * strides (PagedAttention reading the blocks in place). q, the caches
 * and y are fp32/bf16/fp16 (each its own dtype, D unit-stride, the rest any
 * strides), sums and softmax are fp32 and y is rounded once. A row with every
 * key masked gives zeros.
 *
 * int8 caches (atb_decode_attention_i8): kv_dt ATB_I8 with a scale per position
 * and kv head (ks / vs, dtype s_dt, strides like the caches' without D): a key's
 * scores are its int8 dot products times its scale, and each value row's softmax
 * weight is multiplied by its scale, so the rows are dequantized on the fly and
 * the cache read is one byte per element.
 *
 * Work is one chunk per (b, kv head), or per row b when the rows alone keep the
 * threads busy: the G query heads of a group read each key and value row once, and
 * a row's kv heads go through the passes together (a few at a time for long rows),
 * each position's rows of them read whole. Two passes over the keys (scores, then
 * the weighted sum of values: attn_passes.c), the scores of a chunk in one buffer:
 * decode reads the cache once per step and the scores are a few KiB. A head's sums
 * are the same however its chunk is cut.
 */
#include <stddef.h>

#include "attn.h"
#include "common.h"
#include "pool.h"

/* the most key and value bytes of a row a chunk reads in one go (its kv heads
 * together): what L2 holds between the passes, with room to spare */
#define ATB_ATTN_FUSE_BYTES (448 << 10)

typedef struct {
    const DecAttnArgs *a;
    int64_t nomem;  /* set by a chunk that could not get its scores buffer */
    int64_t nonfinite; /* set by a chunk that read an inf/NaN scale (int8 caches) */
    int64_t heads;  /* kv heads per chunk: all of a row's, or one */
    const int64_t *order; /* the rows longest first (NULL: in order) */
} AttnJob;

/* the scale of position s of row b, kv head kh (an int8 cache's) */
static inline float scale_at(const DecAttnArgs *a, int sh, int64_t addr, int64_t b, int64_t s,
                             int64_t kh, int64_t sb, int64_t ss, int64_t shh) {
    float tmp;
    return *atb_load(P(addr), (int)a->s_dt, row_at(a, sh, b, s, sb, ss) + kh * shh, 1, &tmp);
}

/* the keys [lo, end) row b attends */
static void row_keys(const DecAttnArgs *a, int64_t b, int64_t *lo, int64_t *end) {
    *lo = a->lo;
    *end = a->n;
    if (a->ends) {
        *end = ival(a->ends, (int)a->ends_i32, b);
        if (a->window > 0 && *end - a->window > *lo) *lo = *end - a->window;
    }
}

/* the G query heads of each of the nk kv heads from kh of row b (query head
 * (kh + i) * G + j at index i * G + j of the buffers) */
/* each score row of the G query heads of kv heads kh .. kh+nk-1 times its position's
 * int8 scale (at addr, strides sb / ss / shh: the key or value scales); an inf/NaN
 * scale is flagged */
static void scale_scores(AttnJob *job, int sh, int64_t addr, int64_t sb, int64_t ss,
                         int64_t shh, int64_t b, int64_t kh, int64_t nk, int64_t lo, int64_t L,
                         int64_t G, float *sc) {
    const DecAttnArgs *a = job->a;
    for (int64_t i = 0; i < nk; ++i)
        for (int64_t s = 0; s < L; ++s) {
            const float f = scale_at(a, sh, addr, b, lo + s, kh + i, sb, ss, shh);
            if (!isfinite(f)) job->nonfinite = 1;
            for (int64_t j = i * G; j < (i + 1) * G; ++j) sc[j * L + s] *= f;
        }
}

static void run_group(AttnJob *job, int64_t b, int64_t kh, int64_t nk) {
    const DecAttnArgs *a = job->a;
    int64_t lo, end;
    row_keys(a, b, &lo, &end);
    const int64_t D = a->D, G = a->H / a->KV, NH = nk * G, L = end > lo ? end - lo : 0;
    const int sh = a->table ? block_shift(a->block_size) : -1;
    const uint8_t *mask = a->mask ? (const uint8_t *)P(a->mask) + b * a->mask_sb : NULL;
    float *buf = (float *)malloc((size_t)(NH * L + 2 * NH * D + 16 * D) * sizeof(float));
    if (!buf) {
        job->nomem = 1;
        return;
    }
    float *sc = buf, *qf = buf + NH * L, *acc = qf + NH * D, *row = acc + NH * D;
    const float scale = (float)a->scale;
    for (int64_t j = 0; j < NH; ++j) {
        const int64_t h = kh * G + j;
        const float *qv = atb_load(P(a->q), (int)a->q_dt, b * a->q_sb + h * a->q_sh, D, qf + j * D);
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = qv[d] * scale;
    }
    /* pass 1: scores, and each head's max */
    float mx[64];
    float *mxp = NH <= 64 ? mx : (float *)malloc((size_t)NH * sizeof(float));
    if (!mxp) {
        free(buf);
        job->nomem = 1;
        return;
    }
    for (int64_t j = 0; j < NH; ++j) mxp[j] = -INFINITY;
    atb_attn_scores(a, b, kh, nk, lo, L, qf, G, sc, row);
    if (a->ks)  /* int8 keys: q . (c * s) = s * (q . c) */
        scale_scores(job, sh, a->ks, a->ks_sb, a->ks_ss, a->ks_sh, b, kh, nk, lo, L, G, sc);
    if (mask)
        for (int64_t s = 0; s < L; ++s)
            if (!mask[(lo + s) * a->mask_ss])
                for (int64_t j = 0; j < NH; ++j) sc[j * L + s] = -INFINITY;
    for (int64_t j = 0; j < NH; ++j) {  /* a head's scores are contiguous: one pass each */
        const float *z = sc + j * L;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t s = 0; s < L; ++s) m = z[s] > m ? z[s] : m;
        mxp[j] = m;
    }
    /* softmax numerators in place; the sums normalise once at the end */
    for (int64_t j = 0; j < NH; ++j) {
        float *z = sc + j * L, m = mxp[j], sum = 0.0f;
        if (m == -INFINITY) { /* every key masked */
            mxp[j] = 0.0f;
            continue;
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < L; ++s) {
            z[s] = atb_expf(z[s] - m);
            sum += z[s];
        }
        mxp[j] = 1.0f / sum;
    }
    if (a->vs)  /* int8 values: p (c * s) = (p s) c; the sums above normalise */
        scale_scores(job, sh, a->vs, a->vs_sb, a->vs_ss, a->vs_sh, b, kh, nk, lo, L, G, sc);
    /* pass 2: weighted sum of the value rows */
    atb_attn_values(a, sh, b, kh, nk, lo, L, mask, sc, G, row, acc);
    for (int64_t j = 0; j < NH; ++j) {
        float *o = acc + j * D;
        const float inv = mxp[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        atb_store((void *)P(a->y), (int)a->y_dt, b * a->y_sb + (kh * G + j) * a->y_sh, D, o);
    }
    if (mxp != mx) free(mxp);
    free(buf);
}

static void run_chunk(void *ctx, int64_t chunk) {
    AttnJob *job = (AttnJob *)ctx;
    const DecAttnArgs *a = job->a;
    const int64_t KV = a->KV;
    const int64_t r = job->heads == KV ? chunk : chunk / KV;
    const int64_t b = job->order ? job->order[r] : r;
    if (job->heads != KV) {
        run_group(job, b, chunk % KV, 1);
        return;
    }
    /* as many kv heads at once as keep the row's key and value rows of them in L2
     * from pass 1 (which prefetches the value rows) to pass 2 */
    int64_t lo, end;
    row_keys(a, b, &lo, &end);
    const int64_t head_bytes = (end > lo ? end - lo : 1) * a->D * atb_dt_size((int)a->kv_dt) * 2;
    int64_t nk = ATB_ATTN_FUSE_BYTES / head_bytes;
    nk = nk < 1 ? 1 : (nk > KV ? KV : nk);
    for (int64_t kh = 0; kh < KV; kh += nk) run_group(job, b, kh, kh + nk <= KV ? nk : KV - kh);
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_CACHE_OVERFLOW when a row's end
 * is negative or past n (nothing written), ATB_ERR_NOMEM (y partly written),
 * ATB_ERR_NONFINITE when an int8 cache's scale read is inf/NaN (y written, but its
 * rows must be recomputed from the dequantized rows, where c * inf depends on c). */
static int64_t decode_attention(DecAttnArgs a);

ATB_API int64_t atb_decode_attention(const void *args) {
    DecAttnArgs a;
    memset(&a, 0, sizeof a);
    memcpy(&a, args, offsetof(DecAttnArgs, ks));  /* float caches: no scale fields */
    if (a.kv_dt > ATB_F16) return ATB_ERR_ARGS;
    return decode_attention(a);
}

/* int8 caches with their scales (the full DecAttnArgs) */
ATB_API int64_t atb_decode_attention_i8(const void *args) {
    DecAttnArgs a;
    memcpy(&a, args, sizeof a);
    if (a.kv_dt != ATB_I8 || !a.ks || !a.vs || a.s_dt < 0 || a.s_dt > ATB_F16)
        return ATB_ERR_ARGS;
    return decode_attention(a);
}

static int64_t decode_attention(DecAttnArgs a) {
    if (!a.q || !a.k || !a.v || !a.y || a.B < 0 || a.H <= 0 || a.KV <= 0 || a.H % a.KV ||
        a.D <= 0 || a.D > ATB_ATTN_MAX_D || a.lo < 0 || (!a.ends && a.n <= a.lo) ||
        (a.table && a.block_size <= 0))
        return ATB_ERR_ARGS;
    if (a.q_dt < 0 || a.q_dt > ATB_F16 || a.kv_dt < 0 || (a.kv_dt > ATB_F16 && a.kv_dt != ATB_I8) ||
        a.kv_dt == ATB_BOOL || a.y_dt < 0 || a.y_dt > ATB_F16)
        return ATB_ERR_ARGS;
    if (a.ends) /* every row's keys inside [0, n) before anything is written */
        for (int64_t b = 0; b < a.B; ++b) {
            int64_t e = ival(a.ends, (int)a.ends_i32, b);
            if (e < 0 || e > a.n) return ATB_ERR_CACHE_OVERFLOW;
        }
    /* threads only when the cache read is worth a hand-off (a few microseconds); a
     * single decode row's kv heads already are (one head per thread) */
    int64_t bytes = a.B * a.KV * (a.n > a.lo ? a.n - a.lo : 1) * a.D * 2 * atb_dt_size((int)a.kv_dt);
    int nth = bytes < (32 << 10) ? 1 : (int)(a.threads > 0 ? a.threads : 1);
    /* a chunk per batch row (its kv heads together: run_chunk) when the rows alone
     * keep the threads busy, else per (row, kv head) */
    AttnJob job = {&a, 0, 0, a.B >= 4 * nth ? a.KV : 1, NULL};
    int64_t *order = NULL;
    if (a.ends && nth > 1 && (order = (int64_t *)malloc((size_t)a.B * sizeof(int64_t)))) {
        /* the longest rows are taken first, so the last chunks are short ones and the
         * threads finish together (16 paged rows of 16..544 keys: 2.45 -> 2.3-2.4 ms
         * per 8 layers); rows of equal length keep their order */
        for (int64_t b = 0; b < a.B; ++b) {
            const int64_t e = ival(a.ends, (int)a.ends_i32, b);
            int64_t i = b;
            for (; i > 0 && ival(a.ends, (int)a.ends_i32, order[i - 1]) < e; --i)
                order[i] = order[i - 1];
            order[i] = b;
        }
        job.order = order;
    }
    atb_parallel_chunks(run_chunk, &job, a.B * a.KV / job.heads, nth);
    free(order);
    return job.nomem ? ATB_ERR_NOMEM : (job.nonfinite ? ATB_ERR_NONFINITE : 0);
}