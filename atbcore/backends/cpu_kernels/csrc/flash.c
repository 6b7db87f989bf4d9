/* Prefill attention over packed variable-length sequences (FlashAttention's
 * forward on the CPU):
 *
 *   y[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, h / G]) v[j, h / G]
 *
 * Sequence s is the row seqs[s] = {q0, k0, v0, y0, sq, skv}: its sq query tokens
 * start at element q0 of q (token t at q0 + t * q_st), its skv keys and values at
 * k0 / v0, its outputs at y0 (packed varlen or a padded batch alike). Positions are bottom-right
 * aligned: query row i of a sequence with sq queries and skv keys sits at
 * position off + i, off = max(skv - sq, 0). Causal: key j is seen when
 * j <= off + i; a window w > 0 (implies causal) also needs j > off + i - w. A row
 * that sees no key gives zeros. q, k/v and y are fp32/bf16/fp16 (D unit-stride,
 * tokens and heads any strides); scores, softmax and sums are fp32 and y is
 * rounded once.
 *
 * Work: one chunk per (sequence, kv head, block of query rows), the longest
 * first so the pool's threads finish together. A chunk stacks the G query heads
 * of its kv head over its rows (M = G x rows query vectors share every key and
 * value read) and walks the keys it can see in blocks of 64 with the online
 * softmax: scores S = Q K^T of a block as 6 x 64 register tiles (K transposed
 * into a block buffer), then O += P V as 6 x 64 tiles. Causal blocks past a
 * row block's last position are never touched.
 */
#include "common.h"
#include "pool.h"
#include "simd.h"

#define FL_BK 64     /* keys per block */
#define FL_ROWS 6    /* query vectors per register tile */
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

#ifdef ATB_AVX512
/* the tiles' loops over rows and vectors must unroll completely (their
 * accumulators then live in registers) */
#define FL_UNROLL _Pragma("GCC unroll 8")

/* S rows m..m+R, keys 0..16 NZ = Q rows . Kt: R x NZ accumulators */
static inline __attribute__((always_inline)) void score_tile(int R, int NZ, const float *Q,
                                                             const float *Kt, float *S, int64_t m,
                                                             int64_t Dp) {
    __m512 acc[FL_ROWS][4], kv[4];
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < Dp; ++d) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) kv[u] = _mm512_loadu_ps(Kt + d * FL_BK + 16 * u);
        FL_UNROLL
        for (int r = 0; r < R; ++r) {
            __m512 qv = _mm512_set1_ps(Q[(m + r) * Dp + d]);
            FL_UNROLL
            for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_fmadd_ps(qv, kv[u], acc[r][u]);
        }
    }
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) _mm512_storeu_ps(S + (m + r) * FL_BK + 16 * u, acc[r][u]);
    }
}

/* O rows m..m+R, columns c..c+16 NZ += P rows . V[0..nk) */
static inline __attribute__((always_inline)) void pv_tile(int R, int NZ, const float *Pm,
                                                          const float *V, float *O, int64_t m,
                                                          int64_t c, int64_t Dp, int nk) {
    __m512 acc[FL_ROWS][4], vv[4];
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_loadu_ps(O + (m + r) * Dp + c + 16 * u);
    }
    for (int j = 0; j < nk; ++j) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) vv[u] = _mm512_loadu_ps(V + j * Dp + c + 16 * u);
        FL_UNROLL
        for (int r = 0; r < R; ++r) {
            __m512 p = _mm512_set1_ps(Pm[(m + r) * FL_BK + j]);
            FL_UNROLL
            for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_fmadd_ps(p, vv[u], acc[r][u]);
        }
    }
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) _mm512_storeu_ps(O + (m + r) * Dp + c + 16 * u, acc[r][u]);
    }
}

/* the rows [0, M) in tiles of 6, 3 and 1 rows, NZ vectors wide */
#define FL_ROW_TILES(NZ, TILE, ...)                                        \
    do {                                                                   \
        int64_t m = 0;                                                     \
        for (; m + FL_ROWS <= M; m += FL_ROWS) TILE(FL_ROWS, NZ, __VA_ARGS__); \
        for (; m + 3 <= M; m += 3) TILE(3, NZ, __VA_ARGS__);               \
        for (; m < M; ++m) TILE(1, NZ, __VA_ARGS__);                       \
    } while (0)
#define FL_BY_WIDTH(nz, TILE, ...)                                         \
    switch (nz) {                                                          \
    case 1: FL_ROW_TILES(1, TILE, __VA_ARGS__); break;                     \
    case 2: FL_ROW_TILES(2, TILE, __VA_ARGS__); break;                     \
    case 3: FL_ROW_TILES(3, TILE, __VA_ARGS__); break;                     \
    default: FL_ROW_TILES(4, TILE, __VA_ARGS__); break;                    \
    }
