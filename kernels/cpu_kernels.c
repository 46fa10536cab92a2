/* The CPU kernels of the decode path (x86-64 with AVX2 and FMA), built by kernels/cpu.py.
 *
 * Why C and not torch: a decode step of a small model is ~150 matrix-vector products and ~250
 * small element-wise ops. Through torch each op costs a dispatch (5-10 us) and the fp32 GEMV
 * reads its weights at half the machine's bandwidth; quantized weights have no fast torch kernel
 * for fp32 activations on AVX2. Here a linear layer reads the GGUF blocks themselves (4 or 8 bits
 * a weight instead of 32) and each op is one call.
 *
 * Numerics: activations stay fp32 and every product is accumulated in fp32, so the result is the
 * same math as dequantizing the weights to fp32 and calling a BLAS, up to the order of the sums.
 *
 * Threads: OpenMP, with the thread count passed by the caller (torch's, so one setting rules both).
 *
 * Weight formats (ggml's block layouts, 32 weights a block, rows of K/32 blocks):
 *   Q4_0 (2): fp16 d, 16 bytes of nibbles;          w = (q - 8) * d
 *   Q4_1 (3): fp16 d, fp16 m, 16 bytes of nibbles;  w = q * d + m
 *   Q8_0 (8): fp16 d, 32 int8;                      w = q * d
 * In a nibble block, byte j holds weight j (low nibble) and weight j + 16 (high nibble).
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8 };

/* Weight rows dequantized together; x rows multiplied against them together. */
#define NT 4
#define MT 2
/* Rows of x per pass over the weights: a pass's x (MB * K floats) stays in L2. */
#define MB 64

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 u8x8_to_float(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

static inline __m256 i8x8_to_float(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

int tri_block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q8_0: return 34;
    default: return 0;
    }
}

/* One row of K weights (K a multiple of 32) -> fp32. */
static void dequant_row(int fmt, const uint8_t *row, int K, float *out) {
    const int nb = K / 32;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    if (fmt == FMT_Q4_1 || fmt == FMT_Q4_0) {
        const int bytes = fmt == FMT_Q4_1 ? 20 : 18;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * bytes;
            const float dv = half_to_float(blk);
            const __m256 d = _mm256_set1_ps(dv);
            const __m256 m = _mm256_set1_ps(fmt == FMT_Q4_1 ? half_to_float(blk + 2) : -8.0f * dv);
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + bytes - 16));
            const __m128i lo = _mm_and_si128(q, low4);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
            float *o = out + b * 32;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(u8x8_to_float(lo), d, m));
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(u8x8_to_float(_mm_srli_si128(lo, 8)), d, m));
            _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(u8x8_to_float(hi), d, m));
            _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(u8x8_to_float(_mm_srli_si128(hi, 8)), d, m));
        }
    } else if (fmt == FMT_Q8_0) {
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            const __m256 d = _mm256_set1_ps(half_to_float(blk));
            float *o = out + b * 32;
            for (int j = 0; j < 4; j++) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * j));
                _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(i8x8_to_float(q), d));
            }
        }
    }
}

/* y[m, n0 + t] for t < NT and m in [m0, m1): x rows times the NT dequantized rows in w. */
static void tile(const float *x, int ldx, int m0, int m1, int K, const float *w, int nt,
                 const float *bias, float *y, int ldy, int n0) {
    int m = m0;
    if (nt == NT) {
        for (; m + MT <= m1; m += MT) {
            const float *x0 = x + (size_t)m * ldx, *x1 = x0 + ldx;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
            __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
            for (int k = 0; k < K; k += 8) {
                const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
                const __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
                const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
                a00 = _mm256_fmadd_ps(w0, v0, a00); a01 = _mm256_fmadd_ps(w1, v0, a01);
                a02 = _mm256_fmadd_ps(w2, v0, a02); a03 = _mm256_fmadd_ps(w3, v0, a03);
                a10 = _mm256_fmadd_ps(w0, v1, a10); a11 = _mm256_fmadd_ps(w1, v1, a11);
                a12 = _mm256_fmadd_ps(w2, v1, a12); a13 = _mm256_fmadd_ps(w3, v1, a13);
            }
            float *y0 = y + (size_t)m * ldy + n0, *y1 = y0 + ldy;
            y0[0] = hsum(a00); y0[1] = hsum(a01); y0[2] = hsum(a02); y0[3] = hsum(a03);
            y1[0] = hsum(a10); y1[1] = hsum(a11); y1[2] = hsum(a12); y1[3] = hsum(a13);
            if (bias) {
                for (int t = 0; t < NT; t++) { y0[t] += bias[n0 + t]; y1[t] += bias[n0 + t]; }
            }
        }
    }
    for (; m < m1; m++) {  /* the last odd row, or every row of a short tile */
        const float *xr = x + (size_t)m * ldx;
        for (int t = 0; t < nt; t++) {
            const float *wr = w + (size_t)t * K;
            __m256 a = _mm256_setzero_ps();
            for (int k = 0; k < K; k += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(xr + k), a);
            y[(size_t)m * ldy + n0 + t] = hsum(a) + (bias ? bias[n0 + t] : 0.0f);
        }
    }
}

