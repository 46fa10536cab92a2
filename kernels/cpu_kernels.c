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
 * Weight formats: ggml's, 32 weights a block, with each row's blocks rearranged at load time
 * (kernels/cpu.py, PackedWeight.from_blocks) so that a row holds all its codes, then all its
 * scales (then all its minimums): the same bytes, but a kernel loads the scales of 8 blocks in
 * one instruction and the codes of consecutive blocks are adjacent. For a row of nb blocks:
 *   Q4_0 (2): nb * 16 bytes of nibbles | nb fp16 d;               w = (q - 8) * d
 *   Q4_1 (3): nb * 16 bytes of nibbles | nb fp16 d | nb fp16 m;   w = q * d + m
 *   Q8_0 (8): nb * 32 int8             | nb fp16 d;               w = q * d
 * In a block's 16 bytes of nibbles, byte j holds weight j (low nibble) and weight j + 16 (high).
 */

#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8 };

#define INLINE static inline __attribute__((always_inline))

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

/* exp of 8 floats: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by a degree-6
 * polynomial (Cephes' expf coefficients): within 2 ulp of expf. x is clamped to [-87.3, 88.7]
 * (below, 0; above, a large finite value: softmax and SiLU only need those limits). */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 i8x8_to_float(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

/* Bytes of codes per block, and where a row's scales (d) and minimums (m, Q4_1) start. */
static inline int code_bytes(int fmt) { return fmt == FMT_Q8_0 ? 32 : 16; }
static inline const uint8_t *row_scales(int fmt, const uint8_t *row, int nb) {
    return row + (size_t)nb * code_bytes(fmt);
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
    const uint8_t *ds = row_scales(fmt, row, nb), *ms = ds + 2 * nb;
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int b = 0; b < nb; b++) {
        const float dv = half_to_float(ds + 2 * b);
        const __m256 d = _mm256_set1_ps(dv);
        float *o = out + b * 32;
        if (fmt == FMT_Q8_0) {
            for (int j = 0; j < 4; j++) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(row + 32 * b + 8 * j));
                _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(i8x8_to_float(q), d));
            }
            continue;
        }
        const __m256 m = _mm256_set1_ps(fmt == FMT_Q4_1 ? half_to_float(ms + 2 * b) : -8.0f * dv);
        for (int h = 0; h < 2; h++) {  /* as block_dot_ps: 8 code bytes, two nibbles a lane */
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 16 * b + 8 * h)));
            _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), d, m));
            _mm256_storeu_ps(o + 16 + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m));
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

/* Whether M rows of x take the few-rows kernels (weights unpacked in registers, once per row of
 * x) or the tiles (each weight dequantized once into L1, used by MT rows at a time). Measured on
 * SmolLM2 at 2 threads: for the exact kernel the tiles win from 2 rows on; the int16 kernel's
 * integer products keep it ahead up to 3 rows. */
#define FEW_ROWS_EXACT 2
#define FEW_ROWS_INT16 4

static inline int few_rows(int M, int int16_activations) {
    return M < (int16_activations ? FEW_ROWS_INT16 : FEW_ROWS_EXACT);
}

/* The few-rows kernels take 8 blocks at a time: one 8-lane vector per block (or per pair of
 * blocks) of partial sums, reduced to one vector holding each block's sum, so the scales, the
 * minimums and x's block sums of 8 blocks are applied with a few vector instructions. */

/* The sums of 8 vectors, one per block: lane j = sum of v[j]. */
INLINE __m256 reduce8_ps(const __m256 v[8]) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

INLINE __m256i reduce8_epi32(const __m256i v[8]) {
    const __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20),
                            _mm256_permute2x128_si256(t0, t1, 0x31));
}

/* 8 fp16 values as floats. */
INLINE __m256 load_halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* dot(codes of block b, x_b) as 8 partial sums (fp32 x). */
INLINE __m256 block_dot_ps(int fmt, const uint8_t *row, int b, const float *xb) {
    __m256 f[4];
    if (fmt == FMT_Q8_0) {
        for (int j = 0; j < 4; j++)
            f[j] = i8x8_to_float(_mm_loadl_epi64((const __m128i *)(row + 32 * b + 8 * j)));
    } else {
        /* 8 code bytes widened to 8 lanes (the load folds into the widening), then each lane's
         * two nibbles: byte j holds weights j (low) and j + 16 (high). */
        const __m256i low4 = _mm256_set1_epi32(0x0F);
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 16 * b + 8 * h)));
            f[h] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
            f[h + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        }
    }
    __m256 s = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), s);
    s = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), s);
    return _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), s);
}

