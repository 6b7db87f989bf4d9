/* The decode attention's two passes over a (row, kv head)'s cache rows (attn.h): the
 * scores of the G query heads against each key, and the softmax-weighted sum of the
 * value rows. Decode reads a few hundred rows per pass and does 2 FMAs per element
 * read, so the passes are bound by loads and by how sums are reduced: per ISA, the
 * scores keep 8 (AVX2) or 16 (AVX-512) keys' dot products in registers and reduce
 * them in one transpose-and-add tree (a horizontal sum per key cost more than the
 * key's dot product at D = 64), and the value pass keeps a tile of heads x dims in
 * registers across the keys (the plain loop re-reads and re-stores each head's
 * accumulator row per key). AVX2 tiles widen bf16/fp16/int8 rows in registers. */
#include "attn.h"
#include "simd.h"

static inline float dot(const float *x, const float *y, int64_t D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += x[d] * y[d];
    return s;
}

#ifdef ATB_AVX2
#define AL_INLINE static inline __attribute__((always_inline))

/* 8 elements of a cache row from element i, widened to fp32 exactly */
AL_INLINE __m256 load8(const void *row, int dt, int64_t i) {
    if (dt == ATB_F32) return _mm256_loadu_ps((const float *)row + i);
    if (dt == ATB_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == ATB_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    const __m128i c = _mm_loadl_epi64((const __m128i *)((const int8_t *)row + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
}

/* lane i = the sum of v[i]'s 8 lanes */
AL_INLINE __m256 reduce8(const __m256 v[8]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    /* b0: the sums of lanes 0-3 of v0..v3, then of lanes 4-7; b1 the same for v4..v7 */
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                         _mm256_permute2f128_ps(b0, b1, 0x31));
}

AL_INLINE void scores_dt(int dt, const void *const *kr, int cnt, const float *qf, int64_t G,
                         int64_t D, float *sc, int64_t L) {
    const void *r[8];
    for (int i = 0; i < 8; ++i) r[i] = i < cnt ? kr[i] : kr[0];
    for (int64_t j = 0; j < G; ++j) {
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        const float *q = qf + j * D;
        for (int64_t c = 0; c < D; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + c);
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(r[i], dt, c), acc[i]);
        }
        const __m256 s = reduce8(acc);
        if (cnt == 8) {
            _mm256_storeu_ps(sc + j * L, s);
        } else {
            float t[8];
            _mm256_storeu_ps(t, s);
            memcpy(sc + j * L, t, (size_t)cnt * sizeof(float));
        }
    }
}

static void scores8(const void *const *kr, int dt, int cnt, const float *qf, int64_t G,
                      int64_t D, float *sc, int64_t L) {
    switch (dt) {
    case ATB_F32: scores_dt(ATB_F32, kr, cnt, qf, G, D, sc, L); break;
    case ATB_BF16: scores_dt(ATB_BF16, kr, cnt, qf, G, D, sc, L); break;
    case ATB_F16: scores_dt(ATB_F16, kr, cnt, qf, G, D, sc, L); break;
    default: scores_dt(ATB_I8, kr, cnt, qf, G, D, sc, L); break;
    }
}

/* acc[(j0 + h) * D + c0 + 8 v] += sum_i p[(j0 + h) * L + i] vr[i][c0 + 8 v ..] for NH
 * heads and NV vectors: NH * NV accumulators in registers across the keys */
