/* Prefill attention over packed variable-length sequences (FlashAttention's
 * forward on the CPU):
 *
 *   y[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, h / G]) v[j, h / G]
 *
 * Sequence s is the row seqs[s] = {q0, k0, v0, y0, sq, skv}: its sq query tokens
 * start at element q0 of q (token t at q0 + t * q_st), its skv keys and values at
 * k0 / v0, its outputs at y0 (packed varlen or a padded batch alike). Positions are
 * bottom-right aligned: query row i of a sequence with sq queries and skv keys sits
 * at position off + i, off = max(skv - sq, 0). Causal: key j is seen when
 * j <= off + i; a window w > 0 (implies causal) also needs j > off + i - w. A row
 * that sees no key gives zeros. q, k/v and y are fp32/bf16/fp16 (D unit-stride,
 * tokens and heads any strides); scores, softmax and sums are fp32 and y is
 * rounded once.
 *
 * Work: one chunk per (sequence, kv head, block of query rows), the longest first
 * so the pool's threads finish together. A chunk stacks the G query heads of its
 * kv head over its rows: M = G x rows query vectors share every key and value
 * read. They are held transposed, one vector per SIMD lane (Q^T [D][M], O^T
 * [D][M]), so keys and values are read as rows in place (fp32; half types are
 * widened once per block) and the online softmax runs across lanes with no
 * horizontal reductions. Keys go in blocks of 64: scores S^T = K Q^T as register
 * tiles, the causal / window rules as per-lane position masks, then O^T += V^T P^T
 * (flash_blocks.c: 6 x 64-lane tiles over the whole chunk; AVX2 builds, flash_lanes.c:
 * 16 lanes at a time through all three while they are in L1). Blocks past a chunk's
 * last position are never touched. bf16 q and k on a CPU with AVX512_BF16 take the
 * same walk with VDPBF16PS score tiles on bf16 pairs (flash_bf16.c).
 */
#include "common.h"
#include "flash_lanes.h"
#include "flash_bf16.h"
#include "pool.h"
#include "simd.h"

#define FL_MAX_D 256

typedef struct {
    int64_t q, k, v, y;                      /* addresses */
    int64_t q_dt, kv_dt, y_dt;
    int64_t H, KV, D;
    int64_t q_st, q_sh;                      /* element strides: token, head */
    int64_t k_st, k_sh, v_st, v_sh;
    int64_t y_st, y_sh;
    int64_t nseq, seqs;                      /* int64 [nseq][6]: q0, k0, v0, y0, sq, skv */
    int64_t causal, window;
    int64_t threads;
    double scale;
} FlashArgs;

#define P(v) ((const void *)(intptr_t)(v))

typedef struct {
    int32_t seq, kvh, r0, r1;                /* query rows [r0, r1) of the sequence */
    int64_t cost;
} FlChunk;

typedef struct {
    const FlashArgs *a;
    const FlChunk *chunks;
    int64_t nomem;
} FlJob;

static int by_cost(const void *x, const void *y) {
    int64_t a = ((const FlChunk *)x)->cost, b = ((const FlChunk *)y)->cost;
    return a < b ? 1 : (a > b ? -1 : 0);
}

/* this thread's scratch of at least n floats, kept between calls (a chunk's
 * buffers are ~100 KiB: allocating and clearing them per chunk cost a fifth of a
 * short sequence's time); NULL when it cannot grow */
static float *scratch(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    if (n > cap) {
        float *b = (float *)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        if (!b) return NULL;
        free(buf);
        buf = b;
        cap = n;
    }
    return buf;
}

/* where lane m's element d of Qt / Ot lies: slice-major in AVX2 builds (flash_lanes.h),
 * else [D][Mp] */
static inline int64_t lane_at(int64_t d, int64_t m, int64_t Mp, int64_t D) {
#ifdef ATB_AVX2
    (void)Mp;
    return atb_flash_slice_at(d, m, D);
#else
    (void)D;
    return d * Mp + m;
#endif
}