/* Rows of x below this many go through dot_row (weights unpacked in registers, used once);
 * from it on, through tile (each weight dequantized once into L1, used by MT rows at a time). */
#define FEW_ROWS 4

/* The 8 floats of a block's weights [8j, 8j + 8) as their integer codes (0..15 or -128..127). */
static inline void block_codes(int fmt, const uint8_t *blk, __m256 f[4]) {
    if (fmt == FMT_Q8_0) {
        for (int j = 0; j < 4; j++)
            f[j] = i8x8_to_float(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * j)));
        return;
    }
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (fmt == FMT_Q4_1 ? 4 : 2)));
    const __m128i lo = _mm_and_si128(q, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    f[0] = u8x8_to_float(lo);
    f[1] = u8x8_to_float(_mm_srli_si128(lo, 8));
    f[2] = u8x8_to_float(hi);
    f[3] = u8x8_to_float(_mm_srli_si128(hi, 8));
}

/* dot(w_row, x) for one block-format row: sum over blocks of d * dot(codes, x_b) + m * sum(x_b),
 * where m is Q4_1's minimum, -8d for Q4_0 and 0 for Q8_0; ``xsum`` holds sum(x_b) per block. */
static float dot_row(int fmt, const uint8_t *row, const float *x, const float *xsum, int nb) {
    const int bytes = tri_block_bytes(fmt);
    __m256 acc = _mm256_setzero_ps();
    float macc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bytes;
        const float *xb = x + b * 32;
        __m256 f[4];
        block_codes(fmt, blk, f);
        __m256 s = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), s);
        const float d = half_to_float(blk);
        acc = _mm256_fmadd_ps(s, _mm256_set1_ps(d), acc);
        if (fmt == FMT_Q4_1) macc += half_to_float(blk + 2) * xsum[b];
        else if (fmt == FMT_Q4_0) macc -= 8.0f * d * xsum[b];
    }
    return hsum(acc) + macc;
}

static void block_sums(const float *x, int K, float *out) {
    for (int b = 0; b < K / 32; b++) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += x[b * 32 + i];
        out[b] = s;
    }
}

/* The int16-activation variant (opt-in; not exact, relative error ~5e-5): each 32-block of x is
 * rounded to int16 with its own scale, so a block's dot product is integer multiply-adds of
 * the weights' codes widened to int16 (madd: 16 products and 8 sums in one instruction)
 * instead of 32 int-to-float conversions and FMAs. The weights' offset term (Q4_1's m, Q4_0's
 * -8d) uses the exact float sums of x. */
static void quantize_row_q16(const float *x, int K, int16_t *qx, float *dx) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            if (a > amax) amax = a;
        }
        const float d = amax / 32767.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) qx[b * 32 + i] = (int16_t)lrintf(xb[i] * id);
        dx[b] = d;
    }
}

static float dot_row_q16(int fmt, const uint8_t *row, const int16_t *qx, const float *dx,
                         const float *xs, int nb) {
    const int bytes = tri_block_bytes(fmt);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    float macc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bytes;
        const int16_t *xb = qx + b * 32;
        __m256i w0, w1;
        if (fmt == FMT_Q8_0) {
            w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
            w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + bytes - 16));
            w0 = _mm256_cvtepu8_epi16(_mm_and_si128(q, low4));
            w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low4));
        }
        const __m256i p = _mm256_add_epi32(
            _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xb)),
            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xb + 16))));
        const float d = half_to_float(blk);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[b]), acc);
        if (fmt == FMT_Q4_1) macc += half_to_float(blk + 2) * xs[b];
        else if (fmt == FMT_Q4_0) macc -= 8.0f * d * xs[b];
    }
    return hsum(acc) + macc;
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M < FEW_ROWS: exact (dot_row), or with x rounded to
 * int16 first (dot_row_q16). Both need the float sums of x's blocks. */