AL_INLINE void pv_tile(int dt, int NH, int NV, const void *const *vr, int64_t cnt,
                       const float *p, int64_t L, int64_t j0, int64_t c0, int64_t D, float *acc) {
    __m256 a[8];
    for (int h = 0; h < NH; ++h)
        for (int v = 0; v < NV; ++v) a[h * NV + v] = _mm256_loadu_ps(acc + (j0 + h) * D + c0 + 8 * v);
    for (int64_t i = 0; i < cnt; ++i) {
        const void *row = vr[i];
        if (!row) continue;
        __m256 w[2];
        for (int h = 0; h < NH; ++h) w[h] = _mm256_broadcast_ss(p + (j0 + h) * L + i);
        for (int v = 0; v < NV; ++v) {
            const __m256 x = load8(row, dt, c0 + 8 * v);
            for (int h = 0; h < NH; ++h) a[h * NV + v] = _mm256_fmadd_ps(w[h], x, a[h * NV + v]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + (j0 + h) * D + c0 + 8 * v, a[h * NV + v]);
}

AL_INLINE void values_dt(int dt, const void *const *vr, int64_t cnt, const float *p, int64_t L,
                         int64_t G, int64_t D, float *acc) {
    for (int64_t j0 = 0; j0 < G; j0 += 2) {
        const int nh = G - j0 >= 2 ? 2 : 1;
        for (int64_t c0 = 0; c0 < D; c0 += 32) {
            const int nv = D - c0 >= 32 ? 4 : (int)((D - c0) / 8);
#define AL_PV(NH)                                                          \
    switch (nv) {                                                          \
    case 1: pv_tile(dt, NH, 1, vr, cnt, p, L, j0, c0, D, acc); break;      \
    case 2: pv_tile(dt, NH, 2, vr, cnt, p, L, j0, c0, D, acc); break;      \
    case 3: pv_tile(dt, NH, 3, vr, cnt, p, L, j0, c0, D, acc); break;      \
    default: pv_tile(dt, NH, 4, vr, cnt, p, L, j0, c0, D, acc); break;     \
    }
            if (nh == 2) {
                AL_PV(2)
            } else {
                AL_PV(1)
            }
#undef AL_PV
        }
    }
}

/* the value rows of head kh at positions pos0 .. pos0 + cnt (NULL where masked): one
 * 64-key batch of values_lanes */
static inline void value_rows(const DecAttnArgs *a, int sh, int64_t b, int64_t kh, int64_t pos0,
                              int64_t cnt, const uint8_t *mask, const char **vr) {
    const int64_t es = atb_dt_size((int)a->kv_dt);
    const char *vb = (const char *)P(a->v) + kh * a->v_sh * es;
    for (int64_t i = 0; i < cnt; ++i) {
        const int64_t pos = pos0 + i;
        vr[i] = mask && !mask[pos * a->mask_ss] ? NULL
                                                : vb + row_at(a, sh, b, pos, a->v_sb, a->v_ss) * es;
    }
}

static void values_lanes(const void *const *vr, int dt, int64_t cnt, const float *p,
                           int64_t L, int64_t G, int64_t D, float *acc) {
    switch (dt) {
    case ATB_F32: values_dt(ATB_F32, vr, cnt, p, L, G, D, acc); break;
    case ATB_BF16: values_dt(ATB_BF16, vr, cnt, p, L, G, D, acc); break;
    case ATB_F16: values_dt(ATB_F16, vr, cnt, p, L, G, D, acc); break;
    default: values_dt(ATB_I8, vr, cnt, p, L, G, D, acc); break;
    }
}
#endif

/* sc[j * L + s] = qf[j] . k(lo + s) for the G heads of kv head kh of row b (masked
 * keys too: the caller overwrites them); rows: scratch for 16 keys as fp32 */
static void scores_head(const DecAttnArgs *a, int64_t b, int64_t kh, int64_t lo, int64_t L,
                        const float *qf, int64_t G, float *sc, float *rows) {
    const int64_t D = a->D;
    const int sh = a->table ? block_shift(a->block_size) : -1;
#ifdef ATB_AVX512
    if (D % 16 == 0 && D <= 256) {
        /* 16 keys at a time: 16 accumulators per head, one tree reduction for all
         * 16 scores (a reduction per key costs more than the dot itself at D = 64) */
        for (int64_t s0 = 0; s0 < L; s0 += 16) {
            const int cnt = L - s0 < 16 ? (int)(L - s0) : 16;
            const float *kr[16];
            for (int i = 0; i < 16; ++i)
                kr[i] = i < cnt ? atb_load(P(a->k), (int)a->kv_dt,
                                           row_at(a, sh, b, lo + s0 + i, a->k_sb, a->k_ss) +
                                               kh * a->k_sh, D, rows + i * D)
                                : kr[0];
            /* prefetch the next 16 keys' rows while these compute, into L2 (16 paged
             * rows of 16..544 keys, cache cold, 8 layers: into L1 2.8 ms, L2 2.45) */
            const int64_t es = atb_dt_size((int)a->kv_dt), rb = D * es;
            for (int i = 0; i < 16 && s0 + 16 + i < L; ++i) {
                const char *pk = (const char *)P(a->k) +
                                 (row_at(a, sh, b, lo + s0 + 16 + i, a->k_sb, a->k_ss) +
                                  kh * a->k_sh) * es;
                for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(pk + o, _MM_HINT_T2);
            }
            for (int64_t j = 0; j < G; ++j) {
                __m512 acc[16];
                for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 16) {
                    __m512 qv = _mm512_loadu_ps(qf + j * D + c);
                    for (int i = 0; i < 16; ++i)
                        acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[i] + c), acc[i]);
                }
                _mm512_mask_storeu_ps(sc + j * L + s0, (__mmask16)((1u << cnt) - 1u),
                                      atb_reduce16(acc));
            }
        }
        return;
    }