static void run_chunk(void *ctx, int64_t ci) {
    FlJob *job = (FlJob *)ctx;
    const FlashArgs *a = job->a;
    const FlChunk *ch = &job->chunks[ci];
    const int64_t *sd = (const int64_t *)P(a->seqs) + 6 * ch->seq;
    const int64_t D = a->D, G = a->H / a->KV;
    const int64_t sq = sd[4], skv = sd[5];
    const int64_t off = skv > sq ? skv - sq : 0, rows = ch->r1 - ch->r0, M = rows * G;
    const int64_t Mp = (M + 15) / 16 * 16;
    const int causal = a->causal || a->window > 0;
    const int half = a->kv_dt != ATB_F32;
    /* bf16 q and k: the scores by VDPBF16PS on pairs (Qt holds q's bf16 pairs, keys
     * are read in place) */
    const int pairs = a->q_dt == ATB_BF16 && a->kv_dt == ATB_BF16 && atb_flash_bf16_ready();
    /* scratch: Qt, Ot [D][Mp], St [64][Mp], mx, sum, pos [Mp], 8 rows, K/V blocks when
     * widened [64][D] */
    size_t n = (size_t)(2 * D * Mp + FL_BK * Mp + 3 * Mp + 8 * D + (half ? 2 * FL_BK * D : 0));
    float *buf = scratch(n);
    if (!buf) {
        __atomic_store_n(&job->nomem, 1, __ATOMIC_RELAXED);
        return;
    }
    float *Qt = buf, *Ot = Qt + D * Mp, *St = Ot + D * Mp, *mx = St + FL_BK * Mp, *sum = mx + Mp;
    int32_t *pos = (int32_t *)(sum + Mp);
    float *tmp = (float *)(pos + Mp), *Kb = tmp + 8 * D, *Vb = Kb + FL_BK * D;
#ifdef ATB_AVX2
    /* the block walk's softmax is in base 2: scores in log2 units cost exp no range
     * reduction by ln 2 */
    const float scale = (float)(a->scale * 1.4426950408889634);
#else
    const float scale = (float)a->scale;
#endif
    memset(Ot, 0, (size_t)(D * Mp) * sizeof(float));
#ifdef ATB_AVX2
    /* the queries of whole groups of 8 lanes are transposed 8 x 8 in registers (the
     * element-wise loop's strided stores were a third of a short sequence's time) */
    const int64_t m8 = !pairs ? M / 8 * 8 : 0, qes = atb_dt_size((int)a->q_dt);
    const void *q8[8];
#endif
    for (int64_t m = 0; m < Mp; ++m) {   /* lane m = r * G + g: a row's heads side by side */
        mx[m] = -INFINITY;
        sum[m] = 0.0f;
        if (m >= M) {
            pos[m] = FL_NONE;
            for (int64_t d = 0; d < D; ++d) Qt[lane_at(d, m, Mp, D)] = 0.0f;  /* (zero pairs too) */
            continue;
        }
        const int64_t r = m / G, h = ch->kvh * G + m % G, t = ch->r0 + r;
        pos[m] = (int32_t)(off + t);
        const int64_t qo = sd[0] + t * a->q_st + h * a->q_sh;
#ifdef ATB_AVX2
        if (m < m8) {
            q8[m % 8] = (const char *)P(a->q) + qo * qes;
            if (m % 8 == 7) atb_flash_fill_q8(q8, (int)a->q_dt, Qt, m - 7, D, scale);
            continue;
        }
#endif
        if (pairs) {
            atb_flash_bf16_q((uint32_t *)Qt, (const uint16_t *)P(a->q) + qo, m, Mp, D);
            continue;
        }
        const float *src = atb_load(P(a->q), (int)a->q_dt, qo, D, tmp);
        for (int64_t d = 0; d < D; ++d) Qt[lane_at(d, m, Mp, D)] = src[d] * scale;
    }
    /* the keys any row of this block sees */
    int64_t hi = causal ? off + ch->r1 : skv, lo = 0;
    if (hi > skv) hi = skv;
    if (a->window > 0) {
        lo = off + ch->r0 - a->window + 1;
        if (lo < 0) lo = 0;
    }
    const float *kr[FL_BK], *vr[FL_BK];
    for (int64_t j0 = lo; j0 < hi; j0 += FL_BK) {
        const int nk = (int)(hi - j0 < FL_BK ? hi - j0 : FL_BK);
        const uint16_t *kh[FL_BK];
        for (int j = 0; j < nk; ++j) {   /* rows in place, or widened into the block */
            const int64_t t = j0 + j, ko = sd[1] + t * a->k_st + ch->kvh * a->k_sh;
            if (pairs)
                kh[j] = (const uint16_t *)P(a->k) + ko;
            else
                kr[j] = atb_load(P(a->k), (int)a->kv_dt, ko, D, Kb + j * D);
            vr[j] = atb_load(P(a->v), (int)a->kv_dt, sd[2] + t * a->v_st + ch->kvh * a->v_sh, D,
                             Vb + j * D);
        }
#ifdef ATB_AVX2
        atb_flash_block_lanes(kr, vr, Qt, St, Ot, mx, sum, pos, Mp, D, j0, nk, causal, a->window);
        (void)kh;
#else
        if (pairs)
            atb_flash_bf16_scores(kh, (const uint32_t *)Qt, St, Mp, D, nk, scale);
        else
            atb_flash_scores(kr, Qt, St, Mp, D, nk);
        atb_flash_softmax(St, Ot, mx, sum, pos, Mp, D, j0, nk, causal, a->window);
        atb_flash_accumulate(vr, St, Ot, Mp, D, nk);
#endif
    }
    int64_t m = 0;
#ifdef ATB_AVX2
    /* whole groups of 8 lanes leave by 8 x 8 register transposes (lane by lane, each
     * element was a scalar read 64 bytes from the last) */
    for (; m + 8 <= M; m += 8) {
        float inv[8], *dst[8];
        int64_t yo[8];
        for (int i = 0; i < 8; ++i) {
            const int64_t r = (m + i) / G, h = ch->kvh * G + (m + i) % G, t = ch->r0 + r;
            yo[i] = sd[3] + t * a->y_st + h * a->y_sh;
            inv[i] = sum[m + i] > 0.0f ? 1.0f / sum[m + i] : 0.0f;
            dst[i] = a->y_dt == ATB_F32 ? (float *)P(a->y) + yo[i] : tmp + i * D;
        }
        atb_flash_out8(Ot, m, D, inv, dst);
        if (a->y_dt != ATB_F32)
            for (int i = 0; i < 8; ++i) atb_store((void *)P(a->y), (int)a->y_dt, yo[i], D, dst[i]);
    }
#endif
    for (; m < M; ++m) {
        const int64_t r = m / G, h = ch->kvh * G + m % G, t = ch->r0 + r;
        const float inv = sum[m] > 0.0f ? 1.0f / sum[m] : 0.0f;
        for (int64_t d = 0; d < D; ++d) tmp[d] = Ot[lane_at(d, m, Mp, D)] * inv;
        atb_store((void *)P(a->y), (int)a->y_dt, sd[3] + t * a->y_st + h * a->y_sh, D, tmp);
    }
}