static void linear_few_rows(int fmt, const float *x, int M, int K, const uint8_t *w,
                            size_t row_bytes, int N, const float *bias, float *y,
                            int int16_activations, int nthreads) {
    const int nb = K / 32;
    float *xsum = malloc((size_t)M * nb * sizeof(float));
    int16_t *qx = int16_activations ? aligned_alloc(64, (size_t)M * K * 2 + 64) : NULL;
    float *dx = int16_activations ? malloc((size_t)M * nb * sizeof(float)) : NULL;
    for (int m = 0; m < M; m++) {
        block_sums(x + (size_t)m * K, K, xsum + (size_t)m * nb);
        if (qx) quantize_row_q16(x + (size_t)m * K, K, qx + (size_t)m * K, dx + (size_t)m * nb);
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int m = 0; m < M; m++) {
            const float *xs = xsum + (size_t)m * nb;
            const float dot = qx ? dot_row_q16(fmt, row, qx + (size_t)m * K, dx + (size_t)m * nb, xs, nb)
                                 : dot_row(fmt, row, x + (size_t)m * K, xs, nb);
            y[(size_t)m * N + n] = dot + (bias ? bias[n] : 0.0f);
        }
    }
    free(xsum);
    free(qx);
    free(dx);
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias). W's rows are ``row_bytes`` apart, in ``fmt``.
 * K must be a multiple of 32. With ``int16_activations``, fewer than FEW_ROWS rows of x go
 * through the int16 variant. Returns 0, or -1 on a bad argument. */
int tri_linear(int fmt, const float *x, int M, int K, const uint8_t *w, size_t row_bytes, int N,
               const float *bias, float *y, int int16_activations, int nthreads) {
    if (K % 32 != 0 || tri_block_bytes(fmt) == 0)
        return -1;
    if (M < FEW_ROWS) {
        linear_few_rows(fmt, x, M, K, w, row_bytes, N, bias, y, int16_activations, nthreads);
        return 0;
    }
    const int tiles = (N + NT - 1) / NT;
    #pragma omp parallel num_threads(nthreads)
    {
        float *buf = aligned_alloc(64, (size_t)NT * K * sizeof(float));
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int m1 = m0 + MB < M ? m0 + MB : M;
            #pragma omp for schedule(static) nowait
            for (int ti = 0; ti < tiles; ti++) {
                const int n0 = ti * NT;
                const int nt = N - n0 < NT ? N - n0 : NT;
                for (int t = 0; t < nt; t++)
                    dequant_row(fmt, w + (size_t)(n0 + t) * row_bytes, K, buf + (size_t)t * K);
                tile(x, K, m0, m1, K, buf, nt, bias, y, N, n0);
            }
        }
        free(buf);
    }
    return 0;
}

/* Rows of one GGUF tensor -> fp32 (the embedding lookup of quantized tables). */
void tri_dequant_rows(int fmt, const uint8_t *w, size_t row_bytes, const int64_t *rows, int n,
                      int K, float *out) {
    for (int i = 0; i < n; i++)
        dequant_row(fmt, w + (size_t)rows[i] * row_bytes, K, out + (size_t)i * K);
}

/* RMSNorm over rows of H: y = w * v / sqrt(mean(v^2) + eps), where v = x, or with
 * ``residual``, v = x + residual, also written to ``sum`` (the next layer's residual). */
void tri_rms_norm(const float *x, const float *residual, float *sum, const float *w, int M, int H,
                  float eps, float *y, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 8)
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * H;
        const float *v = xr;
        if (residual) {
            const float *r = residual + (size_t)m * H;
            float *s = sum + (size_t)m * H;
            for (int i = 0; i < H; i++) s[i] = xr[i] + r[i];
            v = s;
        }
        float ss = 0.0f;
        for (int i = 0; i < H; i++) ss += v[i] * v[i];
        const float inv = 1.0f / sqrtf(ss / H + eps);
        float *yr = y + (size_t)m * H;
        for (int i = 0; i < H; i++) yr[i] = w[i] * (v[i] * inv);
    }
}

