/* Batch-invariant fp32 kernels: GEMV/GEMM and attention over the paged KV cache (decode, verification
 * and prefill chunks).
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
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* NOTE: exactness rests on this. With contraction allowed (GCC's default) the compiler decides per
 * code path whether a * b + c becomes one FMA (one rounding) or a multiply and an add (two), and
 * its tuning changes the decision (-mtune=znver3 avoids FMA chains in some loops, not in others):
 * a verification step's logits then differ from single-token steps' in the last bit. So the build
 * (kernels/__init__.py) turns contraction off, every fused multiply-add is written out (vfma), and
 * the order and rounding of every sum and product is the source's, whatever -march / -mtune. */
#ifndef SPECGUIDE_FP_CONTRACT_OFF
#error "build with -ffp-contract=off -DSPECGUIDE_FP_CONTRACT_OFF (kernels/__init__.py)"
#endif

/* NOTE: vectors of the CPU's own width (16 floats with AVX-512, 8 with AVX2, 4 otherwise). GCC
 * lowers wider generic vectors through the stack: a 16-float vector type built for AVX2 runs the
 * GEMM an order of magnitude slower than the AVX-512 build on the same CPU. Each output lane's sums
 * are the same operations whatever the width, so the width changes speed, never a row's result
 * within a build. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX2__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi32 __attribute__((vector_size(VW * 4)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef int8_t vi8 __attribute__((vector_size(VW)));
typedef uint8_t vu8 __attribute__((vector_size(VW)));

static inline __attribute__((always_inline)) vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* a * b + c: one rounding where the build has FMA, else a rounded product then a rounded sum (the
   same operations in every loop of one build, vector bodies and tails alike). */
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) {
#if VW == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VW == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline __attribute__((always_inline)) vf splat(float x) {
#if VW == 16
    return (vf)_mm512_set1_ps(x);
#elif VW == 8
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){x, x, x, x}; /* (not {0} + x: that turns -0.0 into +0.0) */
#endif
}

/* m ? a : b, lane-wise (m: all ones or zero per lane) */
static inline __attribute__((always_inline)) vf vsel(vi32 m, vf a, vf b) {
    return (vf)((m & (vi32)a) | (~m & (vi32)b));
}

static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return vsel(a > b, a, b); }

/* The lanes of a summed in lane order (a fixed order: a row's sum whatever its neighbours). */
static inline __attribute__((always_inline)) float sum_lanes(vf a) {
    float s = 0.0f;
    for (int l = 0; l < VW; l++) s += a[l];
    return s;
}

/* Weights are packed once as Wp [O/64, I, 64] (O padded to a multiple of 64 with zero rows), so
   the 64 outputs of a tile read one contiguous stream. Output (b, o) is the sum over i, in order,
   of x[b, i] * W[o, i] in its own vector lane: the same operations for every B.
   Weight-only quantized variants hold Wp as int8 (y = scale[o] * sum x * q) or bf16 (the top
   half of an fp32): each weight is widened to fp32 in a register, so accumulation stays fp32 and
   the result is as batch-invariant as the fp32 kernel. For B >= SCRATCH_B (prefill) a thread
   widens its tile once into an fp32 scratch tile (same values, so the same results) instead of
   once per RB rows. */
#define TILE 64
#define NV (TILE / VW) /* vectors per tile row */
#ifndef RB
#define RB 4 /* rows of x per pass over a weight tile (tuned per machine: kernels/tune.py) */
#endif
#define SCRATCH_B 16
#ifndef ROWS_CHUNK
#define ROWS_CHUNK 32 /* rows per work item of a call with at least twice as many (gemv_for; 64: 0.96-0.99x) */
#endif

enum { W_F32 = 0, W_I8 = 1, W_BF16 = 2 };

/* VW weights from `base` at element idx, widened to fp32. */
static inline __attribute__((always_inline)) vf wload(const void *base, int64_t idx, int kind) {
    if (kind == W_I8) {
        const int8_t *p = (const int8_t *)base + idx;
#if defined(__AVX512F__)
        return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
        return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
        vi8 q;
        memcpy(&q, p, sizeof q);
        return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
#endif
    }
    if (kind == W_BF16) {
        const uint16_t *p = (const uint16_t *)base + idx;
#if defined(__AVX512F__)
        return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
        return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
        vu16 h;
        memcpy(&h, p, sizeof h);
        vu32 w = __builtin_convertvector(h, vu32) << 16;
        vf f;
        memcpy(&f, &w, sizeof f);
        return f;
#endif
    }
    return load((const float *)base + idx);
}

static inline size_t wsize(int kind) { return kind == W_F32 ? 4 : kind == W_I8 ? 1 : 2; }

/* acc[k] += w * x[k, i] for the nb rows of this pass: every weight format ends here, so a row's
   sums are the same operations whatever the format (and the block formats give the fp32 bits). */
static inline __attribute__((always_inline)) void accumulate(vf acc[RB][NV], const vf *w, const float *xb,
                                                             int nb, int i, int I) {
    for (int k = 0; k < RB; k++) {
        if (k >= nb) break;
        const float xv = xb[(int64_t)k * I + i];
        for (int v = 0; v < NV; v++) acc[k][v] = vfma(w[v], splat(xv), acc[k][v]);
    }
}

/* NOTE: explicit loops, not memset: GCC turned a memset of these register arrays into a libc call
   (20% of the integer-dot GEMM at 16 rows). */
static inline __attribute__((always_inline)) void zero_acc(vf acc[RB][NV]) {
    for (int k = 0; k < RB; k++)
        for (int v = 0; v < NV; v++) acc[k][v] = (vf){0};
}

/* y[row, tile t's vector v] = a (* scale) (+ r): one vector in a full tile, element by element in
   the last, partial one (the same operations either way). */
static inline __attribute__((always_inline)) void store_vec(vf a, const float *scale, const float *r, float *y,
                                                            int64_t row, int t, int v, int O) {
    const int64_t base = row * O + t * TILE + v * VW;
    const int o0 = t * TILE + v * VW;
    if ((t + 1) * TILE <= O) {
        if (scale) a *= load(scale + o0);
        if (r) a += load(r + base);
        memcpy(y + base, &a, sizeof a);
        return;
    }
    for (int j = 0; j < VW; j++) {
        if (o0 + j >= O) break;
        float x = a[j];
        if (scale) x *= scale[o0 + j];
        y[base + j] = r ? x + r[base + j] : x;
    }
}

/* y[b + k, tile t] = acc[k] (* scale) (+ r) for the nb rows of a pass. */
static inline __attribute__((always_inline)) void store_rows(vf acc[RB][NV], int nb, const float *scale,
                                                             const float *r, float *y, int t, int b, int O) {
    for (int k = 0; k < nb; k++)
        for (int v = 0; v < NV; v++) store_vec(acc[k][v], scale, r, y, b + k, t, v, O);
}

/* One pass of up to RB rows over one weight tile `wt` (of type `kind`), written to y. */
static inline __attribute__((always_inline)) void tile_rows(
        const float *xb, int nb, const void *wt, int kind, const float *scale, const float *r, float *y,
        int t, int b, int I, int O) {
    vf acc[RB][NV];
    zero_acc(acc);
    for (int i = 0; i < I; i++) {
        vf wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = wload(wt, (int64_t)i * TILE + v * VW, kind);
        accumulate(acc, wv, xb, nb, i, I);
    }
    store_rows(acc, nb, scale, r, y, t, b, O);
}

/* All rows of x over weight tile t; `buf` (an fp32 tile) when widening. One copy per weight type,
   so `kind` is a constant inside each. */
static inline __attribute__((always_inline)) void tile_all(
        int kind, const float *x, const void *Wp, float *buf, const float *scale, const float *r, float *y,
        int t, int B, int I, int O) {
    const char *wt = (const char *)Wp + (int64_t)t * I * TILE * wsize(kind);
    if (buf) {
        for (int64_t e = 0; e < (int64_t)I * TILE; e += VW) {
            vf v = wload(wt, e, kind);
            memcpy(buf + e, &v, sizeof v);
        }
    }
    for (int b = 0; b < B; b += RB) {
        const int nb = B - b < RB ? B - b : RB;
        const float *xb = x + (int64_t)b * I;
        if (buf) tile_rows(xb, nb, buf, W_F32, scale, r, y, t, b, I, O);
        else tile_rows(xb, nb, wt, kind, scale, r, y, t, b, I, O);
    }
}

typedef struct qact qact_t; /* x quantized to int8 (the integer kinds, below) */
typedef void (*tile_fn)(const float *, const qact_t *, const void *, float *, const void *, const float *, float *,
                        int, int, int, int);
#define TILE_FN(NAME, KIND) \
    static void NAME(const float *x, const qact_t *qa, const void *Wp, float *buf, const void *aux, const float *r, \
                     float *y, int t, int B, int I, int O) { \
        (void)qa; \
        tile_all(KIND, x, Wp, buf, (const float *)aux, r, y, t, B, I, O); \
    }
TILE_FN(tile_f32, W_F32)
TILE_FN(tile_i8, W_I8)
TILE_FN(tile_bf16, W_BF16)

/* Block-scaled weights (GGUF's Q4_1 and Q8_0 blocks of 32 inputs, repacked into the same 64-wide
   tiles): for tile t and input i, Q4_1 holds 32 bytes (byte j: lane j in its low nibble, lane
   j + 32 in its high nibble) and Q8_0 64 int8; per block of 32 inputs, `dm` holds d [64] (and m
   [64] for Q4_1) as fp16, as GGUF stores them. w = q * d + m (Q4_1) or q * d (Q8_0): d is an fp16 value and q has at
   most 8 bits, so q * d is exact in fp32 and w is the value GGUF's dequantization gives. The
   accumulation below is the fp32 kernel's, operation for operation, so a block-scaled weight
   gives the same bits as the fp32 kernel on its dequantized weight. I % 32 == 0. */
#define QBLK 32
enum { W_Q4_1 = 3, W_Q8_0 = 4 };

static inline __attribute__((always_inline)) vf i32_to_f(vi32 q) { return __builtin_convertvector(q, vf); }

/* VW bytes zero-extended to int32. */
static inline __attribute__((always_inline)) vi32 zext_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vu8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, vi32);
#endif
}

/* The 64 weights of input i of a tile (NV vectors), given its block's d (and m). Q4_1 lane l is
   byte l % 32's low nibble (l < 32) or high nibble (l >= 32). */
static inline __attribute__((always_inline)) void widen_blk(int kind, const char *wt, int64_t i, const vf *d,
                                                             const vf *m, vf *w) {
    if (kind == W_Q4_1) {
        const uint8_t *qb = (const uint8_t *)wt + i * (TILE / 2);
        vi32 q[NV / 2];  /* the 32 bytes, each zero-extended once */
        for (int c = 0; c < NV / 2; c++) q[c] = zext_u8(qb + c * VW);
        for (int v = 0; v < NV; v++)
            w[v] = vfma(i32_to_f(v < NV / 2 ? q[v] & 15 : q[v - NV / 2] >> 4), d[v], m[v]);
    } else {
        for (int v = 0; v < NV; v++) w[v] = wload(wt, i * TILE + v * VW, W_I8) * d[v];
    }
}

/* One fp16 value (bits) as fp32 (exact; subnormals included): F16C, else sign, exponent and
   mantissa by hand. */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31, mant = h & 0x3FFu;
    float v = e == 0 ? ldexpf((float)mant, -24) : e == 31 ? (mant ? NAN : INFINITY)
                                                        : ldexpf((float)(mant | 0x400u), (int)e - 25);
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits |= sign;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

/* VW fp16 values (bits) widened to fp32 (exact). */
static inline __attribute__((always_inline)) vf load_h(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf out;
    for (int j = 0; j < VW; j++) out[j] = half_to_float(p[j]);
    return out;
#endif
}

static inline __attribute__((always_inline)) void load_dm(int kind, const uint16_t *dm, int64_t blk, vf *d, vf *m) {
    const int per = kind == W_Q4_1 ? 2 * TILE : TILE;  /* fp16 per block: d [64] (+ m [64]) */
    for (int v = 0; v < NV; v++) {
        d[v] = load_h(dm + blk * per + v * VW);
        m[v] = kind == W_Q4_1 ? load_h(dm + blk * per + TILE + v * VW) : (vf){0};
    }
}

/* NOTE: software prefetch of the block `pf_blocks` ahead of the one being widened (0: none). The
   hardware prefetchers lose the stream at each 64-row tile; how far ahead pays is a property of
   the machine's memory, so kernels/tune.py measures it on a stream larger than the L3 cache and
   sets it once (set_prefetch). It changes when bytes arrive, never what is computed. */
static int pf_blocks = 0;

void set_prefetch(int blocks) { pf_blocks = blocks; }

/* NOTE: past the tile's last block it prefetches the next tile's first ones (tiles are contiguous;
   with the dynamic schedule that is usually this thread's next tile: 25% faster than stopping at the
   tile's end), and past the last tile addresses outside the weights: a prefetch never faults. */
static inline __attribute__((always_inline)) void prefetch_blk(int kind, const char *wt, const uint16_t *dm,
                                                                int64_t blk) {
    if (pf_blocks == 0) return;
    blk += pf_blocks;
    const int64_t qb = (kind == W_Q4_1 ? TILE / 2 : TILE) * QBLK, per = kind == W_Q4_1 ? 2 * TILE : TILE;
    const uintptr_t q = (uintptr_t)wt + (uintptr_t)(blk * qb), s = (uintptr_t)dm + (uintptr_t)(blk * per * 2);
    for (int64_t o = 0; o < qb; o += 64) __builtin_prefetch((const void *)(q + o), 0, 0);
    for (int64_t o = 0; o < per * 2; o += 64) __builtin_prefetch((const void *)(s + o), 0, 0);
}