/* Returns 0, ATB_ERR_ARGS for a bad call (nothing written), ATB_ERR_NOMEM. */
ATB_API int64_t atb_prefill_attention(const FlashArgs *a) {
    if (!a || !a->q || !a->k || !a->v || !a->y || (a->nseq && !a->seqs) || a->nseq < 0 ||
        a->H <= 0 || a->KV <= 0 || a->H % a->KV || a->D <= 0 || a->D > FL_MAX_D || a->window < 0)
        return ATB_ERR_ARGS;
    if (a->q_dt < 0 || a->q_dt > ATB_F16 || a->kv_dt < 0 || a->kv_dt > ATB_F16 || a->y_dt < 0 ||
        a->y_dt > ATB_F16)
        return ATB_ERR_ARGS;
    const int64_t *sd = (const int64_t *)P(a->seqs);
    const int64_t G = a->H / a->KV;
    /* about 128 query vectors per chunk: each key block is transposed and copied once
     * for them (64 vectors: 2048 causal tokens 29.4 ms per layer; 128: 27.5; 192: 26.8) */
    int64_t rows = (128 + G - 1) / G;
    int64_t nchunks = 0;
    for (int64_t s = 0; s < a->nseq; ++s) {
        const int64_t sq = sd[6 * s + 4], skv = sd[6 * s + 5];
        if (sq < 0 || skv < 0 || sq > INT32_MAX) return ATB_ERR_ARGS;
        nchunks += (sq + rows - 1) / rows;
    }
    if (nchunks == 0) return 0;
    FlChunk *chunks = (FlChunk *)malloc((size_t)(nchunks * a->KV) * sizeof(FlChunk));
    if (!chunks) return ATB_ERR_NOMEM;
    int64_t c = 0;
    const int causal = a->causal || a->window > 0;
    for (int64_t s = 0; s < a->nseq; ++s) {
        const int64_t sq = sd[6 * s + 4], skv = sd[6 * s + 5];
        const int64_t off = skv > sq ? skv - sq : 0;
        for (int64_t r0 = 0; r0 < sq; r0 += rows) {
            const int64_t r1 = r0 + rows < sq ? r0 + rows : sq;
            int64_t hi = causal ? off + r1 : skv, lo = 0;
            if (hi > skv) hi = skv;
            if (a->window > 0 && off + r0 - a->window + 1 > 0) lo = off + r0 - a->window + 1;
            for (int64_t h = 0; h < a->KV; ++h)
                chunks[c++] = (FlChunk){(int32_t)s, (int32_t)h, (int32_t)r0, (int32_t)r1,
                                        (r1 - r0) * (hi > lo ? hi - lo : 0) + 64};
        }
    }
    qsort(chunks, (size_t)c, sizeof(FlChunk), by_cost);
    FlJob job = {a, chunks, 0};
    atb_parallel_chunks_big(run_chunk, &job, c, (int)(a->threads > 0 ? a->threads : 1));
    free(chunks);
    return job.nomem ? ATB_ERR_NOMEM : 0;
}
