/* Decode attention: one query token per batch row against a KV cache.
 *
 *   y[b, h] = sum_s softmax_s(scale * q[b, h] . k[b, s, h / G]) v[b, s, h / G]
 *
 * over the cache positions s in [lo, n) whose key_mask[b, s] is set (no mask:
 * all of them); G = H / KV query heads share a KV head (GQA/MQA). q, the caches
 * and y are fp32/bf16/fp16 (each its own dtype, D unit-stride, the rest any
 * strides), sums and softmax are fp32 and y is rounded once. A row with every
 * key masked gives zeros.
 *
 * Work is one chunk per (b, kv head): the G query heads of a group read each key
 * and value row once. Two passes over the keys (scores, then the weighted sum of
 * values), the scores of a chunk in one buffer: decode reads the cache once per
 * step and the scores are a few KiB.
 */
#include "common.h"
#include "pool.h"

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
    int64_t threads;
    double scale;
    int64_t lo, n;                           /* keys [lo, n): last, as they change per step */
} DecAttnArgs;

#define P(v) ((const void *)(intptr_t)(v))

typedef struct {
    const DecAttnArgs *a;
    int64_t nomem;  /* set by a chunk that could not get its scores buffer */
} AttnJob;

static inline float dot(const float *x, const float *y, int64_t D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += x[d] * y[d];
    return s;
}

static void run_group(void *ctx, int64_t chunk) {
    AttnJob *job = (AttnJob *)ctx;
    const DecAttnArgs *a = job->a;
    const int64_t D = a->D, G = a->H / a->KV, L = a->n - a->lo;
    const int64_t b = chunk / a->KV, kh = chunk % a->KV;
    const uint8_t *mask = a->mask ? (const uint8_t *)P(a->mask) + b * a->mask_sb : NULL;
    float *buf = (float *)malloc((size_t)(G * L + 2 * G * D + D) * sizeof(float));
    if (!buf) {
        job->nomem = 1;
        return;
    }
    float *sc = buf, *qf = buf + G * L, *acc = qf + G * D, *row = acc + G * D;
    const float scale = (float)a->scale;
    for (int64_t j = 0; j < G; ++j) {
        const int64_t h = kh * G + j;
        const float *qv = atb_load(P(a->q), (int)a->q_dt, b * a->q_sb + h * a->q_sh, D, qf + j * D);
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = qv[d] * scale;
    }
    /* pass 1: scores, and each head's max */
    float mx[64];
    float *mxp = G <= 64 ? mx : (float *)malloc((size_t)G * sizeof(float));
    if (!mxp) {
        free(buf);
        job->nomem = 1;
        return;
    }
    for (int64_t j = 0; j < G; ++j) mxp[j] = -INFINITY;
    for (int64_t s = 0; s < L; ++s) {
        const int64_t pos = a->lo + s;
        if (mask && !mask[pos * a->mask_ss]) {
            for (int64_t j = 0; j < G; ++j) sc[j * L + s] = -INFINITY;
            continue;
        }
        const float *kr = atb_load(P(a->k), (int)a->kv_dt, b * a->k_sb + pos * a->k_ss + kh * a->k_sh,
                                   D, row);
        for (int64_t j = 0; j < G; ++j) {
            float z = dot(qf + j * D, kr, D);
            sc[j * L + s] = z;
            mxp[j] = z > mxp[j] ? z : mxp[j];
        }
    }
    /* softmax numerators in place; the sums normalise once at the end */
    for (int64_t j = 0; j < G; ++j) {
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
    /* pass 2: weighted sum of the value rows */
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t s = 0; s < L; ++s) {
        const int64_t pos = a->lo + s;
        if (mask && !mask[pos * a->mask_ss]) continue;
        const float *vr = atb_load(P(a->v), (int)a->kv_dt, b * a->v_sb + pos * a->v_ss + kh * a->v_sh,
                                   D, row);
        for (int64_t j = 0; j < G; ++j) {
            const float p = sc[j * L + s];
            float *o = acc + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
        }
    }
    for (int64_t j = 0; j < G; ++j) {
        float *o = acc + j * D;
        const float inv = mxp[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        atb_store((void *)P(a->y), (int)a->y_dt, b * a->y_sb + (kh * G + j) * a->y_sh, D, o);
    }
    if (mxp != mx) free(mxp);
    free(buf);
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_NOMEM (y partly written). */
ATB_API int64_t atb_decode_attention(const void *args) {
    DecAttnArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.q || !a.k || !a.v || !a.y || a.B < 0 || a.H <= 0 || a.KV <= 0 || a.H % a.KV ||
        a.D <= 0 || a.D > ATB_ATTN_MAX_D || a.lo < 0 || a.n <= a.lo)
        return ATB_ERR_ARGS;
    if (a.q_dt < 0 || a.q_dt > ATB_F16 || a.kv_dt < 0 || a.kv_dt > ATB_F16 || a.y_dt < 0 ||
        a.y_dt > ATB_F16)
        return ATB_ERR_ARGS;
    AttnJob job = {&a, 0};
    const int64_t chunks = a.B * a.KV;
    /* threads only when the cache read is worth a hand-off (a few microseconds) */
    int64_t bytes = chunks * (a.n - a.lo) * a.D * 2 * atb_dt_size((int)a.kv_dt);
    int nth = bytes < (256 << 10) ? 1 : (int)(a.threads > 0 ? a.threads : 1);
    atb_parallel_chunks(run_group, &job, chunks, nth);
    return job.nomem ? ATB_ERR_NOMEM : 0;
}