/* For each input i of a block-scaled tile, in order: its widened weights `w` [NV], then BODY. */
#define EACH_WIDENED(kind, wt, dm, I, i, w, BODY)                                    \
    for (int64_t blk_ = 0; blk_ < (I) / QBLK; blk_++) {                              \
        vf d_[NV], m_[NV];                                                           \
        prefetch_blk(kind, wt, dm, blk_);                                    \
        load_dm(kind, dm, blk_, d_, m_);                                             \
        for (int i = blk_ * QBLK; i < (blk_ + 1) * QBLK; i++) {                      \
            vf w[NV];                                                                \
            widen_blk(kind, wt, i, d_, m_, w);                                       \
            BODY;                                                                    \
        }                                                                            \
    }

/* tile_rows for block-scaled weights: the same accumulation, the weights widened per block. */
static inline __attribute__((always_inline)) void tile_rows_blk(
        const float *xb, int nb, const char *wt, const uint16_t *dm, int kind, const float *r, float *y,
        int t, int b, int I, int O) {
    vf acc[RB][NV];
    zero_acc(acc);
    EACH_WIDENED(kind, wt, dm, I, i, w, accumulate(acc, w, xb, nb, i, I));
    store_rows(acc, nb, NULL, r, y, t, b, O);
}

static inline __attribute__((always_inline)) void tile_all_blk(
        int kind, const float *x, const void *Wp, float *buf, const uint16_t *dm_all, const float *r, float *y,
        int t, int B, int I, int O) {
    const int64_t qbytes = kind == W_Q4_1 ? TILE / 2 : TILE;
    const char *wt = (const char *)Wp + (int64_t)t * I * qbytes;
    const uint16_t *dm = dm_all + (int64_t)t * (I / QBLK) * (kind == W_Q4_1 ? 2 * TILE : TILE);
    if (buf)  /* prefill: widen the tile once, then the fp32 path (the same values, the same sums) */
        EACH_WIDENED(kind, wt, dm, I, i, w, memcpy(buf + (int64_t)i * TILE, w, sizeof w));
    for (int b = 0; b < B; b += RB) {
        const int nb = B - b < RB ? B - b : RB;
        const float *xb = x + (int64_t)b * I;
        if (buf) tile_rows(xb, nb, buf, W_F32, NULL, r, y, t, b, I, O);
        else tile_rows_blk(xb, nb, wt, dm, kind, r, y, t, b, I, O);
    }
}

static void tile_q4_1(const float *x, const qact_t *qa, const void *Wp, float *buf, const void *dm, const float *r,
                      float *y, int t, int B, int I, int O) {
    (void)qa;
    tile_all_blk(W_Q4_1, x, Wp, buf, dm, r, y, t, B, I, O);
}
static void tile_q8_0(const float *x, const qact_t *qa, const void *Wp, float *buf, const void *dm, const float *r,
                      float *y, int t, int B, int I, int O) {
    (void)qa;
    tile_all_blk(W_Q8_0, x, Wp, buf, dm, r, y, t, B, I, O);
}

/* ---- Integer dot products: block-quantized weights x int8 activations (llama.cpp's arithmetic) ----
 * x is quantized once per call, per row and block of 32 inputs (quant_row): dx = max|x| / 127,
 * xq = round(x / dx) in [-127, 127], sx = dx * sum xq. Per block and output o:
 *   Q8_0: dot = (d[o] * dx) * sum xq q[o]                   (q in [-127, 127])
 *   Q4_1: dot = (d[o] * dx) * sum xq q[o] + m[o] * sx        (q in [0, 15])
 * The integer sums are exact whatever instruction makes them (VNNI dpbusd, maddubs, scalar) and a
 * row's blocks fold into its fp32 sum in block order, so a row's result never depends on the other
 * rows, the thread count or RB: invariant by construction, like the fp32 kernel.
 * Layout: the 4 consecutive inputs of one output share 32 bits, one dot-product lane.
 *   Q8_0: int8 [O/64, I/4, 64, 4];  Q4_1: [O/64, I/4, 32, 4] bytes, output j's 4 inputs in the low
 *   nibbles of bytes (j, 0..3), output j + 32's in their high nibbles.
 *   aux [O/64, I/32, 2, 64] 16-bit: Q4_1 d and m (fp16); Q8_0 d (fp16) and the block's sum of q
 *   (int16: the VNNI path feeds x + 128 as its unsigned operand and takes 128 * sum q back). */
enum { W_Q4_1_Q8 = 5, W_Q8_0_Q8 = 6 };
#define IS_INT_KIND(k) ((k) == W_Q4_1_Q8 || (k) == W_Q8_0_Q8)
#define GRP 4 /* inputs per 32-bit lane */

struct qact {
    int8_t *q;    /* [B, I] */
    float *d, *s; /* [B, I/32]: dx and dx * sum xq */
};

static qact_t qact_alloc(int64_t n) { /* room for n activations */
    qact_t a = {NULL, NULL, NULL};
    if (n > 0) {
        a.q = (int8_t *)malloc((size_t)n);
        a.d = (float *)malloc(sizeof(float) * (size_t)(n / QBLK + 1) * 2);
        a.s = a.d + n / QBLK + 1;
    }
    return a;
}

static void qact_free(qact_t *a) {
    free(a->q);
    free(a->d);
}

/* One row of I inputs. NOTE: a NaN or infinite input gives its block dx = NaN (and q = 0), so the
   row's outputs are NaN, as the fp32 kernel's would be (the engine's NaN check sees them). */
/* n values x (n % VW == 0) as symmetric int8, q[i * stride] = round(x[i] * 127 / max|x|) clamped
   to +-127; returns their scale max|x| / 127 and the sum of q in *sum. The one rounding rule of the
   activations (quant_row) and the int8 KV cache (store_q8). NOTE: a NaN or infinite value gives the
   scale NaN (and every q 0), so what it multiplies is NaN, as in fp32. */
static float quant_q8(const float *x, int n, int8_t *q, int64_t stride, int *sum) {
    vf am = splat(0.0f); /* |x| max per lane (the max of a set: the same in any order) */
    vi32 fin = (vi32){0} - 1;
    for (int i = 0; i < n; i += VW) {
        const vf a = (vf)((vi32)load(x + i) & 0x7FFFFFFF);
        am = vmax(a, am);
        fin &= a <= splat(FLT_MAX); /* false for inf and NaN */
    }
    float amax = 0.0f;
    int finite = 1;
    for (int l = 0; l < VW; l++) {
        amax = am[l] > amax ? am[l] : amax;
        finite &= fin[l] != 0;
    }
    *sum = 0;
    if (!finite) {
        for (int i = 0; i < n; i++) q[i * stride] = 0;
        return NAN;
    }
    const float d = amax / 127.0f, id = d > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; i++) {
        int v = (int)nearbyintf(x[i] * id);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[i * stride] = (int8_t)v;
        *sum += v;
    }
    return d;
}

/* One row of I inputs in blocks of QBLK: their int8 values, dx and dx * sum xq. */
static void quant_row(const float *x, int I, int8_t *q, float *d, float *s) {
    for (int blk = 0; blk < I / QBLK; blk++) {
        int sum;
        d[blk] = quant_q8(x + (int64_t)blk * QBLK, QBLK, q + (int64_t)blk * QBLK, 1, &sum);
        s[blk] = d[blk] * (float)sum; /* NaN with d */
    }
}

/* quant_row over the B rows of x [B, I] (a worksharing loop: its end is a barrier). */
static void quant_rows_for(const float *x, int B, int I, qact_t *qa) {
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++)
        quant_row(x + (int64_t)b * I, I, qa->q + (int64_t)b * I, qa->d + (int64_t)b * (I / QBLK),
                  qa->s + (int64_t)b * (I / QBLK));
}

#if VW == 16 && defined(__AVX512VNNI__)
#define IDOT_VNNI 1 /* one dpbusd per 4 inputs x 16 outputs */
#elif VW == 8 && defined(__AVXVNNI__)
#define IDOT_VNNI 1 /* AVX-VNNI: the same dpbusd over 8 outputs (AVX2 CPUs that have it: Intel's since
                       Alder Lake and Sierra Forest, Zen 5 in a build without AVX-512) */
#elif (VW == 16 && defined(__AVX512BW__)) || (VW == 8 && defined(__AVX2__))
#define IDOT_MADD 1 /* maddubs (u8 x s8 pairs to int16) then madd (pairs to int32) */
#endif

/* Which integer path this build has: 2 VNNI (AVX-512 or AVX-VNNI), 1 maddubs (AVX2 / AVX-512BW), 0 scalar. */
int int_dot_path(void) {
#if defined(IDOT_VNNI)
    return 2;
#elif defined(IDOT_MADD)
    return 1;
#else
    return 0;
#endif
}

static inline __attribute__((always_inline)) vi32 ld32(const void *p) {
    vi32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The 4 bytes at p in every lane. */
static inline __attribute__((always_inline)) vi32 bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (vi32){0} + v;
}

/* acc[l] += sum over the 4 bytes of lane l of a * b, a unsigned or signed (scalar: the portable path). */
static inline __attribute__((always_inline)) vi32 dot4_ref(vi32 acc, vi32 a, vi32 b, int a_signed) {
    int8_t pa[VW * 4], pb[VW * 4];
    memcpy(pa, &a, sizeof pa);
    memcpy(pb, &b, sizeof pb);
    for (int l = 0; l < VW; l++)
        for (int j = 0; j < 4; j++)
            acc[l] += (a_signed ? (int32_t)pa[4 * l + j] : (int32_t)(uint8_t)pa[4 * l + j]) * (int32_t)pb[4 * l + j];
    return acc;
}

typedef int16_t vp16 __attribute__((vector_size(VW * 4))); /* a full register of int16 pairs */

/* The maddubs path (AVX2, AVX-512BW; the portable build never calls these): maddubs16 gives per
   lane two int16 sums of u8 x s8 pairs, widen16 adds each lane's two into its int32. Q4_1 sums a
   whole block's maddubs in int16 before widening (|pair| <= 2 * 15 * 127, so 8 groups sum to at
   most 30480: no overflow, exact); everything else widens each one (dot_us). */
static inline __attribute__((always_inline)) vi32 widen16(vp16 s) {
#if defined(IDOT_MADD) && VW == 16
    return (vi32)_mm512_madd_epi16((__m512i)s, _mm512_set1_epi16(1));
#elif defined(IDOT_MADD)
    return (vi32)_mm256_madd_epi16((__m256i)s, _mm256_set1_epi16(1));
#else
    (void)s;
    return (vi32){0};
#endif
}

static inline __attribute__((always_inline)) vp16 maddubs16(vi32 u, vi32 s) {
#if defined(IDOT_MADD) && VW == 16
    return (vp16)_mm512_maddubs_epi16((__m512i)u, (__m512i)s);
#elif defined(IDOT_MADD)
    return (vp16)_mm256_maddubs_epi16((__m256i)u, (__m256i)s);
#else
    (void)u, (void)s;
    return (vp16){0};
#endif
}

/* acc += u (unsigned bytes) . s (signed bytes) per lane; no intermediate saturation for |u s| pairs
   below 2^15 (maddubs): Q4_1's u <= 15, Q8_0's |w| . |x| <= 127 * 127. */
static inline __attribute__((always_inline)) vi32 dot_us(vi32 acc, vi32 u, vi32 s) {
#if defined(IDOT_VNNI) && VW == 16
    return (vi32)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
#elif defined(IDOT_VNNI)
    return (vi32)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#elif defined(IDOT_MADD)
    return acc + widen16(maddubs16(u, s));
#else
    return dot4_ref(acc, u, s, 0);
#endif
}

/* acc += w . x, both signed bytes; aw = |w| (the maddubs path's unsigned operand). VNNI instead
   takes (x + 128) . w: the fold in tile_rows_q subtracts 128 * sum w. */
static inline __attribute__((always_inline)) vi32 dot_ss(vi32 acc, vi32 w, vi32 aw, vi32 x) {
#if defined(IDOT_VNNI)
    (void)aw;
    return dot_us(acc, x ^ (int32_t)0x80808080, w);
#elif defined(IDOT_MADD) && VW == 16
    const __m512i sx = _mm512_mask_sub_epi8((__m512i)x, _mm512_movepi8_mask((__m512i)w), _mm512_setzero_si512(),
                                            (__m512i)x); /* x where w >= 0, -x where w < 0 (w = 0: aw = 0) */
    return dot_us(acc, aw, (vi32)sx);
#elif defined(IDOT_MADD)
    return dot_us(acc, aw, (vi32)_mm256_sign_epi8((__m256i)x, (__m256i)w));
#else
    (void)aw;
    return dot4_ref(acc, w, x, 1);
#endif
}

static inline __attribute__((always_inline)) vi32 abs8(vi32 w) {
#if defined(IDOT_MADD) && VW == 16
    return (vi32)_mm512_abs_epi8((__m512i)w);
#elif defined(IDOT_MADD)
    return (vi32)_mm256_abs_epi8((__m256i)w);
#else
    return w;
#endif
}

typedef int16_t vi16 __attribute__((vector_size(VW * 2)));

/* NOTE: registers. A pass keeps, per row, QNS integer block sums live (the fp32 sums are read and
 * written once per block: memory, or registers where the compiler can keep them); a pass over the
 * whole 64-output tile (RB 4 x NV vectors x 2) spilled to the stack on every ISA (593 stack
 * references in the AVX2 build's Q4_1 kernel). So the integer kernels run QNS vectors of the tile
 * and QRB rows per pass over one block: the block's weights (1-2 KB) come from L1 after the
 * first pass. Which vectors and rows share a pass never changes a sum. */
