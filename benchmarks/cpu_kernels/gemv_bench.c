/* Decode GEMV microbenchmark: the C matmuls atb binds (atb_linear_rows on 32-output
 * panels for fp32 / bf16 / int8 weights, atb_linear_w8a8, atb_linear_w4) at one activation
 * row, on the default model's shapes, against a streaming read of the same bytes.
 *
 * "stream" mode runs a whole model's weights (LAYERS x {qkv, o, gate|up, down} + head,
 * more than the L3) in decode order, timing each call; "l3" repeats the seed MLP's two
 * fp32 matmuls (5.6 MB, L3-resident); "rows" runs the gate|up matmul (L3-resident) at the
 * row counts of GEMV_MS (GF/s: the few-row tiles). GEMV_M sets the x rows of stream / l3 /
 * l2 (default 1: a 16-row decode step is GEMV_M=16 stream). Built and run by gemv_bench.py (which links the
 * kernel sources with the library's own flags). Output: one line per (mode, kernel,
 * shape, threads): median ns per call, bytes, GB/s. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "linear.h"
#include "linear_w4.h"
#include "pool.h"

int64_t atb_linear_rows(const LinArgs *a);
int64_t atb_linear_w4(const W4Args *a);
int64_t atb_linear_w8a8(const LinArgs *a);

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static uint64_t rng = 88172645463325252ull;
static float frand(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((rng >> 40) & 0xffffff) / 16777216.0f - 0.5f;
}

/* 2 MB aligned and advised huge pages, as the engine's panel-packed weights
 * (native_panels.py): 4 KB pages cost a decode step's stream TLB misses it does not have */
static void *alloc(size_t n) {
    void *p = NULL;
    n = ((n ? n : 64) + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1);
    if (posix_memalign(&p, 2 << 20, n)) abort();
    madvise(p, n, MADV_HUGEPAGE);
    return p;
}

enum { K_F32, K_BF16, K_I8, K_W4, K_READ, K_W8A8, NKIND };
static const char *KNAME[] = {"fp32", "bf16", "w8", "w4", "read", "w8a8"};

typedef struct { int64_t n, k; const char *name; } Shape;

typedef struct {
    int kind;
    Shape s;
    void *w, *scale; /* w4: codes, fp16 scales */
    int64_t bytes;
} Mat;

static int64_t panels(int64_t n) { return (n + 31) / 32; }

static void make(Mat *m, int kind, Shape s) {
    m->kind = kind;
    m->s = s;
    m->scale = NULL;
    const int64_t P = panels(s.n), K = s.k;
    if (kind == K_W4) {
        const int64_t nblk = (K + 31) / 32;
        const int64_t cb = P * nblk * W4_BLOCK_BYTES, sb = P * nblk * 32 * 2;
        uint8_t *c = alloc(cb);
        uint16_t *sc = alloc(sb);
        for (int64_t i = 0; i < cb; ++i) c[i] = (uint8_t)(frand() * 256 + 128);
        for (int64_t i = 0; i < sb / 2; ++i) sc[i] = 0x2000 + (uint16_t)(i & 255); /* small fp16 */
        m->w = c;
        m->scale = sc;
        m->bytes = cb + sb;
        return;
    }
    const int64_t cnt = kind == K_W8A8 ? P * ((K + 3) / 4 + 1) * 128 : P * K * 32;
    if (kind == K_F32 || kind == K_READ) {
        float *w = alloc(cnt * 4);
        for (int64_t i = 0; i < cnt; ++i) w[i] = frand() * 0.1f;
        m->w = w;
        m->bytes = cnt * 4;
    } else if (kind == K_BF16) {
        uint16_t *w = alloc(cnt * 2);
        for (int64_t i = 0; i < cnt; ++i) {
            float f = frand() * 0.1f;
            uint32_t u;
            memcpy(&u, &f, 4);
            w[i] = (uint16_t)(u >> 16);
        }
        m->w = w;
        m->bytes = cnt * 2;
    } else {
        int8_t *w = alloc(cnt);
        float *sc = alloc(P * 32 * 4);
        for (int64_t i = 0; i < cnt; ++i) w[i] = (int8_t)(frand() * 254); /* (w8a8: the column
                                                 sums row is noise too: read, not used on AVX2) */
        for (int64_t i = 0; i < P * 32; ++i) sc[i] = 0.001f;
        m->w = w;
        m->scale = sc;
        m->bytes = cnt + P * 32 * 4;
    }
}