/* The offset term of 8 blocks from b: m_j * xs_j, where m is Q4_1's minimum, -8d for Q4_0, 0 for
 * Q8_0; ``offset`` is one block's m. */
INLINE __m256 offsets(int fmt, const uint8_t *ds, int nb, int b, const float *xs, __m256 acc) {
    if (fmt == FMT_Q4_1)
        return _mm256_fmadd_ps(load_halves(ds + 2 * (size_t)nb + 2 * b), _mm256_loadu_ps(xs + b), acc);
    if (fmt == FMT_Q4_0)
        return _mm256_fmadd_ps(_mm256_mul_ps(load_halves(ds + 2 * b), _mm256_set1_ps(-8.0f)),
                               _mm256_loadu_ps(xs + b), acc);
    return acc;
}

INLINE float offset(int fmt, const uint8_t *ds, int nb, int b) {
    if (fmt == FMT_Q4_1) return half_to_float(ds + 2 * (size_t)nb + 2 * b);
    if (fmt == FMT_Q4_0) return -8.0f * half_to_float(ds + 2 * b);
    return 0.0f;
}

/* 8 blocks from b into acc (see group_q16). */
INLINE __m256 group_f32(int fmt, const uint8_t *row, const uint8_t *ds, int nb, int b,
                        const float *x, const float *xsum, __m256 acc) {
    __m256 v[8];
    for (int j = 0; j < 8; j++)
        v[j] = block_dot_ps(fmt, row, b + j, x + (size_t)(b + j) * 32);
    acc = _mm256_fmadd_ps(reduce8_ps(v), load_halves(ds + 2 * b), acc);
    return offsets(fmt, ds, nb, b, xsum, acc);
}

INLINE float dot_row_fmt(int fmt, const uint8_t *row, const float *x, const float *xsum, int nb) {
    const uint8_t *ds = row_scales(fmt, row, nb);
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = group_f32(fmt, row, ds, nb, b, x, xsum, acc);
    float tail = 0.0f;  /* the last nb % 8 blocks, one at a time */
    for (; b < nb; b++)
        tail += hsum(block_dot_ps(fmt, row, b, x + (size_t)b * 32)) * half_to_float(ds + 2 * b)
                + offset(fmt, ds, nb, b) * xsum[b];
    return hsum(acc) + tail;
}

/* dot(w_row, x), exact: sum over blocks of d * dot(codes, x_b) + m * sum(x_b); ``xsum`` holds
 * sum(x_b) per block. */
static float dot_row(int fmt, const uint8_t *row, const float *x, const float *xsum, int nb) {
    switch (fmt) {
    case FMT_Q4_0: return dot_row_fmt(FMT_Q4_0, row, x, xsum, nb);
    case FMT_Q4_1: return dot_row_fmt(FMT_Q4_1, row, x, xsum, nb);
    default: return dot_row_fmt(FMT_Q8_0, row, x, xsum, nb);
    }
}

static void block_sums(const float *x, int K, float *out) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        out[b] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                    _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
    }
}

/* The int16-activation variant (opt-in; not exact, relative error ~5e-5): each 32-block of x is
 * rounded to int16 with its own scale (dx), so a block's dot product is an exact integer sum.
 * The weights' offset term (Q4_1's m, Q4_0's -8d) uses the exact float sums of x.
 *
 * Q8_0 codes are widened to int16 and multiplied with madd. For 4-bit codes (0..15) the int16 x
 * is split into its signed high byte and unsigned low byte, x = 256 * xh + xl, so that maddubs
 * (unsigned bytes times signed bytes, pairs summed to int16) takes 32 codes at once: codes * xh
 * and xl * codes (a code is a valid signed byte) never leave int16, and two madds combine them
 * into sum(code * x) exactly. Two blocks go together (their 32 code bytes are adjacent): x is
 * laid out per pair of blocks as four 32-byte vectors, xh of weights 0-15 of both blocks, xh of
 * weights 16-31, then xl of the same (see quantize_row_q16). */