#endif
#ifdef ATB_AVX2
    if (D % 8 == 0) { /* rows widened in registers, 8 keys' sums reduced at once */
        const int64_t es = atb_dt_size((int)a->kv_dt);
        for (int64_t s0 = 0; s0 < L; s0 += 8) {
            const int cnt = L - s0 < 8 ? (int)(L - s0) : 8;
            const void *kr[8];
            for (int i = 0; i < cnt; ++i)
                kr[i] = (const char *)P(a->k) +
                        (row_at(a, sh, b, lo + s0 + i, a->k_sb, a->k_ss) + kh * a->k_sh) * es;
            /* the keys 16 ahead, and the value rows of these keys (pass 2 reads them
             * from L2 then): a step's caches of all layers outgrow L2 */
            for (int64_t s = s0 + 16; s < s0 + 24 && s < L; ++s) {
                const char *pk = (const char *)P(a->k) +
                                 (row_at(a, sh, b, lo + s, a->k_sb, a->k_ss) + kh * a->k_sh) * es;
                for (int64_t o = 0; o < D * es; o += 64) _mm_prefetch(pk + o, _MM_HINT_T0);
            }
            for (int i = 0; i < cnt; ++i) {
                const char *pv = (const char *)P(a->v) +
                                 (row_at(a, sh, b, lo + s0 + i, a->v_sb, a->v_ss) + kh * a->v_sh) * es;
                for (int64_t o = 0; o < D * es; o += 64) _mm_prefetch(pv + o, _MM_HINT_T1);
            }
            scores8(kr, (int)a->kv_dt, cnt, qf, G, D, sc + s0, L);
        }
        return;
    }
#endif
    for (int64_t s = 0; s < L; ++s) {
        const float *kr = atb_load(P(a->k), (int)a->kv_dt,
                                   row_at(a, sh, b, lo + s, a->k_sb, a->k_ss) + kh * a->k_sh, D, rows);
        for (int64_t j = 0; j < G; ++j) sc[j * L + s] = dot(qf + j * D, kr, D);
    }
}