#if VW == 8 && defined(IDOT_VNNI)
#ifndef QNS
#define QNS 4 /* AVX-VNNI (int32 sums, no int16 ones beside them): 4 vectors x 2 rows a pass were 1.1-1.2x */
#endif
#ifndef QRB
#define QRB 2 /* faster at 16 rows than 2 x 4, 2 x 6 or 4 x 3 (bench/bench_kernels.py), as fast at 256 */
#endif
#elif VW == 8
#ifndef QNS
#define QNS 2 /* vectors per pass: a Q4_1 load's low and high nibbles (vectors c and c + NV/2) */
#endif
#else
#undef QNS
#define QNS NV /* AVX-512 (32 registers) and the portable path: the whole tile (faster there) */
#endif
#ifndef QRB
#define QRB 4 /* rows per pass (AVX2: 4 beat 2, 3, 6 and 8) */
#endif
#define QRG 16 /* rows whose fp32 sums [QRG][NV] a multi-row call keeps while it walks a tile's blocks */

#if defined(IDOT_MADD)
#define Q4_SUM16 1 /* Q4_1 block sums in int16 (one madd per block instead of one per 4 inputs) */
#else
#define Q4_SUM16 0
#endif

/* Block `blk` of one integer-kind tile for up to QRB rows (b ..) of the quantized x over QNS of
   its vectors (pass p: QNS / 2 loads' low and high nibbles, vectors p * QNS/2 .. and those + NV/2; all
   of them when ns is NV):
   the integer sums of the block, folded into the rows' fp32 sums acc[k][vector]:
     acc += (d * dx) * isum (+ m * sx)
   A row's sums fold block by block in block order, whatever the pass and the row group. */
static inline __attribute__((always_inline)) void block_q(int kind, const qact_t *qa, int nb, const char *wt,
                                                           const uint16_t *aux, vf acc[][NV], int64_t blk, int b,
                                                           int I, int p, const int ns, const int rb) {
    const int q4 = kind == W_Q4_1_Q8, nblk = I / QBLK;
    const int64_t gbytes = q4 ? TILE * GRP / 2 : TILE * GRP; /* bytes per group of 4 inputs */
    int vv[NV]; /* the tile vectors of this pass: ns / 2 loads' low and high nibbles (Q4_1) */
    for (int s = 0; s < ns; s++) vv[s] = ns == 1 ? p : p * (ns / 2) + s % (ns / 2) + (s / (ns / 2)) * (NV / 2);
    vi32 isum[QRB][NV];
    vp16 hsum[QRB][NV];
    for (int k = 0; k < rb; k++)
        for (int s = 0; s < ns; s++) isum[k][s] = (vi32){0}, hsum[k][s] = (vp16){0};
    for (int g = 0; g < QBLK / GRP; g++) {
        const char *wg = wt + (blk * (QBLK / GRP) + g) * gbytes;
        vi32 w[NV], aw[NV];
        for (int s = 0; s < ns; s++) {
            if (q4) {
                const vi32 raw = ld32(wg + (int64_t)(vv[s] % (NV / 2)) * VW * 4);
                w[s] = (vv[s] < NV / 2 ? raw : (vi32)((vu32)raw >> 4)) & 0x0F0F0F0F;
            } else {
                w[s] = ld32(wg + (int64_t)vv[s] * VW * 4);
                aw[s] = abs8(w[s]);
            }
        }
        const int8_t *xg = qa->q + (int64_t)b * I + blk * QBLK + g * GRP;
        for (int k = 0; k < rb; k++) {
            if (k >= nb) break;
            const vi32 xb = bcast4(xg + (int64_t)k * I);
            for (int s = 0; s < ns; s++) {
                if (q4 && Q4_SUM16) hsum[k][s] += maddubs16(w[s], xb);
                else isum[k][s] = q4 ? dot_us(isum[k][s], w[s], xb) : dot_ss(isum[k][s], w[s], aw[s], xb);
            }
        }
    }
    const uint16_t *bd = aux + blk * 2 * TILE;
    vf d[NV], m[NV];
    vi32 corr[NV];
    for (int s = 0; s < ns; s++) {
        d[s] = load_h(bd + vv[s] * VW);
        corr[s] = (vi32){0};
        if (q4) {
            m[s] = load_h(bd + TILE + vv[s] * VW);
        } else {
#if defined(IDOT_VNNI)
            vi16 ws; /* the block's sum of q */
            memcpy(&ws, bd + TILE + vv[s] * VW, sizeof ws);
            corr[s] = __builtin_convertvector(ws, vi32) * 128;
#endif
        }
    }
    for (int k = 0; k < rb; k++) {
        if (k >= nb) break;
        const int64_t row = (int64_t)(b + k) * nblk + blk;
        const vf dx = splat(qa->d[row]);
        for (int s = 0; s < ns; s++) {
            const vi32 sum = q4 ? (Q4_SUM16 ? widen16(hsum[k][s]) : isum[k][s]) : isum[k][s] - corr[s];
            vf a = vfma(i32_to_f(sum), d[s] * dx, acc[k][vv[s]]);
            if (q4) a = vfma(m[s], splat(qa->s[row]), a);
            acc[k][vv[s]] = a;
        }
    }
}

/* Rows b0 .. b0+nr-1 (nr <= QRG) of the quantized x over integer-kind tile t: the tile's blocks
   walked once, each block's passes (rb rows x ns vectors) in turn, the rows' fp32 sums kept
   across the walk. */
static inline __attribute__((always_inline)) void walk_q(int kind, const qact_t *qa, const char *wt,
                                                          const uint16_t *at, const float *r, float *y, int t,
                                                          int b0, int nr, int I, int O, const int ns,
                                                          const int rb) {
    const int pk = kind == W_Q4_1_Q8 ? W_Q4_1 : W_Q8_0; /* the same block layout for prefetching */
    vf acc[QRG][NV];
    for (int k = 0; k < nr; k++)
        for (int s = 0; s < NV; s++) acc[k][s] = (vf){0};
    for (int64_t blk = 0; blk < I / QBLK; blk++) {
        prefetch_blk(pk, wt, at, blk);
        for (int b = 0; b < nr; b += rb)
            for (int p = 0; p < NV / ns; p++)
                block_q(kind, qa, nr - b < rb ? nr - b : rb, wt, at, acc + b, blk, b0 + b, I, p, ns, rb);
    }
    for (int k = 0; k < nr; k++)
        for (int s = 0; s < NV; s++) store_vec(acc[k][s], NULL, r, y, b0 + k, t, s, O);
}

/* All rows of x over integer-kind tile t. One row (a decode step's GEMV): the whole tile per block,
   its sums in registers. More rows, several passes per block (AVX2): up to QRG rows at a time walk
   the tile's blocks once, so the weights stream from memory once per QRG rows while the passes
   compute; a walk per pass instead (each pass over the whole tile) left memory idle during the
   later ones (B = 4 cost 2.0x B = 1 streamed, the sum of its compute and its memory time). One
   pass per block (AVX-512, portable): QRB rows at a time walk the tile, their sums in registers
   (walking it once for QRG rows was no faster there). */
static inline __attribute__((always_inline)) void tile_all_q(int kind, const qact_t *qa, const void *Wp,
                                                              const uint16_t *aux, const float *r, float *y,
                                                              int t, int B, int I, int O) {
    const char *wt = (const char *)Wp + (int64_t)t * I * (kind == W_Q4_1_Q8 ? TILE / 2 : TILE);
    const uint16_t *at = aux + (int64_t)t * (I / QBLK) * 2 * TILE;
    if (B == 1)
        walk_q(kind, qa, wt, at, r, y, t, 0, 1, I, O, NV, 1);
    else if (QNS < NV)
        for (int b0 = 0; b0 < B; b0 += QRG) walk_q(kind, qa, wt, at, r, y, t, b0, B - b0 < QRG ? B - b0 : QRG, I, O, QNS, QRB);
    else
        for (int b0 = 0; b0 < B; b0 += QRB) walk_q(kind, qa, wt, at, r, y, t, b0, B - b0 < QRB ? B - b0 : QRB, I, O, NV, QRB);
}

static void tile_q4_1_q8(const float *x, const qact_t *qa, const void *Wp, float *buf, const void *aux,
                         const float *r, float *y, int t, int B, int I, int O) {
    (void)x, (void)buf;
    tile_all_q(W_Q4_1_Q8, qa, Wp, aux, r, y, t, B, I, O);
}
static void tile_q8_0_q8(const float *x, const qact_t *qa, const void *Wp, float *buf, const void *aux,
                         const float *r, float *y, int t, int B, int I, int O) {
    (void)x, (void)buf;
    tile_all_q(W_Q8_0_Q8, qa, Wp, aux, r, y, t, B, I, O);
}

static const tile_fn TILE_FNS[] = {tile_f32, tile_i8, tile_bf16, tile_q4_1, tile_q8_0, tile_q4_1_q8,
                                   tile_q8_0_q8}; /* by kind */

/* y = x W^T (+ r) as a worksharing loop: inside a parallel region the team shares the tiles
   (then waits at the loop's end); outside one, the calling thread does them all. `qa`: room for
   x's int8 quantization (integer kinds: quantized here, once per call). `sel` (NULL: every tile):
   only tiles sel[0..nsel) are computed, each to the same bits as in a call over all of them. */
typedef struct epi epi_t; /* what a layer's projection adds to each tile it computes (forward_f32) */
static void epi_tile(const epi_t *ep, float *y, int t, int64_t b0, int nb, int O);

static void gemv_sel_for(int kind, const float *x, const void *Wp, const void *aux, const float *r, float *y,
                         int B, int I, int O, qact_t *qa, const int32_t *sel, int nsel, const epi_t *ep) {
    const int tiles = sel ? nsel : (O + TILE - 1) / TILE;
    if (IS_INT_KIND(kind)) {
        quant_rows_for(x, B, I, qa); /* (the loop's end is a barrier) */
    } else if (ep) { /* the epilogue reads what the team wrote before the call */
        #pragma omp barrier
    }
    const int widen = kind != W_F32 && !IS_INT_KIND(kind) && B >= SCRATCH_B;
    float *buf = widen ? (float *)aligned_alloc(64, sizeof(float) * (size_t)I * TILE) : NULL;
    /* Many rows (prefill): work items of ROWS_CHUNK rows x one tile, so that the team shares the
       rows of a projection with few tiles (q|k|v 15, o 9: one thread idled at the end). A row's
       sums do not depend on the rows beside it. NOTE: the widened kinds (q4_1, q8_0, bf16, int8
       with fp32 activations) widen a tile once per item, not once per call (~1/32 more work). */
    const int chunks = B >= 2 * ROWS_CHUNK ? (B + ROWS_CHUNK - 1) / ROWS_CHUNK : 1;
    const int rows = chunks > 1 ? ROWS_CHUNK : B;
    #pragma omp for schedule(dynamic, 2)
    for (int e = 0; e < tiles * chunks; e++) {
        const int t = sel ? sel[e / chunks] : e / chunks, b0 = (e % chunks) * rows, nb = B - b0 < rows ? B - b0 : rows;
        qact_t qb = *qa;
        if (qa->q) qb.q += (int64_t)b0 * I, qb.d += (int64_t)b0 * (I / QBLK), qb.s += (int64_t)b0 * (I / QBLK);
        TILE_FNS[kind](x + (int64_t)b0 * I, &qb, Wp, buf, aux, r ? r + (int64_t)b0 * O : NULL, y + (int64_t)b0 * O,
                       t, nb, I, O);
        if (ep) epi_tile(ep, y, t, b0, nb, O);
    }
    free(buf);
}

static void gemv_for(int kind, const float *x, const void *Wp, const void *aux, const float *r, float *y,
                     int B, int I, int O, qact_t *qa) {
    gemv_sel_for(kind, x, Wp, aux, r, y, B, I, O, qa, NULL, 0, NULL);
}

static void gemv_any(int kind, const float *x, const void *Wp, const void *aux, const float *r, float *y,
                     int B, int I, int O, int threads) {
    qact_t qa = qact_alloc(IS_INT_KIND(kind) ? (int64_t)B * I : 0);
    #pragma omp parallel num_threads(threads)
    gemv_for(kind, x, Wp, aux, r, y, B, I, O, &qa);
    qact_free(&qa);
}

/* y [B, O] = x W^T over the output tiles sel[0..nsel) (64 outputs each) of a weight of kind `kind`
   (W_*); every other output is -inf. The LM head of a guided step whose grammar masks ban every
   token of the other tiles in every row (mask_tiles): the logits the masks leave are the same bits
   as a whole call's. */
void gemv_tiles(int kind, const float *x, const void *Wp, const void *aux, float *y, int B, int I, int O,
                const int32_t *sel, int nsel, int threads) {
    qact_t qa = qact_alloc(IS_INT_KIND(kind) ? (int64_t)B * I : 0);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < (int64_t)B * O; i++) y[i] = -INFINITY;
        gemv_sel_for(kind, x, Wp, aux, NULL, y, B, I, O, &qa, sel, nsel, NULL);
    }
    qact_free(&qa);
}

/* The output tiles (64 tokens each, of O) that mask rows rows[0..R) of words [*][W] (one bit a token)
   allow any token of, into sel (room for O / 64, ascending); -1 when a row has no mask (token_mask
   clear: every token allowed). */
