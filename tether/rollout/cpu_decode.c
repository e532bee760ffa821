/* A decode step, and a prefill, of a Llama / Mistral / Qwen2 / Qwen3 decoder on the CPU in float32,
   one call each.

Why C: at the sampler's CPU shapes (hidden 128..1024, batch 8..256) a decode step is ~25 small
torch ops per layer, and everything but the matmuls (RMSNorm, RoPE, the cache write, attention over
hundreds of tiny [G, D] x [D, S] products, SiLU) costs as much as the matmuls themselves. Here the
matmuls are the BLAS sgemm that torch.mm calls (passed in as a function pointer: the same kernel,
no second BLAS), and everything else is fused (one pass per row; a tiled KV cache, see
attention_rows in cpu_attention.h). The weights are the HF model's own tensors, read in place. Built on first use by
rollout/cpu.py (gcc -O3, OpenMP); the equations are HF's and the tests compare with the Python
path and with a training forward.

Layouts (row-major, contiguous):
  weights: cpu.py PER_LAYER (per layer: ln1, wq, bq, wk, bk, wv, bv, qn, kn, wo, ln2, wg, wu, wd;
           then embed, norm, lm_head; biases / q-k norms may be NULL)
  cache:   tiles of 16 slots, tile-major: k [layers, tiles, rows, kv_heads, head_dim, 16],
           v [layers, tiles, rows, kv_heads, 16, head_dim] (why: attention_rows)
  bias:    [>= B rows, bias_stride] additive mask (0 or -inf) over cache slots
  rope:    cos, sin_signed: row p (stride rope_stride floats) = the head_dim values at position p,
           sin_signed = [-sin(first half), sin(second half)], so rotate_half(x)*sin = roll(x)*sin_signed
*/
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_attention.h" /* exp_fast, rmsnorm, rope, RB, attention_rows, attention_prompt */

/* bench/profile_cpu_step.py builds with -DTETHER_PROFILE: seconds per part of the decode step,
   summed over calls (layer_in: norm + q/k/v matmuls; attention; layer_out: o, norm, MLP; head). */
#ifdef TETHER_PROFILE
#include <time.h>
double tether_profile[4];
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define TIC(t) double t = now_s()
#define TOC(t, i) (tether_profile[i] += now_s() - t, t = now_s())
#else
#define TIC(t)
#define TOC(t, i)
#endif

typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                        const float *, const int *, const float *, const int *, const float *, float *,
                        const int *);

enum { W_LN1, W_Q, W_BQ, W_K, W_BK, W_V, W_BV, W_QN, W_KN, W_O, W_LN2, W_G, W_U, W_D, W_PER_LAYER };

/* C[B, N] = beta * C + A[B, K] @ W[N, K]^T for row-major A, W, C: in BLAS's column-major terms
   C^T = W^T' A^T, i.e. sgemm("T", "N", N, B, K, W, A). beta = 1 adds into C (the residual). */
static void linear(sgemm_t gemm, const float *A, const float *W, float *C, int B, int N, int K, float beta) {
    const float one = 1.0f;
    gemm("T", "N", &N, &B, &K, &one, W, &K, A, &K, &beta, C, &N);
}

/* C = A W^T through `gemm`, for cpu.py's check that the sgemm it found is the interface used here. */
void tether_gemm_check(sgemm_t gemm, const float *A, const float *W, float *C, int B, int N, int K) {
    linear(gemm, A, W, C, B, N, K, 0.0f);
}

/* silu(g) * u into g, n values (HF's act_fn(gate) * up). */
static void silu_mul(float *g, const float *u, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_fast(-g[i])) * u[i];
}

static int threads_for(int nt, int64_t work) { return work < 8192 ? 1 : nt; }

/* The one argument of tether_decode_step and tether_prefill: cpu.py's Args mirrors it field for
   field (same names, types and order), so the argument list is written once on each side. A field a
   call does not read is ignored. */
