/* A run of 53-bit uniforms from an MT19937 state, as torch's CPU generator draws
 * them for uniform_() on float64 (two 32-bit outputs per draw, the first as the
 * high word, the low 53 bits of the pair times 2^-53), returning only the draws
 * at the positions asked for.
 *
 * The sampler (atb_torch/models/sampler.py) reproduces torch.multinomial's draw
 * over a vocabulary-sized row, where only the few columns top-k/top-p kept can
 * win: every draw must still move the generator, but only the kept ones need
 * tempering and the logarithm. The state twist runs as two vectorisable loops
 * (the standard recurrence split where its reads switch from old to new words),
 * so a 32k-draw step costs the twists alone.
 *
 * State convention: key[624] words and pos, the number of words of the current
 * block already used (624: the next draw twists first); atb_mt_load/store move
 * them from/to the bytes of torch's CPUGeneratorImplState (mt19937.h). */
#include "common.h"
#include "mt19937.h"

#define MT_N 624
#define MT_M 397

typedef struct {
    int64_t state;    /* torch's CPU generator state bytes (mt19937.h), updated */
    int64_t n;        /* draws to make */
    int64_t want;     /* int64 [nwant]: ascending draw indices in [0, n) */
    int64_t nwant;
    int64_t out;      /* double [nwant] */
} MtArgs;

#define P(v) ((void *)(intptr_t)(v))

static inline uint32_t mix(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

static void twist(uint32_t *restrict s) {
    /* s[i] reads s[i + 1] (still old) and s[i + 397] (old for i < 227) */
    for (int i = 0; i < MT_N - MT_M; ++i) s[i] = s[i + MT_M] ^ mix(s[i], s[i + 1]);
    /* from i = 227 the third read is the new s[i - 227], 227 words behind */
    for (int i = MT_N - MT_M; i < MT_N - 1; ++i) s[i] = s[i + MT_M - MT_N] ^ mix(s[i], s[i + 1]);
    s[MT_N - 1] = s[MT_M - 1] ^ mix(s[MT_N - 1], s[0]);
}

static inline uint32_t temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

int64_t atb_mt_uniforms_at(uint32_t *s, int64_t *pos_io, int64_t n, const int64_t *want,
                           int64_t nwant, double *out) {
    int64_t pos = *pos_io;
    if (n < 0 || nwant < 0 || pos < 0 || pos > MT_N) return ATB_ERR_ARGS;
    /* word g (0 = the next one the generator gives) is s[g - base] in this block */
    int64_t base = -pos, prev = -1;
    for (int64_t w = 0; w < nwant; ++w) {
        int64_t j = want[w];
        if (j <= prev || j >= n) return ATB_ERR_ARGS;
        prev = j;
        uint32_t word[2];
        for (int h = 0; h < 2; ++h) {
            int64_t g = 2 * j + h;
            while (g - base >= MT_N) {
                twist(s);
                base += MT_N;
            }
            word[h] = temper(s[g - base]);
        }
        uint64_t bits = (((uint64_t)word[0] << 32) | word[1]) & ((UINT64_C(1) << 53) - 1);
        out[w] = (double)bits * (1.0 / (double)(UINT64_C(1) << 53));
    }
    if (n > 0) {
        int64_t last = 2 * n - 1;  /* the last word the draws use */
        while (last - base >= MT_N) {
            twist(s);
            base += MT_N;
        }
        pos = last + 1 - base;
    }
    *pos_io = pos;
    return 0;
}

int atb_mt_load(const uint8_t *raw, uint32_t *key, int64_t *pos) {
    int32_t left;
    memcpy(&left, raw + ATB_MT_LEFT, 4);
    if (left < 1 || left > MT_N) return 1;
    for (int i = 0; i < MT_N; ++i) {
        uint64_t w;
        memcpy(&w, raw + ATB_MT_WORDS + 8 * i, 8);
        if (w >> 32) return 1;
        key[i] = (uint32_t)w;
    }
    *pos = MT_N + 1 - left;  /* torch counts the words left, +1 */
    return 0;
}

void atb_mt_store(uint8_t *raw, const uint32_t *key, int64_t pos) {
    int32_t left = (int32_t)(MT_N + 1 - pos);
    uint64_t next = (uint64_t)pos;
    memcpy(raw + ATB_MT_LEFT, &left, 4);
    memcpy(raw + ATB_MT_NEXT, &next, 8);
    for (int i = 0; i < MT_N; ++i) {
        uint64_t w = key[i];
        memcpy(raw + ATB_MT_WORDS + 8 * i, &w, 8);
    }
}

ATB_API int64_t atb_mt19937_uniforms(const void *args) {
    MtArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.state || (a.nwant && (!a.want || !a.out))) return ATB_ERR_ARGS;
    uint32_t key[MT_N];
    int64_t pos;
    if (atb_mt_load((const uint8_t *)P(a.state), key, &pos)) return ATB_ERR_ARGS;
    int64_t st = atb_mt_uniforms_at(key, &pos, a.n, (const int64_t *)P(a.want), a.nwant,
                                    (double *)P(a.out));
    if (st == 0) atb_mt_store((uint8_t *)P(a.state), key, pos);
    return st;
}