int mask_tiles(const int32_t *words, int64_t W, const int32_t *token_mask, const int64_t *rows, int64_t R,
               int O, int32_t *sel) {
    for (int64_t r = 0; r < R; r++)
        if (!token_mask[rows[r]]) return -1;
    const int tiles = (O + TILE - 1) / TILE, wpt = TILE / 32;
    int n = 0;
    for (int t = 0; t < tiles; t++) {
        int any = 0;
        for (int64_t r = 0; r < R && !any; r++) {
            const int32_t *w = words + rows[r] * W;
            for (int k = t * wpt; k < (t + 1) * wpt && k < W; k++) any |= w[k] != 0;
        }
        if (any) sel[n++] = t;
    }
    return n;
}

void gemv_f32(const float *x, const float *Wp, const float *r, float *y, int B, int I, int O, int threads) {
    gemv_any(W_F32, x, Wp, NULL, r, y, B, I, O, threads);
}

/* Wp int8 [O/64, I, 64], scale [O]: y = scale[o] * (x . q[o]) (+ r). */
void gemv_i8(const float *x, const int8_t *Wp, const float *scale, const float *r, float *y,
             int B, int I, int O, int threads) {
    gemv_any(W_I8, x, Wp, scale, r, y, B, I, O, threads);
}

/* Wp bf16 bits [O/64, I, 64]. */
void gemv_bf16(const float *x, const uint16_t *Wp, const float *r, float *y, int B, int I, int O, int threads) {
    gemv_any(W_BF16, x, Wp, NULL, r, y, B, I, O, threads);
}

/* Wp Q4_1 nibbles [O/64, I, 32] uint8, dm [O/64, I/32, 2, 64] fp16 (d, m). */
void gemv_q4_1(const float *x, const uint8_t *Wp, const uint16_t *dm, const float *r, float *y,
               int B, int I, int O, int threads) {
    gemv_any(W_Q4_1, x, Wp, dm, r, y, B, I, O, threads);
}

/* Wp Q8_0 [O/64, I, 64] int8, d [O/64, I/32, 64] fp16. */
void gemv_q8_0(const float *x, const int8_t *Wp, const uint16_t *d, const float *r, float *y,
               int B, int I, int O, int threads) {
    gemv_any(W_Q8_0, x, Wp, d, r, y, B, I, O, threads);
}

/* Q4_1 weights x int8 activations: Wp [O/64, I/4, 32, 4] uint8, dm [O/64, I/32, 2, 64] fp16. */
void gemv_q4_1_q8(const float *x, const uint8_t *Wp, const uint16_t *dm, const float *r, float *y,
                  int B, int I, int O, int threads) {
    gemv_any(W_Q4_1_Q8, x, Wp, dm, r, y, B, I, O, threads);
}

/* Q8_0 weights x int8 activations: Wp [O/64, I/4, 64, 4] int8, aux [O/64, I/32, 2, 64] (d fp16, sum q int16). */
void gemv_q8_0_q8(const float *x, const int8_t *Wp, const uint16_t *aux, const float *r, float *y,
                  int B, int I, int O, int threads) {
    gemv_any(W_Q8_0_Q8, x, Wp, aux, r, y, B, I, O, threads);
}

/* Causal attention over the paged KV cache, for every query count: decode, verification and
 * prefill chunks alike.
 *   q    [B, T, nh, hd]      queries after RoPE
 *   kc   [blocks, kvh, hw, KB] this layer's key cache, KB positions a block (key_at; already
 *        holding the queries' own keys)
 *   vc   [blocks, kvh, KB, hw] both fp32, both fp16, or both int8 (kvk: KV_*; hw = kv_w(kvk, hd))
 *   table [slots, mb]        block ids: position j of row slot[b] is in block table[slot[b]][j / KB]
 *   slot [B], pos [B, T]     block-table row and absolute position of each query
 *   out  [B, T, nh, hd]
 * Query (b, t, h) attends to keys 0..pos[b, t] of its slot (only the last `window` of them when
 * window > 0: sliding-window layers), KV head h / (nh / kvh). Scores are q.k * scale, soft-capped
 * to softcap * tanh(s / softcap) when softcap > 0 (Gemma 2). hd % 16 == 0.
 *
 * NOTE: invariance. A tile is up to TQ queries (t, h) of one row b and one KV head, in (t, h) order.
 * For each query, whatever else shares the tile (other positions, heads, T, B, the chunk split):
 *   s_j = (sum over i ascending of q_i * k_ji, one FMA chain) * scale [then soft-capped]
 *   m = max_j s_j;  p_j = vexp(s_j - m);  l = sum over j ascending of p_j (one chain)
 *   o_i = (sum over j ascending of p_j * v_ji, one FMA chain) * (1 / l)
 * over its keys j = first..pos (int8 cache: k_ji, v_ji the stored q, s_j's sum times the key's scale
 * before `scale`, p_j times the value row's scale once l is summed). A tile runs over the union of its queries' keys; a key outside a
 * query's range gets s = -inf there, so p = 0 and the sums add exact zeros (keys within the tile's
 * range are real, finite cache rows: the tile's own keys or earlier ones). So the result of a query
 * is the same bits in a decode step, a verification step or any prefill chunk: a prompt's K/V and
 * outputs do not depend on how it was split into chunks (prefix caching reuses any prefix).
 * Speed: scores and probabilities with lanes over keys (each block of KB keys is a vector per dim:
 * a score costs hd / VW FMAs per key and query, however few queries a tile has: a decode step has
 * one per head), outputs with lanes over dims; each key and value row is read from memory once per
 * tile; exp is a polynomial in vector registers. */

/* exp(x) for x <= 88 (a score minus its query's max; SiLU's -g, capped): Cephes' expf polynomial
   on x - n ln2, times 2^n (about 1 ulp); 0 below -87 (and for -inf). */
static inline __attribute__((always_inline)) vf vexp(vf x) {
    const vi32 under = x < splat(-87.0f);
    x = vsel(under, splat(-87.0f), x);
    const vf t = vfma(x, splat(1.44269504088896341f), splat(12582912.0f)); /* 1.5 * 2^23: round to nearest */
    const vf n = t - 12582912.0f;
    const vi32 e = ((vi32)t - 0x4B400000 + 127) << 23; /* 2^n */
    vf r = vfma(n, splat(-0.693359375f), x);
    r = vfma(n, splat(2.12194440e-4f), r);
    vf p = splat(1.9875691500e-4f);
    p = vfma(p, r, splat(1.3981999507e-3f));
    p = vfma(p, r, splat(8.3334519073e-3f));
    p = vfma(p, r, splat(4.1665795894e-2f));
    p = vfma(p, r, splat(1.6666665459e-1f));
    p = vfma(p, r, splat(5.0000001201e-1f));
    p = vfma(p, r * r, r) + 1.0f;
    return (vf)(~under & (vi32)(p * (vf)e));
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) */
static inline __attribute__((always_inline)) vf vtanh(vf x) {
    const vi32 sign = (vi32)x & (vi32)splat(-0.0f);
    const vf e = vexp((vf)((vi32)x | (vi32)splat(-0.0f)) * 2.0f); /* -2|x| */
    return (vf)((vi32)((1.0f - e) / (1.0f + e)) | sign);
}

/* The key cache holds each KV head's keys in blocks of KB positions, dims outermost: [hw][KB], so
   KB keys' dim i are one vector (lanes over keys: decode). */
#define KB 16

/* What the KV cache holds (kvk): fp32; fp16 (half the bytes a decode step reads); or int8 with a
   scale per position and KV head (a quarter of them, plus the scale): q = round(x * 127 / max|x|)
   over the head's hd values, dequantized as q * (max|x| / 127). Each value is stored once, when
   written, and every later query reads the same stored values whatever the step, batch or chunk,
   so the invariance holds as with fp32. An int8 position takes hw = hd + KV_SB elements: its fp32
   scale follows its values (V: the row's last 4 bytes; K: byte m of a key's scale in row hd + m of
   its block, the key's column, so that copying a block's columns copies whole keys). */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };
#define KV_SB 4

static inline int kv_es(int kvk) { return kvk == KV_F16 ? 2 : kvk == KV_I8 ? 1 : 4; } /* bytes an element */
static inline int kv_w(int kvk, int hd) { return kvk == KV_I8 ? hd + KV_SB : hd; }   /* elements a position */

/* The caches are paged: a layer's keys [blocks][kvh][hw][KB] and values [blocks][kvh][KB][hw]; a
   sequence's position j lives in block tb[j / KB] of its row of the block table, column (keys) or
   row (values) j % KB. pages_t: that row, the elements a block takes (kvh * hw * KB) and its KV
   head's offset in a block (g * hw * KB). */
typedef struct {
    const int32_t *tb;
    int64_t bs, go;
} pages_t;

static inline __attribute__((always_inline)) pages_t pages(const int32_t *table, int mb, int64_t slot, int kvh,
                                                           int g, int hw) {
    return (pages_t){table + slot * mb, (int64_t)kvh * hw * KB, (int64_t)g * hw * KB};
}

/* Offset of key j's dim 0 in the key cache; dim i is at + i * KB. */
static inline __attribute__((always_inline)) int64_t key_at(pages_t pg, int64_t j) {
    return pg.tb[j / KB] * pg.bs + pg.go + j % KB;
}

/* Offset of value row j (hw elements) in the value cache. */
static inline __attribute__((always_inline)) int64_t val_at(pages_t pg, int64_t j, int hw) {
    return pg.tb[j / KB] * pg.bs + pg.go + (j % KB) * hw;
}

/* VW cached values from element idx, widened to fp32 (int8: the stored q, unscaled). */
static inline __attribute__((always_inline)) vf load_kv(const void *c, int64_t idx, int kvk) {
    return kvk == KV_I8 ? wload(c, idx, W_I8) : kvk == KV_F16 ? load_h((const uint16_t *)c + idx)
                                                               : load((const float *)c + idx);
}