#define QX_BLOCK_BYTES 64  /* bytes of prepared x per block, either layout */

/* Bytes of one prepared row of K values: whole pairs of blocks (an odd last block's partner is 0). */
static size_t qx_row_bytes(int K) { return (size_t)(K / 32 + 1) / 2 * 2 * QX_BLOCK_BYTES; }

static void quantize_row_q16(int fmt, const float *x, int K, uint8_t *qx, float *dx) {
    const int nb = K / 32;
    memset(qx, 0, qx_row_bytes(K));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++)
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * j)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 32767.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        dx[b] = d;
        /* round to nearest even, as lrintf in the default rounding mode */
        int32_t v[32];
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(v + 8 * j),
                                _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), _mm256_set1_ps(id))));
        for (int i = 0; i < 32; i++) {
            const int16_t q = (int16_t)v[i];
            if (fmt == FMT_Q8_0) {
                ((int16_t *)qx)[b * 32 + i] = q;
            } else {
                uint8_t *pair = qx + (size_t)(b / 2) * 2 * QX_BLOCK_BYTES;
                const int at = (b % 2) * 16 + (i % 16) + (i / 16) * 32;
                pair[at] = (uint8_t)((uint16_t)q >> 8);
                pair[64 + at] = (uint8_t)(q & 0xFF);
            }
        }
    }
}

/* sum(code * x) of blocks b and b + 1 (4-bit codes): lanes 0-3 block b's partial sums, 4-7 b + 1's. */
INLINE __m256i pair_dot_q4(const uint8_t *codes, const uint8_t *xp, int both) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i q = both ? _mm256_loadu_si256((const __m256i *)codes)
                           : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)codes));
    const __m256i lo = _mm256_and_si256(q, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    const __m256i h = _mm256_add_epi16(
        _mm256_maddubs_epi16(lo, _mm256_load_si256((const __m256i *)xp)),
        _mm256_maddubs_epi16(hi, _mm256_load_si256((const __m256i *)(xp + 32))));
    const __m256i l = _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(xp + 64)), lo),
        _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(xp + 96)), hi));
    return _mm256_add_epi32(_mm256_madd_epi16(h, _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(l, _mm256_set1_epi16(1)));
}

/* sum(code * x) of Q8_0 block b as 8 partial sums. */
INLINE __m256i block_dot_q8(const uint8_t *row, int b, const int16_t *xb) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 32 * b)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 32 * b + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_load_si256((const __m256i *)xb)),
                            _mm256_madd_epi16(w1, _mm256_load_si256((const __m256i *)(xb + 16))));
}

/* 8 blocks from b into acc. Always inlined, and called with a constant fmt: no branch inside. */
INLINE __m256 group_q16(int fmt, const uint8_t *row, const uint8_t *ds, int nb, int b,
                        const uint8_t *qx, const float *dx, const float *xs, __m256 acc) {
    /* pair sums come out as [b0 b2 b4 b6 | b1 b3 b5 b7]: back to block order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i sums;
    if (fmt == FMT_Q8_0) {
        __m256i v[8];
        for (int j = 0; j < 8; j++)
            v[j] = block_dot_q8(row, b + j, (const int16_t *)(qx + (size_t)(b + j) * QX_BLOCK_BYTES));
        sums = reduce8_epi32(v);
    } else {
        __m256i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = pair_dot_q4(row + 16 * (size_t)(b + 2 * j), qx + (size_t)(b + 2 * j) * QX_BLOCK_BYTES, 1);
        sums = _mm256_permutevar8x32_epi32(
            _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])), order);
    }
    const __m256 scale = _mm256_mul_ps(load_halves(ds + 2 * b), _mm256_loadu_ps(dx + b));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
    return offsets(fmt, ds, nb, b, xs, acc);
}

INLINE float dot_row_q16_fmt(int fmt, const uint8_t *row, const uint8_t *qx, const float *dx,
                             const float *xs, int nb) {
    const uint8_t *ds = row_scales(fmt, row, nb);
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = group_q16(fmt, row, ds, nb, b, qx, dx, xs, acc);
    float tail = 0.0f;  /* the last nb % 8 blocks: one at a time, or a pair at a time */
    for (; b < nb; b += fmt == FMT_Q8_0 ? 1 : 2) {
        int32_t sums[8];
        if (fmt == FMT_Q8_0) {
            _mm256_storeu_si256((__m256i *)sums,
                                block_dot_q8(row, b, (const int16_t *)(qx + (size_t)b * QX_BLOCK_BYTES)));
        } else {  /* lanes 0-3: block b, 4-7: block b + 1 */
            _mm256_storeu_si256((__m256i *)sums, pair_dot_q4(row + 16 * (size_t)b,
                                                             qx + (size_t)b * QX_BLOCK_BYTES, b + 1 < nb));
        }
        for (int j = 0; j < (fmt == FMT_Q8_0 ? 1 : 2) && b + j < nb; j++) {
            const int32_t s = fmt == FMT_Q8_0
                ? sums[0] + sums[1] + sums[2] + sums[3] + sums[4] + sums[5] + sums[6] + sums[7]
                : sums[4 * j] + sums[4 * j + 1] + sums[4 * j + 2] + sums[4 * j + 3];
            tail += (float)s * (half_to_float(ds + 2 * (b + j)) * dx[b + j])
                    + offset(fmt, ds, nb, b + j) * xs[b + j];
        }
    }
    return hsum(acc) + tail;
}

