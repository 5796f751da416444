/* Batch-invariant fp32 kernels for decode-sized inputs: GEMV/GEMM and attention over the slot cache.
 *
 * y[b, o] = sum_i x[b, i] * W[o, i] (+ r[b, o]), W row-major [O, I].
 * Every output element is computed by the same instruction sequence whatever the number of
 * rows B or threads: the result for a row never depends on which other rows share the call.
 * (oneDNN/MKL pick different kernels for different B, so their results differ in the last bits.)
 * Small B is memory-bound: each weight tile is streamed once per 4 rows of x.
 * NOTE: dynamic scheduling: when another thread of the process holds a core, the other OpenMP
 * thread takes more tiles instead of the whole step waiting at the barrier (+~14% at batch 1 on
 * 2 cores). Which thread computes a tile never changes what it computes.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += v[j];
    return s;
}

static inline v16 load(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Weights are packed once as Wp [O/64, I, 64] (O padded to a multiple of 64 with zero rows), so
   the 64 outputs of a tile read one contiguous stream. Output (b, o) is the sum over i, in order,
   of x[b, i] * W[o, i] in its own vector lane: the same operations for every B. */
#define TILE 64
#define RB 4 /* rows of x per pass over a weight tile */

void pack_weight_f32(const float *W, float *Wp, int I, int O) {
    const int tiles = (O + TILE - 1) / TILE;
    for (int t = 0; t < tiles; t++)
        for (int i = 0; i < I; i++)
            for (int j = 0; j < TILE; j++) {
                int o = t * TILE + j;
                Wp[((int64_t)t * I + i) * TILE + j] = o < O ? W[(int64_t)o * I + i] : 0.0f;
            }
}

void gemv_f32(const float *x, const float *Wp, const float *r, float *y, int B, int I, int O, int threads) {
    const int tiles = (O + TILE - 1) / TILE;
    #pragma omp parallel for schedule(dynamic, 2) num_threads(threads)
    for (int t = 0; t < tiles; t++) {
        const float *wt = Wp + (int64_t)t * I * TILE;
        for (int b = 0; b < B; b += RB) {
            const int nb = B - b < RB ? B - b : RB;
            v16 acc[RB][4];
            memset(acc, 0, sizeof acc);
            const float *xb = x + (int64_t)b * I;
            for (int i = 0; i < I; i++) {
                const float *w = wt + (int64_t)i * TILE;
                v16 w0 = load(w), w1 = load(w + 16), w2 = load(w + 32), w3 = load(w + 48);
                for (int k = 0; k < RB; k++) {
                    if (k >= nb) break;
                    float xv = xb[(int64_t)k * I + i];
                    acc[k][0] += w0 * xv; acc[k][1] += w1 * xv; acc[k][2] += w2 * xv; acc[k][3] += w3 * xv;
                }
            }
            for (int k = 0; k < nb; k++)
                for (int j = 0; j < TILE; j++) {
                    int o = t * TILE + j;
                    if (o >= O) break;
                    int64_t idx = (int64_t)(b + k) * O + o;
                    float v = acc[k][j / 16][j % 16];
                    y[idx] = r ? v + r[idx] : v;
                }
        }
    }
}

/* Causal attention of decode/verification queries over the per-slot KV cache.
 *   q    [B, T, nh, hd]      queries after RoPE
 *   kc   [slots, kvh, S, hd] this layer's key cache (already holding the queries' own keys)
 *   vc   [slots, kvh, S, hd]
 *   slot [B], pos [B, T]     cache row and absolute position of each query
 *   out  [B, T, nh, hd]
 * Query (b, t, h) attends to keys 0..pos[b, t] of its slot, KV head h / (nh / kvh). Each output
 * is computed by the same instruction sequence whatever B and T are. hd % 16 == 0. */
void attn_f32(const float *q, const float *kc, const float *vc, const int64_t *slot, const int64_t *pos,
              float *out, int B, int T, int nh, int kvh, int S, int hd, float scale, int threads) {
    const int group = nh / kvh;
    #pragma omp parallel for collapse(3) schedule(dynamic, 2) num_threads(threads)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < nh; h++) {
                const int64_t n = pos[(int64_t)b * T + t] + 1;
                const float *qv = q + (((int64_t)b * T + t) * nh + h) * hd;
                const int64_t base = ((slot[b] * kvh) + h / group) * (int64_t)S * hd;
                const float *K = kc + base, *V = vc + base;
                float *o = out + (((int64_t)b * T + t) * nh + h) * hd;
                float stack[4096];
                float *p = n <= 4096 ? stack : (float *)malloc(sizeof(float) * n);
                float m = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    v16 acc = {0};
                    for (int i = 0; i < hd; i += 16) acc += load(qv + i) * load(K + j * hd + i);
                    p[j] = hsum(acc) * scale;
                    if (p[j] > m) m = p[j];
                }
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
                const float inv = 1.0f / sum;
                for (int i = 0; i < hd; i += 16) {
                    v16 acc = {0};
                    for (int64_t j = 0; j < n; j++) acc += p[j] * load(V + j * hd + i);
                    acc *= inv;
                    memcpy(o + i, &acc, sizeof acc);
                }
                if (p != stack) free(p);
            }
}

/* Fused decode attention block: RoPE on q and k, K/V written into the slot cache, causal
 * attention - one call per layer instead of ~10 torch ops.
 *   qkv  [B, T, nh + 2 kvh, hd]  the fused projection (q heads, k heads, v heads)
 *   cos, sin [P, hd]             RoPE tables; sin carries the rotate_half sign (-sin | +sin)
 *   qrot [B, T, nh, hd]          scratch for the rotated queries
 * RoPE: x * cos + roll(x, hd / 2) * sin, as the torch path computes it. */
void rope_attn_f32(const float *qkv, const float *cos_t, const float *sin_t, float *kc, float *vc,
                   const int64_t *slot, const int64_t *pos, float *qrot, float *out,
                   int B, int T, int nh, int kvh, int S, int hd, float scale, int threads) {
    const int H = nh + 2 * kvh, half = hd / 2;
    /* phase 1: rotate q, rotate k and write k, v (all before any query reads the cache) */
    #pragma omp parallel for collapse(2) schedule(dynamic, 2) num_threads(threads)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const int64_t bt = (int64_t)b * T + t, p = pos[bt];
            const float *c = cos_t + p * hd, *s = sin_t + p * hd;
            const float *row = qkv + bt * H * hd;
            for (int h = 0; h < nh + kvh; h++) {
                const float *x = row + (int64_t)h * hd;
                float *dst = h < nh ? qrot + (bt * nh + h) * hd
                                    : kc + ((slot[b] * kvh + (h - nh)) * (int64_t)S + p) * hd;
                for (int i = 0; i < hd; i++) dst[i] = x[i] * c[i] + x[(i + half) % hd] * s[i];
            }
            for (int g = 0; g < kvh; g++)
                memcpy(vc + ((slot[b] * kvh + g) * (int64_t)S + p) * hd, row + (int64_t)(nh + kvh + g) * hd,
                       sizeof(float) * hd);
        }
    attn_f32(qrot, kc, vc, slot, pos, out, B, T, nh, kvh, S, hd, scale, threads);
}
