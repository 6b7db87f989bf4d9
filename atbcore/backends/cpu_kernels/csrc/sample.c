/* Sampling's usual tail in one call: [temperature,] top-k [, top-p], softmax and
 * torch.multinomial's draw, for fp32 logit rows, deciding the token Hugging Face's
 * processors + torch.multinomial give, or saying it cannot be sure (status 1: the
 * caller then runs the exact path from the same generator state).
 *
 * Exact where it can be: the k + 1 largest logits (any NaN: undecided), the
 * temperature's float32 division (x / (float)t, which the caller checks is torch's),
 * the draws (mt19937.h: the same uniforms, the generator moved past the row).
 * torch's float32 softmax and cumulative sum are not reproduced bit for bit;
 * they are computed in double, and a decision is taken only when it holds for
 * every value within a bound of torch's rounding:
 *   - top-p's cut: the cumulative sums on both sides of it are farther than
 *     DELTA from the limit (torch's float32 sums are within a few 1e-6 of the
 *     exact ones for k <= TOPK_MAX: exp arguments rounded to float32 give a
 *     relative error <= 87 * 2^-24 on the terms that are not ~0, the sum and
 *     cumulative sum k * 2^-24);
 *   - the draw, argmax p / q: the best ratio beats the second by a relative
 *     margin above the same bounds (plus q's float32 rounding), and both
 *     probabilities are normal floats;
 *   - no tie at the k-th value or at top-p's cut (torch's sort order decides).
 * The row is read once (a block max skips blocks below the current k + 1-th). */
#include "common.h"
#include "mt19937.h"

#define TOPK_MAX 1024

typedef struct {
    int64_t x, rows, v, x_stride; /* float32 [rows, v] logits, row stride */
    int64_t k;                    /* top-k, 1 <= k < v, k <= TOPK_MAX */
    int64_t temp_mode;            /* 0: none, 1: x / (float)t (torch's division) */
    int64_t keep;                 /* top-p's min_tokens_to_keep */
    int64_t state;                /* torch's generator state bytes (mt19937.h), advanced on success */
    int64_t out;                  /* int64 [rows] tokens */
    double temperature;
    double limit;                 /* top-p removes the ascending prefix with cum <= limit; < 0: none */
} SampleArgs;

#define P(v) ((void *)(intptr_t)(v))

/* insert (value, index) into the descending val[0..*n) of capacity cap */
static void insert(float *val, int64_t *idx, int64_t *n, int64_t cap, float value, int64_t index) {
    int64_t p = *n < cap ? (*n)++ : cap - 1;
    while (p > 0 && val[p - 1] < value) {
        val[p] = val[p - 1];
        idx[p] = idx[p - 1];
        --p;
    }
    val[p] = value;
    idx[p] = index;
}

