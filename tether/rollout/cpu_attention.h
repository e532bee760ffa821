/* The attention of cpu_decode.c over its tiled KV cache (decode: attention_rows, prefill:
   attention_prompt), and the per-element math it shares with the layers there (exp, RMSNorm, RoPE).

Not a public header: only cpu_decode.c includes it, so the two are one translation unit (these
helpers inline into the layers' code) and one library; cpu.py's build cache is keyed by both files.
Layouts are in cpu_decode.c's header comment.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for the softmax and SiLU, written so the compiler vectorizes it (libm's expf is a scalar
   call): exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 split in two parts (Cody-Waite),
   exp(r) by Cephes' degree-6 polynomial: within 2 ulp of expf on the clamped range. */
static inline float exp_fast(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  /* not fminf/fmaxf: libm calls, no SIMD */
    const float shift = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    float t = x * 1.44269504088896341f + shift;
    float n = t - shift;
    int32_t ti, si;
    memcpy(&ti, &t, 4);
    memcpy(&si, &shift, 4);
    int32_t ni = ti - si;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t pi;
    memcpy(&pi, &p, 4);
    pi += ni << 23;
    memcpy(&p, &pi, 4);
    return p;
}

/* HF's RMSNorm: x * rsqrt(mean(x^2) + eps), then times the weight. */
static inline void rmsnorm(const float *x, const float *w, float *out, int n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* RoPE on one head in place: x*cos + roll(x, D/2)*sin_signed (HF's rotate-half form). */
static inline void rope(float *x, const float *c, const float *s, int D) {
    const int h = D / 2;
    float tmp[h];
    for (int i = 0; i < h; i++) tmp[i] = x[i];
#pragma omp simd
    for (int i = 0; i < h; i++) x[i] = x[i] * c[i] + x[i + h] * s[i];
#pragma omp simd
    for (int i = h; i < D; i++) x[i] = x[i] * c[i] + tmp[i - h] * s[i];
}

/* 16 floats: GCC/Clang vector extensions compile this to one AVX-512 register, two AVX2 ones or
   four NEON ones. Accumulating in such locals keeps them in registers (an array indexed at run
   time would go through memory, one store-load round trip per FMA). aligned(4): unaligned loads. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define LOAD(p) (*(const v16 *)(p))

/* rows per attention block: 16 rows x 4 KB per tile for the tiny model (see attention_rows); 32 and
   64 measured within 2 % of it at batch 256 */
#define RB 16

/* o0 = c0 * o0 + p0 . V, o1 = c1 * o1 + p1 . V over one tile's 16 slots, for 16 * NV dimensions (V
   rows of stride D): each value vector is loaded once for both heads, the 2 * NV sums stay in
   registers (NV is a constant at every call, so the loops unroll). o1 == o0: one head only. */
static inline __attribute__((always_inline)) void pv_tile(const float *r, int D, const float *p0, const float *p1,
                                                          float c0, float c1, float *o0, float *o1, const int NV) {
    v16 a[4], c[4];
    for (int v = 0; v < NV; v++) a[v] = c0 * LOAD(o0 + 16 * v), c[v] = c1 * LOAD(o1 + 16 * v);
    for (int i = 0; i < 16; i++) {
        const float x0 = p0[i], x1 = p1[i];
        for (int v = 0; v < NV; v++) {
            const v16 y = LOAD(r + (int64_t)i * D + 16 * v);
            a[v] += x0 * y, c[v] += x1 * y;
        }
    }
    for (int v = 0; v < NV; v++) {
        memcpy(o1 + 16 * v, &c[v], 64);
        memcpy(o0 + 16 * v, &a[v], 64);  /* last: when o1 == o0 these are the sums kept */
    }
}

/* One tile of the online softmax for one head: s = its 16 scores (scale and mask applied) becomes
   exp(s - m') with m' the new running max; the running sum l is updated and the factor that
   rescales the head's output so far, exp(m - m'), returned. Masked slots (-inf) give exactly 0. */
static inline float softmax_tile(float *s, float *m, float *l) {
    float mt = -INFINITY, sum = 0.0f;
    for (int i = 0; i < 16; i++) mt = s[i] > mt ? s[i] : mt;
    const float mn = mt > *m ? mt : *m;
    if (mn == -INFINITY) {  /* nothing visible yet (left padding): no weight, nothing to rescale */
        for (int i = 0; i < 16; i++) s[i] = 0.0f;
        return 1.0f;
    }
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < 16; i++) {
        s[i] = s[i] == -INFINITY ? 0.0f : exp_fast(s[i] - mn);
        sum += s[i];
    }
    const float c = *m == -INFINITY ? 0.0f : exp_fast(*m - mn);
    *l = *l * c + sum, *m = mn;
    return c;
}

/* Two query heads (q0, q1; q1 == q0: one) against one tile of one kv head: their 16 scores (times
   scale, plus the tile's additive mask bt), the online softmax update, and p . V into o0, o1. knew:
   when not NULL, the tile still holds an old key in slot `lane`; the scores there are computed from
   knew instead (the caller writes it into the tile after this). Inlined: as a call, the decode
   step at batch 256 was 10 % slower. */
static inline __attribute__((always_inline)) void tile_heads(
    const float *kt, const float *vt, const float *q0, const float *q1, const float *bt, float scale, int D,
    const float *knew, int lane, float *m0, float *l0, float *m1, float *l1, float *o0, float *o1) {
    v16 a0 = {0}, a1 = {0}, e0 = {0}, e1 = {0};  /* even / odd d: two FMA chains each */
    for (int d = 0; d < D; d += 2) {
        const v16 x = LOAD(kt + d * 16), y = LOAD(kt + d * 16 + 16);
        a0 += q0[d] * x, a1 += q0[d + 1] * y;
        e0 += q1[d] * x, e1 += q1[d + 1] * y;
    }
    float s0[16], s1[16];
    a0 = (a0 + a1) * scale + LOAD(bt), e0 = (e0 + e1) * scale + LOAD(bt);
    memcpy(s0, &a0, 64), memcpy(s1, &e0, 64);
    if (knew) {
        float d0 = 0.0f, d1 = 0.0f;
        for (int d = 0; d < D; d++) d0 += q0[d] * knew[d], d1 += q1[d] * knew[d];
        s0[lane] = d0 * scale + bt[lane], s1[lane] = d1 * scale + bt[lane];
    }
    const int one = q1 == q0;
    const float c0 = softmax_tile(s0, m0, l0), c1 = one ? c0 : softmax_tile(s1, m1, l1);
    const float *p1 = one ? s0 : s1;
    int d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv_tile(vt + d0, D, s0, p1, c0, c1, o0 + d0, o1 + d0, 4);
    if (D - d0 == 48) pv_tile(vt + d0, D, s0, p1, c0, c1, o0 + d0, o1 + d0, 3);
    if (D - d0 == 32) pv_tile(vt + d0, D, s0, p1, c0, c1, o0 + d0, o1 + d0, 2);
    if (D - d0 == 16) pv_tile(vt + d0, D, s0, p1, c0, c1, o0 + d0, o1 + d0, 1);
}

/* q-k norm (Qwen3) and RoPE of one token's H query heads and Hkv key heads at position p. */
static void qk_prepare(float *q, float *k, int H, int Hkv, int D, const float *qn, const float *kn, float qk_eps,
                       const float *cos, const float *sin, int64_t rope_stride, int64_t p) {
    const float *c = cos + p * rope_stride, *s = sin + p * rope_stride;
    for (int j = 0; j < H; j++) {
        if (qn) rmsnorm(q + (int64_t)j * D, qn, q + (int64_t)j * D, D, qk_eps);
        rope(q + (int64_t)j * D, c, s, D);
    }
    for (int g = 0; g < Hkv; g++) {
        if (kn) rmsnorm(k + (int64_t)g * D, kn, k + (int64_t)g * D, D, qk_eps);
        rope(k + (int64_t)g * D, c, s, D);
    }
}

/* out[h] /= l[h] (the online softmax's sum), or 0 where nothing was visible. */
static void normalize(float *out, const float *l, int H, int D) {
    for (int j = 0; j < H; j++) {
        const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
        for (int d = 0; d < D; d++) out[(int64_t)j * D + d] *= inv;
    }
}

/* Decode attention of rows b0..b1 (a block of RB rows) for one layer, after their q, k, v
   projections: q-k norm, RoPE, the new k and v into cache slot `slot`, then softmax(q k^T * scale +
   bias) v over slots < kv_len for each of the H query heads (head j reads kv head j / G, HF's
   repeat_kv).

   Cache layout, and why: the cache of a batch far exceeds L3 (batch 256, tiny model: 51 MB), so the
   attention streams it from DRAM, and the hardware prefetcher only streams long contiguous runs
   (measured here: 8 KB runs with gaps 14 GB/s, 64 KB runs 32 GB/s, contiguous 40 GB/s). So slots
   come in tiles of 16, and a tile holds every row's keys (values) for its 16 slots: the slots in
   use are a contiguous prefix of the layer's cache, and a block of RB rows reads RB * kv_heads *
   4 KB (tiny model) contiguously per tile. Within a tile, keys are [D, 16] (the 16 slots' scores
   are one vector FMA per dimension, no horizontal sums) and values [16, D] (16 dimensions of p * v
   per FMA). One pass over the tiles, the softmax online (flash-decoding: a running max and sum per
   head, the output rescaled when the max grows), two query heads per read of a tile. The new
   value is written just before its tile is read and the new key just after (each a cache miss
   otherwise: written up front they cost 0.6 ms of a 7 ms step at batch 256).
   ml: 2 * RB * H floats of scratch. Requires D % 16 == 0 (cpu.support checks). */
static void attention_rows(int b0, int b1, int H, int Hkv, int D, const float *qn, const float *kn,
                           float qk_eps, float *q, float *k, const float *v, const float *cos, const float *sin,
                           int64_t rope_stride, const int64_t *pos, float *kc, float *vc, int64_t rows,
                           int64_t slot, int64_t kv_len, const float *bias, int64_t bias_stride, float scale,
                           float *out, float *ml) {
    const int G = H / Hkv;
    const int64_t T = (kv_len + 15) / 16, tile = 16 * (int64_t)D;
    const int64_t row_stride = (int64_t)Hkv * tile, tile_stride = rows * row_stride;
    float *m = ml, *l = ml + RB * H;
    for (int b = b0; b < b1; b++) {
        qk_prepare(q + (int64_t)b * H * D, k + (int64_t)b * Hkv * D, H, Hkv, D, qn, kn, qk_eps, cos, sin,
                   rope_stride, pos[b]);
        for (int j = 0; j < H; j++) m[(b - b0) * H + j] = -INFINITY, l[(b - b0) * H + j] = 0.0f;
        memset(out + (int64_t)b * H * D, 0, sizeof(float) * H * D);
    }
    const int lane = slot % 16;
    for (int64_t t = 0; t < T; t++)  /* tile by tile, each tile's rows b0..b1 in order: one run */
        for (int b = b0; b < b1; b++) {
            float bt[16];  /* this tile's additive mask; slots >= kv_len masked (not read: may not exist) */
            for (int i = 0; i < 16; i++) bt[i] = t * 16 + i < kv_len ? bias[b * bias_stride + t * 16 + i] : -INFINITY;
            const int here = t == slot / 16;
            for (int g = 0; g < Hkv; g++) {
                float *kt = kc + t * tile_stride + b * row_stride + g * tile;
                float *vt = vc + t * tile_stride + b * row_stride + g * tile;
                const float *kg = k + ((int64_t)b * Hkv + g) * D;
                if (here) memcpy(vt + lane * D, v + ((int64_t)b * Hkv + g) * D, sizeof(float) * D);
                for (int j = 0; j < G; j += 2) {
                    const int h0 = g * G + j, h1 = j + 1 < G ? h0 + 1 : h0, bh = (b - b0) * H;
                    tile_heads(kt, vt, q + ((int64_t)b * H + h0) * D, q + ((int64_t)b * H + h1) * D, bt, scale, D,
                               here ? kg : NULL, lane, m + bh + h0, l + bh + h0, m + bh + h1, l + bh + h1,
                               out + ((int64_t)b * H + h0) * D, out + ((int64_t)b * H + h1) * D);
                }
                if (here)
                    for (int d = 0; d < D; d++) kt[d * 16 + lane] = kg[d];
            }
        }
    for (int b = b0; b < b1; b++) normalize(out + (int64_t)b * H * D, l + (b - b0) * H, H, D);
}

/* Prefill attention of one prompt row (P tokens, cache row `row`): every token's q-k norm and RoPE,
   all its keys and values into slots 0..P-1, then causal attention of each token over the tiles up
   to it (slots <= i that are not padding; a padding token attends to itself only, as in the torch
   path, so every output is finite). The row's tiles are read once per token and stay in cache.
   ml: 2 * H floats of scratch. */
static void attention_prompt(int P, const unsigned char *real, const int64_t *pos, int H, int Hkv, int D,
                             const float *qn, const float *kn, float qk_eps, float *q, float *k, const float *v,
                             const float *cos, const float *sin, int64_t rope_stride, float *kc, float *vc,
                             int64_t rows, int64_t row, float scale, float *out, float *ml) {
    const int G = H / Hkv;
    const int64_t tile = 16 * (int64_t)D, row_stride = (int64_t)Hkv * tile, tile_stride = rows * row_stride;
    for (int i = 0; i < P; i++) {
        float *qi = q + (int64_t)i * H * D, *ki = k + (int64_t)i * Hkv * D;
        qk_prepare(qi, ki, H, Hkv, D, qn, kn, qk_eps, cos, sin, rope_stride, pos[i]);
        for (int g = 0; g < Hkv; g++) {
            const int64_t at = i / 16 * tile_stride + row * row_stride + g * tile;
            for (int d = 0; d < D; d++) kc[at + d * 16 + i % 16] = ki[(int64_t)g * D + d];
            memcpy(vc + at + i % 16 * D, v + ((int64_t)i * Hkv + g) * D, sizeof(float) * D);
        }
    }
    float *m = ml, *l = ml + H;
    for (int i = 0; i < P; i++) {
        float *o = out + (int64_t)i * H * D;
        const float *qi = q + (int64_t)i * H * D;
        for (int j = 0; j < H; j++) m[j] = -INFINITY, l[j] = 0.0f;
        memset(o, 0, sizeof(float) * H * D);
        for (int64_t t = 0; t <= i / 16; t++) {
            float bt[16];
            for (int s = 0; s < 16; s++) {
                const int64_t slot = t * 16 + s;
                const int visible = real[i] ? slot <= i && real[slot] : slot == i;
                bt[s] = visible ? 0.0f : -INFINITY;
            }
            for (int g = 0; g < Hkv; g++) {
                const float *kt = kc + t * tile_stride + row * row_stride + g * tile;
                const float *vt = vc + t * tile_stride + row * row_stride + g * tile;
                for (int j = 0; j < G; j += 2) {
                    const int h0 = g * G + j, h1 = j + 1 < G ? h0 + 1 : h0;
                    tile_heads(kt, vt, qi + (int64_t)h0 * D, qi + (int64_t)h1 * D, bt, scale, D, NULL, 0,
                               m + h0, l + h0, m + h1, l + h1, o + (int64_t)h0 * D, o + (int64_t)h1 * D);
                }
            }
        }
        normalize(o, l, H, D);
    }
}