static float dot_row_q16(int fmt, const uint8_t *row, const uint8_t *qx, const float *dx,
                         const float *xs, int nb) {
    switch (fmt) {
    case FMT_Q4_0: return dot_row_q16_fmt(FMT_Q4_0, row, qx, dx, xs, nb);
    case FMT_Q4_1: return dot_row_q16_fmt(FMT_Q4_1, row, qx, dx, xs, nb);
    default: return dot_row_q16_fmt(FMT_Q8_0, row, qx, dx, xs, nb);
    }
}

/* The pieces below run inside a parallel region their caller opens: their loops are orphaned
 * work-sharing constructs (``omp for``), so a public entry point opens one region for one op and
 * tri_decode_step opens one for a whole step, and both run the same code in the same order (the
 * fused step's results are bitwise those of the op-by-op path). Each ``omp for`` ends with a
 * barrier. */

/* What a few-rows product needs of x before the threads start: the float sums of x's blocks,
 * and with int16 activations x rounded to int16 (qx) with a scale per block (dx). */
static void linear_prep(int fmt, const float *x, int M, int K, float *xsum, uint8_t *qx, float *dx) {
    const int nb = K / 32;
    for (int m = 0; m < M; m++) {
        block_sums(x + (size_t)m * K, K, xsum + (size_t)m * nb);
        if (qx) quantize_row_q16(fmt, x + (size_t)m * K, K, qx + m * qx_row_bytes(K), dx + (size_t)m * nb);
    }
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias), few_rows(M), after linear_prep: exact (dot_row), or
 * with x rounded to int16 (dot_row_q16) when qx is given. */
static void linear_few_rows_omp(int fmt, const float *x, int M, int K, const uint8_t *w,
                                size_t row_bytes, int N, const float *bias, float *y,
                                const float *xsum, const uint8_t *qx, const float *dx) {
    const int nb = K / 32;
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        /* the row after next on its way from memory while this one is computed */
        for (size_t off = 0; off < row_bytes; off += 64)
            _mm_prefetch((const char *)(row + 2 * row_bytes + off), _MM_HINT_T0);
        for (int m = 0; m < M; m++) {
            const float *xs = xsum + (size_t)m * nb;
            const float dot = qx ? dot_row_q16(fmt, row, qx + m * qx_row_bytes(K), dx + (size_t)m * nb, xs, nb)
                                 : dot_row(fmt, row, x + (size_t)m * K, xs, nb);
            y[(size_t)m * N + n] = dot + (bias ? bias[n] : 0.0f);
        }
    }
}

/* The same product for more rows: tiles of NT weight rows dequantized into L1 (a buffer
 * per thread), MB rows of x per pass. */
static void linear_tiles_omp(int fmt, const float *x, int M, int K, const uint8_t *w,
                             size_t row_bytes, int N, const float *bias, float *y) {
    const int tiles = (N + NT - 1) / NT;
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
    #pragma omp barrier
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias). W's rows are ``row_bytes`` apart, in ``fmt``.
 * K must be a multiple of 32. With ``int16_activations``, up to 3 rows of x go through the
 * int16 variant (see few_rows). Returns 0, or -1 on a bad argument. */