/* The fp32 scales of the VW keys whose dim 0 is at element kv of an int8 key cache (hd dims). */
static inline __attribute__((always_inline)) vf key_scales(const void *K, int64_t kv, int hd) {
    vu32 u = (vu32){0};
    for (int m = 0; m < KV_SB; m++) {
        vu8 b;
        memcpy(&b, (const uint8_t *)K + kv + (int64_t)(hd + m) * KB, sizeof b);
        u |= __builtin_convertvector(b, vu32) << (8 * m);
    }
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One head's hd values x as int8 (quant_q8) into c at element idx, stride apart; their scale's
   bytes to idx + hd * stride, stride apart (a key's planes) or, stride 1, the 4 bytes after the
   values. A NaN or infinite value makes the position's scores or outputs NaN (quant_q8). */
static void store_q8(void *c, int64_t idx, int64_t stride, const float *x, int hd) {
    int8_t *q = (int8_t *)c;
    int sum;
    const float d = quant_q8(x, hd, q + idx, stride, &sum);
    uint8_t b[KV_SB];
    memcpy(b, &d, sizeof b);
    for (int m = 0; m < KV_SB; m++) q[idx + (int64_t)(hd + m) * stride] = (int8_t)b[m];
}

/* x into element idx of a cache: fp16 rounds to nearest even and saturates at +-65504 (NaN stays NaN). */
static inline __attribute__((always_inline)) void store_kv(void *c, int64_t idx, float x, int kvk) {
    if (kvk == KV_F32) {
        ((float *)c)[idx] = x;
        return;
    }
    x = x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x;
    const _Float16 h = (_Float16)x;
    memcpy((uint16_t *)c + idx, &h, sizeof h);
}

/* A tile's passes over its keys (attn_tile, below). */
#define TQ 16                   /* queries per tile (of one row b and KV head) */
#define QS (VW == 16 ? 6 : 4)   /* queries per scores pass (at most) */
#define SCV (VW == 16 ? 4 : 2)  /* key vectors per scores pass: QS x SCV FMA chains in flight */
#define QV (VW == 16 ? 12 : 4)  /* queries per values pass (at most) */
#define PFV KB                  /* value rows prefetched ahead: the next block's */

/* Per-thread scratch that grows as needed (OpenMP threads persist between calls). */
static __thread float *scratch_buf;
static __thread size_t scratch_cap;

static float *scratch(size_t floats) {
    if (floats > scratch_cap) {
        free(scratch_buf);
        scratch_cap = floats + floats / 2;
        scratch_buf = (float *)aligned_alloc(64, (scratch_cap * sizeof(float) + 63) / 64 * 64);
    }
    return scratch_buf;
}

/* Calls F(n) for n = qn, a constant in each case (1 <= qn <= 12): the passes below are compiled
   once per query count, so their accumulators stay in registers. */
#define BY_COUNT(qn, F)                                                                            \
    switch (qn) {                                                                                  \
    case 1: F(1); break; case 2: F(2); break; case 3: F(3); break; case 4: F(4); break;            \
    case 5: F(5); break; case 6: F(6); break; case 7: F(7); break; case 8: F(8); break;            \
    case 9: F(9); break; case 10: F(10); break; case 11: F(11); break; default: F(12); break;     \
    }

/* One scores pass: qn queries (qe) over keys k0s .. last + VW - 1, SCV vectors at a time; their
   masked scores to S [qn][nk] and their maxes to m [qn]. Past the last vector, a pass repeats the
   last one (computed, never stored). int8: ksc [key - k0s] the keys' scales (NULL: read here). */
static inline __attribute__((always_inline)) void scores_pass(
        const int qn, const float *const *qe, const void *K, pages_t pg, int kvk, int64_t k0s, int64_t last,
        int64_t nk, int hd, int hw, float scale, float softcap, const int32_t *lfirst, const int32_t *lpos, int prefetch,
        float *S, float *m, const float *ksc) {
    const vf ninf = splat(-INFINITY);
    const int es = kv_es(kvk);
    vi32 iota;
    for (int l = 0; l < VW; l++) iota[l] = l;
    vf mx[12];
    for (int e = 0; e < qn; e++) mx[e] = ninf;
    for (int64_t k0 = k0s; k0 <= last; k0 += SCV * VW) {
        int64_t kv[SCV];
        for (int c = 0; c < SCV; c++) kv[c] = key_at(pg, k0 + c * VW < last ? k0 + c * VW : last);
        /* NOTE: the blocks of the next pass's keys (short streams the hardware prefetchers do not
           ramp up on) requested ahead (a hint: it changes no result). AVX-512: a few lines a dim
           as the dims go (a burst of 128 stalled the loop); AVX2: all at once (spread, they cost
           more than they gained there) */
        const char *next[SCV * VW / KB + 1];
        int nnext = 0;
        if (prefetch)
            for (int64_t j = (k0 + SCV * VW) / KB * KB; j <= last && j < k0 + 2 * SCV * VW; j += KB)
                next[nnext++] = (const char *)K + (pg.tb[j / KB] * pg.bs + pg.go) * es;
        const int lines = hw * KB * es / 64; /* a block's */
#if VW != 16
        for (int b = 0; b < nnext; b++)
            for (int l = 0; l < lines; l++) __builtin_prefetch(next[b] + l * 64, 0, 3);
#endif
        vf acc[12][SCV];
        for (int e = 0; e < qn; e++)
            for (int c = 0; c < SCV; c++) acc[e][c] = (vf){0};
        for (int i = 0; i < hd; i++) {
#if VW == 16
            for (int b = 0; b < nnext; b++)
                for (int l = i * lines / hd; l < (i + 1) * lines / hd; l++) __builtin_prefetch(next[b] + l * 64, 0, 3);
#endif
            vf k[SCV];
            for (int c = 0; c < SCV; c++) k[c] = load_kv(K, kv[c] + (int64_t)i * KB, kvk);
            for (int e = 0; e < qn; e++) {
                const vf qi = splat(qe[e][i]);
                for (int c = 0; c < SCV; c++) acc[e][c] = vfma(qi, k[c], acc[e][c]);
            }
        }
        vf ks[SCV]; /* int8: the keys' scales (q.k = (q.kq) * scale_k) */
        for (int c = 0; c < SCV; c++)
            ks[c] = kvk != KV_I8 ? splat(1.0f) : ksc ? load(ksc + ((k0 + c * VW < last ? k0 + c * VW : last) - k0s))
                                                    : key_scales(K, kv[c], hd);
        for (int e = 0; e < qn; e++)
            for (int c = 0; c < SCV && k0 + c * VW <= last; c++) {
                vf x = (kvk == KV_I8 ? acc[e][c] * ks[c] : acc[e][c]) * scale;
                if (softcap > 0.0f) x = vtanh(x / softcap) * softcap;
                const vi32 key = iota + (int32_t)(k0 + c * VW);
                x = vsel((key >= lfirst[e]) & (key <= lpos[e]), x, ninf);
                mx[e] = vmax(mx[e], x);
                memcpy(S + (int64_t)e * nk + (k0 - k0s) + c * VW, &x, sizeof x);
            }
    }
    for (int e = 0; e < qn; e++) {
        float mm = -INFINITY;
        for (int l = 0; l < VW; l++) mm = mx[e][l] > mm ? mx[e][l] : mm;
        m[e] = mm;
    }
}

/* Masked scores S [ne][nk] of keys k0s .. k0s + nk - 1 (whole vectors; nk % VW == 0) and each
   query's max m [ne], QS queries per pass (the first prefetches; the keys are in cache after it).
   int8 with several passes: the keys' scales gathered into ksc [nk] once, not by every pass (4
   byte planes a key: prefill tiles of 16 queries took 1.18x the fp16 cache's time with them
   gathered per pass). One pass (decode) reads them as it goes: a pass of its own ahead of it
   waits on memory for the blocks' scale rows (8 decode streams 3-7% slower). */
static void scores_keys(const float *q, const int64_t *row, int ne, const void *K, pages_t pg, int kvk, int64_t k0s,
                        int64_t nk, int hd, int hw, float scale, float softcap, const int32_t *lfirst,
                        const int32_t *lpos, float *S, float *m, float *ksc) {
    const float *ks = NULL; /* the gathered scales, or NULL: each pass reads them */
    if (kvk == KV_I8 && ne > QS) { /* the keys' scales side by side, once a tile */
        for (int64_t j = 0; j < nk; j += VW) {
            const vf sc = key_scales(K, key_at(pg, k0s + j), hd);
            memcpy(ksc + j, &sc, sizeof sc);
        }
        ks = ksc;
    }
    for (int e0 = 0; e0 < ne; e0 += QS) {
        const int qn = ne - e0 < QS ? ne - e0 : QS;
        const float *qe[QS];
        for (int e = 0; e < qn; e++) qe[e] = q + row[e0 + e] * hd;
#define SCORES(n) scores_pass(n, qe, K, pg, kvk, k0s, k0s + nk - VW, nk, hd, hw, scale, softcap, lfirst + e0, lpos + e0, \
                              e0 == 0, S + (int64_t)e0 * nk, m + e0, ks)
        BY_COUNT(qn, SCORES)
#undef SCORES
    }
}

/* One values pass: qn queries' outputs, dims c0 * VW .. (ch vectors); P [qn][n] (row stride ps)
   their probabilities of keys jmin .. jmin + n - 1, inv [qn] 1 / their sums. */
static inline __attribute__((always_inline)) void values_pass(
        const int qn, const int ch, const float *P, int64_t ps, const float *inv, const void *V, pages_t pg, int kvk,
        int64_t jmin, int64_t n, int hd, int c0, int prefetch, const int64_t *row, float *out) {
    const int es = kv_es(kvk), hw = kv_w(kvk, hd);
    vf o[12][4];
    for (int e = 0; e < qn; e++)
        for (int c = 0; c < ch; c++) o[e][c] = (vf){0};
    for (int64_t j = 0; j < n;) { /* the rows of one block at a time */
        const int64_t p = jmin + j, seg = KB - p % KB < n - j ? KB - p % KB : n - j;
        int64_t vr = val_at(pg, p, hw) + (int64_t)c0 * VW;
        /* NOTE: rows PFV (a block) ahead requested on a tile's first pass (a hint) */
        const char *pf = prefetch && p / KB < (jmin + n - 1) / KB ? (const char *)V + val_at(pg, p + PFV, hw) * es
                                                                   : NULL;
        for (int64_t r = 0; r < seg; r++, j++, vr += hw) {
            if (pf)
                for (int b = 0; b < hw * es; b += 64) __builtin_prefetch(pf + r * hw * es + b, 0, 3);
            vf v[4];
            for (int c = 0; c < ch; c++) v[c] = load_kv(V, vr + c * VW, kvk);
            for (int e = 0; e < qn; e++) {
                const vf pj = splat(P[e * ps + j]);
                for (int c = 0; c < ch; c++) o[e][c] = vfma(pj, v[c], o[e][c]);
            }
        }
    }
    for (int e = 0; e < qn; e++)
        for (int c = 0; c < ch; c++) {
            const vf y = o[e][c] * inv[e];
            memcpy(out + row[e] * hd + (c0 + c) * VW, &y, sizeof y);
        }
}

/* values_pass with ch (4, 2 or 1) a constant in each call. */
static inline __attribute__((always_inline)) void values_any(
        const int qn, int ch, const float *P, int64_t ps, const float *inv, const void *V, pages_t pg, int kvk,
        int64_t jmin, int64_t n, int hd, int c0, int prefetch, const int64_t *row, float *out) {
    if (ch == 4) values_pass(qn, 4, P, ps, inv, V, pg, kvk, jmin, n, hd, c0, prefetch, row, out);
    else if (ch == 2) values_pass(qn, 2, P, ps, inv, V, pg, kvk, jmin, n, hd, c0, prefetch, row, out);
    else values_pass(qn, 1, P, ps, inv, V, pg, kvk, jmin, n, hd, c0, prefetch, row, out);
}

/* Outputs of the tile's queries with lanes over dims: up to QV queries per pass, 4 output vectors
   a pass for up to QV / 2 queries (a whole row of a 64-dim head with AVX-512), else 2 (or 1). */
static void values_dims(const float *P, int64_t ps, const float *inv, const void *V, pages_t pg, int kvk, int64_t jmin,
                        int64_t n, int hd, int ne, const int64_t *row, float *out) {
    const int nv = hd / VW;
    for (int e0 = 0; e0 < ne; e0 += QV) {
        const int qn = ne - e0 < QV ? ne - e0 : QV, ch = qn <= QV / 2 && nv % 4 == 0 ? 4 : nv % 2 == 0 ? 2 : 1;
        for (int c0 = 0; c0 < nv; c0 += ch) {
#define VALUES(k) values_any(k, ch, P + (int64_t)e0 * ps, ps, inv + e0, V, pg, kvk, jmin, n, hd, c0, \
                             e0 == 0 && c0 == 0, row + e0, out)
            BY_COUNT(qn, VALUES)
#undef VALUES
        }
    }
}

/* One tile: queries e0 .. e0+ne-1 (ne <= TQ) of row b (its tokens: flat rows r0 ..), KV head g
   (query e: t = e / group, head g * group + e % group): scores, probabilities, outputs. */
static void attn_tile(const float *q, const void *kc, const void *vc, int kvk, const int32_t *table, int mb,
                      const int64_t *slot, const int64_t *pos, float *out, int b, int g, int e0, int ne, int64_t r0,
                      int nh, int kvh, int hd, float scale, int window, float softcap) {
    const int group = nh / kvh;
    int32_t lpos[TQ], lfirst[TQ];
    int64_t row[TQ]; /* (b, t, h) index of each query */
    int64_t jmin = INT64_MAX, jmax = -1;
    for (int l = 0; l < ne; l++) {
        const int e = e0 + l, t = e / group, h = g * group + e % group;
        const int64_t p = pos[r0 + t], f = window > 0 && p + 1 > window ? p + 1 - window : 0;
        lpos[l] = (int32_t)p;
        lfirst[l] = (int32_t)f;
        row[l] = (r0 + t) * nh + h;
        if (f < jmin) jmin = f;
        if (p > jmax) jmax = p;
    }
    const int hw = kv_w(kvk, hd), es = kv_es(kvk);
    const pages_t pg = pages(table, mb, slot[b], kvh, g, hw);
    /* keys k0s .. k0s + nk - 1: the tile's range in whole vectors */
    const int64_t k0s = jmin / VW * VW, nk = jmax / VW * VW + VW - k0s, n = jmax - jmin + 1, off = jmin - k0s;
    float *P = scratch((size_t)(ne + 1) * nk); /* [ne][nk]: scores, then probabilities (+ int8: [nk] value scales) */
    float m[TQ], inv[TQ];
    scores_keys(q, row, ne, kc, pg, kvk, k0s, nk, hd, hw, scale, softcap, lfirst, lpos, P, m,
                P + (int64_t)ne * nk);
    /* l = sum_j p_j: lane i sums keys k0s + i, + VW, ... in order (key j in lane j % VW: the same
       lane whatever the tile, and a masked key adds an exact 0), then the lanes in order */
    for (int e = 0; e < ne; e++) {
        const vf me = splat(m[e]);
        vf sum = (vf){0};
        for (int64_t v = 0; v < nk; v += VW) {
            const vf p = vexp(load(P + e * nk + v) - me);
            memcpy(P + e * nk + v, &p, sizeof p);
            sum += p;
        }
        inv[e] = 1.0f / sum_lanes(sum);
    }
    if (kvk == KV_I8) { /* p v = (p scale_v) vq: each row's scale into its probabilities, once, in
                           vectors (a query at a time: each row's scale is read once, into vs) */
        float *vs = P + (int64_t)ne * nk; /* [n]: the rows' scales side by side */
        for (int64_t j = 0; j < n; j++)
            memcpy(vs + j, (const int8_t *)vc + val_at(pg, jmin + j, hw) * es + hd, sizeof *vs);
        for (int e = 0; e < ne; e++) {
            float *pe = P + e * nk + off;
            int64_t j = 0;
            for (; j + VW <= n; j += VW) {
                const vf x = load(pe + j) * load(vs + j);
                memcpy(pe + j, &x, sizeof x);
            }
            for (; j < n; j++) pe[j] *= vs[j];
        }
    }
    values_dims(P + off, nk, inv, vc, pg, kvk, jmin, n, hd, ne, row, out);
}

/* Row b's first token: rows of T tokens (seg NULL), or of seg[b + 1] - seg[b] (varlen: seg [B + 1]
   the rows' starts in the flat token order, seg[B] the tokens in all). */
static inline int64_t row_start(const int64_t *seg, int b, int T) { return seg ? seg[b] : (int64_t)b * T; }