typedef struct {
    /* the model: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab; RMSNorm epsilon,
       q-k norm epsilon, attention scale; the weights (header); BLAS sgemm; threads */
    int L, Hd, H, Hkv, D, I, V;
    float eps, qk_eps, scale;
    const float *const *w;
    sgemm_t gemm;
    int nt;
    /* the KV cache (tiled: attention_rows), its rows and slots; the RoPE tables (header) */
    float *kcache, *vcache;
    int64_t cache_rows, slots;
    const float *cos, *sin;
    int64_t rope_stride;
    /* scratch, [n tokens, width] each: x, h (hidden), q, att (heads * D), k, v (kv_heads * D), g, u
       (intermediate); ml: running softmax statistics (per thread: 2 * RB * heads floats) */
    float *x, *h, *q, *k, *v, *att, *g, *u, *ml;
    /* the call: B rows (prefill: of P tokens, into cache rows row0..); the step's tokens and
       positions [B], its cache slot (read through a pointer: the caller advances it in a tensor),
       attention over slots < kv_len masked by bias [B, bias_stride]; the prefill's ids and real
       (1 = token, 0 = padding) [B, P], its positions computed into pos [B * P]; logits [B, V] */
    int B, P;
    int64_t row0, kv_len, bias_stride;
    const int64_t *tokens, *slot, *ids;
    int64_t *pos;
    const unsigned char *real;
    float *bias, *logits;
} Args;

/* for cpu.py's check that its Args has this layout's size */
size_t tether_args_size(void) { return sizeof(Args); }

/* Layer l up to attention for n tokens: h = ln1(x); q, k, v = h W^T (+ bias). */
static void layer_in(const Args *S, const float *const *W, int64_t n) {
    const int ntr = threads_for(S->nt, n * S->Hd);
#pragma omp parallel for num_threads(ntr) if (ntr > 1)
    for (int64_t b = 0; b < n; b++) rmsnorm(S->x + b * S->Hd, W[W_LN1], S->h + b * S->Hd, S->Hd, S->eps);
    float *qkv[3] = {S->q, S->k, S->v};
    const int widths[3] = {S->H * S->D, S->Hkv * S->D, S->Hkv * S->D};
    for (int i = 0; i < 3; i++) {
        const float *bia = W[W_BQ + 2 * i];
        if (bia)
            for (int64_t b = 0; b < n; b++) memcpy(qkv[i] + b * widths[i], bia, sizeof(float) * widths[i]);
        linear(S->gemm, S->h, W[W_Q + 2 * i], qkv[i], (int)n, widths[i], S->Hd, bia ? 1.0f : 0.0f);
    }
}

/* Layer l after attention: x += att Wo^T; x += down(silu(gate(ln2(x))) * up(ln2(x))). */
static void layer_out(const Args *S, const float *const *W, int64_t n) {
    const sgemm_t gemm = S->gemm;
    float *x = S->x, *h = S->h, *g = S->g, *u = S->u;
    linear(gemm, S->att, W[W_O], x, (int)n, S->Hd, S->H * S->D, 1.0f);
    const int ntr = threads_for(S->nt, n * S->Hd), ntm = threads_for(S->nt, n * S->I);
#pragma omp parallel for num_threads(ntr) if (ntr > 1)
    for (int64_t b = 0; b < n; b++) rmsnorm(x + b * S->Hd, W[W_LN2], h + b * S->Hd, S->Hd, S->eps);
    linear(gemm, h, W[W_G], g, (int)n, S->I, S->Hd, 0.0f);
    linear(gemm, h, W[W_U], u, (int)n, S->I, S->Hd, 0.0f);
#pragma omp parallel for num_threads(ntm) if (ntm > 1)
    for (int64_t b = 0; b < n; b++) silu_mul(g + b * S->I, u + b * S->I, S->I);
    linear(gemm, g, W[W_D], x, (int)n, S->Hd, S->I, 1.0f);
}

/* logits[r] = lm_head(norm(x[r * x_stride])) for r < n. */
static void head(const Args *S, const float *const *tail, int64_t n, const float *x, int64_t x_stride) {
    for (int64_t r = 0; r < n; r++) rmsnorm(x + r * x_stride, tail[1], S->h + r * S->Hd, S->Hd, S->eps);
    linear(S->gemm, S->h, tail[2], S->logits, (int)n, S->V, S->Hd, 0.0f);
}

/* The whole decode step: tokens, pos [B] -> logits [B, V]. Scratch of B rows; ml: nt * 2 * RB *
   heads floats. */