#endif

/* S[m][0..nk) = Q[m] . Kt[.][0..nk) for m in [0, M): Q [M][Dp], Kt [Dp][64] (S
 * columns up to the next multiple of 16 are written too) */
static void scores(const float *Q, const float *Kt, float *S, int64_t M, int64_t Dp, int nk) {
#ifdef ATB_AVX512
    FL_BY_WIDTH((nk + 15) / 16, score_tile, Q, Kt, S, m, Dp)
#else
    for (int64_t m = 0; m < M; ++m) {
        float *s = S + m * FL_BK;
        for (int j = 0; j < nk; ++j) s[j] = 0.0f;
        for (int64_t d = 0; d < Dp; ++d) {
            const float qv = Q[m * Dp + d], *kt = Kt + d * FL_BK;
#pragma omp simd
            for (int j = 0; j < nk; ++j) s[j] += qv * kt[j];
        }
    }
#endif
}

/* O[m][0..Dp) += sum_j Pm[m][j] V[j][0..Dp) for j < nk: P [M][64], V [64][Dp] */
static void accumulate(const float *Pm, const float *V, float *O, int64_t M, int64_t Dp,
                       int nk) {
#ifdef ATB_AVX512
    for (int64_t c = 0; c < Dp; c += 64) {
        const int64_t w = Dp - c < 64 ? Dp - c : 64;
        FL_BY_WIDTH(w / 16, pv_tile, Pm, V, O, m, c, Dp, nk)
    }
#else
    for (int64_t m = 0; m < M; ++m) {
        float *o = O + m * Dp;
        for (int j = 0; j < nk; ++j) {
            const float p = Pm[m * FL_BK + j], *vr = V + j * Dp;
#pragma omp simd
            for (int64_t d = 0; d < Dp; ++d) o[d] += p * vr[d];
        }
    }
#endif
}

/* s[jlo..jhi) -> exp(s - m') with m' = max(*mx, those scores) stored in *mx, the
 * other lanes of the block -> 0; returns the sum of the exponentials */
static inline float softmax_block(float *s, int64_t jlo, int64_t jhi, float *mx) {
#ifdef ATB_AVX512
    const uint64_t valid = (jhi >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << jhi) - 1)) &
                           ~(((uint64_t)1 << jlo) - 1);
    __m512 v[4], m4 = _mm512_set1_ps(-INFINITY);
    for (int u = 0; u < 4; ++u) {
        v[u] = _mm512_loadu_ps(s + 16 * u);
        m4 = _mm512_mask_max_ps(m4, (__mmask16)(valid >> (16 * u)), m4, v[u]);
    }
    float bm = _mm512_reduce_max_ps(m4);
    const float mnew = bm > *mx ? bm : *mx;
    const __m512 mv = _mm512_set1_ps(mnew);
    __m512 acc = _mm512_setzero_ps();
    for (int u = 0; u < 4; ++u) {
        __m512 p = _mm512_maskz_mov_ps((__mmask16)(valid >> (16 * u)),
                                       atb_exp16(_mm512_sub_ps(v[u], mv)));
        _mm512_storeu_ps(s + 16 * u, p);
        acc = _mm512_add_ps(acc, p);
    }
    *mx = mnew;
    return _mm512_reduce_add_ps(acc);
#else
    float bm = -INFINITY;
    for (int64_t j = jlo; j < jhi; ++j) bm = s[j] > bm ? s[j] : bm;
    const float mnew = bm > *mx ? bm : *mx;
    float ps = 0.0f;
#pragma omp simd reduction(+ : ps)
    for (int j = 0; j < FL_BK; ++j) {
        float p = (j >= jlo && j < jhi) ? atb_expf(s[j] - mnew) : 0.0f;
        s[j] = p;
        ps += p;
    }
    *mx = mnew;
    return ps;
#endif
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