int tri_linear(int fmt, const float *x, int M, int K, const uint8_t *w, size_t row_bytes, int N,
               const float *bias, float *y, int int16_activations, int nthreads) {
    if (K % 32 != 0 || tri_block_bytes(fmt) == 0)
        return -1;
    if (!few_rows(M, int16_activations)) {
        #pragma omp parallel num_threads(nthreads)
        linear_tiles_omp(fmt, x, M, K, w, row_bytes, N, bias, y);
        return 0;
    }
    const int nb = K / 32;
    float *xsum = malloc((size_t)M * nb * sizeof(float));
    uint8_t *qx = int16_activations ? aligned_alloc(64, M * qx_row_bytes(K)) : NULL;
    float *dx = int16_activations ? malloc((size_t)M * nb * sizeof(float)) : NULL;
    linear_prep(fmt, x, M, K, xsum, qx, dx);
    #pragma omp parallel num_threads(nthreads)
    linear_few_rows_omp(fmt, x, M, K, w, row_bytes, N, bias, y, xsum, qx, dx);
    free(xsum);
    free(qx);
    free(dx);
    return 0;
}

/* Rows of one GGUF tensor -> fp32 (the embedding lookup of quantized tables). */
void tri_dequant_rows(int fmt, const uint8_t *w, size_t row_bytes, const int64_t *rows, int n,
                      int K, float *out) {
    for (int i = 0; i < n; i++)
        dequant_row(fmt, w + (size_t)rows[i] * row_bytes, K, out + (size_t)i * K);
}

/* RMSNorm of one row of H: y = w * v / sqrt(mean(v^2) + eps), where v = x, or with
 * ``residual``, v = x + residual, also written to ``sum`` (may be ``residual`` itself). */
static void rms_norm_row(const float *xr, const float *r, float *s, const float *w, int H,
                         float eps, float *yr) {
    const float *v = xr;
    if (r) {
        for (int i = 0; i < H; i++) s[i] = xr[i] + r[i];
        v = s;
    }
    float ss = 0.0f;
    for (int i = 0; i < H; i++) ss += v[i] * v[i];
    const float inv = 1.0f / sqrtf(ss / H + eps);
    for (int i = 0; i < H; i++) yr[i] = w[i] * (v[i] * inv);
}

static void rms_norm_omp(const float *x, const float *residual, float *sum, const float *w,
                         int M, int H, float eps, float *y) {
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        rms_norm_row(x + (size_t)m * H, residual ? residual + (size_t)m * H : NULL,
                     sum ? sum + (size_t)m * H : NULL, w, H, eps, y + (size_t)m * H);
}

/* RMSNorm over rows of H (see rms_norm_row). */
void tri_rms_norm(const float *x, const float *residual, float *sum, const float *w, int M, int H,
                  float eps, float *y, int nthreads) {
    #pragma omp parallel num_threads(M > 8 ? nthreads : 1)
    rms_norm_omp(x, residual, sum, w, M, H, eps, y);
}

static void silu_and_mul_omp(const float *x, int M, int I, float *y) {
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        const float *g = x + (size_t)m * 2 * I, *u = g + I;
        float *o = y + (size_t)m * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                  _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* silu(gate) * up for x = [M, 2I] holding cat(gate, up) -> y [M, I]. */
void tri_silu_and_mul(const float *x, int M, int I, float *y, int nthreads) {
    #pragma omp parallel num_threads(M > 8 ? nthreads : 1)
    silu_and_mul_omp(x, M, I, y);
}

/* Neox rotary embedding in place on q [T, Hq, D] and k [T, Hkv, D] (rows ``q_stride`` and
 * ``k_stride`` floats apart per token), then k and v [T, Hkv, D] (v rows ``v_stride`` apart)
 * stored into their cache slots: cache [num_slots, Hkv, D]. cos_sin: [max_pos, D] = cat(cos, sin). */
static void rope_store_token(float *q, float *k, const float *v, int64_t position, int64_t slot,
                             int Hq, int Hkv, int D, const float *cos_sin, float *k_cache,
                             float *v_cache) {
    const int half = D / 2;
    const float *cs = cos_sin + (size_t)position * D;
    for (int h = 0; h < Hq + Hkv; h++) {
        float *x = h < Hq ? q + (size_t)h * D : k + (size_t)(h - Hq) * D;
        for (int i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half], c = cs[i], s = cs[i + half];
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
        }
    }
    memcpy(k_cache + (size_t)slot * Hkv * D, k, (size_t)Hkv * D * sizeof(float));
    memcpy(v_cache + (size_t)slot * Hkv * D, v, (size_t)Hkv * D * sizeof(float));
}