typedef struct { const float *w; int64_t n; float out[2][16]; } ReadJob;

/* the streaming read: every byte of w summed by 256-bit loads, chunks over the pool */
static void read_chunk(void *ctx, int64_t c) {
    ReadJob *j = (ReadJob *)ctx;
    const int64_t per = (j->n / 16 + 15) / 16 * 16;
    const int64_t a = c * per, b = a + per < j->n ? a + per : j->n;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = a; i + 32 <= b; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(j->w + i));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(j->w + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(j->w + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_load_ps(j->w + i + 24));
    }
    _mm256_storeu_ps(j->out[c & 1], _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* x rows (GEMV_M; rows mode: each of GEMV_MS) up to ROWS_MAX, outputs up to 32000 */
#define ROWS_MAX 256
static float xbuf[ROWS_MAX * 2048], ybuf[ROWS_MAX * 32000];
static int64_t rows = 1;

static void run(const Mat *m, int nth) {
    const Shape s = m->s;
    if (m->kind == K_READ) {
        ReadJob j = {(const float *)m->w, m->bytes / 4, {{0}}};
        atb_parallel_chunks(read_chunk, &j, 16, nth);
        return;
    }
    if (m->kind == K_W4) {
        W4Args a = {0};
        a.x = (int64_t)(intptr_t)xbuf; a.x_dt = ATB_F32; a.x_stride = s.k; a.m = rows; a.k = s.k;
        a.n = s.n; a.w = (int64_t)(intptr_t)m->w; a.scales = (int64_t)(intptr_t)m->scale;
        a.group = 32; a.y = (int64_t)(intptr_t)ybuf; a.y_dt = ATB_F32; a.y_stride = s.n;
        a.threads = nth;
        if (atb_linear_w4(&a)) abort();
        return;
    }
    LinArgs a = {0};
    a.x = (int64_t)(intptr_t)xbuf; a.w = (int64_t)(intptr_t)m->w;
    a.scale = (int64_t)(intptr_t)m->scale; a.y = (int64_t)(intptr_t)ybuf;
    a.w_dt = m->kind == K_F32 ? W_F32 : m->kind == K_BF16 ? W_BF16 : W_I8;
    a.m = rows; a.k = s.k; a.n = s.n; a.x_stride = s.k; a.w_stride = s.k; a.y_stride = s.n;
    a.threads = nth; a.packed = 1;
    if (m->kind == K_W8A8) {
        a.w_dt = W_I8;
        if (atb_linear_w8a8(&a)) abort();
        return;
    }
    if (atb_linear_rows(&a)) abort();
}

static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define LAYERS 8
#define NSH 5
static const Shape SHAPES[NSH] = {{1536, 512, "qkv 512->1536"}, {512, 512, "o 512->512"},
                                  {2752, 512, "gate|up 512->2752"}, {512, 1376, "down 1376->512"},
                                  {32000, 512, "head 512->32000"}};

/* one decode step's matmuls in order, per-shape times over reps steps */
static void stream(int kind, int nth, int reps) {
    static Mat mats[LAYERS * 4 + 1];
    int nm = 0;
    for (int l = 0; l < LAYERS; ++l)
        for (int i = 0; i < 4; ++i) make(&mats[nm++], kind == K_READ ? K_F32 : kind, SHAPES[i]);
    make(&mats[nm++], kind == K_READ ? K_F32 : kind, SHAPES[4]);
    double *t = calloc((size_t)reps * nm, sizeof(double));
    for (int r = -2; r < reps; ++r)
        for (int i = 0; i < nm; ++i) {
            Mat mm = mats[i];
            if (kind == K_READ) mm.kind = K_READ;
            double t0 = now_ns();
            run(&mm, nth);
            if (r >= 0) t[(size_t)r * nm + i] = now_ns() - t0;
        }
    double step_bytes = 0, step_ns = 0;
    for (int sh = 0; sh < NSH; ++sh) {
        double *v = calloc(reps, sizeof(double));
        int cnt = sh < 4 ? LAYERS : 1;
        double bytes = mats[sh < 4 ? sh : nm - 1].bytes;
        for (int r = 0; r < reps; ++r) {
            double sum = 0;
            for (int i = 0; i < nm; ++i)
                if ((sh < 4 && i < nm - 1 && i % 4 == sh) || (sh == 4 && i == nm - 1))
                    sum += t[(size_t)r * nm + i];
            v[r] = sum / cnt;
        }
        qsort(v, reps, sizeof(double), cmpd);
        double med = v[reps / 2];
        step_bytes += bytes * cnt;
        step_ns += med * cnt;
        printf("stream %-5s %-18s t%d %9.1f us %9.3f MB %6.1f GB/s (fastest %5.1f)\n", KNAME[kind],
               SHAPES[sh].name, nth, med / 1e3, bytes / 1e6, bytes / med, bytes / v[0]);
        free(v);
    }
    double step_flop = 0;
    for (int i = 0; i < nm; ++i) step_flop += 2.0 * rows * mats[i].s.n * mats[i].s.k;
    printf("stream %-5s %-18s t%d %9.1f us %9.3f MB %6.1f GB/s m=%lld %.1f GF/s\n", KNAME[kind],
           "STEP", nth, step_ns / 1e3, step_bytes / 1e6, step_bytes / step_ns, (long long)rows,
           step_flop / step_ns);
    for (int i = 0; i < nm; ++i) { free(mats[i].w); free(mats[i].scale); }
    free(t);
}

/* the seed MLP's fp32 matmuls (512->1376, 1376->512) repeated: L3-resident */
static void l3(int kind, int nth, int reps) {
    const Shape sh[2] = {{1376, 512, "mlp 512->1376"}, {512, 1376, "mlp 1376->512"}};
    Mat m[2];
    for (int i = 0; i < 2; ++i) make(&m[i], kind == K_READ ? K_F32 : kind, sh[i]);
    for (int i = 0; i < 2; ++i) {
        if (kind == K_READ) m[i].kind = K_READ;
        double *v = calloc(reps, sizeof(double));
        for (int r = -20; r < reps; ++r) {
            run(&m[0], nth);  /* both stay warm, as in the MLP */
            run(&m[1], nth);
            double t0 = now_ns();
            run(&m[i], nth);
            if (r >= 0) v[r] = now_ns() - t0;
        }
        qsort(v, reps, sizeof(double), cmpd);
        double med = v[reps / 2];
        printf("l3     %-5s %-18s t%d %9.1f us %9.3f MB %6.1f GB/s\n", KNAME[kind], sh[i].name, nth,
               med / 1e3, m[i].bytes / 1e6, m[i].bytes / med);
        free(v);
    }
    for (int i = 0; i < 2; ++i) { free(m[i].w); free(m[i].scale); }
}

/* the kernel's own rate: one 128 x 512 weight (L2-resident) on one thread, the fastest of
 * reps calls (a shared machine's preemptions only ever add time) */
static void l2(int kind, int reps) {
    const char *e = getenv("GEMV_L2_N");
    const int64_t n = e ? atoll(e) : 128;
    static char name[32];
    snprintf(name, sizeof name, "l2 512->%lld", (long long)n);
    const Shape sh = {n, 512, name};
    const char *em = getenv("GEMV_M");
    rows = em ? atoll(em) : 1;
    if (rows < 1 || rows > ROWS_MAX || n > 32000) {
        fprintf(stderr, "GEMV_M must be 1..%d and GEMV_L2_N at most 32000\n", ROWS_MAX);
        exit(2);
    }
    Mat m;
    make(&m, kind == K_READ ? K_F32 : kind, sh);
    if (kind == K_READ) m.kind = K_READ;
    double best = 1e30;
    for (int r = -50; r < reps * 20; ++r) {
        double t0 = now_ns();
        run(&m, 1);
        double t = now_ns() - t0;
        if (r >= 0 && t < best) best = t;
    }
    printf("l2     %-5s %-18s t1 %9.2f us %9.3f MB %6.1f GB/s (fastest) m=%lld %.1f GFLOP/s\n",
           KNAME[kind], sh.name, best / 1e3, m.bytes / 1e6, m.bytes / best, (long long)rows,
           2.0 * rows * n * 512 / best);
    free(m.w);
    free(m.scale);
}

/* GF/s of the gate|up matmul (512 -> 2752, L3-resident) at each row count of GEMV_MS
 * (default 1,4,8,12,16,32,64,256) on nth threads: median and fastest of reps calls */
static void rows_mode(int kind, int nth, int reps) {
    const char *e = getenv("GEMV_MS");
    char ms[256];
    snprintf(ms, sizeof ms, "%s", e ? e : "1,4,8,12,16,32,64,256");
    const Shape sh = {2752, 512, "gate|up 512->2752"};
    Mat m;
    make(&m, kind == K_READ ? K_F32 : kind, sh);
    double *v = calloc(reps, sizeof(double));
    char *save = NULL;
    for (char *tok = strtok_r(ms, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        rows = atoll(tok);
        if (rows < 1 || rows > ROWS_MAX) { fprintf(stderr, "GEMV_MS: 1..%d\n", ROWS_MAX); exit(2); }
        const int inner = rows < 16 ? 8 : 2;
        for (int r = -5; r < reps; ++r) {
            double t0 = now_ns();
            for (int i = 0; i < inner; ++i) run(&m, nth);
            if (r >= 0) v[r] = (now_ns() - t0) / inner;
        }
        qsort(v, reps, sizeof(double), cmpd);
        const double fl = 2.0 * rows * sh.n * sh.k;
        printf("rows   %-5s %-18s t%d m=%-4lld %9.1f us %6.1f GF/s (fastest %6.1f)\n", KNAME[kind],
               sh.name, nth, (long long)rows, v[reps / 2] / 1e3, fl / v[reps / 2], fl / v[0]);
    }
    free(v);
    free(m.w);
    free(m.scale);
    rows = 1;
}

int main(int argc, char **argv) {
    /* argv: mode (stream|l3|l2|rows) kinds (comma list) threads (comma list) reps */
    const char *mode = argc > 1 ? argv[1] : "stream";
    const char *kinds = argc > 2 ? argv[2] : "read,fp32,bf16,w8,w8a8,w4";
    const char *ths = argc > 3 ? argv[3] : "1,2";
    int reps = argc > 4 ? atoi(argv[4]) : 21;
    for (int i = 0; i < ROWS_MAX * 2048; ++i) xbuf[i] = frand();
    const char *em = getenv("GEMV_M"); /* stream and l3 modes: x rows */
    if (em && strcmp(mode, "l2")) rows = atoll(em);
    if (rows < 1 || rows > ROWS_MAX) { fprintf(stderr, "GEMV_M: 1..%d\n", ROWS_MAX); return 2; }
    char kb[128];
    snprintf(kb, sizeof kb, "%s", kinds);
    for (char *tok = strtok(kb, ","); tok; tok = strtok(NULL, ",")) {
        int kind = -1;
        for (int k = 0; k < NKIND; ++k)
            if (!strcmp(tok, KNAME[k])) kind = k;
        if (kind < 0) { fprintf(stderr, "unknown kind %s\n", tok); return 2; }
        for (const char *t = ths; *t; ++t) {
            if (*t < '1' || *t > '9') continue;
            int nth = *t - '0';
            if (!strcmp(mode, "l3")) l3(kind, nth, reps);
            else if (!strcmp(mode, "l2")) { if (nth == 1) l2(kind, reps); }
            else if (!strcmp(mode, "rows")) rows_mode(kind, nth, reps);
            else stream(kind, nth, reps);
        }
    }
    return 0;
}