/* the cap largest of x[0..v) descending; 1 when the row holds a NaN */
static int row_top(const float *x, int64_t v, int64_t cap, float *val, int64_t *idx) {
    int64_t n = 0;
    for (int64_t i = 0; i < cap; ++i) {
        if (x[i] != x[i]) return 1;
        insert(val, idx, &n, cap, x[i], i);
    }
    for (int64_t i = cap; i < v; i += 16) {
        int64_t m = v - i < 16 ? v - i : 16;
        float bm = -INFINITY;
        int nan = 0;
        for (int64_t j = 0; j < m; ++j) {
            bm = x[i + j] > bm ? x[i + j] : bm;
            nan |= x[i + j] != x[i + j];
        }
        if (nan) return 1;
        if (bm <= val[cap - 1]) continue;
        for (int64_t j = 0; j < m; ++j)
            if (x[i + j] > val[cap - 1]) insert(val, idx, &n, cap, x[i + j], i + j);
    }
    return 0;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* one row: 0 and *token, or 1 (undecided); the state moves past the row's v draws */
static int sample_row(const SampleArgs *a, const float *x, uint32_t *s, int64_t *pos,
                      int64_t *token) {
    const int64_t k = a->k, cap = k + 1;
    float val[TOPK_MAX + 1];
    int64_t idx[TOPK_MAX + 1], cols[TOPK_MAX];
    double e[TOPK_MAX], u[TOPK_MAX];
    if (row_top(x, a->v, cap, val, idx)) return 1;
    for (int64_t i = 0; i < cap; ++i) {
        if (a->temp_mode == 1) val[i] = val[i] / (float)a->temperature;
    }
    if (val[k] == val[k - 1]) return 1;               /* top-k keeps every tie */
    double sum = 0;
    for (int64_t i = 0; i < k; ++i) {
        if (!isfinite(val[i])) return 1;
        e[i] = exp((double)val[i] - (double)val[0]);
        sum += e[i];
    }
    int64_t count = k;
    if (a->limit >= 0) {
        const double delta = 1e-4 + (double)k * 4.8e-7;
        double cum = 0, before = -1;                  /* cum through the last removed */
        int64_t removed = 0;
        for (; removed < k; ++removed) {              /* ascending: from val[k - 1] up */
            double next = cum + e[k - 1 - removed] / sum;
            if (next > a->limit) {
                cum = next;
                break;
            }
            before = cum = next;
        }
        if (before >= 0 && before > a->limit - delta) return 1;
        if (removed < k && cum < a->limit + delta) return 1;
        count = k - removed;
        if (count < a->keep) count = a->keep < k ? a->keep : k;
        if (count < 1) return 1;
        if (count < k && val[count - 1] == val[count]) return 1;  /* a tie at the cut */
    }
    double kept_sum = 0;
    for (int64_t i = 0; i < count; ++i) {
        kept_sum += e[i];
        cols[i] = idx[i];
    }
    qsort(cols, (size_t)count, sizeof cols[0], cmp_i64);
    if (atb_mt_uniforms_at(s, pos, a->v, cols, count, u)) return -1;
    /* the survivors by column again: their e values */
    double best = -INFINITY, second = -INFINITY, p_best = 0, p_second = 0;
    int64_t at = 0;
    for (int64_t c = 0; c < count; ++c) {
        int64_t i = 0;
        while (idx[i] != cols[c]) ++i;
        double p = e[i] / kept_sum;
        double q = (double)(float)(-log1p(-u[c]));
        double r = p / q;
        if (r > best) {
            second = best, p_second = p_best;
            best = r, p_best = p, at = cols[c];
        } else if (r > second) {
            second = r, p_second = p;
        }
    }
    const double margin = 1e-4 + (double)count * 4.8e-7;
    if (p_best < 1e-30 || (count > 1 && (second >= best * (1 - margin) || p_second < 1e-30)))
        return 1;
    *token = at;
    return 0;
}

ATB_API int64_t atb_sample_top_k(const void *args) {
    SampleArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.x || !a.state || !a.out || a.rows < 1 || a.k < 1 || a.k >= a.v ||
        a.k > TOPK_MAX || a.x_stride < a.v || a.keep < 0 || a.temp_mode < 0 || a.temp_mode > 1 ||
        (a.temp_mode && !(a.temperature > 0)))
        return ATB_ERR_ARGS;
    uint32_t key[624];
    int64_t pos;
    if (atb_mt_load((const uint8_t *)P(a.state), key, &pos)) return ATB_ERR_ARGS;
    int64_t *out = (int64_t *)P(a.out);
    for (int64_t r = 0; r < a.rows; ++r) {
        int st = sample_row(&a, (const float *)P(a.x) + r * a.x_stride, key, &pos, &out[r]);
        if (st) return st < 0 ? ATB_ERR_ARGS : 1;
    }
    atb_mt_store((uint8_t *)P(a.state), key, pos);
    return 0;
}

/* Hugging Face's RepetitionPenaltyLogitsProcessor in place: every token id seen
 * in a row has its score s replaced by s < 0 ? s * p : s / p (float32, p =
 * (float)penalty, as torch's ops with a Python float), once however often it was
 * seen (all scores are read before any is written). ATB_ERR_ARGS for an id
 * outside [0, v) (the caller leaves those to Hugging Face). */
typedef struct {
    int64_t x, rows, v, x_stride;  /* float32 [rows, v] scores, updated */
    int64_t ids, n, ids_stride;    /* int64 [rows, n] */
    double penalty;
} PenaltyArgs;

#define PENALTY_MAX_IDS 65536

ATB_API int64_t atb_repetition_penalty(const void *args) {
    PenaltyArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.x || !a.ids || a.rows < 0 || a.n < 0 || a.n > PENALTY_MAX_IDS || a.v < 1 ||
        a.x_stride < a.v || a.ids_stride < a.n || !(a.penalty > 0))
        return ATB_ERR_ARGS;
    const float p = (float)a.penalty;
    float *seen = malloc(sizeof(float) * (size_t)(a.n ? a.n : 1));
    if (!seen) return ATB_ERR_NOMEM;
    for (int64_t r = 0; r < a.rows; ++r) {
        const int64_t *ids = (const int64_t *)P(a.ids) + r * a.ids_stride;
        for (int64_t j = 0; j < a.n; ++j) {
            if (ids[j] < 0 || ids[j] >= a.v) {
                free(seen);
                return ATB_ERR_ARGS;  /* checked before any row is written */
            }
        }
    }
    for (int64_t r = 0; r < a.rows; ++r) {
        float *x = (float *)P(a.x) + r * a.x_stride;
        const int64_t *ids = (const int64_t *)P(a.ids) + r * a.ids_stride;
        for (int64_t j = 0; j < a.n; ++j) seen[j] = x[ids[j]];
        for (int64_t j = 0; j < a.n; ++j) x[ids[j]] = seen[j] < 0 ? seen[j] * p : seen[j] / p;
    }
    free(seen);
    return 0;
}