void atb_attn_scores(const DecAttnArgs *a, int64_t b, int64_t kh, int64_t nk, int64_t lo,
                     int64_t L, const float *qf, int64_t G, float *sc, float *rows) {
    const int64_t D = a->D;
#if defined(ATB_AVX2)
    if (D % 8 == 0 && nk > 1) {
        /* the nk kv heads of each 8 keys in turn: a position's heads are adjacent in
         * the cache, so its rows are read whole and each block streams once */
        const int sh = a->table ? block_shift(a->block_size) : -1;
        const int64_t es = atb_dt_size((int)a->kv_dt), rb = D * es;
        const char *kb = (const char *)P(a->k) + kh * a->k_sh * es;
        const char *vb = (const char *)P(a->v) + kh * a->v_sh * es;
        for (int64_t s0 = 0; s0 < L; s0 += 8) {
            const int cnt = L - s0 < 8 ? (int)(L - s0) : 8;
            const char *k0[8];
            for (int i = 0; i < cnt; ++i)
                k0[i] = kb + row_at(a, sh, b, lo + s0 + i, a->k_sb, a->k_ss) * es;
            /* as scores_head: the keys 16 ahead, and these keys' value rows */
            for (int64_t s = s0 + 16; s < s0 + 24 && s < L; ++s) {
                const char *pk = kb + row_at(a, sh, b, lo + s, a->k_sb, a->k_ss) * es;
                for (int64_t k = 0; k < nk; ++k)
                    for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(pk + k * a->k_sh * es + o, _MM_HINT_T0);
            }
            for (int i = 0; i < cnt; ++i) {
                const char *pv = vb + row_at(a, sh, b, lo + s0 + i, a->v_sb, a->v_ss) * es;
                for (int64_t k = 0; k < nk; ++k)
                    for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(pv + k * a->v_sh * es + o, _MM_HINT_T1);
            }
            for (int64_t k = 0; k < nk; ++k) {
                const void *kr[8];
                for (int i = 0; i < cnt; ++i) kr[i] = k0[i] + k * a->k_sh * es;
                scores8(kr, (int)a->kv_dt, cnt, qf + k * G * D, G, D, sc + k * G * L + s0, L);
            }
        }
        return;
    }
#endif
    for (int64_t k = 0; k < nk; ++k)
        scores_head(a, b, kh + k, lo, L, qf + k * G * D, G, sc + k * G * L, rows);
}

#ifdef ATB_AVX512
/* acc[j0 + jj] = sum_s p[j0 + jj][s] v(s) for NH heads, NV vectors of D each: the
 * NH * NV <= 16 accumulators stay in registers across the keys */
static inline __attribute__((always_inline)) void pv_tile(
    int NV, int NH, const DecAttnArgs *a, int sh, int64_t b, int64_t kh, int64_t lo, int64_t L,
    const uint8_t *mask, const float *sc, int64_t j0, float *row, float *acc_out) {
    __m512 acc[16];
    for (int i = 0; i < NV * NH; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < L; ++s) {
        const int64_t pos = lo + s;
        if (mask && !mask[pos * a->mask_ss]) continue;
        const float *vr = atb_load(P(a->v), (int)a->kv_dt,
                                   row_at(a, sh, b, pos, a->v_sb, a->v_ss) + kh * a->v_sh,
                                   16 * NV, row);
        if (s + 8 < L) { /* the value row 8 keys ahead */
            const int64_t es = atb_dt_size((int)a->kv_dt);
            const char *pv = (const char *)P(a->v) +
                             (row_at(a, sh, b, pos + 8, a->v_sb, a->v_ss) + kh * a->v_sh) * es;
            for (int64_t o = 0; o < 16 * NV * es; o += 64) _mm_prefetch(pv + o, _MM_HINT_T2);
        }
        __m512 p[8];
        for (int jj = 0; jj < NH; ++jj) p[jj] = _mm512_set1_ps(sc[(j0 + jj) * L + s]);
        for (int c = 0; c < NV; ++c) {
            __m512 v = _mm512_loadu_ps(vr + 16 * c);
            for (int jj = 0; jj < NH; ++jj)
                acc[jj * NV + c] = _mm512_fmadd_ps(p[jj], v, acc[jj * NV + c]);
        }
    }
    for (int jj = 0; jj < NH; ++jj)
        for (int c = 0; c < NV; ++c)
            _mm512_storeu_ps(acc_out + (j0 + jj) * 16 * NV + 16 * c, acc[jj * NV + c]);
}
#endif