static void run_chunk(void *ctx, int64_t ci) {
    FlJob *job = (FlJob *)ctx;
    const FlashArgs *a = job->a;
    const FlChunk *ch = &job->chunks[ci];
    const int64_t *sd = (const int64_t *)P(a->seqs) + 6 * ch->seq;
    const int64_t D = a->D, Dp = (D + 15) / 16 * 16, G = a->H / a->KV;
    const int64_t sq = sd[4], skv = sd[5];
    const int64_t off = skv > sq ? skv - sq : 0, rows = ch->r1 - ch->r0, M = rows * G;
    const int causal = a->causal || a->window > 0;
    /* scratch: Q [M][Dp], O [M][Dp], S [M][64], Kt [Dp][64], V [64][Dp], m/l [M], row tmp */
    size_t n = (size_t)(2 * M * Dp + M * FL_BK + 2 * Dp * FL_BK + 2 * M + Dp);
    float *buf = scratch(n);
    if (!buf) {
        __atomic_store_n(&job->nomem, 1, __ATOMIC_RELAXED);
        return;
    }
    float *Q = buf, *O = Q + M * Dp, *S = O + M * Dp, *Kt = S + M * FL_BK, *V = Kt + Dp * FL_BK;
    float *mx = V + FL_BK * Dp, *sum = mx + M, *tmp = sum + M;
    const float scale = (float)a->scale;
    /* zero what is read before written: O, the padding of Q's rows and of Kt (0 x
     * stale NaN would reach real scores); V's padding only reaches O's padding */
    memset(O, 0, (size_t)(M * Dp) * sizeof(float));
    if (Dp > D) {
        for (int64_t m = 0; m < M; ++m) memset(Q + m * Dp + D, 0, (size_t)(Dp - D) * sizeof(float));
        memset(Kt + D * FL_BK, 0, (size_t)((Dp - D) * FL_BK) * sizeof(float));
    }
    for (int64_t r = 0; r < rows; ++r) {   /* m = r * G + g: a row's heads side by side */
        const int64_t t = ch->r0 + r;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = ch->kvh * G + g;
            const float *src = atb_load(P(a->q), (int)a->q_dt, sd[0] + t * a->q_st + h * a->q_sh, D,
                                        tmp);
            float *dst = Q + (r * G + g) * Dp;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
        }
    }
    for (int64_t m = 0; m < M; ++m) {
        mx[m] = -INFINITY;
        sum[m] = 0.0f;
    }
    /* the keys any row of this block sees */
    int64_t hi = causal ? off + ch->r1 : skv, lo = 0;
    if (hi > skv) hi = skv;
    if (a->window > 0) {
        lo = off + ch->r0 - a->window + 1;
        if (lo < 0) lo = 0;
    }
    for (int64_t j0 = lo; j0 < hi; j0 += FL_BK) {
        const int nk = (int)(hi - j0 < FL_BK ? hi - j0 : FL_BK);
        for (int j = 0; j < nk; ++j) {
            const int64_t t = j0 + j;
            const int64_t ko = sd[1] + t * a->k_st + ch->kvh * a->k_sh;
            const int64_t vo = sd[2] + t * a->v_st + ch->kvh * a->v_sh;
            const float *kr = atb_load(P(a->k), (int)a->kv_dt, ko, D, tmp);
            for (int64_t d = 0; d < D; ++d) Kt[d * FL_BK + j] = kr[d];
            const float *vr = atb_load(P(a->v), (int)a->kv_dt, vo, D, V + j * Dp);
            if (vr != V + j * Dp) memcpy(V + j * Dp, vr, (size_t)D * sizeof(float));
        }
        /* Kt columns past nk hold stale keys: their scores are never read */
        scores(Q, Kt, S, M, Dp, nk);
        for (int64_t m = 0; m < M; ++m) {
            const int64_t pos = off + ch->r0 + m / G;
            /* keys [jlo, jhi) of this block are seen by this row */
            int64_t jhi = causal ? pos + 1 - j0 : nk, jlo = 0;
            if (jhi > nk) jhi = nk;
            if (a->window > 0 && pos - a->window + 1 > j0) jlo = pos - a->window + 1 - j0;
            float *s = S + m * FL_BK;
            if (jhi <= jlo) {
                memset(s, 0, FL_BK * sizeof(float));
                continue;
            }
            const float mold = mx[m];
            float ps = softmax_block(s, jlo, jhi, &mx[m]);
            const float corr = atb_expf(mold - mx[m]);   /* exp(-inf) = 0 on the first block */
            sum[m] = sum[m] * corr + ps;
            if (corr != 1.0f) {
                float *o = O + m * Dp;
#pragma omp simd
                for (int64_t d = 0; d < Dp; ++d) o[d] *= corr;
            }
        }
        accumulate(S, V, O, M, Dp, nk);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = ch->r0 + r;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t m = r * G + g, h = ch->kvh * G + g;
            const float inv = sum[m] > 0.0f ? 1.0f / sum[m] : 0.0f;
            float *o = O + m * Dp;
            for (int64_t d = 0; d < D; ++d) o[d] *= inv;
            atb_store((void *)P(a->y), (int)a->y_dt, sd[3] + t * a->y_st + h * a->y_sh, D, o);
        }
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