/* The row of flat token n: the last b with row_start(b) <= n. */
static inline int row_of(const int64_t *seg, int B, int T, int64_t n) {
    if (!seg) return (int)(n / T);
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (seg[mid] <= n) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Attention of every query as a worksharing loop (see gemv_for). Rows of any length (seg): a
   tile never spans two rows, so a query's tile, and its result, is the one it has alone. */
static void attn_for(const float *q, const void *kc, const void *vc, int kvk, const int32_t *table, int mb,
                     const int64_t *slot, const int64_t *pos, const int64_t *seg, float *out, int B, int T, int nh,
                     int kvh, int hd, float scale, int window, float softcap) {
    const int group = nh / kvh;
    int64_t first[B + 1]; /* row b's first work item (kvh x its tiles) */
    first[0] = 0;
    for (int b = 0; b < B; b++) {
        const int64_t per = (row_start(seg, b + 1, T) - row_start(seg, b, T)) * group;
        first[b + 1] = first[b] + kvh * ((per + TQ - 1) / TQ);
    }
    /* per row and KV head, the last tiles (the most keys) first, so the dynamic schedule ends balanced */
    #pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < first[B]; w++) {
        int lo = 0, hi = B - 1; /* the row of item w */
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (first[mid] <= w) lo = mid; else hi = mid - 1;
        }
        const int b = lo;
        const int64_t r0 = row_start(seg, b, T), per = (row_start(seg, b + 1, T) - r0) * group;
        const int64_t tiles = (first[b + 1] - first[b]) / kvh, rem = w - first[b];
        const int g = (int)(rem / tiles), k = (int)(tiles - 1 - rem % tiles);
        const int e0 = k * TQ, ne = per - e0 < TQ ? (int)(per - e0) : TQ;
        attn_tile(q, kc, vc, kvk, table, mb, slot, pos, out, b, g, e0, ne, r0, nh, kvh, hd, scale, window, softcap);
    }
}

#define MAX_HD 512 /* the longest head rope_write_for takes (kernels.MAX_HEAD_DIM) */

/* VW floats to fp16 at p, as store_kv stores each (nearest even, saturated, NaN stays NaN). */
static inline __attribute__((always_inline)) void store_h(uint16_t *p, vf x) {
    x = vsel(x > splat(65504.0f), splat(65504.0f), vsel(x < splat(-65504.0f), splat(-65504.0f), x));
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__) && defined(__F16C__)
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int l = 0; l < VW; l++) store_kv(p, l, x[l], 1);
#endif
}

/* dst = x * c + roll(x, hd / 2) * s over one head (the same products and sum per dim, in vectors
   when half a head is whole vectors). */
static inline __attribute__((always_inline)) void rope_head(const float *x, const float *c, const float *s,
                                                             float *dst, int hd) {
    const int half = hd / 2;
    if (half % VW == 0) {
        for (int i = 0; i < hd; i += VW) {
            const vf y = load(x + i) * load(c + i) + load(x + (i + half) % hd) * load(s + i);
            memcpy(dst + i, &y, sizeof y);
        }
    } else {
        for (int i = 0; i < hd; i++) dst[i] = x[i] * c[i] + x[(i + half) % hd] * s[i];
    }
}

/* RoPE on q (into qrot) and k, K and V written into the paged cache at their positions: a
   worksharing loop (see gemv_for). */
static void rope_write_for(const float *qkv, const float *cos_t, const float *sin_t, void *kc, void *vc, int kvk,
                           const int32_t *table, int mb, const int64_t *slot, const int64_t *pos,
                           const int64_t *seg, float *qrot, int B, int T, int nh, int kvh, int hd) {
    const int H = nh + 2 * kvh, hw = kv_w(kvk, hd);
    /* NOTE: contiguous tokens a thread (static): a block of KB keys shares its cache lines (the dims lie
       KB apart), so tokens dealt out in turns had both threads writing the same lines */
    #pragma omp for schedule(static)
    for (int64_t bt = 0; bt < row_start(seg, B, T); bt++) {
        const int b = row_of(seg, B, T, bt);
        const int64_t p = pos[bt];
        const float *c = cos_t + p * hd, *s = sin_t + p * hd;
        const float *row = qkv + bt * H * hd;
        for (int h = 0; h < nh; h++) rope_head(row + (int64_t)h * hd, c, s, qrot + (bt * nh + h) * hd, hd);
        float kr[MAX_HD]; /* one rotated key */
        for (int g = 0; g < kvh; g++) { /* keys to their block of the cache (dims KB apart), values to their row */
            const float *v = row + (int64_t)(nh + kvh + g) * hd;
            const pages_t pg = pages(table, mb, slot[b], kvh, g, hw);
            const int64_t kat = key_at(pg, p), vat = val_at(pg, p, hw);
            rope_head(row + (int64_t)(nh + g) * hd, c, s, kr, hd);
            if (kvk == KV_I8) {
                store_q8(kc, kat, KB, kr, hd);
                store_q8(vc, vat, 1, v, hd);
                continue;
            }
            for (int i = 0; i < hd; i++) store_kv(kc, kat + (int64_t)i * KB, kr[i], kvk);
            if (kvk == KV_F16 && hd % VW == 0)
                for (int i = 0; i < hd; i += VW) store_h((uint16_t *)vc + vat + i, load(v + i));
            else
                for (int i = 0; i < hd; i++) store_kv(vc, vat + i, v[i], kvk);
        }
    }
}

/* Fused attention block: RoPE on q and k, K/V written into the paged cache, causal attention - one
 * call per layer instead of ~10 torch ops.
 *   qkv  [B, T, nh + 2 kvh, hd]  the fused projection (q heads, k heads, v heads); varlen (seg: see
 *                                row_start): [seg[B], nh + 2 kvh, hd], row b's tokens seg[b] ..
 *   cos, sin [P, hd]             RoPE tables; sin carries the rotate_half sign (-sin | +sin)
 *   qrot [B, T, nh, hd]          scratch for the rotated queries
 * RoPE: x * cos + roll(x, hd / 2) * sin, as the torch path computes it. */
void rope_attn_f32(const float *qkv, const float *cos_t, const float *sin_t, void *kc, void *vc, int kvk,
                   const int32_t *table, int mb, const int64_t *slot, const int64_t *pos, const int64_t *seg,
                   float *qrot, float *out, int B, int T, int nh, int kvh, int hd, float scale, int window,
                   float softcap, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        /* every key written before any query reads the cache: the loop's end is a barrier */
        rope_write_for(qkv, cos_t, sin_t, kc, vc, kvk, table, mb, slot, pos, seg, qrot, B, T, nh, kvh, hd);
        attn_for(qrot, kc, vc, kvk, table, mb, slot, pos, seg, out, B, T, nh, kvh, hd, scale, window, softcap);
    }
}

/* ---- Decoder layers in one call ------------------------------------------------------------
 * A whole forward of the Llama-family decoder stack (models/llama.py) in one parallel region:
 * per layer, RMSNorm, q|k|v (+ bias) [, q/k norms], RoPE + cache write + attention, o + residual
 * [sandwich norm], RMSNorm, gate|up, act(gate) * up, down + residual [sandwich norm]. The Python
 * path did ~15 calls a layer (ctypes, torch ops, allocations): at batch 1 those cost as much as
 * streaming the weights. Every step is per row (RMSNorm, activation) or one of the batch-invariant
 * kernels above, so a row's result still never depends on the batch, T or the thread count. */
enum { P_QKV = 0, P_O = 1, P_GATE_UP = 2, P_DOWN = 3 };

typedef struct {
    const void *w[4];   /* packed weights (qkv, o, gate_up, down) */
    const void *aux[4]; /* their scales (int8: fp32 [O]; q4_1 / q8_0: fp16 blocks) or NULL */
    int kind[4];        /* W_F32 .. W_Q8_0 */
    int local;          /* sliding-window layer: `window` keys, the local RoPE tables */
    const float *qkv_bias, *in_norm, *post_norm, *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm; /* or NULL */
} layer_t;

/* LoRA adapters (models/lora.py): y += B (s A x) for each token whose cache row is bound to an
   adapter. A projection's adapter is up to 3 pieces (q|k|v, gate|up: one per output range), each
   A [r, in] and B^T [r, len] in tiles of outputs ([ceil(len / LORA_TILE), r, LORA_TILE], zero-padded)
   (fp32, bf16 or int8: `kind`; int8 with a scale per row, sa / sb [r]), scale s; its ranks summed
   are the token's t. */
#define LORA_TILE 64 /* models/lora.py B_TILE */
typedef struct {
    const void *a, *b;
    const float *sa, *sb;
    float scale;
    int r, off, len, kind;
} lora_piece_t;

typedef struct {
    lora_piece_t piece[3];
    int n;
} lora_proj_t;

typedef struct {
    const lora_proj_t *proj; /* [adapters][layers][4] (P_QKV .. P_DOWN); n 0: none for that projection */
    const int32_t *of_row;   /* [cache rows]: the adapter bound to the row, or -1 */
    int adapters, layers, rmax; /* rmax: the largest summed rank of any projection */
} lora_t;

/* The tokens of one forward grouped by adapter: tokens tok[start[g] .. start[g + 1]) use adapter
   ad[g] (rows sharing an adapter read its weights once a step). */
typedef struct {
    int n;                  /* groups */
    int32_t *ad;            /* [n] */
    int64_t *start, *tok;   /* [n + 1], [N] */
    int32_t *of_tok;        /* [N] each token's adapter, or -1 */
} lora_groups_t;

typedef struct {
    int hidden, inter, nh, kvh, hd, mb, window, act; /* act: 0 silu, 1 gelu (tanh); mb: the block table's columns */
    float eps, scale, softcap;
    const float *cos, *sin, *cos_local, *sin_local; /* RoPE tables [P, hd] */
    void *kc, *vc;         /* this stack's caches [layers, blocks, kvh, ..] (pages_t) */
    const int32_t *table;  /* [slots, mb] block ids: row slot[b] is the forward's row b's */
    int64_t layer_stride;  /* elements from one layer's cache to the next */
    int kvk;               /* what the caches hold (KV_*) */
    const float *final_norm; /* [hidden]: the model's norm after the last layer (NULL: none) */
    const lora_t *lora;      /* adapters of the rows (NULL: none) */
} stack_t;

/* y = x * rsqrt(mean(x^2) + eps) * w over one row of D (y may be x). */
static inline void rms_row(const float *x, const float *w, float *y, int D, float eps) {
    vf acc = (vf){0}; /* lane l: x[l]^2 + x[l + VW]^2 + ... in order, then the lanes in order */
    int i = 0;
    for (; i + VW <= D; i += VW) {
        const vf v = load(x + i);
        acc += v * v;
    }
    float ss = sum_lanes(acc);
    for (; i < D; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int i = 0; i < D; i++) y[i] = (x[i] * r) * w[i];
}

/* rms_row over N rows of D. */
static void rms_rows_for(const float *x, const float *w, float *y, int64_t N, int D, float eps) {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) rms_row(x + n * D, w, y + n * D, D, eps);
}

/* act(g) * u for VW inputs (h[n, j] = act(gu[n, j]) * gu[n, inter + j]): SiLU g / (1 + exp(-g))
   with vexp's polynomial (-g capped at 88: exp(88) is finite, and g / (1 + e) is then ~0 as it
   should be), or GELU's tanh form. */
static inline __attribute__((always_inline)) vf act_mul(vf g, vf u, int act) {
    if (act == 1)
        return 0.5f * g * (1.0f + vtanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    const vf x = -g;
    return g / (1.0f + vexp(vsel(x > splat(88.0f), splat(88.0f), x))) * u;
}

static void act_mul_for(const float *gu, float *h, int64_t N, int inter, int act) {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *g = gu + n * 2 * inter, *u = g + inter;
        float *hr = h + n * inter;
        int j = 0;
        for (; j + VW <= inter; j += VW) {
            const vf v = act_mul(load(g + j), load(u + j), act);
            memcpy(hr + j, &v, sizeof v);
        }
        if (j < inter) { /* the last few through the same vector code */
            float gt[VW] = {0}, ut[VW] = {0};
            memcpy(gt, g + j, sizeof(float) * (size_t)(inter - j));
            memcpy(ut, u + j, sizeof(float) * (size_t)(inter - j));
            const vf v = act_mul(load(gt), load(ut), act);
            memcpy(hr + j, &v, sizeof(float) * (size_t)(inter - j));
        }
    }
}

static void add_rows_for(float *y, const float *a, int64_t N, int D) { /* y += a */
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int i = 0; i < D; i++) y[n * D + i] += a[n * D + i];
}

/* w[i] as fp32 (w of `kind`: W_F32, W_BF16 or W_I8). */
static inline float wval(const void *w, int64_t i, int kind) {
    if (kind == W_I8) return (float)((const int8_t *)w)[i];
    if (kind != W_BF16) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

#if VW == 16
#define LM 4 /* tokens that share each weight vector loaded (the adapters' products; registers: AVX-512 32) */
#else
#define LM 2
#endif

/* out[j] = sum w[i] x[j][i] for j < m (w of `kind`: W_F32, W_BF16 or W_I8), each in a fixed order
   (4 partial sums over the vectors, their lanes in order, then the tail): the same bits whatever
   m, the token's neighbours or the thread. One load of w serves the m rows. */
static inline __attribute__((always_inline)) void dots_w(const void *w, const int kind, const float *const *x, int n,
                                                         float *out, const int m) {
    vf a[LM][4];
    for (int j = 0; j < m; j++) a[j][0] = a[j][1] = a[j][2] = a[j][3] = (vf){0};
    int i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        const vf w0 = wload(w, i, kind), w1 = wload(w, i + VW, kind), w2 = wload(w, i + 2 * VW, kind),
                 w3 = wload(w, i + 3 * VW, kind);
        for (int j = 0; j < m; j++) {
            a[j][0] += w0 * load(x[j] + i);
            a[j][1] += w1 * load(x[j] + i + VW);
            a[j][2] += w2 * load(x[j] + i + 2 * VW);
            a[j][3] += w3 * load(x[j] + i + 3 * VW);
        }
    }
    for (; i + VW <= n; i += VW) {
        const vf w0 = wload(w, i, kind);
        for (int j = 0; j < m; j++) a[j][0] += w0 * load(x[j] + i);
    }
    for (int j = 0; j < m; j++) {
        float sj = sum_lanes((a[j][0] + a[j][1]) + (a[j][2] + a[j][3]));
        for (int q = i; q < n; q++) sj += wval(w, q, kind) * x[j][q];
        out[j] = sj;
    }
}