void tri_rope_store(float *q, int q_stride, float *k, int k_stride, const float *v, int v_stride,
                    const int64_t *positions, const int64_t *slots, int T, int Hq, int Hkv, int D,
                    const float *cos_sin, float *k_cache, float *v_cache) {
    for (int t = 0; t < T; t++)
        rope_store_token(q + (size_t)t * q_stride, k + (size_t)t * k_stride, v + (size_t)t * v_stride,
                         positions[t], slots[t], Hq, Hkv, D, cos_sin, k_cache, v_cache);
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
    __m256 sum = _mm256_setzero_ps();
    int p = 0;
    for (; p + 8 <= L; p += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + p), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(scores + p, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; p < L; p++) {
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

static void decode_attention_omp(const float *q, int q_stride, const float *k_cache,
                                 const float *v_cache, const int64_t *page_table, int max_pages,
                                 const int64_t *seq_lens, int B, int Hq, int Hkv, int D, int S,
                                 float scale, float *out, int max_len, int nthreads) {
    const int G = Hq / Hkv;
    /* Enough sequences: one work item each. Fewer than two per thread: one per (sequence, head). */
    const int per_head = B < 2 * nthreads;
    const int items = per_head ? B * Hq : B;
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

void tri_decode_attention(const float *q, int q_stride, const float *k_cache,
                          const float *v_cache, const int64_t *page_table, int max_pages,
                          const int64_t *seq_lens, int B, int Hq, int Hkv, int D, int S,
                          float scale, float *out, int max_len, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    decode_attention_omp(q, q_stride, k_cache, v_cache, page_table, max_pages, seq_lens, B, Hq,
                         Hkv, D, S, scale, out, max_len, nthreads);
}

/* -- A whole decode step in one call --------------------------------------------------------------
 *
 * A decode step of a small model is ~10 ops per layer; called one by one from Python, each costs a
 * dispatch and a fork/join of the threads, ~6 ms of a 15 ms step for a 135M model. Here the step
 * (embedding, every layer, the final norm, the lm_head) runs in one parallel region; the threads
 * meet at a barrier between ops. Each op is the same code the op-by-op path runs, in the same
 * order, so the logits are bitwise the same. Only for a step of B sequences decoding one token
 * each, with every linear weight in a block format. */

typedef struct {
    int fmt;
    const uint8_t *w;
    size_t row_bytes;
    int N, K;
    const float *bias;     /* or NULL */
    int int16_activations;
} tri_lin;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm;  /* per-head norms (Qwen3), or NULL */
    tri_lin qkv, o, gate_up, down;
} tri_layer;

typedef struct {
    int num_layers, H, Hq, Hkv, D, I, page_size;
    float eps, scale;
    int embed_fmt;            /* a block format, or 0: fp32 rows of H floats */
    const uint8_t *embed;
    size_t embed_row_bytes;
    const float *final_norm;
    tri_lin lm_head;
    const float *cos_sin;
    const tri_layer *layers;  /* num_layers of them */
} tri_model;

/* One linear inside the step's region: the prep by one thread, then the rows shared out.
 * ``xsum``, ``qx``, ``dx`` are the step's scratch (room for B rows of the widest input). */
static void step_linear(const tri_lin *L, const float *x, int M, float *y, float *xsum,
                        uint8_t *qx, float *dx) {
    if (!few_rows(M, L->int16_activations)) {
        linear_tiles_omp(L->fmt, x, M, L->K, L->w, L->row_bytes, L->N, L->bias, y);
        return;
    }
    uint8_t *q = L->int16_activations ? qx : NULL;
    #pragma omp single
    linear_prep(L->fmt, x, M, L->K, xsum, q, dx);
    linear_few_rows_omp(L->fmt, x, M, L->K, L->w, L->row_bytes, L->N, L->bias, y, xsum, q, dx);
}

/* logits [B, vocab] for B sequences each decoding one token: ids, positions and KV slots of the
 * new tokens, the page table [B, max_pages] and context lengths (after this token) of each. */
int tri_decode_step(const tri_model *m, float *const *k_caches, float *const *v_caches, int B,
                    const int64_t *ids, const int64_t *positions, const int64_t *slots,
                    const int64_t *page_table, int max_pages, const int64_t *seq_lens,
                    int max_len, float *logits, int nthreads) {
    const int H = m->H, Hq = m->Hq, Hkv = m->Hkv, D = m->D, I = m->I;
    const int QKV = (Hq + 2 * Hkv) * D;
    int widest = H > I ? H : I;
    if (Hq * D > widest) widest = Hq * D;
    float *hidden = malloc((size_t)B * H * sizeof(float));
    float *residual = malloc((size_t)B * H * sizeof(float));
    float *normed = malloc((size_t)B * H * sizeof(float));
    float *qkv = malloc((size_t)B * QKV * sizeof(float));
    float *attn = malloc((size_t)B * Hq * D * sizeof(float));
    float *gate_up = malloc((size_t)B * 2 * I * sizeof(float));
    float *act = malloc((size_t)B * I * sizeof(float));
    float *xsum = malloc((size_t)B * (widest / 32) * sizeof(float));
    uint8_t *qx = aligned_alloc(64, B * qx_row_bytes(widest));
    float *dx = malloc((size_t)B * (widest / 32) * sizeof(float));
    int rc = -1;
    if (!hidden || !residual || !normed || !qkv || !attn || !gate_up || !act || !xsum || !qx || !dx)
        goto done;
    for (int b = 0; b < B; b++) {
        float *row = residual + (size_t)b * H;  /* the embedding is layer 0's residual */
        if (m->embed_fmt)
            dequant_row(m->embed_fmt, m->embed + (size_t)ids[b] * m->embed_row_bytes, H, row);
        else
            memcpy(row, m->embed + (size_t)ids[b] * m->embed_row_bytes, (size_t)H * sizeof(float));
    }
    #pragma omp parallel num_threads(nthreads)
    {
        for (int l = 0; l < m->num_layers; l++) {
            const tri_layer *L = &m->layers[l];
            /* layer 0 normalizes the embedding; later layers add the pending residual first */
            rms_norm_omp(l ? hidden : residual, l ? residual : NULL, l ? residual : NULL,
                         L->input_norm, B, H, m->eps, normed);
            step_linear(&L->qkv, normed, B, qkv, xsum, qx, dx);
            #pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *q = qkv + (size_t)b * QKV, *k = q + Hq * D, *v = k + Hkv * D;
                if (L->q_norm) {
                    for (int h = 0; h < Hq; h++)
                        rms_norm_row(q + h * D, NULL, NULL, L->q_norm, D, m->eps, q + h * D);
                    for (int h = 0; h < Hkv; h++)
                        rms_norm_row(k + h * D, NULL, NULL, L->k_norm, D, m->eps, k + h * D);
                }
                rope_store_token(q, k, v, positions[b], slots[b], Hq, Hkv, D, m->cos_sin,
                                 k_caches[l], v_caches[l]);
            }
            decode_attention_omp(qkv, QKV, k_caches[l], v_caches[l], page_table, max_pages,
                                 seq_lens, B, Hq, Hkv, D, m->page_size, m->scale, attn, max_len,
                                 omp_get_num_threads());
            step_linear(&L->o, attn, B, hidden, xsum, qx, dx);
            rms_norm_omp(hidden, residual, residual, L->post_norm, B, H, m->eps, normed);
            step_linear(&L->gate_up, normed, B, gate_up, xsum, qx, dx);
            silu_and_mul_omp(gate_up, B, I, act);
            step_linear(&L->down, act, B, hidden, xsum, qx, dx);
        }
        rms_norm_omp(hidden, residual, residual, m->final_norm, B, H, m->eps, normed);
        step_linear(&m->lm_head, normed, B, logits, xsum, qx, dx);
    }
    rc = 0;
done:
    free(hidden); free(residual); free(normed); free(qkv); free(attn); free(gate_up);
    free(act); free(xsum); free(qx); free(dx);
    return rc;
}