void tether_decode_step(const Args *S) {
    const int B = S->B;
    const float *const *tail = S->w + (int64_t)S->L * W_PER_LAYER;
    const int64_t slot = *S->slot;  /* read here: the caller keeps it in a tensor it advances */
    for (int b = 0; b < B; b++) {  /* the new slot is visible to its own row; embed the tokens */
        S->bias[b * S->bias_stride + slot] = 0.0f;
        memcpy(S->x + (int64_t)b * S->Hd, tail[0] + S->tokens[b] * S->Hd, sizeof(float) * S->Hd);
    }
    const int nta = threads_for(S->nt, (int64_t)B * S->H * S->kv_len * S->D), nblk = (B + RB - 1) / RB;
    const int64_t layer = (S->slots + 15) / 16 * 16 * S->cache_rows * S->Hkv * S->D;
    for (int l = 0; l < S->L; l++) {
        const float *const *W = S->w + (int64_t)l * W_PER_LAYER;
        TIC(t);
        layer_in(S, W, B);
        TOC(t, 0);
#pragma omp parallel for num_threads(nta < nblk ? nta : nblk) if (nta > 1 && nblk > 1) schedule(static)
        for (int blk = 0; blk < nblk; blk++) {
            const int b0 = blk * RB, b1 = b0 + RB < B ? b0 + RB : B;
#ifdef _OPENMP
            float *mlt = S->ml + (int64_t)omp_get_thread_num() * 2 * RB * S->H;
#else
            float *mlt = S->ml;
#endif
            attention_rows(b0, b1, S->H, S->Hkv, S->D, W[W_QN], W[W_KN], S->qk_eps, S->q, S->k, S->v, S->cos,
                           S->sin, S->rope_stride, S->pos, S->kcache + l * layer, S->vcache + l * layer,
                           S->cache_rows, slot, S->kv_len, S->bias, S->bias_stride, S->scale, S->att, mlt);
        }
        TOC(t, 1);
        layer_out(S, W, B);
        TOC(t, 2);
    }
    TIC(t);
    head(S, tail, B, S->x, S->Hd);
    TOC(t, 3);
}

/* The prefill of B left-padded prompts of P tokens into cache rows row0..row0+B-1, slots 0..P-1:
   ids, real [B, P] -> logits of each row's last position [B, V]. Each token's position (into pos) is
   the number of real tokens before it. Scratch of B * P rows; ml: nt * 2 * heads floats. */
void tether_prefill(const Args *S) {
    const int B = S->B, P = S->P;
    const float *const *tail = S->w + (int64_t)S->L * W_PER_LAYER;
    const int64_t n = (int64_t)B * P;
    for (int b = 0; b < B; b++) {
        int64_t seen = 0;
        for (int i = 0; i < P; i++) {
            const int64_t t = (int64_t)b * P + i;
            seen += S->real[t];
            S->pos[t] = seen > 0 ? seen - 1 : 0;  /* as the torch path: cumsum(mask) - 1, clamped at 0 */
            memcpy(S->x + t * S->Hd, tail[0] + S->ids[t] * S->Hd, sizeof(float) * S->Hd);
        }
    }
    const int64_t layer = (S->slots + 15) / 16 * 16 * S->cache_rows * S->Hkv * S->D;
    const int nta = threads_for(S->nt, n * S->H * S->D);
    for (int l = 0; l < S->L; l++) {
        const float *const *W = S->w + (int64_t)l * W_PER_LAYER;
        layer_in(S, W, n);
#pragma omp parallel for num_threads(nta < B ? nta : B) if (nta > 1 && B > 1) schedule(static)
        for (int b = 0; b < B; b++) {
#ifdef _OPENMP
            float *mlt = S->ml + (int64_t)omp_get_thread_num() * 2 * S->H;
#else
            float *mlt = S->ml;
#endif
            const int64_t t0 = (int64_t)b * P;
            attention_prompt(P, S->real + t0, S->pos + t0, S->H, S->Hkv, S->D, W[W_QN], W[W_KN], S->qk_eps,
                             S->q + t0 * S->H * S->D, S->k + t0 * S->Hkv * S->D, S->v + t0 * S->Hkv * S->D,
                             S->cos, S->sin, S->rope_stride, S->kcache + l * layer, S->vcache + l * layer,
                             S->cache_rows, S->row0 + b, S->scale, S->att + t0 * S->H * S->D, mlt);
        }
        layer_out(S, W, n);
    }
    head(S, tail, B, S->x + (int64_t)(P - 1) * S->Hd, (int64_t)P * S->Hd);
}