#define DOTS_W_CASE(K, M) case (K) * 8 + (M): dots_w(w, K, x, n, out, M); break;
#if LM == 4
#define DOTS_W_KIND(K) DOTS_W_CASE(K, 1) DOTS_W_CASE(K, 2) DOTS_W_CASE(K, 3) DOTS_W_CASE(K, 4)
#else
#define DOTS_W_KIND(K) DOTS_W_CASE(K, 1) DOTS_W_CASE(K, 2)
#endif
static void dots_w_any(const void *w, int kind, const float *const *x, int n, float *out, int m) {
    switch (kind * 8 + m) { /* the kind and count as constants: wload's branch and the loops resolved */
        DOTS_W_KIND(W_F32) DOTS_W_KIND(W_I8) DOTS_W_KIND(W_BF16)
    }
}

/* The low-rank half of projection p of layer li: t [N, rmax] = s A x [N, I] (times B^T's row
   scales, int8) for each group's tokens (each element one thread's dot: batch- and thread-invariant). NOTE: no barrier at its
   end: the projection's tile loop reads t after the barrier it starts with (gemv_sel_for). */
static void lora_low_for(const lora_t *lo, const lora_groups_t *gr, int li, int p, const float *x, float *t, int I) {
    if (!lo) return;
    const int R = lo->rmax;
    int rp = 0; /* this projection's largest summed rank over the groups' adapters: the units that have work */
    for (int g = 0; g < gr->n; g++) {
        const lora_proj_t *pr = &lo->proj[((int64_t)gr->ad[g] * lo->layers + li) * 4 + p];
        int r = 0;
        for (int i = 0; i < pr->n; i++) r += pr->piece[i].r;
        rp = r > rp ? r : rp;
    }
    #pragma omp for schedule(static) nowait
    for (int64_t e = 0; e < (int64_t)gr->n * rp; e++) { /* the pieces' ranks one after another */
        const int g = (int)(e / rp);
        int k = (int)(e % rp);
        const lora_proj_t *pr = &lo->proj[((int64_t)gr->ad[g] * lo->layers + li) * 4 + p];
        for (int i = 0; i < pr->n; k -= pr->piece[i].r, i++) {
            const lora_piece_t *pc = &pr->piece[i];
            if (k >= pc->r) continue;
            const void *row = (const char *)pc->a + (size_t)k * I * wsize(pc->kind);
            for (int64_t j0 = gr->start[g]; j0 < gr->start[g + 1]; j0 += LM) {
                const int m = gr->start[g + 1] - j0 < LM ? (int)(gr->start[g + 1] - j0) : LM;
                const float *xs[LM];
                float d[LM];
                for (int j = 0; j < m; j++) xs[j] = x + gr->tok[j0 + j] * I;
                dots_w_any(row, pc->kind, xs, I, d, m);
                for (int j = 0; j < m; j++) { /* with int8 B^T's row scale: lora_out's */
                    const float v = pc->scale * (pc->sa ? pc->sa[k] * d[j] : d[j]);
                    t[gr->tok[j0 + j] * R + (e % rp)] = pc->sb ? v * pc->sb[k] : v;
                }
            }
            break;
        }
    }
}

static inline void store_add(float *p, vf a) { /* p[0 .. VW) += a */
    const vf v = load(p) + a;
    memcpy(p, &v, sizeof v);
}

/* ys[j] [a, b) += B^T[:, a - off .. b - off]^T ts[j] for j < m tokens of one piece's adapter (ts:
   lora_low_for's t, int8 row scales in it):
   output o sums t[k] B^T[k, o] over k in order, in registers, whatever the vector width or m (one
   load of B^T serves the m tokens). B^T is held in tiles of LORA_TILE outputs ([tiles, r, LORA_TILE]:
   a tile's weights one stream); [a, b) is split where a tile ends. */
static inline __attribute__((always_inline)) void lora_out(const lora_piece_t *pc, const int kind,
                                                           const float *const *ts, float *const *ys, int a, int b,
                                                           const int m) {
    const void *bt = pc->b;
    for (int s0 = a, s1; s0 < b; s0 = s1) {
        const int tile = (s0 - pc->off) / LORA_TILE;
        s1 = pc->off + (tile + 1) * LORA_TILE < b ? pc->off + (tile + 1) * LORA_TILE : b;
        const int64_t base = (int64_t)tile * pc->r * LORA_TILE - tile * LORA_TILE - pc->off; /* + k LORA_TILE + o */
        for (int o = s0; o < s1;) {
            const int nv = s1 - o >= 4 * VW ? 4 : s1 - o >= VW ? 1 : 0, step = nv ? nv * VW : s1 - o;
            if (nv == 4) {
                vf acc[LM][4];
                for (int j = 0; j < m; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = (vf){0};
                for (int k = 0; k < pc->r; k++) {
                    const int64_t row = base + (int64_t)k * LORA_TILE + o;
                    const vf w0 = wload(bt, row, kind), w1 = wload(bt, row + VW, kind),
                             w2 = wload(bt, row + 2 * VW, kind), w3 = wload(bt, row + 3 * VW, kind);
                    for (int j = 0; j < m; j++) {
                        const vf tk = splat(ts[j][k]);
                        acc[j][0] += tk * w0, acc[j][1] += tk * w1, acc[j][2] += tk * w2, acc[j][3] += tk * w3;
                    }
                }
                for (int j = 0; j < m; j++)
                    for (int v = 0; v < 4; v++) store_add(ys[j] + o + v * VW, acc[j][v]);
            } else {
                for (int j = 0; j < m; j++) {
                    if (nv) {
                        vf a0 = (vf){0};
                        for (int k = 0; k < pc->r; k++)
                            a0 += splat(ts[j][k]) * wload(bt, base + (int64_t)k * LORA_TILE + o, kind);
                        store_add(ys[j] + o, a0);
                    } else {
                        for (int q = o; q < s1; q++) {
                            float acc = 0.0f;
                            for (int k = 0; k < pc->r; k++)
                                acc += ts[j][k] * wval(bt, base + (int64_t)k * LORA_TILE + q, kind);
                            ys[j][q] += acc;
                        }
                    }
                }
            }
            o += step;
        }
    }
}

#define LORA_OUT_CASE(K, M) case (K) * 8 + (M): lora_out(pc, K, ts, ys, a, b, M); break;
#if LM == 4
#define LORA_OUT_KIND(K) LORA_OUT_CASE(K, 1) LORA_OUT_CASE(K, 2) LORA_OUT_CASE(K, 3) LORA_OUT_CASE(K, 4)
#else
#define LORA_OUT_KIND(K) LORA_OUT_CASE(K, 1) LORA_OUT_CASE(K, 2)
#endif
static void lora_out_any(const lora_piece_t *pc, const float *const *ts, float *const *ys, int a, int b, int m) {
    switch (pc->kind * 8 + m) {
        LORA_OUT_KIND(W_F32) LORA_OUT_KIND(W_I8) LORA_OUT_KIND(W_BF16)
    }
}

struct epi {
    const float *bias;     /* [O] or NULL */
    const lora_t *lo;      /* NULL: no adapters in this forward */
    const int32_t *ad;     /* [N] each token's adapter, or -1 */
    float *t;              /* [N, rmax] lora_low_for's */
    int li, p;             /* layer, projection */
};

/* Tile t (outputs t * TILE ..) of tokens b0 .. b0 + nb - 1 of a projection, after its products:
   y += bias, then y += B t for the token's adapter (the order the torch path adds them in). Rows
   without an adapter keep their bits. */
static void epi_tile(const epi_t *ep, float *y, int t, int64_t b0, int nb, int O) {
    const int o0 = t * TILE, o1 = o0 + TILE < O ? o0 + TILE : O;
    const lora_t *lo = ep->lo;
    if (ep->bias)
        for (int64_t n = b0; n < b0 + nb; n++)
            for (int o = o0; o < o1; o++) y[n * O + o] += ep->bias[o];
    if (!lo) return;
    _Static_assert(2 * ROWS_CHUNK <= 64, "a work item's rows fit the mask");
    uint64_t done = 0; /* the item's tokens done (nb < 2 * ROWS_CHUNK) */
    for (int i = 0; i < nb; i++) {
        const int32_t ad = ep->ad[b0 + i];
        if (ad < 0 || (done >> i & 1)) continue;
        int64_t tok[LM];
        int m = 0;
        for (int j = i; j < nb && m < LM; j++) /* up to LM of the tile's tokens with this adapter */
            if (ep->ad[b0 + j] == ad && !(done >> j & 1)) done |= 1ull << j, tok[m++] = b0 + j;
        const lora_proj_t *pr = &lo->proj[((int64_t)ad * lo->layers + ep->li) * 4 + ep->p];
        for (int q = 0, roff = 0; q < pr->n; roff += pr->piece[q].r, q++) {
            const lora_piece_t *pc = &pr->piece[q];
            const int a = o0 > pc->off ? o0 : pc->off, b = o1 < pc->off + pc->len ? o1 : pc->off + pc->len;
            if (a >= b) continue;
            const float *ts[LM];
            float *ys[LM];
            for (int j = 0; j < m; j++) ts[j] = ep->t + tok[j] * lo->rmax + roff, ys[j] = y + tok[j] * O;
            lora_out_any(pc, ts, ys, a, b, m);
        }
    }
}

/* The tokens of rows slot[b] grouped by their adapters (counting sort, in token order within a
   group); n 0 when no token has one. */
static lora_groups_t lora_groups(const lora_t *lo, const int64_t *slot, const int64_t *seg, int B, int T, int64_t N) {
    lora_groups_t gr = {0, NULL, NULL, NULL, NULL};
    int64_t *count = (int64_t *)calloc((size_t)lo->adapters + 1, sizeof(int64_t));
    int32_t *ad = (int32_t *)malloc(sizeof(int32_t) * (size_t)(N ? N : 1));
    for (int b = 0; b < B; b++)
        for (int64_t n = row_start(seg, b, T); n < row_start(seg, b + 1, T); n++) {
            const int32_t a = lo->of_row[slot[b]];
            ad[n] = a >= 0 && a < lo->adapters ? a : -1;
            if (ad[n] >= 0) count[ad[n]]++;
        }
    for (int a = 0; a < lo->adapters; a++) gr.n += count[a] > 0;
    if (gr.n) {
        gr.ad = (int32_t *)malloc(sizeof(int32_t) * (size_t)gr.n);
        gr.start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(gr.n + 1));
        gr.tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)N);
        int64_t *at = (int64_t *)malloc(sizeof(int64_t) * (size_t)lo->adapters);
        int g = 0;
        gr.start[0] = 0;
        for (int a = 0; a < lo->adapters; a++)
            if (count[a]) {
                gr.ad[g] = a;
                at[a] = gr.start[g];
                gr.start[g + 1] = gr.start[g] + count[a];
                g++;
            }
        for (int64_t n = 0; n < N; n++)
            if (ad[n] >= 0) gr.tok[at[ad[n]]++] = n;
        free(at);
    }
    free(count);
    gr.of_tok = ad;
    return gr;
}

/* y = W x (+ r) of projection p, then its epilogue ep (NULL: none): the adapters' low-rank half
   first, then their output half and the bias as each tile is computed. */
static void proj_for(const layer_t *l, int p, const float *x, const float *r, float *y, int64_t N, int I, int O,
                     qact_t *qa, const lora_groups_t *gr, const epi_t *ep) {
    if (ep) lora_low_for(ep->lo, gr, ep->li, p, x, ep->t, I);
    gemv_sel_for(l->kind[p], x, l->w[p], l->aux[p], r, y, (int)N, I, O, qa, NULL, 0, ep);
}

/* The residual stream y += W x (+ the token's adapter's B A x: ep), or with a sandwich norm
   y += norm(W x + B A x) (tmp: scratch [N, O]). */
static void proj_add_for(const layer_t *l, int p, const float *x, float *y, float *tmp, const float *out_norm,
                         int64_t N, int I, int O, float eps, qact_t *qa, const lora_groups_t *gr, const epi_t *ep) {
    if (out_norm) {
        proj_for(l, p, x, NULL, tmp, N, I, O, qa, gr, ep);
        rms_rows_for(tmp, out_norm, tmp, N, O, eps);
        add_rows_for(y, tmp, N, O);
    } else { /* NOTE: (y + W x) + B A x: rows without an adapter keep their bits */
        proj_for(l, p, x, y, y, N, I, O, qa, gr, ep);
    }
}

/* x [B, T, hidden] (the residual stream, updated in place) through layers L[0..nl) at positions
   pos [B, T] of cache rows slot [B], then the final norm (c->final_norm) in place. Varlen (seg
   [B + 1], see row_start): x [seg[B], hidden], pos [seg[B]]. */