/* acc[j] = sum_s sc[j * L + s] v(lo + s) over the unmasked keys, for the G heads */
static void values_head(const DecAttnArgs *a, int sh, int64_t b, int64_t kh, int64_t lo,
                        int64_t L, const uint8_t *mask, const float *sc, int64_t G, float *row,
                        float *acc) {
    const int64_t D = a->D;
#ifdef ATB_AVX512
    const int64_t nv = D / 16;
    if (D % 16 == 0 && (nv == 2 || nv == 4 || nv == 8 || nv == 16)) {
        const int64_t per = 16 / nv < 8 ? 16 / nv : 8;   /* heads per register tile */
        for (int64_t j0 = 0; j0 < G; j0 += per) {
            const int nh = (int)(G - j0 < per ? G - j0 : per);
#define ATB_PV(NV)                                                                     \
    switch (nh) {                                                                      \
    case 1: pv_tile(NV, 1, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break;        \
    case 2: if (NV <= 8) pv_tile(NV, 2, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break; \
    case 3: if (NV <= 4) pv_tile(NV, 3, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break; \
    case 4: if (NV <= 4) pv_tile(NV, 4, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break; \
    case 5: if (NV <= 2) pv_tile(NV, 5, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break; \
    case 6: if (NV <= 2) pv_tile(NV, 6, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break; \
    case 7: if (NV <= 2) pv_tile(NV, 7, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break; \
    default: if (NV <= 2) pv_tile(NV, 8, a, sh, b, kh, lo, L, mask, sc, j0, row, acc); break; \
    }
            switch (nv) {
            case 2: ATB_PV(2) break;
            case 4: ATB_PV(4) break;
            case 8: ATB_PV(8) break;
            default: ATB_PV(16) break;
            }
#undef ATB_PV
        }
        return;
    }
#endif
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
#ifdef ATB_AVX2
    if (D % 8 == 0) { /* 64 keys' rows at a time (NULL: masked) */
        for (int64_t s0 = 0; s0 < L; s0 += 64) {
            const int64_t cnt = L - s0 < 64 ? L - s0 : 64;
            const char *vr[64];
            value_rows(a, sh, b, kh, lo + s0, cnt, mask, vr);
            values_lanes((const void *const *)vr, (int)a->kv_dt, cnt, sc + s0, L, G, D, acc);
        }
        return;
    }
#endif
    for (int64_t s = 0; s < L; ++s) {
        const int64_t pos = lo + s;
        if (mask && !mask[pos * a->mask_ss]) continue;
        const float *vr = atb_load(P(a->v), (int)a->kv_dt,
                                   row_at(a, sh, b, pos, a->v_sb, a->v_ss) + kh * a->v_sh, D, row);
        for (int64_t j = 0; j < G; ++j) {
            const float p = sc[j * L + s];
            float *o = acc + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
        }
    }
}

void atb_attn_values(const DecAttnArgs *a, int sh, int64_t b, int64_t kh, int64_t nk, int64_t lo,
                     int64_t L, const uint8_t *mask, const float *sc, int64_t G, float *row,
                     float *acc) {
    const int64_t D = a->D;
#if defined(ATB_AVX2)
    if (D % 8 == 0 && nk > 1) { /* values_head's 64-key batches, the nk heads in turn */
        const int64_t es = atb_dt_size((int)a->kv_dt);
        memset(acc, 0, (size_t)(nk * G * D) * sizeof(float));
        for (int64_t s0 = 0; s0 < L; s0 += 64) {
            const int64_t cnt = L - s0 < 64 ? L - s0 : 64;
            const char *v0[64];
            value_rows(a, sh, b, kh, lo + s0, cnt, mask, v0);
            for (int64_t k = 0; k < nk; ++k) {
                const void *vr[64];
                for (int64_t i = 0; i < cnt; ++i) vr[i] = v0[i] ? v0[i] + k * a->v_sh * es : NULL;
                values_lanes(vr, (int)a->kv_dt, cnt, sc + k * G * L + s0, L, G, D, acc + k * G * D);
            }
        }
        return;
    }
#endif
    for (int64_t k = 0; k < nk; ++k)
        values_head(a, sh, b, kh + k, lo, L, mask, sc + k * G * L, G, row, acc + k * G * D);
}