/* silu(gate) * up for x = [M, 2I] holding cat(gate, up) -> y [M, I]. */
void tri_silu_and_mul(const float *x, int M, int I, float *y, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 8)
    for (int m = 0; m < M; m++) {
        const float *g = x + (size_t)m * 2 * I, *u = g + I;
        float *o = y + (size_t)m * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Neox rotary embedding in place on q [T, Hq, D] and k [T, Hkv, D] (rows ``q_stride`` and
 * ``k_stride`` floats apart per token), then k and v [T, Hkv, D] (v rows ``v_stride`` apart)
 * stored into their cache slots: cache [num_slots, Hkv, D]. cos_sin: [max_pos, D] = cat(cos, sin). */
void tri_rope_store(float *q, int q_stride, float *k, int k_stride, const float *v, int v_stride,
                    const int64_t *positions, const int64_t *slots, int T, int Hq, int Hkv, int D,
                    const float *cos_sin, float *k_cache, float *v_cache) {
    const int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *cs = cos_sin + (size_t)positions[t] * D;
        for (int h = 0; h < Hq + Hkv; h++) {
            float *x = h < Hq ? q + (size_t)t * q_stride + h * D : k + (size_t)t * k_stride + (h - Hq) * D;
            for (int i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half], c = cs[i], s = cs[i + half];
                x[i] = x1 * c - x2 * s;
                x[i + half] = x2 * c + x1 * s;
            }
        }
        const size_t slot = (size_t)slots[t] * Hkv * D;
        memcpy(k_cache + slot, k + (size_t)t * k_stride, (size_t)Hkv * D * sizeof(float));
        memcpy(v_cache + slot, v + (size_t)t * v_stride, (size_t)Hkv * D * sizeof(float));
    }
}

/* Decode attention over the paged cache, read in place (no gathered copy).
 * q: [B, Hq, D] (rows ``q_stride`` floats apart per sequence); cache: [pages, S, Hkv, D];
 * page_table: [B, max_pages]; seq_lens: [B]; out: [B, Hq, D]; D a multiple of 8.
 * One work item per sequence: its pages are read in address order, every KV head of a token
 * together (they are adjacent), and a head's keys and values stay in L2 for its G = Hq / Hkv
 * query heads; with fewer than two sequences per thread, one per (sequence, query head). Scores are exact (two passes: max, then exp and sums), as torch's SDPA. */
static void attend_one(const float *qr, const float *k_cache, const float *v_cache,
                       const int64_t *pages, int L, int kh, int Hkv, int D, int S, float scale,
                       float *scores, float *o) {
    float mx = -INFINITY;
    for (int p = 0; p < L; p++) {
        const float *kr = k_cache + (((size_t)pages[p / S] * S + p % S) * Hkv + kh) * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= D; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), _mm256_loadu_ps(kr + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i + 8), _mm256_loadu_ps(kr + i + 8), a1);
        }
        if (i < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), _mm256_loadu_ps(kr + i), a0);
        const float s = hsum(_mm256_add_ps(a0, a1)) * scale;
        scores[p] = s;
        if (s > mx) mx = s;
    }
    float total = 0.0f;
    for (int p = 0; p < L; p++) {
        scores[p] = expf(scores[p] - mx);
        total += scores[p];
    }
    const float inv = 1.0f / total;
    for (int i0 = 0; i0 < D; i0 += 64) {  /* up to 8 vectors of the output in registers */
        const int nv = (D - i0) / 8 < 8 ? (D - i0) / 8 : 8;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int p = 0; p < L; p++) {
            const float *vr = v_cache + (((size_t)pages[p / S] * S + p % S) * Hkv + kh) * D + i0;
            const __m256 w = _mm256_set1_ps(scores[p]);
            for (int j = 0; j < nv; j++)
                acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * j), acc[j]);
        }
        const __m256 scale_out = _mm256_set1_ps(inv);
        for (int j = 0; j < nv; j++)
            _mm256_storeu_ps(o + i0 + 8 * j, _mm256_mul_ps(acc[j], scale_out));
    }
}

void tri_decode_attention(const float *q, int q_stride, const float *k_cache,
                          const float *v_cache, const int64_t *page_table, int max_pages,
                          const int64_t *seq_lens, int B, int Hq, int Hkv, int D, int S,
                          float scale, float *out, int max_len, int nthreads) {
    const int G = Hq / Hkv;
    /* Enough sequences: one work item each. Fewer than two per thread: one per (sequence, head). */
    const int per_head = B < 2 * nthreads;
    const int items = per_head ? B * Hq : B;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc((size_t)max_len * sizeof(float));
        #pragma omp for schedule(dynamic)
        for (int i = 0; i < items; i++) {
            const int b = per_head ? i / Hq : i;
            const int L = (int)seq_lens[b];
            const int64_t *pages = page_table + (size_t)b * max_pages;
            for (int h = per_head ? i % Hq : 0; h < (per_head ? i % Hq + 1 : Hq); h++)
                attend_one(q + (size_t)b * q_stride + (size_t)h * D, k_cache, v_cache, pages, L,
                           h / G, Hkv, D, S, scale, scores, out + ((size_t)b * Hq + h) * D);
        }
        free(scores);
    }
}