void forward_f32(const layer_t *L, int nl, const stack_t *c, float *x, const int64_t *slot, const int64_t *pos,
                 const int64_t *seg, int B, int T, int threads) {
    const int64_t N = row_start(seg, B, T);
    const int H = c->nh + 2 * c->kvh, D = c->hidden, Q = c->nh * c->hd;
    const int64_t need = N * ((int64_t)D * 2 + (int64_t)H * c->hd + 2 * (int64_t)Q + 3 * (int64_t)c->inter);
    float *work = (float *)malloc(sizeof(float) * (size_t)need);
    float *xn = work, *tmp = xn + N * D, *qkv = tmp + N * D, *qrot = qkv + N * H * c->hd, *att = qrot + N * Q;
    float *gu = att + N * Q, *h = gu + N * 2 * c->inter;
    const int widest = D > Q ? (D > c->inter ? D : c->inter) : (Q > c->inter ? Q : c->inter);
    qact_t qa = qact_alloc(N * widest); /* x quantized for the integer kinds (any projection's input) */
    const lora_t *lo = c->lora;
    lora_groups_t gr = {0, NULL, NULL, NULL, NULL};
    float *lt = NULL; /* [N, rmax] the adapters' low-rank inputs */
    if (lo) {
        gr = lora_groups(lo, slot, seg, B, T, N);
        if (gr.n) lt = (float *)malloc(sizeof(float) * (size_t)(N * lo->rmax));
        else lo = NULL;
    }
    #pragma omp parallel num_threads(threads)
    for (int li = 0; li < nl; li++) {
        const layer_t *l = &L[li];
        const int64_t at = li * c->layer_stride * kv_es(c->kvk); /* bytes */
        void *kc = (char *)c->kc + at, *vc = (char *)c->vc + at;
        const epi_t eq = {l->qkv_bias, lo, gr.of_tok, lt, li, P_QKV}, eo = {NULL, lo, gr.of_tok, lt, li, P_O},
                    eg = {NULL, lo, gr.of_tok, lt, li, P_GATE_UP}, ed = {NULL, lo, gr.of_tok, lt, li, P_DOWN};
        rms_rows_for(x, l->in_norm, xn, N, D, c->eps);
        proj_for(l, P_QKV, xn, NULL, qkv, N, D, H * c->hd, &qa, &gr, l->qkv_bias || lo ? &eq : NULL);
        if (l->q_norm) {  /* per head, before RoPE (Qwen3, Gemma 3) */
            #pragma omp for schedule(static)
            for (int64_t e = 0; e < N * (c->nh + c->kvh); e++) {
                const int64_t n = e / (c->nh + c->kvh);
                const int hh = (int)(e % (c->nh + c->kvh));
                float *row = qkv + (n * H + hh) * c->hd;
                rms_row(row, hh < c->nh ? l->q_norm : l->k_norm, row, c->hd, c->eps);
            }
        }
        const float *cs = l->local ? c->cos_local : c->cos, *sn = l->local ? c->sin_local : c->sin;
        rope_write_for(qkv, cs, sn, kc, vc, c->kvk, c->table, c->mb, slot, pos, seg, qrot, B, T, c->nh, c->kvh,
                       c->hd);
        attn_for(qrot, kc, vc, c->kvk, c->table, c->mb, slot, pos, seg, att, B, T, c->nh, c->kvh, c->hd,
                 c->scale, l->local ? c->window : 0, c->softcap);
        proj_add_for(l, P_O, att, x, tmp, l->attn_out_norm, N, Q, D, c->eps, &qa, &gr, lo ? &eo : NULL);
        rms_rows_for(x, l->post_norm, xn, N, D, c->eps);
        proj_for(l, P_GATE_UP, xn, NULL, gu, N, D, 2 * c->inter, &qa, &gr, lo ? &eg : NULL);
        act_mul_for(gu, h, N, c->inter, c->act);
        proj_add_for(l, P_DOWN, h, x, tmp, l->mlp_out_norm, N, c->inter, D, c->eps, &qa, &gr, lo ? &ed : NULL);
    }
    if (c->final_norm) rms_rows_for(x, c->final_norm, x, N, D, c->eps);
    free(gr.ad);
    free(gr.start);
    free(gr.tok);
    free(gr.of_tok);
    free(lt);
    free(work);
    qact_free(&qa);
}

/* Grammar masks (guided/decoder.py `mask_logits`), in place: logits [R][Vp] get -inf where mask
   row rows[r] of words [*][W] (one bit a token, little-endian in int32 words) has the token's bit
   clear, in the rows whose token_mask[rows[r]] is set; without d2t, ids >= vocab too. d2t [Vp]
   (NULL: column j is token j) maps a drafter's pruned vocabulary to token ids. The same -inf the
   torch path writes. */
void mask_logits_rows(float *logits, int64_t R, int64_t Vp, const int32_t *words, int64_t W,
                      const int32_t *token_mask, const int64_t *rows, int64_t vocab, const int64_t *d2t) {
    for (int64_t r = 0; r < R; r++) {
        const int64_t mr = rows[r];
        if (!token_mask[mr]) continue;
        const uint32_t *w = (const uint32_t *)words + mr * W;
        float *y = logits + r * Vp;
        if (d2t) {
            for (int64_t j = 0; j < Vp; j++) {
                const int64_t t = d2t[j];
                if (!((w[t >> 5] >> (t & 31)) & 1u)) y[j] = -INFINITY;
            }
            continue;
        }
        const int64_t V = Vp < vocab ? Vp : vocab;
        int64_t j = 0;
        for (; j + 32 <= V; j += 32) {
            const uint32_t b = w[j >> 5];
            if (b == 0xFFFFFFFFu) continue;
            for (int l = 0; l < 32; l++)
                if (!((b >> l) & 1u)) y[j + l] = -INFINITY;
        }
        for (; j < V; j++)
            if (!((w[j >> 5] >> (j & 31)) & 1u)) y[j] = -INFINITY;
        for (; j < Vp; j++) y[j] = -INFINITY;
    }
}

/* Per row of x [R][V]: idx[r] = the index of its first maximum, a NaN counting as the maximum (its
   first index), as torch.argmax; bad[r] (when not NULL) = the row holds a NaN or +inf. A scan of
   the row in vectors (max and NaN lanes), then of its first V entries up to the index. */
void argmax_rows(const float *x, int64_t R, int64_t V, int64_t *idx, uint8_t *bad) {
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * V;
        vf mx = splat(-INFINITY);
        vi32 nan = (vi32){0};
        int64_t j = 0;
        for (; j + VW <= V; j += VW) {
            const vf v = load(row + j);
            nan |= v != v;
            mx = vmax(mx, v);
        }
        float m = -INFINITY;
        int has_nan = 0;
        for (int l = 0; l < VW; l++) {
            m = mx[l] > m ? mx[l] : m;
            has_nan |= nan[l] != 0;
        }
        for (; j < V; j++) {
            has_nan |= row[j] != row[j];
            m = row[j] > m ? row[j] : m;
        }
        int64_t at = 0;
        if (has_nan) {
            while (row[at] == row[at]) at++;
        } else {
            while (row[at] != m) at++;
        }
        idx[r] = at;
        if (bad) bad[r] = (uint8_t)(has_nan || m == INFINITY);
    }
}

/* A greedy step's tail over logits [B][T][V] (masked; T - 1 drafts a row): the target's token at
   each position is its argmax (argmax_rows); accepted[b] = the length of the prefix of drafts
   (drafts[b * ds_b + k * ds_k], k < num[b]) equal to those tokens; next[b] = the token after it, or
   bad_token when any of the row's T positions holds a NaN or +inf (acceptance.verify, then
   step.nonfinite_rows, in one pass over the logits). drafts / num may be NULL when T == 1. */
void greedy_verify_rows(const float *logits, int64_t B, int64_t T, int64_t V, const int64_t *drafts, int64_t ds_b,
                        int64_t ds_k, const int64_t *num, int64_t *accepted, int64_t *next, int64_t bad_token) {
    for (int64_t b = 0; b < B; b++) {
        int64_t a = 0, nxt = 0, tok;
        int bad = 0, matching = 1;
        for (int64_t t = 0; t < T; t++) {
            uint8_t nf;
            argmax_rows(logits + (b * T + t) * V, 1, V, &tok, &nf);
            bad |= nf;
            if (matching) {
                if (t < T - 1 && t < num[b] && drafts[b * ds_b + t * ds_k] == tok) {
                    a++;
                } else {
                    nxt = tok;
                    matching = 0;
                }
            }
        }
        accepted[b] = a;
        next[b] = bad ? bad_token : nxt;
    }
}

/* A drafter's token per row of its masked logits [B][V]: the argmax (argmax_rows), mapped by d2t
   (a pruned vocabulary) when given. With proposals (the hybrid): fixed[b] when >= 0 (grammar-forced,
   trusted n-gram), else fallback[b] when >= 0 and the drafter is unsure, its top probability
   1 / sum exp(l - max) below `unsure` (a row with a NaN or no finite logit is not unsure: torch's
   softmax gives NaN there). out[b] and out2[b] (the device and host rows of the step's drafts). */
void draft_pick_rows(const float *logits, int64_t B, int64_t V, const int64_t *d2t, const int64_t *fixed,
                     const int64_t *fallback, float unsure, int64_t *out, int64_t *out2) {
    for (int64_t b = 0; b < B; b++) {
        const float *row = logits + b * V;
        int64_t at;
        argmax_rows(row, 1, V, &at, NULL);
        int64_t tok = d2t ? d2t[at] : at;
        if (fixed && fixed[b] >= 0) {
            tok = fixed[b];
        } else if (fallback && fallback[b] >= 0) {
            const float m = row[at];
            if (m == m && m > -INFINITY && m < INFINITY) {
                const vf mv = splat(m);
                vf acc = splat(0.0f);
                int64_t j = 0;
                for (; j + VW <= V; j += VW) acc += vexp(load(row + j) - mv);
                float sum = sum_lanes(acc);
                for (; j < V; j++) sum += expf(row[j] - m);
                if (sum == sum && 1.0f / sum < unsure) tok = fallback[b];
            }
        }
        out[b] = tok;
        if (out2) out2[b] = tok;
    }
}

/* dst [R][D] rows at[n] = src [N][D] rows (fp32; a forward's features to their positions' rows of a
   paged store): an index_put without torch's temporaries. Returns 0, or -1 with nothing written
   when a row is outside [0, R). */
int scatter_rows(float *dst, int64_t R, const float *src, const int64_t *at, int64_t N, int64_t D) {
    for (int64_t n = 0; n < N; n++)
        if (at[n] < 0 || at[n] >= R) return -1;
    for (int64_t n = 0; n < N; n++) memcpy(dst + at[n] * D, src + n * D, sizeof(float) * (size_t)D);
    return 0;
}

/* One Q8_0 row: y [D] = q [D] int8 times d [D/32] fp16, a block of 32 each (q * d in fp32). */
static inline void q8_row(const int8_t *q, const uint16_t *d, float *y, int D) {
    for (int b = 0; b < D / 32; b++) {
        const float db = half_to_float(d[b]);
        for (int i = b * 32; i < b * 32 + 32; i++) y[i] = (float)q[i] * db;
    }
}

/* out [N][D] = Q8_0 rows ids of Q [V][D] int8, Qd [V][D/32] fp16 (an embedding lookup: Q8Rows).
   Returns 0, or -1 with nothing written when an id is out of range. */
int q8_rows(const int8_t *Q, const uint16_t *Qd, int64_t V, const int64_t *ids, float *out, int64_t N, int D) {
    for (int64_t n = 0; n < N; n++)
        if (ids[n] < 0 || ids[n] >= V) return -1;
    for (int64_t n = 0; n < N; n++) q8_row(Q + ids[n] * D, Qd + ids[n] * (D / 32), out + n * D, D);
    return 0;
}

/* The draft head's input rows: out [N][2D] = [feats[n] ; rms_row(E[ids[n]], w)] (its features and its
   token's normed embedding, one call instead of the embedding, the norm and the concatenation). The
   embedding is E [V][D] fp32, or (E NULL) Q8_0 rows: Q [V][D] int8 times Qd [V][D/32] fp16 per block
   of 32 (each value q * d in fp32: the fp32 table's bits). With `at`, feats is a store [R][D] and
   row n reads its row at[n].
   Returns 0, or -1 with nothing written when a row or id is out of range. */
int head_inputs(const float *feats, const int64_t *at, int64_t R, const float *E, const int8_t *Q, const uint16_t *Qd,
                int64_t V, const int64_t *ids, const float *w, float *out, int64_t N, int D, float eps) {
    for (int64_t n = 0; n < N; n++)
        if (ids[n] < 0 || ids[n] >= V || (at && (at[n] < 0 || at[n] >= R))) return -1;
    for (int64_t n = 0; n < N; n++) {
        const int64_t f = at ? at[n] : n;
        float *e = out + n * 2 * D + D;
        memcpy(out + n * 2 * D, feats + f * D, sizeof(float) * (size_t)D);
        if (E) {
            rms_row(E + ids[n] * D, w, e, D, eps);
            continue;
        }
        q8_row(Q + ids[n] * D, Qd + ids[n] * (D / 32), e, D);
        rms_row(e, w, e, D, eps);
    }
    return 0;
}

/* out [B][D] = src [B][T][D] at row (b, at[b]): a batch's one row each. Returns 0, or -1 with nothing
   written when an at[b] is outside [0, T). */
int pick_rows(const float *src, const int64_t *at, float *out, int64_t B, int64_t T, int64_t D) {
    for (int64_t b = 0; b < B; b++)
        if (at[b] < 0 || at[b] >= T) return -1;
    for (int64_t b = 0; b < B; b++) memcpy(out + b * D, src + (b * T + at[b]) * D, sizeof(float) * (size_t)D);
    return 0;
}

/* y [N][D] = the RMS norm of x's rows with weight w (rms_row: the layer stack's own), one thread. */
void rms_norm_rows(const float *x, const float *w, float *y, int64_t N, int D, float eps) {
    for (int64_t n = 0; n < N; n++) rms_row(x + n * D, w, y + n * D, D, eps);
}
