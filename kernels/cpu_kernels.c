/* The CPU kernels of the decode path (x86-64 with AVX2, FMA and F16C), built by kernels/cpu.py.
 *
 * Why C and not torch: a decode step of a small model is ~150 matrix-vector products and ~250
 * small element-wise ops. Through torch each op costs a dispatch (5-10 us) and the fp32 GEMV
 * reads its weights at half the machine's bandwidth; quantized weights have no fast torch kernel
 * for fp32 activations on AVX2. Here a linear layer reads the GGUF blocks themselves (4 to 8 bits
 * a weight, or 16, instead of 32) and each op is one call.
 *
 * Numerics: activations stay fp32 and every product is accumulated in fp32, so the result is the
 * same math as dequantizing the weights to fp32 and calling a BLAS, up to the order of the sums.
 *
 * Threads: OpenMP, with the thread count passed by the caller (torch's, so one setting rules both).
 *
 * Weight formats: ggml's, rearranged once at load by tri_pack (the same information in about the
 * same bytes) so that every block format reads the same way: a row of K weights is nb = K / 32
 * blocks of 32 weights whose codes come first, then the high bits of 5- and 6-bit codes, then
 * the scales. A weight is w = code * scale + offset, with a scale and an offset per block (per
 * half block for Q6_K, whose offset is folded into its codes). For a row of nb blocks:
 *   Q4_0 (2):  nb * 16 nibbles |                  | nb fp16 d                  w = (q - 8) d
 *   Q4_1 (3):  nb * 16 nibbles |                  | nb fp16 d | nb fp16 m      w = q d + m
 *   Q5_0 (6):  nb * 16 nibbles | nb * 4 (bit 4)   | nb fp16 d                  w = (q - 16) d
 *   Q5_1 (7):  nb * 16 nibbles | nb * 4 (bit 4)   | nb fp16 d | nb fp16 m      w = q d + m
 *   Q8_0 (8):  nb * 32 int8    |                  | nb fp16 d                  w = q d
 *   Q4_K (12): nb * 16 nibbles |                  | per 8 blocks (a super-block of 256):
 *              fp16 d, fp16 dmin, 8 uint8 scales sc, 8 uint8 minimums mn     w = q d sc - dmin mn
 *   Q5_K (13): nb * 16 nibbles | nb * 4 (bit 4)   | as Q4_K
 *   Q6_K (14): nb * 16 nibbles | nb * 8 (bits 4-5)| per 8 blocks: fp16 d, 8 int8 scales of the
 *              blocks' first halves, 8 of their second halves               w = (q - 32) d sc
 *   F16 (1), BF16 (30): K 16-bit floats as they are.
 * In a block's 16 bytes of nibbles, byte j holds the low 4 bits of weight j (low nibble) and of
 * weight j + 16 (high). 5-bit codes keep a uint32 whose bit k is bit 4 of weight k (ggml's own
 * qh order; with AVX512BW a byte mask as it is); Q6_K keeps 8 bytes,
 * byte i's bits 2j, 2j + 1 being bits 4 and 5 of weight i + 8j (laid out for the 8 int32 lanes
 * a block's codes are widened to, lane i taking weights i, i + 8, i + 16 and i + 24). With
 * AVX512-VBMI both are merged into a block's 32 code bytes before widening (block_codes_q6);
 * without, a shift, an and and an or per 8 weights. ggml's own
 * K-quant layouts interleave the codes by 64 and pack the 6-bit scales; tri_pack undoes both
 * (Q4_K and Q5_K grow by 4 bytes per 256 weights, 3%).
 */

#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    FMT_F16 = 1, FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q5_0 = 6, FMT_Q5_1 = 7, FMT_Q8_0 = 8,
    FMT_Q4_K = 12, FMT_Q5_K = 13, FMT_Q6_K = 14, FMT_BF16 = 30,
};

/* Bumped whenever a struct or signature of the ctypes boundary changes; kernels/cpu.py checks it. */
int tri_abi_version(void) { return 8; }

#define INLINE static inline __attribute__((always_inline))

/* Weight rows dequantized together; x rows multiplied against them together. */
#define NT 4
/* x rows per register block: NT * MT accumulators, NT weight vectors and one x vector must fit
 * the vector registers (32 with AVX-512VL, 16 without). */
#ifdef __AVX512VL__
#define MT 6
#else
#define MT 2
#endif
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

/* -- formats -------------------------------------------------------------------------------------- */

static inline int is_16bit(int fmt) { return fmt == FMT_F16 || fmt == FMT_BF16; }
static inline int is_kquant(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K; }
static inline int is_5bit(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_Q5_K; }
static inline int has_min(int fmt) { return fmt == FMT_Q4_1 || fmt == FMT_Q5_1; }

/* Weights per block of the format as ggml stores it, and that block's bytes; 0 if unknown. */
static int native_block(int fmt, int *weights) {
    *weights = is_kquant(fmt) ? 256 : 32;
    switch (fmt) {
    case FMT_F16: case FMT_BF16: *weights = 1; return 2;
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q5_0: return 22;
    case FMT_Q5_1: return 24;
    case FMT_Q8_0: return 34;
    case FMT_Q4_K: return 144;
    case FMT_Q5_K: return 176;
    case FMT_Q6_K: return 210;
    default: return 0;
    }
}

/* Bytes per 32-weight block of codes, of high bits, and of the scales region of a row. */
static inline int code_bytes(int fmt) { return fmt == FMT_Q8_0 ? 32 : 16; }
static inline int plane_bytes(int fmt) { return fmt == FMT_Q6_K ? 8 : is_5bit(fmt) ? 4 : 0; }
static size_t meta_bytes(int fmt, int nb) {
    if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) return (size_t)nb / 8 * 20;
    if (fmt == FMT_Q6_K) return (size_t)nb / 8 * 18;
    return (size_t)nb * (has_min(fmt) ? 4 : 2);
}

/* Bytes of one packed row of K weights (K a multiple of 32, of 256 for the K-quants), or 0 if
 * the format or K is not one the kernels take. */
size_t tri_row_bytes(int fmt, int K) {
    int per;
    if (K <= 0 || native_block(fmt, &per) == 0 || K % 32 || (is_kquant(fmt) && K % 256))
        return 0;
    if (is_16bit(fmt)) return (size_t)K * 2;
    const int nb = K / 32;
    return (size_t)nb * (code_bytes(fmt) + plane_bytes(fmt)) + meta_bytes(fmt, nb);
}

/* Bytes of one row of K weights as ggml stores it. */
size_t tri_native_row_bytes(int fmt, int K) {
    int per;
    const int bytes = native_block(fmt, &per);
    return bytes && K % per == 0 ? (size_t)(K / per) * bytes : 0;
}

static inline const uint8_t *row_planes(int fmt, const uint8_t *row, int nb) {
    return row + (size_t)nb * code_bytes(fmt);
}
static inline const uint8_t *row_meta(int fmt, const uint8_t *row, int nb) {
    return row + (size_t)nb * (code_bytes(fmt) + plane_bytes(fmt));
}

/* -- packing: ggml's blocks -> the layout above ------------------------------------------------- */

/* Codes q[32] (natural order, values < 64) of one block into its nibbles and high bits: bit 4
 * of 5-bit codes in natural order; Q6_K's bits 4-5 laid out for the 8 lanes block_codes widens
 * them to, lane i holding those of weights i, i + 8, i + 16 and i + 24 (see the layout comment
 * at the top). */
static void put_codes(int fmt, const uint8_t *q, uint8_t *nib, uint8_t *high) {
    for (int j = 0; j < 16; j++)
        nib[j] = (uint8_t)((q[j] & 15) | (q[j + 16] & 15) << 4);
    if (is_5bit(fmt)) {
        uint32_t w = 0;
        for (int i = 0; i < 32; i++) w |= (uint32_t)((q[i] >> 4) & 1) << i;
        memcpy(high, &w, 4);
    } else if (fmt == FMT_Q6_K) {
        for (int i = 0; i < 8; i++) {
            uint8_t v = 0;
            for (int j = 0; j < 4; j++) v |= (uint8_t)(((q[i + 8 * j] >> 4) & 3) << (2 * j));
            high[i] = v;
        }
    }
}

/* ggml's get_scale_min_k4: the 6-bit scale and minimum of sub-block j of a Q4_K/Q5_K block. */
static void scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* One row of ggml blocks -> one packed row. */
static void pack_row(int fmt, const uint8_t *src, int K, uint8_t *dst) {
    if (is_16bit(fmt)) {
        memcpy(dst, src, (size_t)K * 2);
        return;
    }
    const int nb = K / 32;
    uint8_t *codes = dst, *planes = dst + (size_t)nb * code_bytes(fmt);
    uint8_t *meta = dst + (size_t)nb * (code_bytes(fmt) + plane_bytes(fmt));
    uint8_t q[256];
    if (!is_kquant(fmt)) {
        int per;
        const int bytes = native_block(fmt, &per);
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = src + (size_t)b * bytes;
            memcpy(meta + 2 * b, blk, 2);                                 /* d */
            if (has_min(fmt)) memcpy(meta + 2 * (size_t)nb + 2 * b, blk + 2, 2);  /* m */
            if (fmt == FMT_Q8_0) {
                memcpy(codes + 32 * (size_t)b, blk + 2, 32);
                continue;
            }
            const uint8_t *qs = blk + bytes - 16;
            if (!is_5bit(fmt)) {
                memcpy(codes + 16 * (size_t)b, qs, 16);  /* the nibbles are already in our order */
                continue;
            }
            uint32_t qh;  /* bit i: bit 4 of weight i */
            memcpy(&qh, blk + (has_min(fmt) ? 4 : 2), 4);
            for (int i = 0; i < 16; i++) {
                q[i] = (uint8_t)((qs[i] & 15) | ((qh >> i) & 1) << 4);
                q[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
            }
            put_codes(fmt, q, codes + 16 * (size_t)b, planes + 4 * (size_t)b);
        }
        return;
    }
    int per;
    const int bytes = native_block(fmt, &per);
    for (int s = 0; s < nb / 8; s++) {
        const uint8_t *blk = src + (size_t)s * bytes;
        if (fmt == FMT_Q6_K) {
            const uint8_t *ql = blk, *qh = blk + 128, *sc = blk + 192;
            for (int n = 0; n < 2; n++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t *a = ql + 64 * n, h = qh[32 * n + l];
                    q[128 * n + l] = (uint8_t)((a[l] & 15) | (h & 3) << 4);
                    q[128 * n + 32 + l] = (uint8_t)((a[l + 32] & 15) | ((h >> 2) & 3) << 4);
                    q[128 * n + 64 + l] = (uint8_t)((a[l] >> 4) | ((h >> 4) & 3) << 4);
                    q[128 * n + 96 + l] = (uint8_t)((a[l + 32] >> 4) | ((h >> 6) & 3) << 4);
                }
            uint8_t *m = meta + (size_t)s * 18;
            memcpy(m, blk + 208, 2);
            for (int j = 0; j < 8; j++) {
                m[2 + j] = sc[2 * j];
                m[10 + j] = sc[2 * j + 1];
            }
        } else {  /* Q4_K, Q5_K: d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of bit 4), codes */
            const uint8_t *scales = blk + 4;
            const uint8_t *qh = fmt == FMT_Q5_K ? blk + 16 : NULL;
            const uint8_t *qs = blk + (fmt == FMT_Q5_K ? 48 : 16);
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    q[64 * c + l] = qs[32 * c + l] & 15;
                    q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
                    if (qh) {
                        q[64 * c + l] |= (uint8_t)(((qh[l] >> (2 * c)) & 1) << 4);
                        q[64 * c + 32 + l] |= (uint8_t)(((qh[l] >> (2 * c + 1)) & 1) << 4);
                    }
                }
            uint8_t *m = meta + (size_t)s * 20;
            memcpy(m, blk, 4);
            for (int j = 0; j < 8; j++) scale_min_k4(j, scales, m + 4 + j, m + 12 + j);
        }
        for (int j = 0; j < 8; j++) {
            const int b = 8 * s + j;
            put_codes(fmt, q + 32 * j, codes + 16 * (size_t)b, planes + (size_t)plane_bytes(fmt) * b);
        }
    }
}

/* ``rows`` rows of ggml blocks ([rows, native row bytes], as a GGUF file stores a tensor) ->
 * packed rows [rows, tri_row_bytes]. Returns 0, or -1 for a format or K the kernels do not take. */
int tri_pack(int fmt, const uint8_t *src, int64_t rows, int K, uint8_t *dst, int nthreads) {
    const size_t in = tri_native_row_bytes(fmt, K), out = tri_row_bytes(fmt, K);
    if (in == 0 || out == 0 || rows < 0)
        return -1;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++)
        pack_row(fmt, src + (size_t)r * in, K, dst + (size_t)r * out);
    return 0;
}

/* -- the 8-row interleaved layout (x8) ---------------------------------------------------------
 *
 * Why: the int8 GEMM over the row layout ends each (weight row, x row, 8 blocks) with a float
 * reduction of 8 blocks' integer sums (3 hadd, a permute, a convert, two FMAs), as much work as
 * the products themselves. Interleaving 8 weight rows so that 32-bit lane r of a vector holds 4
 * consecutive codes of row r (llama.cpp's repacked block_q4_Kx8) lets one vpdpbusd against 4
 * bytes of x broadcast to every lane accumulate 8 output rows at once: no horizontal sum, and
 * the scales of 8 rows are applied as one vector. Only the int8 path reads it (lin_valid), for
 * Q4_K and Q6_K (the bytes of a Q4_K_M file); the layout is chosen per tensor when a model is
 * loaded for int8 activations (kernels/cpu.py, PackedWeight.with_layout).
 *
 * A part's first rows / 8 * 8 rows are groups of 8, each group taking the bytes of its 8 rows
 * (so sizes, row offsets and the concatenation of parts are those of the row layout); the last
 * rows % 8 stay in the row layout. A group is a chunk per super-block (256 weights), holding:
 *   Q4_K (8 * 148 B): per block j of the 8: 128 B of codes; then fp16 d[8 rows], fp16
 *        dmin[8], uint8 sc[block j][row r] (64 B), uint8 mn[j][r] (64 B).
 *   Q6_K (8 * 210 B): per block: 128 B of codes; per block: 64 B of bits 4-5; then fp16 d[8],
 *        int8 scales of the first halves [j][r] (64 B), of the second halves [j][r] (64 B).
 * A block's 128 B of codes are 4 vectors of 32 B; vector v's bytes 4r..4r+3 are row r's nibble
 * bytes 4v..4v+3 of the row layout: low nibbles weights 4v..4v+3, high nibbles 16+4v..16+4v+3.
 * Q6_K's bits 4-5 are 2 vectors: byte 4r+i of the first holds in bits 2v, 2v+1 those of row r's
 * weight 4v+i, the second those of weight 16+4v+i. */

#define X8 8
#define FMT_X8 0x100  /* in tri_lin.fmt: the part is in the x8 layout */

static inline int x8_format(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K; }

/* Bytes of one super-block's chunk of a group. */
static inline size_t x8_chunk(int fmt) { return fmt == FMT_Q6_K ? 8 * 210 : 8 * 148; }

/* A row-layout block's natural codes (0..63) into q[32]. */
static void row_block_codes(int fmt, const uint8_t *row, int nb, int b, uint8_t q[32]) {
    const uint8_t *nib = row + 16 * (size_t)b;
    for (int j = 0; j < 16; j++) {
        q[j] = nib[j] & 15;
        q[j + 16] = nib[j] >> 4;
    }
    if (fmt == FMT_Q6_K) {
        const uint8_t *h = row_planes(fmt, row, nb) + 8 * (size_t)b;
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 4; j++) q[i + 8 * j] |= (uint8_t)(((h[i] >> (2 * j)) & 3) << 4);
    }
}

/* 8 row-layout rows (``rows``, rb bytes apart) -> one x8 group (``g``, 8 * rb bytes). */
static void x8_from_rows(int fmt, const uint8_t *rows, size_t rb, int nb, uint8_t *g) {
    const size_t ch = x8_chunk(fmt);
    for (int s = 0; s < nb / 8; s++) {
        uint8_t *c = g + (size_t)s * ch;
        for (int r = 0; r < X8; r++) {
            const uint8_t *row = rows + r * rb;
            const uint8_t *meta = row_meta(fmt, row, nb) + (size_t)s * (fmt == FMT_Q6_K ? 18 : 20);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * s + j;
                for (int v = 0; v < 4; v++)
                    memcpy(c + 128 * j + 32 * v + 4 * r, row + 16 * (size_t)b + 4 * v, 4);
                if (fmt == FMT_Q6_K) {
                    uint8_t q[32];
                    row_block_codes(fmt, row, nb, b, q);
                    uint8_t *h = c + 1024 + 64 * j;
                    for (int i = 0; i < 4; i++) {
                        uint8_t lo = 0, hi = 0;
                        for (int v = 0; v < 4; v++) {
                            lo |= (uint8_t)((q[4 * v + i] >> 4) << (2 * v));
                            hi |= (uint8_t)((q[16 + 4 * v + i] >> 4) << (2 * v));
                        }
                        h[4 * r + i] = lo;
                        h[32 + 4 * r + i] = hi;
                    }
                }
            }
            if (fmt == FMT_Q6_K) {
                memcpy(c + 1536 + 2 * r, meta, 2);
                for (int j = 0; j < 8; j++) {
                    c[1552 + 8 * j + r] = meta[2 + j];
                    c[1616 + 8 * j + r] = meta[10 + j];
                }
            } else {
                memcpy(c + 1024 + 2 * r, meta, 2);
                memcpy(c + 1040 + 2 * r, meta + 2, 2);
                for (int j = 0; j < 8; j++) {
                    c[1056 + 8 * j + r] = meta[4 + j];
                    c[1120 + 8 * j + r] = meta[12 + j];
                }
            }
        }
    }
}

/* Row r of an x8 group -> its row-layout bytes (``row``, rb bytes). */
static void x8_to_row(int fmt, const uint8_t *g, int r, int nb, uint8_t *row) {
    const size_t ch = x8_chunk(fmt);
    uint8_t *planes = row + (size_t)nb * 16;
    uint8_t *meta = row + (size_t)nb * (16 + plane_bytes(fmt));
    for (int s = 0; s < nb / 8; s++) {
        const uint8_t *c = g + (size_t)s * ch;
        for (int j = 0; j < 8; j++) {
            const int b = 8 * s + j;
            for (int v = 0; v < 4; v++)
                memcpy(row + 16 * (size_t)b + 4 * v, c + 128 * j + 32 * v + 4 * r, 4);
            if (fmt == FMT_Q6_K) {
                const uint8_t *h = c + 1024 + 64 * j;
                uint8_t q[32];
                for (int i = 0; i < 4; i++)
                    for (int v = 0; v < 4; v++) {
                        q[4 * v + i] = (h[4 * r + i] >> (2 * v)) & 3;
                        q[16 + 4 * v + i] = (h[32 + 4 * r + i] >> (2 * v)) & 3;
                    }
                uint8_t *p = planes + 8 * (size_t)b;
                for (int i = 0; i < 8; i++) {
                    uint8_t w = 0;
                    for (int jj = 0; jj < 4; jj++) w |= (uint8_t)(q[i + 8 * jj] << (2 * jj));
                    p[i] = w;
                }
            }
        }
        if (fmt == FMT_Q6_K) {
            uint8_t *m = meta + (size_t)s * 18;
            memcpy(m, c + 1536 + 2 * r, 2);
            for (int j = 0; j < 8; j++) {
                m[2 + j] = c[1552 + 8 * j + r];
                m[10 + j] = c[1616 + 8 * j + r];
            }
        } else {
            uint8_t *m = meta + (size_t)s * 20;
            memcpy(m, c + 1024 + 2 * r, 2);
            memcpy(m + 2, c + 1040 + 2 * r, 2);
            for (int j = 0; j < 8; j++) {
                m[4 + j] = c[1056 + 8 * j + r];
                m[12 + j] = c[1120 + 8 * j + r];
            }
        }
    }
}

/* -- the 16-row interleaved layout (x16), for the exact kernels ---------------------------------
 *
 * The exact row kernel (dot_row) sums each block's 32 products as 8 lanes of partial sums, then
 * adds the lanes, scales the sum and adds it into the row's total: per block and row of x, a
 * horizontal reduction, a store and a reload next to its 4 FMAs. x16 puts one weight row in
 * each 32-bit lane instead (16 rows a group: a 512-bit vector's lanes, two 256-bit vectors'
 * without AVX-512), so a block's codes of 16 rows widen to floats with one instruction per 16
 * weights and every sum of dot_row is made lane by lane, with x broadcast: the same products,
 * the same FMAs and the same additions in the same order for each (weight row, x row), only no
 * reduction across lanes. The results are bitwise dot_row's (tested), which is why the exact
 * path can take this layout where it has the kernel: a sequence's logits stay those of the row
 * layout, of any batch, of any build.
 *
 * A part's first rows / 16 * 16 rows are groups of 16, each taking the bytes of its 16 rows; the
 * last rows % 16 stay in rows. A group is a chunk per unit (a block of 32 weights; a super-block
 * of 256 for the K-quants) holding, for its blocks j in order, the codes as segments of 16 bytes
 * (segment s: one byte of each of the 16 rows, row r at byte r), then the scales:
 *   4-bit codes (all but Q8_0: the low 4 bits of 5- and 6-bit ones): 16 segments a block, segment 2i the rows'
 *        nibble byte i (weights i and 16 + i), segment 2i + 1 their byte 8 + i (8 + i, 24 + i);
 *   Q8_0: 32 segments a block, segment 4i + j the rows' code byte 8j + i;
 *   high bits, after the unit's codes: a segment per plane byte of a block (Q5_0, Q5_1, Q5_K: 4
 *        a block, segment t the rows' byte t of bit 4; Q6_K: 8, segment i the rows' byte i);
 *   then Q4_0, Q5_0, Q8_0: fp16 d[16]; Q4_1, Q5_1: d[16], m[16]; Q4_K, Q5_K: d[16], dmin[16],
 *        sc[8][16], mn[8][16]; Q6_K: d[16], the first halves' scales [8][16], the second
 *        halves' [8][16]. Every block format has it; 16-bit floats stay in rows. */

#define X16 16
#define FMT_X16 0x200  /* in tri_lin.fmt: the part is in the x16 layout */

static inline int x16_format(int fmt) { return !is_16bit(fmt); }

/* Blocks of a unit, and bytes of one unit's chunk of a group. */
static inline int x16_unit_blocks(int fmt) { return is_kquant(fmt) ? 8 : 1; }
static inline size_t x16_chunk(int fmt) {
    const int nbu = x16_unit_blocks(fmt);
    return X16 * (nbu * (size_t)(code_bytes(fmt) + plane_bytes(fmt)) + meta_bytes(fmt, nbu));
}
/* Where a chunk's scales start, and where block j's high bits are in it. */
static inline size_t x16_meta_at(int fmt) {
    return X16 * (size_t)x16_unit_blocks(fmt) * (code_bytes(fmt) + plane_bytes(fmt));
}
static inline size_t x16_planes_at(int fmt, int j) {
    return X16 * ((size_t)x16_unit_blocks(fmt) * code_bytes(fmt) + (size_t)j * plane_bytes(fmt));
}

/* Row r of a group <-> its row-layout bytes (``row``, of nb blocks): to the group with
 * ``to_group``, else back. */
static void x16_move_row(int fmt, uint8_t *row, int nb, uint8_t *g, int r, int to_group) {
    const int nbu = x16_unit_blocks(fmt), cb = code_bytes(fmt);
    const size_t ch = x16_chunk(fmt), M = x16_meta_at(fmt);
    uint8_t *planes = row + (size_t)nb * cb, *meta = row + (size_t)nb * (cb + plane_bytes(fmt));
#define X16_MOVE(group_at, row_at) \
    do { if (to_group) (group_at) = (row_at); else (row_at) = (group_at); } while (0)
    for (int u = 0; u < nb / nbu; u++) {
        uint8_t *c = g + (size_t)u * ch;
        for (int j = 0; j < nbu; j++) {
            const int b = u * nbu + j;
            uint8_t *codes = c + (size_t)j * X16 * cb;
            for (int t = 0; t < cb; t++) {
                const int s = cb == 16 ? (t < 8 ? 2 * t : 2 * (t - 8) + 1) : 4 * (t % 8) + t / 8;
                X16_MOVE(codes[16 * s + r], row[(size_t)b * cb + t]);
            }
            for (int t = 0; t < plane_bytes(fmt); t++)
                X16_MOVE(c[x16_planes_at(fmt, j) + 16 * t + r], planes[(size_t)plane_bytes(fmt) * b + t]);
        }
        uint8_t *m = c + M;
        if (is_kquant(fmt)) {
            uint8_t *rm = meta + (size_t)u * (fmt == FMT_Q6_K ? 18 : 20);
            X16_MOVE(m[2 * r], rm[0]);
            X16_MOVE(m[2 * r + 1], rm[1]);
            const int first = fmt == FMT_Q6_K ? 2 : 4, at = fmt == FMT_Q6_K ? 32 : 64;
            if (fmt != FMT_Q6_K) {
                X16_MOVE(m[32 + 2 * r], rm[2]);
                X16_MOVE(m[32 + 2 * r + 1], rm[3]);
            }
            for (int j = 0; j < 8; j++) {
                X16_MOVE(m[at + 16 * j + r], rm[first + j]);
                X16_MOVE(m[at + 128 + 16 * j + r], rm[first + 8 + j]);
            }
        } else {
            X16_MOVE(m[2 * r], meta[2 * (size_t)u]);
            X16_MOVE(m[2 * r + 1], meta[2 * (size_t)u + 1]);
            if (has_min(fmt)) {
                X16_MOVE(m[32 + 2 * r], meta[2 * (size_t)nb + 2 * u]);
                X16_MOVE(m[32 + 2 * r + 1], meta[2 * (size_t)nb + 2 * u + 1]);
            }
        }
    }
#undef X16_MOVE
}

/* Rows a group of the layout in ``fmt``'s flags holds (1: the row layout). */
static inline int layout_rows(int fmt) {
    return fmt & FMT_X8 ? X8 : fmt & FMT_X16 ? X16 : 1;
}

/* Packed rows [rows, row_bytes] of ``fmt`` converted in place between the row layout and
 * ``layout`` (FMT_X8 or FMT_X16): to it with ``to_layout``, else back. Returns 0, -1 for a
 * format without that layout or a bad size, -2 without scratch memory. */
int tri_relayout(int fmt, uint8_t *data, int64_t rows, int K, size_t row_bytes, int layout,
                 int to_layout, int nthreads) {
    const size_t rb = tri_row_bytes(fmt, K);
    const int ok = layout == FMT_X8 ? x8_format(fmt) : layout == FMT_X16 ? x16_format(fmt) : 0;
    if (!ok || rb == 0 || row_bytes != rb || rows < 0)
        return -1;
    const int nb = K / 32, G = layout_rows(layout);
    const int64_t groups = rows / G;
    int rc = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        uint8_t *tmp = malloc(G * rb);
        if (!tmp) {
            #pragma omp atomic write
            rc = -2;
        }
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (!tmp) continue;
            uint8_t *at = data + (size_t)g * G * rb;
            memcpy(tmp, at, G * rb);
            if (G == X8 && to_layout)
                x8_from_rows(fmt, tmp, rb, nb, at);
            else
                for (int r = 0; r < G; r++) {
                    if (G == X8) x8_to_row(fmt, tmp, r, nb, at + r * rb);
                    else if (to_layout) x16_move_row(fmt, tmp + r * rb, nb, at, r, 1);
                    else x16_move_row(fmt, at + r * rb, nb, tmp, r, 0);
                }
        }
        free(tmp);
    }
    return rc;
}

/* Row n of a packed tensor (``fmt`` with FMT_X8 or FMT_X16 where it is in that layout, of
 * ``rows`` rows) in the row layout: the row itself, or copied out of its group into ``buf`` (rb
 * bytes). */
static const uint8_t *row_in_row_layout(int fmt, const uint8_t *w, size_t rb, int64_t rows,
                                        int64_t n, int K, uint8_t *buf) {
    const int G = layout_rows(fmt);
    if (G == 1 || n >= rows / G * G)
        return w + (size_t)n * rb;
    const uint8_t *g = w + (size_t)(n / G) * G * rb;
    if (G == X8)
        x8_to_row(fmt & 0xFF, g, (int)(n % G), K / 32, buf);
    else
        x16_move_row(fmt & 0xFF, buf, K / 32, (uint8_t *)g, (int)(n % G), 0);
    return buf;
}

/* -- reading packed blocks ------------------------------------------------------------------------ */

/* a | (b & m): one vpternlogd with AVX512VL, an and and an or without. */
INLINE __m256i or_bits(__m256i a, __m256i b, __m256i m) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
    return _mm256_ternarylogic_epi32(a, b, m, 0xF8);
#else
    return _mm256_or_si256(a, _mm256_and_si256(b, m));
#endif
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_VBMI 1
#else
#define HAVE_VBMI 0
#endif

#if HAVE_VBMI
/* Block b's 4-bit parts as bytes in natural order (byte k: weight k): its 16 nibble bytes in
 * both halves of a vector, the second half shifted by 4, then masked. */
INLINE __m256i nibble_bytes(const uint8_t *row, int b) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + 16 * (size_t)b)));
    return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

/* Bytes 8j..8j+7 of v zero-extended to the 8 int32 lanes (one vpermb, zero-masked). */
INLINE __m256i widen_bytes(__m256i v, int j) {
    return _mm256_maskz_permutexvar_epi8(0x11111111u,
        _mm256_setr_epi32(8 * j, 8 * j + 1, 8 * j + 2, 8 * j + 3, 8 * j + 4, 8 * j + 5, 8 * j + 6, 8 * j + 7), v);
}
#endif

/* Block b's 32 codes as floats: f[0] weights 0-7, f[1] 8-15, f[2] 16-23, f[3] 24-31 (Q6_K's
 * less 32 with ``q6_centred``; the few-rows kernel applies its -32 through x's half-block sums
 * instead). Called with constant fmt and flag, so it compiles to one format's code. Every path
 * below gives the same integer codes, so the floats, and every sum made of them, do not depend
 * on the instructions the build has. */
INLINE void block_codes_q6(int fmt, const uint8_t *row, int nb, int b, __m256 f[4], int q6_centred) {
    if (fmt == FMT_Q8_0) {
        for (int j = 0; j < 4; j++)
            f[j] = i8x8_to_float(_mm_loadl_epi64((const __m128i *)(row + 32 * (size_t)b + 8 * j)));
        return;
    }
    __m256i c[4];
    const uint8_t *p = row_planes(fmt, row, nb) + (size_t)plane_bytes(fmt) * b;
#if HAVE_VBMI
    if (is_5bit(fmt) || fmt == FMT_Q6_K) {
        /* the codes built as 32 bytes, then widened: the high bits cost one or two instructions
         * a block, not a shift, an and and an or per 8 weights */
        __m256i q = nibble_bytes(row, b);
        if (is_5bit(fmt)) {  /* bit k of the word: bit 4 of weight k, a byte mask */
            uint32_t w;
            memcpy(&w, p, 4);
            q = _mm256_mask_add_epi8(q, (__mmask32)w, q, _mm256_set1_epi8(0x10));  /* = or */
        } else {  /* byte i's bits 2j, 2j + 1 (weight 8j + i) to bits 4-5 of byte 8j + i: each
                   * byte picks its 8 bits at 8i + 2j - 4 of the 8 plane bytes (vpmultishiftqb) */
            uint64_t h;
            memcpy(&h, p, 8);
            const __m256i ctl = _mm256_setr_epi8(
                60, 4, 12, 20, 28, 36, 44, 52,  62, 6, 14, 22, 30, 38, 46, 54,
                0, 8, 16, 24, 32, 40, 48, 56,  2, 10, 18, 26, 34, 42, 50, 58);
            q = or_bits(q, _mm256_multishift_epi64_epi8(ctl, _mm256_set1_epi64x((long long)h)),
                        _mm256_set1_epi8(0x30));
        }
        for (int j = 0; j < 4; j++) c[j] = widen_bytes(q, j);
        if (fmt == FMT_Q6_K && q6_centred)
            for (int j = 0; j < 4; j++) c[j] = _mm256_sub_epi32(c[j], _mm256_set1_epi32(32));
        for (int j = 0; j < 4; j++) f[j] = _mm256_cvtepi32_ps(c[j]);
        return;
    }
#endif
    /* 8 code bytes widened to 8 lanes (the load folds into the widening), then each lane's two
     * nibbles: byte j holds weights j (low) and j + 16 (high). */
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 16 * (size_t)b + 8 * h)));
        c[h] = _mm256_and_si256(v, low4);
        c[h + 2] = _mm256_srli_epi32(v, 4);
    }
    if (is_5bit(fmt)) {  /* bit 8j + i of the word (weight 8j + i) to bit 4 of lane i of c[j] */
        uint32_t w;
        memcpy(&w, p, 4);
        const __m256i bit4 = _mm256_set1_epi32(16);
        const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        c[0] = or_bits(c[0], _mm256_slli_epi32(v, 4), bit4);
        for (int j = 1; j < 4; j++) c[j] = or_bits(c[j], _mm256_srli_epi32(v, 8 * j - 4), bit4);
    } else if (fmt == FMT_Q6_K) {  /* lane i's byte, two bits per vector, to bits 4-5 */
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        const __m256i bits45 = _mm256_set1_epi32(0x30), off = _mm256_set1_epi32(32);
        c[0] = or_bits(c[0], _mm256_slli_epi32(v, 4), bits45);
        c[1] = or_bits(c[1], _mm256_slli_epi32(v, 2), bits45);
        c[2] = or_bits(c[2], v, bits45);
        c[3] = or_bits(c[3], _mm256_srli_epi32(v, 2), bits45);
        if (q6_centred)
            for (int j = 0; j < 4; j++) c[j] = _mm256_sub_epi32(c[j], off);
    }
    for (int j = 0; j < 4; j++) f[j] = _mm256_cvtepi32_ps(c[j]);
}

INLINE void block_codes(int fmt, const uint8_t *row, int nb, int b, __m256 f[4]) {
    block_codes_q6(fmt, row, nb, b, f, 1);
}

/* Block b's scale and offset (w = code * scale + offset; Q6_K: *s0 for weights 0-15, *s1 for
 * 16-31, no offset). */
INLINE void block_affine(int fmt, const uint8_t *meta, int nb, int b, float *s0, float *s1,
                         float *off) {
    if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) {
        const uint8_t *m = meta + (size_t)(b / 8) * 20;
        *s0 = *s1 = half_to_float(m) * m[4 + b % 8];
        *off = -half_to_float(m + 2) * m[12 + b % 8];
        return;
    }
    if (fmt == FMT_Q6_K) {
        const uint8_t *m = meta + (size_t)(b / 8) * 18;
        const float d = half_to_float(m);
        *s0 = d * (int8_t)m[2 + b % 8];
        *s1 = d * (int8_t)m[10 + b % 8];
        *off = 0.0f;
        return;
    }
    const float d = half_to_float(meta + 2 * (size_t)b);
    *s0 = *s1 = d;
    *off = has_min(fmt) ? half_to_float(meta + 2 * (size_t)nb + 2 * b)
         : fmt == FMT_Q4_0 ? -8.0f * d : fmt == FMT_Q5_0 ? -16.0f * d : 0.0f;
}

/* 8 floats from 8 16-bit values of ``fmt`` (F16 or BF16). */
INLINE __m256 load16(int fmt, const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    if (fmt == FMT_F16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

INLINE void dequant_row_fmt(int fmt, const uint8_t *row, int K, float *out) {
    if (is_16bit(fmt)) {
        for (int k = 0; k < K; k += 8) _mm256_storeu_ps(out + k, load16(fmt, row + 2 * (size_t)k));
        return;
    }
    const int nb = K / 32;
    const uint8_t *meta = row_meta(fmt, row, nb);
    for (int b = 0; b < nb; b++) {
        __m256 f[4];
        float s0, s1, off;
        block_codes(fmt, row, nb, b, f);
        block_affine(fmt, meta, nb, b, &s0, &s1, &off);
        const __m256 o = _mm256_set1_ps(off);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(out + 32 * (size_t)b + 8 * j,
                             _mm256_fmadd_ps(f[j], _mm256_set1_ps(j < 2 ? s0 : s1), o));
    }
}

/* One row of K weights (K a multiple of 32) -> fp32. */
static void dequant_row(int fmt, const uint8_t *row, int K, float *out) {
    switch (fmt) {
    case FMT_F16: dequant_row_fmt(FMT_F16, row, K, out); break;
    case FMT_BF16: dequant_row_fmt(FMT_BF16, row, K, out); break;
    case FMT_Q4_0: dequant_row_fmt(FMT_Q4_0, row, K, out); break;
    case FMT_Q4_1: dequant_row_fmt(FMT_Q4_1, row, K, out); break;
    case FMT_Q5_0: dequant_row_fmt(FMT_Q5_0, row, K, out); break;
    case FMT_Q5_1: dequant_row_fmt(FMT_Q5_1, row, K, out); break;
    case FMT_Q8_0: dequant_row_fmt(FMT_Q8_0, row, K, out); break;
    case FMT_Q4_K: dequant_row_fmt(FMT_Q4_K, row, K, out); break;
    case FMT_Q5_K: dequant_row_fmt(FMT_Q5_K, row, K, out); break;
    case FMT_Q6_K: dequant_row_fmt(FMT_Q6_K, row, K, out); break;
    }
}

/* R rows of x (R <= MT, a constant where it is inlined) times the NT dequantized rows in w:
 * y[r, n0 + t]. Each product is 8 lanes of partial sums over k, FMA after FMA, then summed
 * across the lanes, the same order for any R, so a row's result does not depend on which
 * rows share its register block. */
INLINE void tile_block(const float *x, int ldx, int R, int K, const float *w, const float *bias,
                       float *y, int ldy, int n0) {
    __m256 a[MT][NT];
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        #pragma GCC unroll 8
        for (int t = 0; t < NT; t++) a[r][t] = _mm256_setzero_ps();
    }
    for (int k = 0; k < K; k += 8) {
        __m256 wv[NT];
        #pragma GCC unroll 8
        for (int t = 0; t < NT; t++) wv[t] = _mm256_loadu_ps(w + (size_t)t * K + k);
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256 v = _mm256_loadu_ps(x + (size_t)r * ldx + k);
            #pragma GCC unroll 8
            for (int t = 0; t < NT; t++) a[r][t] = _mm256_fmadd_ps(wv[t], v, a[r][t]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        #pragma GCC unroll 8
        for (int t = 0; t < NT; t++)
            y[(size_t)r * ldy + n0 + t] = hsum(a[r][t]) + (bias ? bias[n0 + t] : 0.0f);
    }
}

/* y[m, n0 + t] for t < nt and m in [m0, m1): x rows times the nt (<= NT) dequantized rows in w. */
static void tile(const float *x, int ldx, int m0, int m1, int K, const float *w, int nt,
                 const float *bias, float *y, int ldy, int n0) {
    int m = m0;
    if (nt == NT) {
        for (; m + MT <= m1; m += MT)
            tile_block(x + (size_t)m * ldx, ldx, MT, K, w, bias, y + (size_t)m * ldy, ldy, n0);
        switch (m1 - m) {  /* the rows left over, in one block of their own */
#if MT > 5
        case 5: tile_block(x + (size_t)m * ldx, ldx, 5, K, w, bias, y + (size_t)m * ldy, ldy, n0); return;
        case 4: tile_block(x + (size_t)m * ldx, ldx, 4, K, w, bias, y + (size_t)m * ldy, ldy, n0); return;
        case 3: tile_block(x + (size_t)m * ldx, ldx, 3, K, w, bias, y + (size_t)m * ldy, ldy, n0); return;
#endif
#if MT > 2
        case 2: tile_block(x + (size_t)m * ldx, ldx, 2, K, w, bias, y + (size_t)m * ldy, ldy, n0); return;
#endif
        case 1: tile_block(x + (size_t)m * ldx, ldx, 1, K, w, bias, y + (size_t)m * ldy, ldy, n0); return;
        default: return;
        }
    }
    for (; m < m1; m++) {  /* a short tile (a part's last rows): one product at a time */
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


/* Weight bytes PREFETCH_AHEAD past where a group of 8 blocks of a row reads, asked of the
 * cache as the group starts: the row (``rb`` bytes, ``nb`` blocks) and the rows after it stream
 * in ahead of the kernels at the pace they read them. Asking for a whole row ahead at once, as
 * before, left long rows (K = 8192: 4.6-6.7 KB) at half the bandwidth: measured at 1 thread
 * over 130 MB of Q4_K and Q6_K, 6.5 -> 15 GB/s and 5.4 -> 11 GB/s. A prefetch cannot fault, so
 * reading past the last row is harmless. */
#define PREFETCH_AHEAD 4096

INLINE void prefetch_group(const uint8_t *row, size_t rb, int b, int nb) {
    const char *p = (const char *)row + PREFETCH_AHEAD + rb * b / nb;
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
    _mm_prefetch(p + 128, _MM_HINT_T0);
}

/* dot(codes f of one block, x_b) as 8 partial sums (fp32 x); Q6_K's two halves apart in *hi, its
 * codes not centred (see group_f32). dot_rows calls it once per row of x on codes unpacked once. */
INLINE __m256 codes_dot_ps(int fmt, const __m256 f[4], const float *xb, __m256 *hi) {
    __m256 s = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), s);
    if (fmt == FMT_Q6_K) {
        *hi = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
        return s;
    }
    s = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), s);
    return _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), s);
}

/* dot(codes of block b, x_b): its codes unpacked, then codes_dot_ps. */
INLINE __m256 block_dot_ps(int fmt, const uint8_t *row, int nb, int b, const float *xb, __m256 *hi) {
    __m256 f[4];
    block_codes_q6(fmt, row, nb, b, f, 0);
    return codes_dot_ps(fmt, f, xb, hi);
}

/* The scales and offsets of the 8 blocks from b (b a multiple of 8), for the formats with one
 * scale a block (all but Q6_K). */
INLINE void group_affine(int fmt, const uint8_t *meta, int nb, int b, __m256 *scale, __m256 *off) {
    if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) {
        const uint8_t *m = meta + (size_t)(b / 8) * 20;
        *scale = _mm256_mul_ps(_mm256_set1_ps(half_to_float(m)),
                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m + 4)))));
        *off = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(m + 2)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m + 12)))));
        return;
    }
    *scale = load_halves(meta + 2 * (size_t)b);
    *off = has_min(fmt) ? load_halves(meta + 2 * (size_t)nb + 2 * b)
         : _mm256_mul_ps(*scale, _mm256_set1_ps(fmt == FMT_Q4_0 ? -8.0f : fmt == FMT_Q5_0 ? -16.0f : 0.0f));
}

/* The scales d * sc of the first (lo) and second (hi) halves of Q6_K's 8 blocks from b, as
 * vectors and as arrays. */
INLINE void q6k_group_scales(const uint8_t *meta, int b, __m256 *slo, __m256 *shi,
                             float lo[8], float hi[8]) {
    const uint8_t *m = meta + (size_t)(b / 8) * 18;
    const __m256 d = _mm256_set1_ps(half_to_float(m));
    *slo = _mm256_mul_ps(d, i8x8_to_float(_mm_loadl_epi64((const __m128i *)(m + 2))));
    *shi = _mm256_mul_ps(d, i8x8_to_float(_mm_loadl_epi64((const __m128i *)(m + 10))));
    _mm256_storeu_ps(lo, *slo);
    _mm256_storeu_ps(hi, *shi);
}

/* 8 blocks from b into acc: each block's sum of code * x times its scale, plus its offset times
 * the sum of its x (``xsum``). The scales and offsets of 8 blocks are applied as vectors. */
INLINE __m256 group_f32(int fmt, const uint8_t *row, const uint8_t *meta, int nb, int b,
                        const float *x, const float *xsum, __m256 acc) {
    __m256 v[8];
    if (fmt == FMT_Q6_K) {
        /* two scales a block, applied per block before the reduction; the codes' -32 comes as
         * -32 * scale * (sum of the half block's x), from x's half-block sums after its block
         * sums (xsum + nb: per group of 8 blocks, 8 first halves then 8 second halves) */
        __m256 slo, shi;
        float lo[8], hi[8];
        q6k_group_scales(meta, b, &slo, &shi, lo, hi);
        for (int j = 0; j < 8; j++) {
            __m256 h;
            const __m256 l = block_dot_ps(fmt, row, nb, b + j, x + (size_t)(b + j) * 32, &h);
            v[j] = _mm256_fmadd_ps(h, _mm256_set1_ps(hi[j]), _mm256_mul_ps(l, _mm256_set1_ps(lo[j])));
        }
        const float *halves = xsum + nb + 2 * (size_t)b;
        const __m256 off = _mm256_fmadd_ps(slo, _mm256_loadu_ps(halves),
                                           _mm256_mul_ps(shi, _mm256_loadu_ps(halves + 8)));
        return _mm256_add_ps(acc, _mm256_fmadd_ps(off, _mm256_set1_ps(-32.0f), reduce8_ps(v)));
    }
    for (int j = 0; j < 8; j++)
        v[j] = block_dot_ps(fmt, row, nb, b + j, x + (size_t)(b + j) * 32, NULL);
    __m256 scale, off;
    group_affine(fmt, meta, nb, b, &scale, &off);
    acc = _mm256_fmadd_ps(reduce8_ps(v), scale, acc);
    return fmt == FMT_Q8_0 ? acc : _mm256_fmadd_ps(off, _mm256_loadu_ps(xsum + b), acc);
}

INLINE float dot_row_fmt(int fmt, const uint8_t *row, size_t rb, const float *x, const float *xsum,
                         int K) {
    if (is_16bit(fmt)) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int k = 0; k < K; k += 32)
            for (int j = 0; j < 4; j++)
                a[j] = _mm256_fmadd_ps(load16(fmt, row + 2 * (size_t)(k + 8 * j)),
                                       _mm256_loadu_ps(x + k + 8 * j), a[j]);
        return hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    }
    const int nb = K / 32;
    const uint8_t *meta = row_meta(fmt, row, nb);
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        prefetch_group(row, rb, b, nb);
        acc = group_f32(fmt, row, meta, nb, b, x, xsum, acc);
    }
    /* the last nb % 8 blocks (none for the K-quants), one at a time; fmaf, not a * b + c * d,
     * so that the compiler's contraction cannot pick the order (dot_x16 repeats it) */
    float tail = 0.0f;
    for (; b < nb; b++) {
        float s0, s1, off;
        block_affine(fmt, meta, nb, b, &s0, &s1, &off);
        tail += fmaf(hsum(block_dot_ps(fmt, row, nb, b, x + (size_t)b * 32, NULL)), s0, off * xsum[b]);
    }
    return hsum(acc) + tail;
}

/* dot(w_row, x), exact: sum over blocks of scale * dot(codes, x_b) + offset * sum(x_b);
 * ``xsum`` holds sum(x_b) per block. */
static float dot_row(int fmt, const uint8_t *row, size_t rb, const float *x, const float *xsum, int K) {
    switch (fmt) {
    case FMT_F16: return dot_row_fmt(FMT_F16, row, rb, x, xsum, K);
    case FMT_BF16: return dot_row_fmt(FMT_BF16, row, rb, x, xsum, K);
    case FMT_Q4_0: return dot_row_fmt(FMT_Q4_0, row, rb, x, xsum, K);
    case FMT_Q4_1: return dot_row_fmt(FMT_Q4_1, row, rb, x, xsum, K);
    case FMT_Q5_0: return dot_row_fmt(FMT_Q5_0, row, rb, x, xsum, K);
    case FMT_Q5_1: return dot_row_fmt(FMT_Q5_1, row, rb, x, xsum, K);
    case FMT_Q8_0: return dot_row_fmt(FMT_Q8_0, row, rb, x, xsum, K);
    case FMT_Q4_K: return dot_row_fmt(FMT_Q4_K, row, rb, x, xsum, K);
    case FMT_Q5_K: return dot_row_fmt(FMT_Q5_K, row, rb, x, xsum, K);
    default: return dot_row_fmt(FMT_Q6_K, row, rb, x, xsum, K);
    }
}

/* -- a few rows of x, exact and batch invariant --------------------------------------------------- */

/* Rows of x that dot_rows multiplies with one weight row at a time: each block's codes are
 * unpacked once into registers and multiplied with every row's x. */
#define ROWS_MAX 8

/* out[r] = dot(w_row, x row r) for R <= ROWS_MAX rows of x (``ldx`` floats apart, their block
 * sums ``ldxs`` apart), each row's sum bitwise dot_row_fmt's for that row alone: the same
 * products and additions in the same order (group_f32's per group of 8 blocks, then the tail),
 * only the unpacking of the codes and scales shared between rows. Why: a sequence's logits then
 * do not depend on how many rows share its step (speculative decoding's verify rows, batches). */
INLINE void dot_rows_fmt(int fmt, const uint8_t *row, size_t rb, const float *x, size_t ldx,
                         const float *xsum, size_t ldxs, int K, int R, float *out) {
    if (is_16bit(fmt)) {
        /* dot_row_fmt's 4 accumulators per row; 3 rows at a time keep theirs in registers */
        for (int r0 = 0; r0 < R; r0 += 3) {
            const int n = R - r0 < 3 ? R - r0 : 3;
            __m256 a[3][4];
            for (int r = 0; r < 3; r++)
                for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
            for (int k = 0; k < K; k += 32)
                for (int j = 0; j < 4; j++) {
                    const __m256 w = load16(fmt, row + 2 * (size_t)(k + 8 * j));
                    for (int r = 0; r < n; r++)
                        a[r][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (r0 + r) * ldx + k + 8 * j), a[r][j]);
                }
            for (int r = 0; r < n; r++)
                out[r0 + r] = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]),
                                                 _mm256_add_ps(a[r][2], a[r][3])));
        }
        return;
    }
    const int nb = K / 32;
    const uint8_t *meta = row_meta(fmt, row, nb);
    __m256 acc[ROWS_MAX], v[ROWS_MAX][8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        prefetch_group(row, rb, b, nb);
        if (fmt == FMT_Q6_K) {  /* group_f32's Q6_K branch, row by row */
            __m256 slo, shi;
            float lo[8], hi[8];
            q6k_group_scales(meta, b, &slo, &shi, lo, hi);
            for (int j = 0; j < 8; j++) {
                __m256 f[4];
                block_codes_q6(fmt, row, nb, b + j, f, 0);
                const __m256 sl = _mm256_set1_ps(lo[j]), sh = _mm256_set1_ps(hi[j]);
                for (int r = 0; r < R; r++) {
                    __m256 h;
                    const __m256 l = codes_dot_ps(fmt, f, x + r * ldx + (size_t)(b + j) * 32, &h);
                    v[r][j] = _mm256_fmadd_ps(h, sh, _mm256_mul_ps(l, sl));
                }
            }
            for (int r = 0; r < R; r++) {
                const float *halves = xsum + r * ldxs + nb + 2 * (size_t)b;
                const __m256 off = _mm256_fmadd_ps(slo, _mm256_loadu_ps(halves),
                                                   _mm256_mul_ps(shi, _mm256_loadu_ps(halves + 8)));
                acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(off, _mm256_set1_ps(-32.0f), reduce8_ps(v[r])));
            }
            continue;
        }
        for (int j = 0; j < 8; j++) {
            __m256 f[4];
            block_codes_q6(fmt, row, nb, b + j, f, 0);
            for (int r = 0; r < R; r++)
                v[r][j] = codes_dot_ps(fmt, f, x + r * ldx + (size_t)(b + j) * 32, NULL);
        }
        __m256 scale, off;
        group_affine(fmt, meta, nb, b, &scale, &off);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(reduce8_ps(v[r]), scale, acc[r]);
            if (fmt != FMT_Q8_0)
                acc[r] = _mm256_fmadd_ps(off, _mm256_loadu_ps(xsum + r * ldxs + b), acc[r]);
        }
    }
    float tail[ROWS_MAX];  /* the last nb % 8 blocks (none for the K-quants), one at a time */
    for (int r = 0; r < R; r++) tail[r] = 0.0f;
    for (; b < nb; b++) {
        float s0, s1, off;
        __m256 f[4];
        block_affine(fmt, meta, nb, b, &s0, &s1, &off);
        block_codes_q6(fmt, row, nb, b, f, 0);
        for (int r = 0; r < R; r++)
            tail[r] += fmaf(hsum(codes_dot_ps(fmt, f, x + r * ldx + (size_t)b * 32, NULL)), s0,
                            off * xsum[r * ldxs + b]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + tail[r];
}

/* dot_rows_fmt with the number of rows known at compile time (so each row's sums keep to
 * registers), for the format at run time. */
#define DOT_ROWS_R(F, R) case R: dot_rows_fmt(F, row, rb, x, ldx, xsum, ldxs, K, R, out); break;
#define DOT_ROWS_FMT(F) \
    switch (R) { \
    DOT_ROWS_R(F, 1) DOT_ROWS_R(F, 2) DOT_ROWS_R(F, 3) DOT_ROWS_R(F, 4) \
    DOT_ROWS_R(F, 5) DOT_ROWS_R(F, 6) DOT_ROWS_R(F, 7) default: DOT_ROWS_R(F, 8) \
    } \
    break;

static void dot_rows(int fmt, const uint8_t *row, size_t rb, const float *x, size_t ldx,
                     const float *xsum, size_t ldxs, int K, int R, float *out) {
    switch (fmt) {
    case FMT_F16: DOT_ROWS_FMT(FMT_F16)
    case FMT_BF16: DOT_ROWS_FMT(FMT_BF16)
    case FMT_Q4_0: DOT_ROWS_FMT(FMT_Q4_0)
    case FMT_Q4_1: DOT_ROWS_FMT(FMT_Q4_1)
    case FMT_Q5_0: DOT_ROWS_FMT(FMT_Q5_0)
    case FMT_Q5_1: DOT_ROWS_FMT(FMT_Q5_1)
    case FMT_Q8_0: DOT_ROWS_FMT(FMT_Q8_0)
    case FMT_Q4_K: DOT_ROWS_FMT(FMT_Q4_K)
    case FMT_Q5_K: DOT_ROWS_FMT(FMT_Q5_K)
    default: DOT_ROWS_FMT(FMT_Q6_K)
    }
}
#undef DOT_ROWS_FMT
#undef DOT_ROWS_R

/* -- a few rows of x times a group of 16 weight rows in x16, bitwise dot_row ----------------------
 *
 * Lane r of every vector is weight row r of the group (16 lanes with AVX-512F; without it two
 * halves of 8 lanes, in one pass or one after the other: dot_x16). For block b and a row of x, P[i] (i < 8) is dot_row's
 * partial sum i, made with the same operations lane by lane: code(i) x[i], then FMAs of
 * code(8 + i) x[8 + i], code(16 + i) x[16 + i], code(24 + i) x[24 + i] (Q6_K: its two halves
 * apart, then scaled as group_f32 does); the block's sum adds them in reduce8_ps's order
 * ((P0 + P1) + (P2 + P3)) + ((P4 + P5) + (P6 + P7)), or in hsum's for a block past the last
 * whole group of 8 ((P0 + P4) + (P2 + P6)) + ((P1 + P5) + (P3 + P7)): the pairs come in the
 * order x16_order gives. The scaled block sums go into acc[b % 8], as they go into dot_row's
 * lane b % 8, and the row's result adds those 8 in hsum's order, then the tail. */

#ifdef __AVX512F__
typedef __m512 lf;
typedef __m512i li;
#define LW 16
#define L_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define L_I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define L_HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define L_CVT _mm512_cvtepi32_ps
#define L_ANDC(a, c) _mm512_and_si512((a), _mm512_set1_epi32(c))
#define L_OR _mm512_or_si512
#define L_SRL _mm512_srli_epi32
#define L_SLL _mm512_slli_epi32
#define L_FMA _mm512_fmadd_ps
#define L_MUL _mm512_mul_ps
#define L_ADD _mm512_add_ps
#define L_SET1 _mm512_set1_ps
#define L_ZERO _mm512_setzero_ps
#define L_NEG(a) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)))
#define L_STORE _mm512_storeu_ps
#else
typedef __m256 lf;
typedef __m256i li;
#define LW 8
#define L_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define L_I8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define L_HALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define L_CVT _mm256_cvtepi32_ps
#define L_ANDC(a, c) _mm256_and_si256((a), _mm256_set1_epi32(c))
#define L_OR _mm256_or_si256
#define L_SRL _mm256_srli_epi32
#define L_SLL _mm256_slli_epi32
#define L_FMA _mm256_fmadd_ps
#define L_MUL _mm256_mul_ps
#define L_ADD _mm256_add_ps
#define L_SET1 _mm256_set1_ps
#define L_ZERO _mm256_setzero_ps
#define L_NEG(a) _mm256_xor_ps((a), _mm256_set1_ps(-0.0f))
#define L_STORE _mm256_storeu_ps
#endif

/* The codes of partial sum i of a block (weights i, 8 + i, 16 + i, 24 + i) for the lanes from
 * byte ``h`` of each segment, as floats; Q6_K's not centred (its -32 comes through x's sums).
 * ``bit4``: the 5-bit formats' plane bytes 0-3 of the lanes, shifted left by 4 (byte j's bit i
 * is bit 4 of weight 8j + i). ``cb``: where not NULL, the block's whole codes as bytes
 * (x16_code_bytes, without AVX-512), read instead of ``codes``, ``planes`` and ``bit4``. */
INLINE void x16_codes(int fmt, const uint8_t *codes, const uint8_t *planes, const li bit4[4],
                      const uint8_t *cb, int i, int h, lf f[4]) {
    if (cb) {  /* whole codes as bytes (x16_code_bytes) */
        for (int j = 0; j < 4; j++) f[j] = L_CVT(L_U8(cb + 64 * i + 16 * j + h));
        return;
    }
    if (fmt == FMT_Q8_0) {
        for (int j = 0; j < 4; j++) f[j] = L_CVT(L_I8(codes + 16 * (4 * i + j) + h));
        return;
    }
    const li a = L_U8(codes + 16 * (2 * i) + h), b = L_U8(codes + 16 * (2 * i + 1) + h);
    li c[4] = {L_ANDC(a, 15), L_ANDC(b, 15), L_SRL(a, 4), L_SRL(b, 4)};
    if (fmt == FMT_Q6_K) {  /* plane byte i: bits 2j, 2j + 1 are bits 4-5 of weight i + 8j */
        const li p = L_U8(planes + 16 * i + h);
        c[0] = L_OR(c[0], L_ANDC(L_SLL(p, 4), 0x30));
        c[1] = L_OR(c[1], L_ANDC(L_SLL(p, 2), 0x30));
        c[2] = L_OR(c[2], L_ANDC(p, 0x30));
        c[3] = L_OR(c[3], L_ANDC(L_SRL(p, 2), 0x30));
    } else if (is_5bit(fmt)) {
        for (int j = 0; j < 4; j++) c[j] = L_OR(c[j], L_ANDC(L_SRL(bit4[j], i), 0x10));
    }
    for (int j = 0; j < 4; j++) f[j] = L_CVT(c[j]);
}

/* The order in which a block's 8 partial sums are added in pairs: reduce8_ps's (a whole group
 * of 8 blocks: 0, 1, ..., 7) and hsum's (a block past it: 0, 4, 2, 6, 1, 5, 3, 7, the 3-bit
 * reversal). Arithmetic rather than a table lookup: with k known, the compiler folds it. */
INLINE int x16_order(int tail_block, int k) {
    return tail_block ? ((k & 1) << 2) | (k & 2) | ((k >> 2) & 1) : k;
}

/* Without AVX-512, the 5- and 6-bit formats' whole codes of one block of the group's 16 rows,
 * made as bytes 32 at a time before the block's FMAs: cb[64 i + 16 j + r] is the code of weight
 * i + 8j of row r (x16_codes then widens each 8 with one vpmovzxbd). Put together lane by lane
 * in 8 lanes of 32 bits, each high bit took a shift, a mask and an OR per 8 weights; here one of
 * each serves 32. The codes are the same integers, so every float after them is unchanged. */
#ifndef __AVX512F__
#define X16_CODE_BYTES(fmt) (is_5bit(fmt) || (fmt) == FMT_Q6_K)
INLINE void x16_code_bytes(int fmt, const uint8_t *codes, const uint8_t *planes, uint8_t *cb) {
    const __m256i m4 = _mm256_set1_epi8(15);
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        /* segments 2i and 2i + 1: the rows' nibble bytes i and 8 + i */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * i));
        __m256i lo = _mm256_and_si256(v, m4);                         /* weights i | 8 + i */
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);   /* 16 + i | 24 + i */
        if (fmt == FMT_Q6_K) {  /* plane byte i: bits 2j, 2j + 1 are bits 4-5 of weight i + 8j;
                                  * 32-bit shifts (j = 0, 1 in lo's halves, 2, 3 in hi's): what
                                  * crosses from a neighbouring byte lands outside the mask */
            const __m256i pl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(planes + 16 * i)));
            const __m256i m = _mm256_set1_epi8(0x30);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sllv_epi32(pl, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), m));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi32(pl, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), m));
        } else {  /* plane bytes 0-3: byte j's bit i is bit 4 of weight 8j + i */
            const __m256i p01 = _mm256_loadu_si256((const __m256i *)planes);
            const __m256i p23 = _mm256_loadu_si256((const __m256i *)(planes + 32));
            const __m256i m = _mm256_set1_epi8(0x10);
            /* bit i of each byte to bit 4 of the same byte (16-bit shifts by at most 4: what
             * crosses from the next byte lands outside the mask) */
            const __m256i a = i < 4 ? _mm256_slli_epi16(p01, 4 - i) : _mm256_srli_epi16(p01, i - 4);
            const __m256i c = i < 4 ? _mm256_slli_epi16(p23, 4 - i) : _mm256_srli_epi16(p23, i - 4);
            lo = _mm256_or_si256(lo, _mm256_and_si256(a, m));
            hi = _mm256_or_si256(hi, _mm256_and_si256(c, m));
        }
        _mm256_store_si256((__m256i *)(cb + 64 * i), lo);
        _mm256_store_si256((__m256i *)(cb + 64 * i + 32), hi);
    }
    /* read back from memory, each 8 bytes by the vpmovzxbd that widens them (without this the
     * compiler takes them out of the registers, three instructions each) */
    __asm__ volatile("" ::: "memory");
}
#else
#define X16_CODE_BYTES(fmt) 0
INLINE void x16_code_bytes(int fmt, const uint8_t *codes, const uint8_t *planes, uint8_t *cb) {
    (void)fmt; (void)codes; (void)planes; (void)cb;
}
#endif

/* Vectors a group of 16 rows takes: 1 with AVX-512F, 2 (8 lanes each) without. x16_block takes
 * the halves h0 to h0 + nh - 1 of a block in one pass: both where dot_x16_fmt finds that pays
 * (each broadcast of x, each address and each loop step then serves 16 rows), else one. */
#define NH (X16 / LW)

/* Partial sum i of a block for one row of x (``xb``: the block's 32 values of it), every lane of
 * ``f``: dot_row's multiply and three FMAs, lane by lane (Q6_K: its two halves apart, then
 * scaled as group_f32 does). */
INLINE lf x16_partial(int fmt, const lf f[4], const float *xb, int i, lf scale, lf shi) {
    lf lo = L_FMA(f[1], L_SET1(xb[8 + i]), L_MUL(f[0], L_SET1(xb[i])));
    if (fmt == FMT_Q6_K) {
        const lf hi = L_FMA(f[3], L_SET1(xb[24 + i]), L_MUL(f[2], L_SET1(xb[16 + i])));
        return L_FMA(hi, shi, L_MUL(lo, scale));
    }
    lo = L_FMA(f[2], L_SET1(xb[16 + i]), lo);
    return L_FMA(f[3], L_SET1(xb[24 + i]), lo);
}

/* Pair p (of 4) of a block's partial sums into reduce8_ps's tree: s0 = pair 0 + pair 1, s1 =
 * pair 2 + pair 3 (their sum is the block's, x16_block adds them). */
INLINE void x16_add_pair(int p, lf *s0, lf *s1, lf pair) {
    if (p == 0) *s0 = pair;
    else if (p == 1) *s0 = L_ADD(*s0, pair);
    else if (p == 2) *s1 = pair;
    else *s1 = L_ADD(*s1, pair);
}

/* Block b of group g (``c``: its unit's chunk) for R rows of x, every lane: its partial sums
 * added in x16_order(tail_block)'s pairs, scaled, and added into acc[r][b % 8] (a block of a
 * whole group of 8) or tail[r] (a block past them), as dot_row does. */
INLINE void x16_block(int fmt, const uint8_t *c, int nb, int b, int tail_block,
                      const float *x, size_t ldx, const float *xsum, size_t ldxs, int R,
                      lf acc[][8][NH], lf tail[][NH], int h0, int nh, uint8_t *bytes) {
    const int j = b % x16_unit_blocks(fmt);
    const uint8_t *codes = c + (size_t)j * X16 * code_bytes(fmt), *m = c + x16_meta_at(fmt);
    const uint8_t *planes = c + x16_planes_at(fmt, j);
    li bit4[NH][4];
    const uint8_t *cb = X16_CODE_BYTES(fmt) ? bytes : NULL;
    if (cb)
        x16_code_bytes(fmt, codes, planes, bytes);
    /* the block's scales (Q6_K: of its halves) and offsets, lane by lane as dot_row makes them */
    lf scale[NH], off[NH], shi[NH];
    for (int hh = h0; hh < h0 + nh; hh++) {
        const int h = hh * LW;
        if (is_5bit(fmt) && !cb)
            for (int t = 0; t < 4; t++) bit4[hh][t] = L_SLL(L_U8(planes + 16 * t + h), 4);
        shi[hh] = L_ZERO();
        if (fmt == FMT_Q4_K || fmt == FMT_Q5_K) {
            scale[hh] = L_MUL(L_HALF(m + 2 * h), L_CVT(L_U8(m + 64 + 16 * j + h)));
            off[hh] = L_MUL(L_NEG(L_HALF(m + 32 + 2 * h)), L_CVT(L_U8(m + 192 + 16 * j + h)));
        } else if (fmt == FMT_Q6_K) {
            const lf d = L_HALF(m + 2 * h);
            scale[hh] = L_MUL(d, L_CVT(L_I8(m + 32 + 16 * j + h)));
            shi[hh] = L_MUL(d, L_CVT(L_I8(m + 160 + 16 * j + h)));
            off[hh] = L_ZERO();
        } else {
            scale[hh] = L_HALF(m + 2 * h);
            off[hh] = has_min(fmt) ? L_HALF(m + 32 + 2 * h)
                : fmt == FMT_Q4_0 ? L_MUL(scale[hh], L_SET1(-8.0f))
                : fmt == FMT_Q5_0 ? L_MUL(scale[hh], L_SET1(-16.0f)) : L_ZERO();
        }
    }
    lf s0[ROWS_MAX][NH], s1[ROWS_MAX][NH];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        const int i0 = x16_order(tail_block, 2 * p), i1 = x16_order(tail_block, 2 * p + 1);
        if (nh == 1) {  /* a pair's codes, then row by row: the fewest live sums for many rows */
            lf f[2][4];
            x16_codes(fmt, codes, planes, bit4[h0], cb, i0, h0 * LW, f[0]);
            x16_codes(fmt, codes, planes, bit4[h0], cb, i1, h0 * LW, f[1]);
            for (int r = 0; r < R; r++) {
                const float *xb = x + r * ldx + 32 * (size_t)b;
                const lf q0 = x16_partial(fmt, f[0], xb, i0, scale[h0], shi[h0]);
                const lf q1 = x16_partial(fmt, f[1], xb, i1, scale[h0], shi[h0]);
                x16_add_pair(p, &s0[r][h0], &s1[r][h0], L_ADD(q0, q1));
            }
        } else {  /* both halves: one partial sum's codes at a time, the fewest registers */
            lf q[ROWS_MAX][NH];
            #pragma GCC unroll 2
            for (int e = 0; e < 2; e++) {
                const int i = e ? i1 : i0;
                lf f[NH][4];
                for (int hh = 0; hh < NH; hh++)
                    x16_codes(fmt, codes, planes, bit4[hh], cb, i, hh * LW, f[hh]);
                for (int r = 0; r < R; r++) {
                    const float *xb = x + r * ldx + 32 * (size_t)b;
                    for (int hh = 0; hh < NH; hh++) {
                        const lf qe = x16_partial(fmt, f[hh], xb, i, scale[hh], shi[hh]);
                        if (e == 0) q[r][hh] = qe;
                        else x16_add_pair(p, &s0[r][hh], &s1[r][hh], L_ADD(q[r][hh], qe));
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const float *xs = xsum + r * ldxs;
        for (int hh = h0; hh < h0 + nh; hh++) {
            const lf s = L_ADD(s0[r][hh], s1[r][hh]);
            lf *a = &acc[r][b % 8][hh];
            if (tail_block) {  /* dot_row's tail: tail + (sum * scale + offset * sum(x)) */
                tail[r][hh] = L_ADD(tail[r][hh], L_FMA(s, scale[hh], L_MUL(off[hh], L_SET1(xs[b]))));
            } else if (fmt == FMT_Q6_K) {
                const float *halves = xs + nb + 16 * (size_t)(b / 8) + b % 8;
                const lf o = L_FMA(scale[hh], L_SET1(halves[0]), L_MUL(shi[hh], L_SET1(halves[8])));
                *a = L_ADD(*a, L_FMA(o, L_SET1(-32.0f), s));
            } else {
                *a = L_FMA(s, scale[hh], *a);
                if (fmt != FMT_Q8_0)
                    *a = L_FMA(off[hh], L_SET1(xs[b]), *a);
            }
        }
    }
}

/* out[r * 16 + t] = dot(row t of group g, x row r) for r < R (<= ROWS_MAX), exact: each value
 * bitwise dot_row's for that weight row and that row of x. */
INLINE void dot_x16_fmt(int fmt, const uint8_t *g, int nb, const float *x, size_t ldx,
                        const float *xsum, size_t ldxs, int R, float *out, int merge) {
    const int nbu = x16_unit_blocks(fmt), whole = nb / 8 * 8;
    const size_t ch = x16_chunk(fmt), per_block = ch / nbu;
    lf acc[ROWS_MAX][8][NH], tail[ROWS_MAX][NH];
    _Alignas(32) uint8_t bytes[512];  /* x16_code_bytes' */
    for (int r = 0; r < R; r++)
        for (int hh = 0; hh < NH; hh++) {
            tail[r][hh] = L_ZERO();
            for (int j = 0; j < 8; j++) acc[r][j][hh] = L_ZERO();
        }
    /* ``merge``: both halves of a group in one pass over its blocks (dot_x16 says where that
     * pays), else a pass each (AVX2: NH = 2; with AVX-512 one pass either way). */
    const int nh = merge ? NH : 1;
    for (int h0 = 0; h0 < NH; h0 += nh) {
        for (int b = 0; b < nb; b++) {
            const uint8_t *c = g + (size_t)(b / nbu) * ch;
            /* the group's bytes stream in order: a block's share of them, PREFETCH_AHEAD on */
            if (h0 == 0) {
                const char *ahead = (const char *)g + (size_t)b * per_block + PREFETCH_AHEAD;
                for (size_t l = 0; l < per_block; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
            }
            if (b < whole)
                x16_block(fmt, c, nb, b, 0, x, ldx, xsum, ldxs, R, acc, tail, h0, nh, bytes);
            else
                x16_block(fmt, c, nb, b, 1, x, ldx, xsum, ldxs, R, acc, tail, h0, nh, bytes);
        }
    }
    for (int r = 0; r < R; r++)
        for (int hh = 0; hh < NH; hh++) {
            lf a[8];
            for (int j = 0; j < 8; j++) a[j] = acc[r][j][hh];
            const lf s = L_ADD(L_ADD(L_ADD(a[0], a[4]), L_ADD(a[2], a[6])),
                               L_ADD(L_ADD(a[1], a[5]), L_ADD(a[3], a[7])));
            L_STORE(out + r * X16 + hh * LW, L_ADD(s, tail[r][hh]));
        }
}

/* dot_x16_fmt for the format at run time; one row of x (a decode step at batch 1) with the
 * count known at compile time, its sums in registers (~10% faster per kernel; every count
 * compiled apart cost 4x the library's compile time for a few % more at 2-8 rows). Without
 * AVX-512 the halves of a group share a pass for one or two rows of x, and for any number with
 * the formats whose codes are made as bytes for 16 rows at once; with three rows or more of
 * the others the two halves' sums outgrow the 16 registers and a pass each is faster. Two rows
 * are compiled apart there too: the merged pass for any count doubled the compile time. */
#define DOT_X16_FMT(F) \
    if (R == 1) dot_x16_fmt(F, g, nb, x, ldx, xsum, ldxs, 1, out, 1); \
    else if (NH > 1 && R == 2 && !X16_CODE_BYTES(F)) dot_x16_fmt(F, g, nb, x, ldx, xsum, ldxs, 2, out, 1); \
    else dot_x16_fmt(F, g, nb, x, ldx, xsum, ldxs, R, out, X16_CODE_BYTES(F)); \
    break;

static void dot_x16(int fmt, const uint8_t *g, int nb, const float *x, size_t ldx,
                    const float *xsum, size_t ldxs, int R, float *out) {
    switch (fmt) {
    case FMT_Q4_0: DOT_X16_FMT(FMT_Q4_0)
    case FMT_Q4_1: DOT_X16_FMT(FMT_Q4_1)
    case FMT_Q8_0: DOT_X16_FMT(FMT_Q8_0)
    case FMT_Q5_0: DOT_X16_FMT(FMT_Q5_0)
    case FMT_Q5_1: DOT_X16_FMT(FMT_Q5_1)
    case FMT_Q4_K: DOT_X16_FMT(FMT_Q4_K)
    case FMT_Q5_K: DOT_X16_FMT(FMT_Q5_K)
    default: DOT_X16_FMT(FMT_Q6_K)
    }
}
#undef DOT_X16_FMT

/* Per row of x: nb = K / 32 block sums, then for each whole group of 8 blocks the sums of their
 * first halves (8) and of their second halves (8): XSUM_PER_BLOCK floats a block. */
#define XSUM_PER_BLOCK 3

static void block_sums(const float *x, int K, float *out) {
    const int nb = K / 32;
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8));
        const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24));
        out[b] = hsum(_mm256_add_ps(lo, hi));
        if (b < nb / 8 * 8) {
            float *halves = out + nb + (size_t)(b / 8) * 16 + b % 8;
            halves[0] = hsum(lo);
            halves[8] = hsum(hi);
        }
    }
}

/* -- int8 activations (opt-in; every block format; not exact) -----------------------------------
 *
 * What llama.cpp does for every quantized weight: each 32-block of x is rounded to int8 with its
 * own scale dx = max|x| / 127, so a block's dot product with the codes is an integer sum of 32
 * byte products: one vpdpbusd (AVX512-VNNI) or a maddubs and a madd (AVX2) per 32 weights, four
 * times the products per instruction of the fp32 kernels. The weights' offsets (Q4_1's m, Q4_0's
 * -8d, the K-quants' -dmin mn, Q6_K's -32) use the sums of the rounded x (quantize_row_q8).
 * Relative error per product ~1/254 per value (the tolerance is in docs/kernels.md).
 *
 * Codes are unsigned bytes (0..63; Q8_0's signed codes go as |w| with x's sign flipped where w
 * is negative), x signed bytes in [-127, 127]: maddubs' pair sums stay within int16.
 *
 * The kernel takes up to R8 rows of x per pass over a weight row: a group of 8 blocks' codes is
 * unpacked into registers once and multiplied with each row's x, so from 2 rows on it is a GEMM
 * whose weights are decoded once per R8 rows, not once per row.
 *
 * x is prepared per pair of blocks (b, b + 1), 64 bytes: x_b[0:16], x_b+1[0:16], x_b[16:32],
 * x_b+1[16:32], matching the nibbles of the two blocks' 32 code bytes (byte j: weight j low, j + 16
 * high); Q8_0's codes are brought to the same order by two lane permutes a pair. (One layout: at
 * K = 8192 a second one would push x out of L1 while the weights stream through it.) */

/* max |x| over a block of 32 values. */
static inline float block_amax(const float *xb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

#define R8 8

/* Bytes of one prepared row: whole pairs of blocks (an odd last block's partner is 0). */
static size_t q8_row_bytes(int K) { return (size_t)(K / 32 + 1) / 2 * 64; }

INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* v with 0x10 set in each byte whose bit of m is set (bit 4 of a 5-bit code, clear in v's
 * nibbles): one masked byte add with AVX512BW (there is no masked byte or), a byte spread, a
 * compare, an and and an or without. */
INLINE __m256i or_bit4_bytes(__m256i v, uint32_t m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(v, (__mmask32)m, v, _mm256_set1_epi8(0x10));
#else
    const __m256i s = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(s, sel), sel),
                                                _mm256_set1_epi8(0x10)));
#endif
}

/* x's row rounded to int8 (``out``, the pair layout), its block scales (dx) and the sums of the
 * rounded values (``sums``, laid out as block_sums'). The offsets are applied to the rounded x's
 * sums, not the exact ones: then a block's error is sum(w * e) over the rounding errors e of its
 * x, which cancels as the weights are centred, where sum((w - offset) * e) would not (measured
 * on SmolLM2: the exact sums made int8 activations change the top token at 3x as many positions). */
static void quantize_row_q8(const float *x, int K, int8_t *out, float *dx, float *sums) {
    const int nb = K / 32;
    int8_t *pairs = out, nat[32];
    if (nb % 2) memset(pairs + (size_t)(nb - 1) / 2 * 64, 0, 64);
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        const float d = block_amax(xb) / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        dx[b] = d;
        for (int j = 0; j < 4; j++) {  /* round to nearest even; |v| <= 127 */
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), _mm256_set1_ps(id)));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i *)(nat + 8 * j), _mm_packs_epi16(w, w));
        }
        int8_t *pair = pairs + (size_t)(b / 2) * 64 + (b % 2) * 16;
        memcpy(pair, nat, 16);
        memcpy(pair + 32, nat + 16, 16);
        int lo = 0, hi = 0;
        for (int i = 0; i < 16; i++) { lo += nat[i]; hi += nat[i + 16]; }
        sums[b] = d * (float)(lo + hi);
        if (b < nb / 8 * 8) {
            float *halves = sums + nb + (size_t)(b / 8) * 16 + b % 8;
            halves[0] = d * (float)lo;
            halves[8] = d * (float)hi;
        }
    }
}

/* One group's codes, unpacked once for every row of x: 8 vectors (see group_q8). */
typedef struct { __m256i v[8]; } codes8;

/* Blocks b..b+7 of a row (b + 8 <= nb), in x's pair order: pair j's codes of weights 0-15 of
 * both blocks in v[2j], of weights 16-31 in v[2j + 1] (4- and 5-bit formats: the nibbles, with
 * bit 4; Q6_K: 6-bit codes; Q8_0: |w|, the codes themselves in *signs). */
INLINE void unpack_group(int fmt, const uint8_t *row, int nb, int b, codes8 *c, codes8 *signs) {
    if (fmt == FMT_Q8_0) {
        for (int j = 0; j < 4; j++) {
            const uint8_t *w = row + 32 * (size_t)(b + 2 * j);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            signs->v[2 * j] = _mm256_permute2x128_si256(w0, w1, 0x20);
            signs->v[2 * j + 1] = _mm256_permute2x128_si256(w0, w1, 0x31);
            c->v[2 * j] = _mm256_abs_epi8(signs->v[2 * j]);
            c->v[2 * j + 1] = _mm256_abs_epi8(signs->v[2 * j + 1]);
        }
        return;
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t *planes = row_planes(fmt, row, nb);
    for (int j = 0; j < 4; j++) {
        const int bb = b + 2 * j;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(row + 16 * (size_t)bb));
        __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if (is_5bit(fmt)) {  /* weights 0-15 of bb and bb + 1 in lo, 16-31 in hi */
            uint32_t w0, w1;
            memcpy(&w0, planes + 4 * (size_t)bb, 4);
            memcpy(&w1, planes + 4 * (size_t)bb + 4, 4);
            lo = or_bit4_bytes(lo, (w0 & 0xFFFFu) | w1 << 16);
            hi = or_bit4_bytes(hi, w0 >> 16 | (w1 & 0xFFFF0000u));
        } else if (fmt == FMT_Q6_K) {
            /* 64-bit lanes: block bb's 8 high bytes twice, then bb + 1's twice (as pair_dot_q6);
             * a byte's bits 2j, 2j + 1 go to bits 4-5 by one 64-bit shift (by 4 - 2j left for
             * j = 0, 1; by 2j - 4 right for j = 2, 3) and a mask, which keeps only the byte's
             * own bits */
            const __m256i bits45 = _mm256_set1_epi8(0x30);
            const __m256i hb = _mm256_permute4x64_epi64(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(planes + 8 * (size_t)bb))), 0x50);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sllv_epi64(hb, _mm256_setr_epi64x(4, 2, 4, 2)), bits45));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi64(hb, _mm256_setr_epi64x(0, 2, 0, 2)), bits45));
        }
        c->v[2 * j] = lo;
        c->v[2 * j + 1] = hi;
    }
}

/* The group's integer sums with one row of x: lane j block b + j's sum(code * xq) (Q6_K: its
 * first half's, the second halves' in *second). xp: the row's prepared x at block b. */
INLINE __m256i group_sums_q8(int fmt, const codes8 *c, const codes8 *signs, const int8_t *xp,
                             __m256i *second) {
    __m256i v[8];
    /* pair sums come out as [b0 b2 b4 b6 | b1 b3 b5 b7]: back to block order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int j = 0; j < 4; j++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xp + 64 * j));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(xp + 64 * j + 32));
        if (fmt == FMT_Q6_K) {
            v[j] = dpbusd(_mm256_setzero_si256(), c->v[2 * j], a);
            v[4 + j] = dpbusd(_mm256_setzero_si256(), c->v[2 * j + 1], h);
        } else if (fmt == FMT_Q8_0) {
            v[j] = dpbusd(dpbusd(_mm256_setzero_si256(), c->v[2 * j], _mm256_sign_epi8(a, signs->v[2 * j])),
                          c->v[2 * j + 1], _mm256_sign_epi8(h, signs->v[2 * j + 1]));
        } else {
            v[j] = dpbusd(dpbusd(_mm256_setzero_si256(), c->v[2 * j], a), c->v[2 * j + 1], h);
        }
    }
    if (fmt == FMT_Q6_K)
        *second = _mm256_permutevar8x32_epi32(
            _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7])), order);
    return _mm256_permutevar8x32_epi32(
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])), order);
}

/* One block's integer sum with one row of x: the nb % 8 blocks after the groups, which only the
 * 32-block formats have (a K-quant row is whole super-blocks of 8 blocks). Vectorized because
 * SmolLM2's rows of 576 weights end in 2 such blocks: one byte dot product over the block's
 * codes in natural order (bytes 0-15 weights 0-15, 16-31 weights 16-31) and its x. The same
 * integer sum as the groups' (exact), so the order of the float sums does not change. */
static int32_t block_sum_q8(int fmt, const uint8_t *row, int nb, int b, const int8_t *xq) {
    const int8_t *xlo = xq + (size_t)(b / 2) * 64 + (b % 2) * 16;
    __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)xlo)),
                                        _mm_loadu_si128((const __m128i *)(xlo + 32)), 1);
    __m256i u;
    if (fmt == FMT_Q8_0) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(row + 32 * (size_t)b));
        u = _mm256_abs_epi8(w);
        x = _mm256_sign_epi8(x, w);
    } else {
        const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + 16 * (size_t)b)));
        u = _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
        if (is_5bit(fmt)) {
            uint32_t w;
            memcpy(&w, row_planes(fmt, row, nb) + 4 * (size_t)b, 4);
            u = or_bit4_bytes(u, w);
        }
    }
    const __m256i d = dpbusd(_mm256_setzero_si256(), u, x);
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
    const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
}

/* rows of x m0..m0+R (R <= R8) times weight row ``row``: out[r] = dot. xq: prepared rows
 * (q8_row_bytes apart), dx: their block scales, xs: their rounded block sums. */
INLINE void dot_rows_q8_fmt(size_t rb, int fmt, const uint8_t *row, int nb, int R, const int8_t *xq,
                            size_t xq_bytes, const float *dx, const float *xs, float *out) {
    const uint8_t *meta = row_meta(fmt, row, nb);
    __m256 acc[R8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        codes8 c, signs;
        prefetch_group(row, rb, b, nb);
        unpack_group(fmt, row, nb, b, &c, &signs);
        if (fmt == FMT_Q6_K) {
            const uint8_t *m = meta + (size_t)(b / 8) * 18;
            const __m256 d = _mm256_set1_ps(half_to_float(m));
            const __m256 sc_lo = _mm256_mul_ps(d, i8x8_to_float(_mm_loadl_epi64((const __m128i *)(m + 2))));
            const __m256 sc_hi = _mm256_mul_ps(d, i8x8_to_float(_mm_loadl_epi64((const __m128i *)(m + 10))));
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * xq_bytes;
                __m256i second;
                const __m256i first = group_sums_q8(fmt, &c, &signs, x + (size_t)b * 32, &second);
                const __m256 dxv = _mm256_loadu_ps(dx + (size_t)r * nb + b);
                const float *halves = xs + (size_t)r * nb * XSUM_PER_BLOCK + nb + 2 * (size_t)b;
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_mul_ps(sc_lo, dxv), acc[r]);
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), _mm256_mul_ps(sc_hi, dxv), a);
                const __m256 off = _mm256_fmadd_ps(sc_lo, _mm256_loadu_ps(halves),
                                                   _mm256_mul_ps(sc_hi, _mm256_loadu_ps(halves + 8)));
                acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(-32.0f), a);
            }
            continue;
        }
        __m256 scale, off;
        group_affine(fmt, meta, nb, b, &scale, &off);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * xq_bytes;
            const __m256i sums = group_sums_q8(fmt, &c, &signs, x + (size_t)b * 32, NULL);
            const __m256 dxv = _mm256_loadu_ps(dx + (size_t)r * nb + b);
            __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, dxv), acc[r]);
            if (fmt != FMT_Q8_0)
                a = _mm256_fmadd_ps(off, _mm256_loadu_ps(xs + (size_t)r * nb * XSUM_PER_BLOCK + b), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < R; r++) {
        float tail = 0.0f;  /* the last nb % 8 blocks (none for the K-quants) */
        for (int t = b; t < nb; t++) {
            float s0, s1, o;
            block_affine(fmt, meta, nb, t, &s0, &s1, &o);
            const int32_t s = block_sum_q8(fmt, row, nb, t, xq + r * xq_bytes);
            tail += (float)s * (s0 * dx[(size_t)r * nb + t]) + o * xs[(size_t)r * nb * XSUM_PER_BLOCK + t];
        }
        out[r] = hsum(acc[r]) + tail;
    }
}

static void dot_rows_q8(int fmt, const uint8_t *row, size_t rb, int nb, int R, const int8_t *xq,
                        size_t xq_bytes, const float *dx, const float *xs, float *out) {
    switch (fmt) {
    case FMT_Q4_0: dot_rows_q8_fmt(rb, FMT_Q4_0, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    case FMT_Q4_1: dot_rows_q8_fmt(rb, FMT_Q4_1, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    case FMT_Q5_0: dot_rows_q8_fmt(rb, FMT_Q5_0, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    case FMT_Q5_1: dot_rows_q8_fmt(rb, FMT_Q5_1, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    case FMT_Q8_0: dot_rows_q8_fmt(rb, FMT_Q8_0, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    case FMT_Q4_K: dot_rows_q8_fmt(rb, FMT_Q4_K, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    case FMT_Q5_K: dot_rows_q8_fmt(rb, FMT_Q5_K, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    default: dot_rows_q8_fmt(rb, FMT_Q6_K, row, nb, R, xq, xq_bytes, dx, xs, out); break;
    }
}

/* -- the int8 GEMM over the x8 layout ------------------------------------------------------------
 *
 * 8 weight rows (one group) times up to R8 rows of x. Per block of 32 weights, its codes are
 * unpacked once into 8 vectors (4 of low nibbles: weights 4v..4v+3 of each row; 4 of high
 * nibbles: 16+4v..), then for each row of x 8 vpdpbusd against 4 bytes of x broadcast to every
 * lane give lane r row r's integer sum: no horizontal reduction. The block's scale (per row, a
 * vector) times x's block scale and one FMA take it to fp32.
 *   Q4_K: acc += float(sum) * (d sc * dx) + (-dmin mn) * xs, xs the sum of the rounded x (as
 *         the row-layout kernel: then the error cancels as the weights are centred).
 *   Q6_K: each half's sum starts at -32 * (the half's integer sum of x), so it is the sum of
 *         (code - 32) * x; sum_lo * sc_lo + sum_hi * sc_hi stays an integer (|.| < 2^31), then
 *         acc += float(it) * (d * dx).
 * The sums are the row-layout kernel's up to the order of the float additions. */

/* Per row of x, per block: the integer sums of the rounded x over weights 0-15 and 16-31. */
#define XI_PER_BLOCK 2

INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The bytes of block j of an x8 group (``c``, ``ch`` bytes a group) PREFETCH_AHEAD ahead. */
INLINE void prefetch_x8_block(int fmt, const uint8_t *c, size_t ch, int j) {
    const char *pf = (const char *)c + PREFETCH_AHEAD + ch / 8 * j;
    _mm_prefetch(pf, _MM_HINT_T0);
    _mm_prefetch(pf + 64, _MM_HINT_T0);
    _mm_prefetch(pf + 128, _MM_HINT_T0);
    if (fmt == FMT_Q6_K) _mm_prefetch(pf + 192, _MM_HINT_T0);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* With AVX-512, two blocks (b, b + 1) at a time: block b's lanes in the low 256 bits, block b +
 * 1's in the high ones, so each vpdpbusd does 64 weights and each x's 4 bytes for both blocks
 * come by one permute. Every integer sum is the 256-bit kernel's, and each lane's float ops
 * (conversion, scale products) are lane-wise the same; the sums go into acc block by block in
 * the same order (b, then b + 1) at 256 bits: the outputs are bitwise the AVX2 build's. */

/* 32 bytes at p0 in the low half, 32 at p1 in the high half. */
INLINE __m512i pair512(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* v in both halves, and the high half of v (AVX512F alone: no AVX512DQ asked for). */
INLINE __m512 twice256(__m256 v) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(v)),
                                               _mm256_castps_pd(v), 1));
}
INLINE __m256 high256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

INLINE void gemm_x8_fmt(int fmt, const uint8_t *g, int nb, int R, const int8_t *xq, size_t xb,
                        const float *dx, const float *xs, size_t xsb, const int32_t *xi,
                        float *out) {
    const size_t ch = x8_chunk(fmt);
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256 acc[R8];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int s = 0; s < nb / 8; s++) {
        const uint8_t *c = g + (size_t)s * ch;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + (fmt == FMT_Q6_K ? 1536 : 1024))));
        const __m256 dmin = fmt == FMT_Q6_K ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + 1040)));
        const __m512 d2 = twice256(d), dmin2 = twice256(dmin);
        for (int j = 0; j < 8; j += 2) {
            const int b = 8 * s + j;
            prefetch_x8_block(fmt, c, ch, j);
            prefetch_x8_block(fmt, c, ch, j + 1);
            __m512i lo[4], hi[4];
            _Pragma("GCC unroll 4")
            for (int v = 0; v < 4; v++) {
                const __m512i q = pair512(c + 128 * j + 32 * v, c + 128 * (j + 1) + 32 * v);
                lo[v] = _mm512_and_si512(q, low4);
                hi[v] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            }
            __m512 scale, mins = _mm512_setzero_ps();
            __m512i sc_lo = _mm512_setzero_si512(), sc_hi = sc_lo;
            if (fmt == FMT_Q6_K) {
                const __m512i ha = pair512(c + 1024 + 64 * j, c + 1024 + 64 * (j + 1));
                const __m512i hb = pair512(c + 1024 + 64 * j + 32, c + 1024 + 64 * (j + 1) + 32);
                lo[0] = _mm512_or_si512(lo[0], _mm512_and_si512(_mm512_slli_epi16(ha, 4), bits45));
                lo[1] = _mm512_or_si512(lo[1], _mm512_and_si512(_mm512_slli_epi16(ha, 2), bits45));
                lo[2] = _mm512_or_si512(lo[2], _mm512_and_si512(ha, bits45));
                lo[3] = _mm512_or_si512(lo[3], _mm512_and_si512(_mm512_srli_epi16(ha, 2), bits45));
                hi[0] = _mm512_or_si512(hi[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), bits45));
                hi[1] = _mm512_or_si512(hi[1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), bits45));
                hi[2] = _mm512_or_si512(hi[2], _mm512_and_si512(hb, bits45));
                hi[3] = _mm512_or_si512(hi[3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), bits45));
                /* blocks j and j + 1's 8 scales each are adjacent: 16 bytes */
                sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 1552 + 8 * j)));
                sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 1616 + 8 * j)));
                scale = d2;
            } else {
                scale = _mm512_mul_ps(d2, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(c + 1056 + 8 * j)))));
                mins = _mm512_mul_ps(dmin2, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(c + 1120 + 8 * j)))));
            }
            const __m256 mins_a = _mm512_castps512_ps256(mins), mins_b = high256(mins);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) {
                /* blocks b, b + 1 (b even): x_b[0:16], x_b+1[0:16], x_b[16:32], x_b+1[16:32] */
                const int8_t *xp = xq + r * xb + (size_t)(b / 2) * 64;
                /* 128-bit lanes: x_b[0:16], x_b[0:16], x_b+1[0:16], x_b+1[0:16] (and so for 16:32),
                 * so an in-lane dword broadcast (vpshufd) gives each block's half its 4 bytes */
                const __m512i xl0 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xp));
                const __m512i xh0 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xp + 32)));
                const __m512i xl = _mm512_shuffle_i32x4(xl0, xl0, 0x50);
                const __m512i xh = _mm512_shuffle_i32x4(xh0, xh0, 0x50);
                __m512i a0, a1, h0, h1;
                if (fmt == FMT_Q6_K) {
                    const int32_t *xr = xi + ((size_t)r * nb + b) * XI_PER_BLOCK;
                    /* xr[0], xr[1]: block b's halves; xr[2], xr[3]: block b + 1's */
                    a0 = _mm512_inserti64x4(_mm512_set1_epi32(-32 * xr[0]), _mm256_set1_epi32(-32 * xr[2]), 1);
                    h0 = _mm512_inserti64x4(_mm512_set1_epi32(-32 * xr[1]), _mm256_set1_epi32(-32 * xr[3]), 1);
                } else {
                    a0 = h0 = _mm512_setzero_si512();
                }
                a1 = h1 = _mm512_setzero_si512();
                a0 = _mm512_dpbusd_epi32(a0, lo[0], _mm512_shuffle_epi32(xl, 0x00));
                a1 = _mm512_dpbusd_epi32(a1, lo[1], _mm512_shuffle_epi32(xl, 0x55));
                h0 = _mm512_dpbusd_epi32(h0, hi[0], _mm512_shuffle_epi32(xh, 0x00));
                h1 = _mm512_dpbusd_epi32(h1, hi[1], _mm512_shuffle_epi32(xh, 0x55));
                a0 = _mm512_dpbusd_epi32(a0, lo[2], _mm512_shuffle_epi32(xl, 0xAA));
                a1 = _mm512_dpbusd_epi32(a1, lo[3], _mm512_shuffle_epi32(xl, 0xFF));
                h0 = _mm512_dpbusd_epi32(h0, hi[2], _mm512_shuffle_epi32(xh, 0xAA));
                h1 = _mm512_dpbusd_epi32(h1, hi[3], _mm512_shuffle_epi32(xh, 0xFF));
                /* dx of blocks b and b + 1 (adjacent) to their halves */
                const __m512 dxv = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(
                    _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(dx + (size_t)r * nb + b)))));
                __m512i t;
                if (fmt == FMT_Q6_K)
                    t = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(a0, a1), sc_lo),
                                         _mm512_mullo_epi32(_mm512_add_epi32(h0, h1), sc_hi));
                else
                    t = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(h0, h1));
                const __m512 tf = _mm512_cvtepi32_ps(t), m = _mm512_mul_ps(scale, dxv);
                acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(tf), _mm512_castps512_ps256(m), acc[r]);
                if (fmt != FMT_Q6_K)
                    acc[r] = _mm256_fnmadd_ps(mins_a, _mm256_set1_ps(xs[r * xsb + b]), acc[r]);
                acc[r] = _mm256_fmadd_ps(high256(tf), high256(m), acc[r]);
                if (fmt != FMT_Q6_K)
                    acc[r] = _mm256_fnmadd_ps(mins_b, _mm256_set1_ps(xs[r * xsb + b + 1]), acc[r]);
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + X8 * r, acc[r]);
}
#else
INLINE void gemm_x8_fmt(int fmt, const uint8_t *g, int nb, int R, const int8_t *xq, size_t xb,
                        const float *dx, const float *xs, size_t xsb, const int32_t *xi,
                        float *out) {
    const size_t ch = x8_chunk(fmt);
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    __m256 acc[R8];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int s = 0; s < nb / 8; s++) {
        const uint8_t *c = g + (size_t)s * ch;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + (fmt == FMT_Q6_K ? 1536 : 1024))));
        const __m256 dmin = fmt == FMT_Q6_K ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + 1040)));
        for (int j = 0; j < 8; j++) {
            const int b = 8 * s + j;
            prefetch_x8_block(fmt, c, ch, j);
            __m256i lo[4], hi[4];
            _Pragma("GCC unroll 4")
            for (int v = 0; v < 4; v++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(c + 128 * j + 32 * v));
                lo[v] = _mm256_and_si256(q, low4);
                hi[v] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            }
            __m256 scale, mins = _mm256_setzero_ps();
            __m256i sc_lo = _mm256_setzero_si256(), sc_hi = sc_lo;
            if (fmt == FMT_Q6_K) {
                const __m256i ha = _mm256_loadu_si256((const __m256i *)(c + 1024 + 64 * j));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(c + 1024 + 64 * j + 32));
                /* bits 2v, 2v + 1 of each byte to bits 4-5 (16-bit shifts: the mask keeps only
                 * the byte's own bits) */
                lo[0] = _mm256_or_si256(lo[0], _mm256_and_si256(_mm256_slli_epi16(ha, 4), bits45));
                lo[1] = _mm256_or_si256(lo[1], _mm256_and_si256(_mm256_slli_epi16(ha, 2), bits45));
                lo[2] = _mm256_or_si256(lo[2], _mm256_and_si256(ha, bits45));
                lo[3] = _mm256_or_si256(lo[3], _mm256_and_si256(_mm256_srli_epi16(ha, 2), bits45));
                hi[0] = _mm256_or_si256(hi[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45));
                hi[1] = _mm256_or_si256(hi[1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45));
                hi[2] = _mm256_or_si256(hi[2], _mm256_and_si256(hb, bits45));
                hi[3] = _mm256_or_si256(hi[3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45));
                sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 1552 + 8 * j)));
                sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 1616 + 8 * j)));
                scale = d;
            } else {
                scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(c + 1056 + 8 * j)))));
                mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(c + 1120 + 8 * j)))));
            }
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) {
                /* block b's x in the pair layout: weights 0-15 at xp, 16-31 at xp + 32 */
                const int8_t *xp = xq + r * xb + (size_t)(b / 2) * 64 + (b % 2) * 16;
                __m256i a0, a1, h0, h1;
                if (fmt == FMT_Q6_K) {
                    const int32_t *xr = xi + ((size_t)r * nb + b) * XI_PER_BLOCK;
                    a0 = _mm256_set1_epi32(-32 * xr[0]);
                    h0 = _mm256_set1_epi32(-32 * xr[1]);
                } else {
                    a0 = h0 = _mm256_setzero_si256();
                }
                a1 = h1 = _mm256_setzero_si256();
                a0 = dpbusd(a0, lo[0], bcast4(xp));
                a1 = dpbusd(a1, lo[1], bcast4(xp + 4));
                h0 = dpbusd(h0, hi[0], bcast4(xp + 32));
                h1 = dpbusd(h1, hi[1], bcast4(xp + 36));
                a0 = dpbusd(a0, lo[2], bcast4(xp + 8));
                a1 = dpbusd(a1, lo[3], bcast4(xp + 12));
                h0 = dpbusd(h0, hi[2], bcast4(xp + 40));
                h1 = dpbusd(h1, hi[3], bcast4(xp + 44));
                const __m256 dxv = _mm256_set1_ps(dx[(size_t)r * nb + b]);
                if (fmt == FMT_Q6_K) {
                    const __m256i t = _mm256_add_epi32(
                        _mm256_mullo_epi32(_mm256_add_epi32(a0, a1), sc_lo),
                        _mm256_mullo_epi32(_mm256_add_epi32(h0, h1), sc_hi));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(scale, dxv), acc[r]);
                } else {
                    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(h0, h1));
                    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(scale, dxv), acc[r]);
                    acc[r] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(xs[r * xsb + b]), a);
                }
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + X8 * r, acc[r]);
}
#endif

/* With R a constant in each case, so acc[] lives in registers. */
#define GEMM_X8_CASES(F) \
    switch (R) { \
    case 1: gemm_x8_fmt(F, g, nb, 1, xq, xb, dx, xs, xsb, xi, out); break; \
    case 2: gemm_x8_fmt(F, g, nb, 2, xq, xb, dx, xs, xsb, xi, out); break; \
    case 3: gemm_x8_fmt(F, g, nb, 3, xq, xb, dx, xs, xsb, xi, out); break; \
    case 4: gemm_x8_fmt(F, g, nb, 4, xq, xb, dx, xs, xsb, xi, out); break; \
    case 5: gemm_x8_fmt(F, g, nb, 5, xq, xb, dx, xs, xsb, xi, out); break; \
    case 6: gemm_x8_fmt(F, g, nb, 6, xq, xb, dx, xs, xsb, xi, out); break; \
    case 7: gemm_x8_fmt(F, g, nb, 7, xq, xb, dx, xs, xsb, xi, out); break; \
    default: gemm_x8_fmt(F, g, nb, 8, xq, xb, dx, xs, xsb, xi, out); break; \
    }

/* out[r * 8 + i] = dot(row i of group g, x row r) for r < R (see gemm_x8_fmt). */
static void gemm_x8(int fmt, const uint8_t *g, int nb, int R, const int8_t *xq, size_t xb,
                    const float *dx, const float *xs, size_t xsb, const int32_t *xi, float *out) {
    if (fmt == FMT_Q6_K) {
        GEMM_X8_CASES(FMT_Q6_K)
    } else {
        GEMM_X8_CASES(FMT_Q4_K)
    }
}

/* -- linear layers -------------------------------------------------------------------------------
 *
 * The pieces below run inside a parallel region their caller opens: their loops are orphaned
 * work-sharing constructs (``omp for``), so a public entry point opens one region for one op and
 * tri_decode_step opens one for a whole step, and both run the same code in the same order (the
 * fused step's results are bitwise those of the op-by-op path). Each ``omp for`` ends with a
 * barrier. */

/* Whether M rows of x take the few-rows kernels (weights unpacked in registers once per ROWS_MAX
 * rows of x) or the tiles (each weight dequantized once into
 * L1, used by MT rows at a time). Exact: up to 5 rows, where dot_rows costs about what the tiles
 * do on Q4_1 (SmolLM2-135M's [1536, 576] and [576, 1536] at one thread, by CPU time: 0.84-1.19x
 * at 2 rows, 0.50-0.87x at 3, 1.03-1.35x at 4, 0.78-1.07x at 5; three runs) and less on Q4_K
 * and Q6_K ([8192, 2048]: 0.42-0.90x), and each row's result is bitwise its result alone (the tiles' sums
 * run in another order), so speculative decoding's verify rows (up to speculative_tokens + 1)
 * and batches of up to 5 give every sequence the logits it has alone. From 6 rows (6 and 8:
 * 1.24-1.65x on Q4_1) the tiles' fp32 micro-GEMM is cheaper per row than dot_row's per-block
 * sums. -D overrides it (measurement). */
#ifndef FEW_ROWS_EXACT
#define FEW_ROWS_EXACT 6
#endif

static inline int few_rows(int M) {
    return M < FEW_ROWS_EXACT;
}

/* Rows of x below which an exact product takes the few-rows kernel, each row's result then
 * bitwise that row's alone (for the tests and the docs to read, not to guess). */
int tri_few_rows_exact(void) { return FEW_ROWS_EXACT; }

/* A linear layer y[M, N] = x[M, K] @ W[N, K]^T (+ bias). W's rows come in up to MAX_PARTS
 * parts, each in a format of its own: a fused projection whose parts the GGUF file quantized
 * differently (Q4_K_M keeps q and k in Q4_K and v in Q6_K in some layers). */
#define MAX_PARTS 3
typedef struct {
    int nparts;
    int K, N;                       /* N: the parts' rows together */
    const float *bias;              /* [N], or NULL */
    int activations;                /* ACT_*: asked for; taken where lin_activations says */
    int fmt[MAX_PARTS];
    const uint8_t *w[MAX_PARTS];
    size_t row_bytes[MAX_PARTS];    /* bytes from one row of the part to the next */
    int rows[MAX_PARTS];
} tri_lin;

/* How x is multiplied with the weights: exact fp32, or rounded to int8 per 32-block. */
enum { ACT_EXACT = 0, ACT_INT8 = 1 };

/* What L's product takes of what it asks for: int8 where no part is 16-bit floats; else exact. */
static int lin_activations(const tri_lin *L) {
    if (L->activations != ACT_INT8)
        return ACT_EXACT;
    for (int p = 0; p < L->nparts; p++)
        if (is_16bit(L->fmt[p] & 0xFF))
            return ACT_EXACT;
    return ACT_INT8;
}

static int lin_valid(const tri_lin *L) {
    if (L->nparts < 1 || L->nparts > MAX_PARTS || L->K <= 0 || L->K % 32)
        return 0;
    int n = 0;
    for (int p = 0; p < L->nparts; p++) {
        const int fmt = L->fmt[p] & 0xFF, x8 = (L->fmt[p] & FMT_X8) != 0;
        const int x16 = (L->fmt[p] & FMT_X16) != 0;
        const size_t need = tri_row_bytes(fmt, L->K);
        if (need == 0 || L->row_bytes[p] < need || L->rows[p] < 0 || !L->w[p]
            || (L->fmt[p] & ~(0xFF | FMT_X8 | FMT_X16)) || (x8 && x16))
            return 0;
        /* x8: only the int8 kernels read it; x16: only the exact ones; both in groups of whole
         * rows, with no gap between rows */
        if (x8 && (!x8_format(fmt) || L->activations != ACT_INT8 || L->row_bytes[p] != need))
            return 0;
        if (x16 && (!x16_format(fmt) || L->activations != ACT_EXACT || L->row_bytes[p] != need))
            return 0;
        n += L->rows[p];
    }
    return n == L->N;
}

/* Row n of W: its part's format and bytes. */
static inline const uint8_t *lin_row(const tri_lin *L, int n, int *fmt, size_t *row_bytes) {
    int p = 0;
    while (p + 1 < L->nparts && n >= L->rows[p]) n -= L->rows[p++];
    *fmt = L->fmt[p];
    *row_bytes = L->row_bytes[p];
    return L->w[p] + (size_t)n * L->row_bytes[p];
}

/* Row n of W moved back to the start of its x8 or x16 group where it falls in one, so that
 * threads share out whole groups (every thread rounds the same boundaries the same way). */
static int group_start(const tri_lin *L, int n) {
    int p = 0, at = 0;
    while (p + 1 < L->nparts && n - at >= L->rows[p]) at += L->rows[p++];
    const int i = n - at, G = layout_rows(L->fmt[p]);
    if (i < L->rows[p] / G * G)
        return at + i / G * G;
    return n;
}

/* This thread's rows of W, [*n0, *n1): contiguous, with as near an equal share of W's bytes as
 * whole rows (and whole x8 or x16 groups) allow. Parts in different formats differ in bytes a row (Q4_K_M's v in Q6_K, q
 * and k in Q4_K), and an equal share of rows would leave one thread the heavy part. */
static void lin_rows_of_thread(const tri_lin *L, int *n0, int *n1) {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    size_t total = 0;
    for (int p = 0; p < L->nparts; p++) total += (size_t)L->rows[p] * L->row_bytes[p];
    int bounds[2];
    for (int e = 0; e < 2; e++) {  /* the first row at or past byte total * (t + e) / T */
        const size_t target = total / T * (t + e) + total % T * (t + e) / T;
        size_t before = 0;
        int n = 0, p = 0;
        while (p < L->nparts && before + (size_t)L->rows[p] * L->row_bytes[p] <= target) {
            before += (size_t)L->rows[p] * L->row_bytes[p];
            n += L->rows[p++];
        }
        if (p < L->nparts)
            n += (int)((target - before + L->row_bytes[p] - 1) / L->row_bytes[p]);
        bounds[e] = t + e == T ? L->N : group_start(L, n);
    }
    *n0 = bounds[0];
    *n1 = bounds[1];
}

/* What an exact product in the few-rows kernels or x16 needs of x before the threads start:
 * the float sums of x's blocks. */
static void linear_prep_omp(const float *x, int M, int K, float *xsum) {
    const int nb = K / 32;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        block_sums(x + (size_t)m * K, K, xsum + (size_t)m * nb * XSUM_PER_BLOCK);
}

/* 1 if row n of W lies in a group of 16 rows in x16 (dot_x16 takes it, at any M). */
static int in_x16_group(const tri_lin *L, int n) {
    int p = 0;
    while (p + 1 < L->nparts && n >= L->rows[p]) n -= L->rows[p++];
    return (L->fmt[p] & FMT_X16) && n < L->rows[p] / X16 * X16;
}

/* The exact products of the rows in x16 groups, for any number of rows of x (after the prep):
 * each thread's groups, MB rows of x a pass (so that a pass's x stays in L2 while the groups
 * stream), ROWS_MAX rows of x per call of dot_x16. Each value is bitwise dot_row's. */
static void linear_x16_omp(const tri_lin *L, const float *x, int M, float *y, const float *xsum) {
    const int K = L->K, N = L->N, nb = K / 32;
    const size_t xsb = (size_t)nb * XSUM_PER_BLOCK;
    int n0, n1;
    lin_rows_of_thread(L, &n0, &n1);  /* whole groups: n meets a group at its first row */
    for (int m0 = 0; m0 < M; m0 += MB) {
        const int m1 = m0 + MB < M ? m0 + MB : M;
        for (int n = n0; n < n1; n++) {
            if (!in_x16_group(L, n))
                continue;
            int fmt;
            size_t rb;
            const uint8_t *g = lin_row(L, n, &fmt, &rb);
            for (int r0 = m0; r0 < m1; r0 += ROWS_MAX) {
                const int R = m1 - r0 < ROWS_MAX ? m1 - r0 : ROWS_MAX;
                float out[ROWS_MAX * X16];
                dot_x16(fmt & 0xFF, g, nb, x + (size_t)r0 * K, K, xsum + r0 * xsb, xsb, R, out);
                for (int r = 0; r < R; r++)
                    for (int t = 0; t < X16; t++)
                        y[(size_t)(r0 + r) * N + n + t] = out[X16 * r + t] + (L->bias ? L->bias[n + t] : 0.0f);
            }
            n += X16 - 1;
        }
    }
}

/* few_rows(M), after the prep, the rows outside x16 groups: dot_row for one row of x, dot_rows
 * for more (each row's result bitwise dot_row's). */
static void linear_few_rows_omp(const tri_lin *L, const float *x, int M, float *y,
                                const float *xsum) {
    const int K = L->K, N = L->N, nb = K / 32;
    int n0, n1;
    lin_rows_of_thread(L, &n0, &n1);
    for (int n = n0; n < n1; n++) {
        int fmt;
        size_t rb;
        const uint8_t *row = lin_row(L, n, &fmt, &rb);
        if (in_x16_group(L, n))  /* linear_x16_omp's */
            continue;
        fmt &= 0xFF;
        if (M > 1) {  /* up to ROWS_MAX rows of x per unpacking of the row */
            for (int m0 = 0; m0 < M; m0 += ROWS_MAX) {
                const int R = M - m0 < ROWS_MAX ? M - m0 : ROWS_MAX;
                float out[ROWS_MAX];
                dot_rows(fmt, row, rb, x + (size_t)m0 * K, K, xsum + (size_t)m0 * nb * XSUM_PER_BLOCK,
                         (size_t)nb * XSUM_PER_BLOCK, K, R, out);
                for (int r = 0; r < R; r++)
                    y[(size_t)(m0 + r) * N + n] = out[r] + (L->bias ? L->bias[n] : 0.0f);
            }
        } else if (M == 1) {
            y[n] = dot_row(fmt, row, rb, x, xsum, K) + (L->bias ? L->bias[n] : 0.0f);
        }
    }
}

/* The same product for more rows, the rows outside x16 groups: tiles of NT weight rows
 * dequantized into L1 (``bufs``: NT * K floats per thread), MB rows of x per pass. A tile never
 * spans two parts. */
static void linear_tiles_omp(const tri_lin *L, const float *x, int M, float *y, float *bufs) {
    const int K = L->K, N = L->N;
    int tiles[MAX_PARTS + 1] = {0};  /* tiles before part p */
    for (int p = 0; p < L->nparts; p++) tiles[p + 1] = tiles[p] + (L->rows[p] + NT - 1) / NT;
    float *buf = bufs + (size_t)omp_get_thread_num() * NT * K;
    for (int m0 = 0; m0 < M; m0 += MB) {
        const int m1 = m0 + MB < M ? m0 + MB : M;
        #pragma omp for schedule(static) nowait
        for (int ti = 0; ti < tiles[L->nparts]; ti++) {
            int p = 0, n0 = 0;
            while (ti >= tiles[p + 1]) n0 += L->rows[p++];
            const int r0 = (ti - tiles[p]) * NT;
            if (in_x16_group(L, n0 + r0))  /* linear_x16_omp's (a tile never spans a group) */
                continue;
            const int nt = L->rows[p] - r0 < NT ? L->rows[p] - r0 : NT;
            for (int t = 0; t < nt; t++)
                dequant_row(L->fmt[p] & 0xFF, L->w[p] + (size_t)(r0 + t) * L->row_bytes[p], K,
                            buf + (size_t)t * K);
            tile(x, K, m0, m1, K, buf, nt, L->bias, y, N, n0 + r0);
        }
    }
}

/* Scratch of a product of up to M rows of up to K columns on ``threads`` threads. ``xq``: x's
 * rows rounded to int8 (q8_row_bytes each), or, in tri_decode_step before its first linear, the
 * one embedding row it reads in the row layout (a row of blocks: at most 2 bytes a value). */
typedef struct {
    float *xsum, *dx, *tiles;
    uint8_t *xq;
    int32_t *xi;  /* int8 x's integer half-block sums (the x8 Q6_K kernel's -32) */
} lin_scratch;

static int scratch_alloc(lin_scratch *s, int M, int K, int threads) {
    s->xi = malloc((size_t)M * (K / 32) * XI_PER_BLOCK * sizeof(int32_t) + 1);
    s->xsum = malloc((size_t)M * (K / 32) * XSUM_PER_BLOCK * sizeof(float));
    s->dx = malloc((size_t)M * (K / 32) * sizeof(float));
    s->xq = aligned_alloc(64, (size_t)(M > 0 ? M : 1) * 2 * q8_row_bytes(K));
    s->tiles = aligned_alloc(64, (size_t)threads * NT * K * sizeof(float));
    return s->xi && s->xsum && s->dx && s->xq && s->tiles;
}

static void scratch_free(lin_scratch *s) {
    free(s->xi); free(s->xsum); free(s->dx); free(s->xq); free(s->tiles);
}

/* The integer half-block sums of a prepared int8 row (pair layout), for the x8 Q6_K kernel. */
static void half_sums_q8(const int8_t *xq, int nb, int32_t *xi) {
    for (int b = 0; b < nb; b++) {
        const int8_t *lo = xq + (size_t)(b / 2) * 64 + (b % 2) * 16, *hi = lo + 32;
        int32_t a = 0, h = 0;
        for (int i = 0; i < 16; i++) { a += lo[i]; h += hi[i]; }
        xi[XI_PER_BLOCK * b] = a;
        xi[XI_PER_BLOCK * b + 1] = h;
    }
}

/* Any number of rows with int8 activations: every row of x prepared (block sums, int8 rows),
 * then each thread's weight rows multiplied with R8 rows of x at a time, MB rows of x per pass
 * (a pass's prepared x stays in L2): a group of 8 rows of an x8 part by gemm_x8, any other row
 * by dot_rows_q8. */
static void linear_q8_omp(const tri_lin *L, const float *x, int M, float *y, const lin_scratch *s) {
    const int K = L->K, N = L->N, nb = K / 32;
    const size_t xb = q8_row_bytes(K), xsb = (size_t)nb * XSUM_PER_BLOCK;
    int8_t *qx = (int8_t *)s->xq;
    int any_x8 = 0;
    for (int p = 0; p < L->nparts; p++) any_x8 |= (L->fmt[p] & FMT_X8) != 0;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        quantize_row_q8(x + (size_t)m * K, K, qx + m * xb, s->dx + (size_t)m * nb, s->xsum + m * xsb);
        if (any_x8) half_sums_q8(qx + m * xb, nb, s->xi + (size_t)m * nb * XI_PER_BLOCK);
    }
    int n0, n1;
    lin_rows_of_thread(L, &n0, &n1);
    for (int m0 = 0; m0 < M; m0 += MB) {
        const int m1 = m0 + MB < M ? m0 + MB : M;
        for (int n = n0; n < n1;) {
            int p = 0, i = n;
            while (p + 1 < L->nparts && i >= L->rows[p]) i -= L->rows[p++];
            const int fmt = L->fmt[p] & 0xFF;
            const size_t rb = L->row_bytes[p];
            const uint8_t *row = L->w[p] + (size_t)i * rb;
            if ((L->fmt[p] & FMT_X8) && i < L->rows[p] / X8 * X8) {
                for (int r0 = m0; r0 < m1; r0 += R8) {
                    const int R = m1 - r0 < R8 ? m1 - r0 : R8;
                    float out[R8 * X8];
                    gemm_x8(fmt, row, nb, R, qx + r0 * xb, xb, s->dx + (size_t)r0 * nb,
                            s->xsum + r0 * xsb, xsb, s->xi + (size_t)r0 * nb * XI_PER_BLOCK, out);
                    for (int r = 0; r < R; r++) {
                        float *yr = y + (size_t)(r0 + r) * N + n;
                        for (int t = 0; t < X8; t++)
                            yr[t] = out[X8 * r + t] + (L->bias ? L->bias[n + t] : 0.0f);
                    }
                }
                n += X8;
                continue;
            }
            for (int r0 = m0; r0 < m1; r0 += R8) {
                const int R = m1 - r0 < R8 ? m1 - r0 : R8;
                float out[R8];
                dot_rows_q8(fmt, row, rb, nb, R, qx + r0 * xb, xb, s->dx + (size_t)r0 * nb,
                            s->xsum + r0 * xsb, out);
                for (int r = 0; r < R; r++)
                    y[(size_t)(r0 + r) * N + n] = out[r] + (L->bias ? L->bias[n] : 0.0f);
            }
            n++;
        }
    }
    #pragma omp barrier
}

/* One linear inside a parallel region: the prep by one thread, then the rows shared out. */
static void linear_omp(const tri_lin *L, const float *x, int M, float *y, const lin_scratch *s) {
    if (lin_activations(L) == ACT_INT8) {
        linear_q8_omp(L, x, M, y, s);
        return;
    }
    int any_x16 = 0;
    for (int p = 0; p < L->nparts; p++) any_x16 |= (L->fmt[p] & FMT_X16) != 0;
    const int few = few_rows(M);
    if (few || any_x16)
        linear_prep_omp(x, M, L->K, s->xsum);
    if (any_x16)
        linear_x16_omp(L, x, M, y, s->xsum);
    if (few)
        linear_few_rows_omp(L, x, M, y, s->xsum);
    else
        linear_tiles_omp(L, x, M, y, s->tiles);
    #pragma omp barrier
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the layer L describes; with int8 activations
 * every row is rounded to int8 (see lin_activations). Returns 0, -1 on a bad
 * description, -2 when scratch memory cannot be had. */
int tri_linear(const tri_lin *L, const float *x, int M, float *y, int nthreads) {
    if (!lin_valid(L) || M < 0 || nthreads < 1)
        return -1;
    lin_scratch s;
    int rc = -2;
    if (scratch_alloc(&s, M, L->K, nthreads)) {
        #pragma omp parallel num_threads(nthreads)
        linear_omp(L, x, M, y, &s);
        rc = 0;
    }
    scratch_free(&s);
    return rc;
}

/* Rows of one packed tensor -> fp32 (the embedding lookup of a quantized table). Returns 0, or
 * -1 for a format or K the kernels do not take. */
int tri_dequant_rows(int fmt, const uint8_t *w, size_t row_bytes, const int64_t *rows, int n,
                     int K, float *out, int64_t total_rows) {
    const int base = fmt & 0xFF;
    const size_t rb = tri_row_bytes(base, K);
    if (rb == 0 || row_bytes < rb || (fmt & ~(0xFF | FMT_X8 | FMT_X16))
        || ((fmt & FMT_X8) && (fmt & FMT_X16))
        || ((fmt & FMT_X8) && (!x8_format(base) || row_bytes != rb))
        || ((fmt & FMT_X16) && (!x16_format(base) || row_bytes != rb)))
        return -1;
    const int grouped = (fmt & (FMT_X8 | FMT_X16)) != 0;
    uint8_t *buf = grouped ? malloc(rb) : NULL;
    if (grouped && !buf)
        return -2;
    for (int i = 0; i < n; i++)
        dequant_row(base, row_in_row_layout(fmt, w, row_bytes, total_rows, rows[i], K, buf), K,
                    out + (size_t)i * K);
    free(buf);
    return 0;
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

/* The KV cache holds fp32, fp16, q8_0 or q4_0 values: ``kv_f16`` is the kind (KV_F32, KV_F16,
 * KV_Q8_0, KV_Q4_0; the name is the ABI's). A q8_0 cache is ggml's block_q8_0 in place of every 32
 * values of a head's row (an fp16 scale d, then 32 int8 codes q: value = d * q), so an element
 * index ``at`` (a multiple of 8 here) is byte (at / 32) * 34 + 2 + at % 32 of the cache; a q4_0
 * one ggml's block_q4_0 (an fp16 scale, 16 bytes of nibbles: value = d * (nibble - 8)). These
 * read and write 8 of them at a time. */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 2
#define KV_Q4_0 3
#define Q8_0_BYTES 34
#define Q4_0_BYTES 18

INLINE __m256 kv_load(const void *cache, size_t at, int kv_f16) {
    if (kv_f16 == KV_Q4_0) {  /* qs[j]: value j in the low nibble, value j + 16 in the high one */
        const uint8_t *block = (const uint8_t *)cache + (at >> 5) * Q4_0_BYTES;
        uint16_t d;
        memcpy(&d, block, 2);
        const int off = (int)(at & 31);
        __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 2 + (off & 15))));
        w = off >= 16 ? _mm256_srli_epi32(w, 4) : _mm256_and_si256(w, _mm256_set1_epi32(15));
        w = _mm256_sub_epi32(w, _mm256_set1_epi32(8));
        return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d)), _mm256_cvtepi32_ps(w));
    }
    if (kv_f16 == KV_Q8_0) {
        const uint8_t *block = (const uint8_t *)cache + (at >> 5) * Q8_0_BYTES;
        uint16_t d;
        memcpy(&d, block, 2);
        const __m128i q = _mm_loadl_epi64((const __m128i *)(block + 2 + (at & 31)));
        return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    if (kv_f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + at)));
    return _mm256_loadu_ps((const float *)cache + at);
}

/* n values (a multiple of 32 for q8_0) at element index ``at`` (one of 32 for q8_0). q8_0 as
 * ggml's quantize_row_q8_0_ref: d = max |x| / 127, q = round(x / d), d kept as fp16. */
static void kv_store(void *cache, size_t at, const float *x, int n, int kv_f16) {
    if (kv_f16 == KV_Q4_0) {  /* ggml's quantize_row_q4_0_ref: d = (the value of max |x|) / -8 */
        uint8_t *block = (uint8_t *)cache + (at >> 5) * Q4_0_BYTES;
        for (int b = 0; b < n; b += 32, block += Q4_0_BYTES) {
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < 32; j++)
                if (amax < fabsf(x[b + j])) { amax = fabsf(x[b + j]); max = x[b + j]; }
            const float d = max / -8.0f, id = d ? 1.0f / d : 0.0f;
            const uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            memcpy(block, &dh, 2);
            for (int j = 0; j < 16; j++) {
                const int8_t lo = (int8_t)(x[b + j] * id + 8.5f), hi = (int8_t)(x[b + 16 + j] * id + 8.5f);
                block[2 + j] = (uint8_t)((lo < 15 ? lo : 15) | ((hi < 15 ? hi : 15) << 4));
            }
        }
        return;
    }
    if (kv_f16 == KV_Q8_0) {
        uint8_t *block = (uint8_t *)cache + (at >> 5) * Q8_0_BYTES;
        for (int b = 0; b < n; b += 32, block += Q8_0_BYTES) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b + j]));
            const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
            const uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            memcpy(block, &dh, 2);
            for (int j = 0; j < 32; j++) ((int8_t *)block)[2 + j] = (int8_t)roundf(x[b + j] * id);
        }
        return;
    }
    if (!kv_f16) {
        memcpy((float *)cache + at, x, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *o = (uint16_t *)cache + at;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(o + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) o[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* Bytes of n cache values of kind kv_f16 (n a multiple of 32 for q8_0; else rounded up). */
INLINE size_t kv_bytes(size_t n, int kv_f16) {
    if (kv_f16 == KV_Q8_0) return (n + 31) / 32 * Q8_0_BYTES;
    if (kv_f16 == KV_Q4_0) return (n + 31) / 32 * Q4_0_BYTES;
    return n * (kv_f16 ? 2 : 4);
}

/* Neox rotary embedding in place on q [T, Hq, D] and k [T, Hkv, D] (rows ``q_stride`` and
 * ``k_stride`` floats apart per token), then k and v [T, Hkv, D] (v rows ``v_stride`` apart)
 * stored into their cache slots: cache [num_slots, Hkv, D], fp32 or fp16 (rounded to nearest
 * even, as torch's cast). cos_sin: [max_pos, D] = cat(cos, sin). */
static void rope_store_token(float *q, float *k, const float *v, int64_t position, int64_t slot,
                             int Hq, int Hkv, int D, const float *cos_sin, void *k_cache,
                             void *v_cache, int kv_f16) {
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
    kv_store(k_cache, (size_t)slot * Hkv * D, k, Hkv * D, kv_f16);
    kv_store(v_cache, (size_t)slot * Hkv * D, v, Hkv * D, kv_f16);
}

void tri_rope_store(float *q, int q_stride, float *k, int k_stride, const float *v, int v_stride,
                    const int64_t *positions, const int64_t *slots, int T, int Hq, int Hkv, int D,
                    const float *cos_sin, void *k_cache, void *v_cache, int kv_f16) {
    for (int t = 0; t < T; t++)
        rope_store_token(q + (size_t)t * q_stride, k + (size_t)t * k_stride, v + (size_t)t * v_stride,
                         positions[t], slots[t], Hq, Hkv, D, cos_sin, k_cache, v_cache, kv_f16);
}

/* Decode attention over the paged cache, read in place (no gathered copy).
 * q: [B, Hq, D] (rows ``q_stride`` floats apart per sequence); cache: [pages, S, Hkv, D], fp32
 * or fp16 (kv_f16; widened to fp32 as it is read); page_table: [B, max_pages]; seq_lens: [B];
 * out: [B, Hq, D]; D a multiple of 8; every seq_len at most max_len.
 * Scores are exact (two passes: max, then exp and sums), as torch's SDPA.
 *
 * The unit of work is a group of up to GROUP_MAX query heads of one KV head (attend_group):
 * each key and value is widened once for the group. One work item per sequence (all its
 * groups, so a KV head's keys and values stay in L2 for the next group), or, with fewer than
 * two sequences per thread, one per (sequence, query head). Whatever the grouping, a head's
 * every score is the same FMAs over d in the same order and its every output the same FMAs over
 * the positions in order, so all give the same bits. One KV head's keys are Hkv * D values
 * apart from one position to the next (4 KB on the 1.7B-class shape: Hkv = 32, D = 64, fp16),
 * a stride the hardware prefetcher does not follow, so the walk asks for the row PF_ROWS
 * positions ahead itself. */

/* Query heads of one KV head attended together: GROUP_MAX x 8 output vectors, GROUP_MAX
 * weights and one value vector must fit the vector registers (32 with AVX-512VL, else 16). */
#ifdef __AVX512VL__
#define GROUP_MAX 3
#else
#define GROUP_MAX 1
#endif
#define PF_ROWS 12
/* Bytes of a position's row of all KV heads past which one head's walk is a stride the
 * hardware prefetcher does not follow (see attend_seq). */
#define ROW_BYTES_GROUPED 1024

/* Whether a position's row of all KV heads is past ROW_BYTES_GROUPED. */
INLINE int long_rows(int Hkv, int D, int kv_f16) {
    return kv_bytes((size_t)Hkv * D, kv_f16) > ROW_BYTES_GROUPED;
}

/* Where position t of a context's page pg starts (its KV head 0). */
INLINE size_t kv_row(const int64_t *pages, int pg, int t, int Hkv, int D, int S) {
    return ((size_t)pages[pg] * S + t) * Hkv * D;
}

/* Ask for the D values at ``at`` (the row PF_ROWS positions ahead) to be brought into L1. */
INLINE void kv_prefetch(const void *cache, size_t at, int D, int kv_f16) {
    const char *p = (const char *)cache + kv_bytes(at, kv_f16);
    const int bytes = (int)kv_bytes((size_t)D, kv_f16);
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

/* The row PF_ROWS positions after position t of page pg (or none past the context). */
INLINE int ahead(const int64_t *pages, int pg, int t, int n, int p0, int L, int Hkv, int D, int S,
                 size_t *at) {
    if (p0 + t + PF_ROWS >= L || t + PF_ROWS - n >= S) return 0;  /* past the context or the next page */
    *at = t + PF_ROWS < n ? kv_row(pages, pg, t + PF_ROWS, Hkv, D, S)
                          : kv_row(pages, pg + 1, t + PF_ROWS - n, Hkv, D, S);
    return 1;
}

/* scores[p] = exp(scores[p] - mx) in place, for p < L; returns their sum (8 lanes, then the
 * tail: the order every attention kernel here sums them in). */
INLINE float softmax_exp(float *scores, int L, float mx) {
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
    return total;
}

/* R (<= GROUP_MAX, a constant where inlined) query heads q (rows D apart) of KV head kh over a
 * context of L positions: out (rows D apart). ``scores``: R * max_len floats. */
INLINE void attend_group(const float *q, const void *k_cache, const void *v_cache,
                         const int64_t *pages, int L, int kh, int Hkv, int D, int S, float scale,
                         int R, int max_len, float *scores, float *out, int kv_f16) {
    const int far = long_rows(Hkv, D, kv_f16);
    float mx[GROUP_MAX];
    for (int g = 0; g < R; g++) mx[g] = -INFINITY;
    size_t next;
    for (int p0 = 0, pg = 0; p0 < L; p0 += S, pg++) {
        const int n = L - p0 < S ? L - p0 : S;
        for (int t = 0; t < n; t++) {
            if (far && ahead(pages, pg, t, n, p0, L, Hkv, D, S, &next))
                kv_prefetch(k_cache, next + (size_t)kh * D, D, kv_f16);
            const size_t kr = kv_row(pages, pg, t, Hkv, D, S) + (size_t)kh * D;
            __m256 a0[GROUP_MAX], a1[GROUP_MAX];
            #pragma GCC unroll 4
            for (int g = 0; g < R; g++) a0[g] = a1[g] = _mm256_setzero_ps();
            int i = 0;
            for (; i + 16 <= D; i += 16) {
                const __m256 k0 = kv_load(k_cache, kr + i, kv_f16), k1 = kv_load(k_cache, kr + i + 8, kv_f16);
                #pragma GCC unroll 4
                for (int g = 0; g < R; g++) {
                    a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)g * D + i), k0, a0[g]);
                    a1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)g * D + i + 8), k1, a1[g]);
                }
            }
            if (i < D) {
                const __m256 k0 = kv_load(k_cache, kr + i, kv_f16);
                #pragma GCC unroll 4
                for (int g = 0; g < R; g++)
                    a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)g * D + i), k0, a0[g]);
            }
            #pragma GCC unroll 4
            for (int g = 0; g < R; g++) {
                const float sc = hsum(_mm256_add_ps(a0[g], a1[g])) * scale;
                scores[(size_t)g * max_len + p0 + t] = sc;
                if (sc > mx[g]) mx[g] = sc;
            }
        }
    }
    float inv[GROUP_MAX];
    for (int g = 0; g < R; g++) inv[g] = 1.0f / softmax_exp(scores + (size_t)g * max_len, L, mx[g]);
    for (int i0 = 0; i0 < D; i0 += 64) {  /* up to 8 vectors of each head's output in registers */
        const int nv = (D - i0) / 8 < 8 ? (D - i0) / 8 : 8;
        __m256 acc[GROUP_MAX][8];
        #pragma GCC unroll 4
        for (int g = 0; g < R; g++) {
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[g][j] = _mm256_setzero_ps();
        }
        for (int p0 = 0, pg = 0; p0 < L; p0 += S, pg++) {
            const int n = L - p0 < S ? L - p0 : S;
            for (int t = 0; t < n; t++) {
                if (far && ahead(pages, pg, t, n, p0, L, Hkv, D, S, &next))
                    kv_prefetch(v_cache, next + (size_t)kh * D + i0, nv * 8, kv_f16);
                const size_t vr = kv_row(pages, pg, t, Hkv, D, S) + (size_t)kh * D + i0;
                __m256 w[GROUP_MAX];
                #pragma GCC unroll 4
                for (int g = 0; g < R; g++) w[g] = _mm256_set1_ps(scores[(size_t)g * max_len + p0 + t]);
                #pragma GCC unroll 8
                for (int j = 0; j < nv; j++) {
                    const __m256 v = kv_load(v_cache, vr + 8 * j, kv_f16);
                    #pragma GCC unroll 4
                    for (int g = 0; g < R; g++) acc[g][j] = _mm256_fmadd_ps(w[g], v, acc[g][j]);
                }
            }
        }
        #pragma GCC unroll 4
        for (int g = 0; g < R; g++) {
            const __m256 scale_out = _mm256_set1_ps(inv[g]);
            #pragma GCC unroll 8
            for (int j = 0; j < nv; j++)
                _mm256_storeu_ps(out + (size_t)g * D + i0 + 8 * j, _mm256_mul_ps(acc[g][j], scale_out));
        }
    }
}

/* Heads [h0, h0 + R) of one sequence, R <= G and within one KV head. */
static void attend_heads(const float *q, const void *k_cache, const void *v_cache,
                         const int64_t *pages, int L, int h0, int R, int G, int Hkv, int D, int S,
                         float scale, int max_len, float *scores, float *out, int kv_f16) {
    const float *qh = q + (size_t)h0 * D;
    float *oh = out + (size_t)h0 * D;
    const int kh = h0 / G;
#define ATTEND_GROUP(RR) (kv_f16 == KV_Q4_0 ? attend_group(qh, k_cache, v_cache, pages, L, kh, Hkv, D, S, \
                                                          scale, RR, max_len, scores, oh, KV_Q4_0) \
                          : kv_f16 == KV_Q8_0 ? attend_group(qh, k_cache, v_cache, pages, L, kh, Hkv, D, S, \
                                                          scale, RR, max_len, scores, oh, KV_Q8_0) \
                          : kv_f16 ? attend_group(qh, k_cache, v_cache, pages, L, kh, Hkv, D, S, scale, \
                                                RR, max_len, scores, oh, KV_F16) \
                                   : attend_group(qh, k_cache, v_cache, pages, L, kh, Hkv, D, S, scale, \
                                                RR, max_len, scores, oh, KV_F32))
    switch (R) {
#if GROUP_MAX >= 3
    case 3: ATTEND_GROUP(3); return;
    case 2: ATTEND_GROUP(2); return;
#endif
    default: ATTEND_GROUP(1); return;
    }
#undef ATTEND_GROUP
}

/* One sequence, every head, walking the context once in address order (``scratch``: Hq *
 * (max_len + D) floats): at each position the keys of every KV head (adjacent), each dotted with
 * its query heads (head_score's sums); each head's scores exponentiated; then at each position
 * the values of every KV head, each widened once and added into its query heads' output sums,
 * which live in ``scratch`` (each the same FMA chain over the positions, in order, that
 * attend_group keeps in registers). Taken where a position's row of all KV heads is long
 * (ROW_BYTES_GROUPED): there one head's walk strides past the prefetcher and waits on memory
 * at every position (the 1.7B-class shape, a 4 KB row: 19-22 ms against 6-7 ms for this walk,
 * 32 sequences of 300 positions, one thread). */

INLINE float head_score(const float *qr, const void *k_cache, size_t kr, int D, float scale,
                        int kv_f16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= D; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), kv_load(k_cache, kr + i, kv_f16), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i + 8), kv_load(k_cache, kr + i + 8, kv_f16), a1);
    }
    if (i < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), kv_load(k_cache, kr + i, kv_f16), a0);
    return hsum(_mm256_add_ps(a0, a1)) * scale;
}

static void attend_seq(const float *q, const void *k_cache, const void *v_cache,
                       const int64_t *pages, int L, int Hq, int Hkv, int D, int S, float scale,
                       int max_len, float *scratch, float *out, int kv_f16) {
    const int G = Hq / Hkv;
    float *scores = scratch, *sums = scratch + (size_t)Hq * max_len;
    for (int h = 0; h < Hq; h++) scores[(size_t)h * max_len] = -INFINITY;
    float mx[Hq];
    for (int h = 0; h < Hq; h++) mx[h] = -INFINITY;
    for (int p0 = 0, pg = 0; p0 < L; p0 += S, pg++) {
        const int n = L - p0 < S ? L - p0 : S;
        for (int t = 0; t < n; t++) {
            const size_t row = kv_row(pages, pg, t, Hkv, D, S);
            for (int h = 0; h < Hq; h++) {
                const float sc = head_score(q + (size_t)h * D, k_cache, row + (size_t)(h / G) * D,
                                            D, scale, kv_f16);
                scores[(size_t)h * max_len + p0 + t] = sc;
                if (sc > mx[h]) mx[h] = sc;
            }
        }
    }
    float inv[Hq];
    for (int h = 0; h < Hq; h++) inv[h] = 1.0f / softmax_exp(scores + (size_t)h * max_len, L, mx[h]);
    memset(sums, 0, (size_t)Hq * D * sizeof(float));
    for (int p0 = 0, pg = 0; p0 < L; p0 += S, pg++) {
        const int n = L - p0 < S ? L - p0 : S;
        for (int t = 0; t < n; t++) {
            const size_t row = kv_row(pages, pg, t, Hkv, D, S);
            for (int kh = 0; kh < Hkv; kh++) {
                for (int i = 0; i < D; i += 8) {
                    const __m256 v = kv_load(v_cache, row + (size_t)kh * D + i, kv_f16);
                    for (int h = kh * G; h < (kh + 1) * G; h++) {
                        float *acc = sums + (size_t)h * D + i;
                        const __m256 w = _mm256_set1_ps(scores[(size_t)h * max_len + p0 + t]);
                        _mm256_storeu_ps(acc, _mm256_fmadd_ps(w, v, _mm256_loadu_ps(acc)));
                    }
                }
            }
        }
    }
    for (int h = 0; h < Hq; h++) {
        const __m256 scale_out = _mm256_set1_ps(inv[h]);
        for (int i = 0; i < D; i += 8)
            _mm256_storeu_ps(out + (size_t)h * D + i,
                             _mm256_mul_ps(_mm256_loadu_ps(sums + (size_t)h * D + i), scale_out));
    }
}

/* Floats of attention scratch per thread: a group's scores, or attend_seq's scores and sums. */
static size_t attention_scratch(int max_len, int Hq, int D) {
    const size_t group = (size_t)GROUP_MAX * max_len, seq = (size_t)Hq * ((size_t)max_len + D);
    return group > seq ? group : seq;
}

/* ``scratch``: attention_scratch(max_len, Hq, D) floats per thread (the caller's, so nothing is
 * allocated here). */
static void decode_attention_omp(const float *q, int q_stride, const void *k_cache,
                                 const void *v_cache, const int64_t *page_table, int max_pages,
                                 const int64_t *seq_lens, int B, int Hq, int Hkv, int D, int S,
                                 float scale, float *out, int max_len, float *scratch,
                                 int nthreads, int kv_f16) {
    const int G = Hq / Hkv;
    float *scores = scratch + (size_t)omp_get_thread_num() * attention_scratch(max_len, Hq, D);
    if (B < 2 * nthreads) {  /* few sequences: one work item per (sequence, query head) */
        #pragma omp for schedule(dynamic)
        for (int i = 0; i < B * Hq; i++) {
            const int b = i / Hq;
            attend_heads(q + (size_t)b * q_stride, k_cache, v_cache, page_table + (size_t)b * max_pages,
                         (int)seq_lens[b], i % Hq, 1, G, Hkv, D, S, scale, max_len, scores,
                         out + (size_t)b * Hq * D, kv_f16);
        }
        return;
    }
    if (long_rows(Hkv, D, kv_f16)) {  /* attend_seq */
        #pragma omp for schedule(dynamic)
        for (int b = 0; b < B; b++) {
            const float *qb = q + (size_t)b * q_stride;
            const int64_t *pages = page_table + (size_t)b * max_pages;
            float *ob = out + (size_t)b * Hq * D;
            if (kv_f16 == KV_Q4_0)
                attend_seq(qb, k_cache, v_cache, pages, (int)seq_lens[b], Hq, Hkv, D, S, scale, max_len, scores, ob, KV_Q4_0);
            else if (kv_f16 == KV_Q8_0)
                attend_seq(qb, k_cache, v_cache, pages, (int)seq_lens[b], Hq, Hkv, D, S, scale, max_len, scores, ob, KV_Q8_0);
            else if (kv_f16)
                attend_seq(qb, k_cache, v_cache, pages, (int)seq_lens[b], Hq, Hkv, D, S, scale, max_len, scores, ob, 1);
            else
                attend_seq(qb, k_cache, v_cache, pages, (int)seq_lens[b], Hq, Hkv, D, S, scale, max_len, scores, ob, 0);
        }
        return;
    }
    #pragma omp for schedule(dynamic)
    for (int b = 0; b < B; b++) {
        for (int h0 = 0; h0 < Hq; ) {
            const int left = G - h0 % G;  /* heads of this KV head from h0 on */
            const int R = left < GROUP_MAX ? left : GROUP_MAX;
            attend_heads(q + (size_t)b * q_stride, k_cache, v_cache, page_table + (size_t)b * max_pages,
                         (int)seq_lens[b], h0, R, G, Hkv, D, S, scale, max_len, scores,
                         out + (size_t)b * Hq * D, kv_f16);
            h0 += R;
        }
    }
}

/* Every context length within [1, max_len] and its pages within the table's width: the kernels
 * trust these, so they are checked once per call. */
static int seq_lens_valid(const int64_t *seq_lens, int B, int max_len, int max_pages, int S) {
    for (int b = 0; b < B; b++)
        if (seq_lens[b] < 1 || seq_lens[b] > max_len || (seq_lens[b] + S - 1) / S > max_pages)
            return 0;
    return 1;
}

/* Returns 0, -1 on a context length the arguments do not allow, -2 without memory. */
int tri_decode_attention(const float *q, int q_stride, const void *k_cache,
                         const void *v_cache, const int64_t *page_table, int max_pages,
                         const int64_t *seq_lens, int B, int Hq, int Hkv, int D, int S,
                         float scale, float *out, int max_len, int nthreads, int kv_f16) {
    if (!seq_lens_valid(seq_lens, B, max_len, max_pages, S))
        return -1;
    float *scores = malloc((size_t)nthreads * attention_scratch(max_len, Hq, D) * sizeof(float));
    if (!scores)
        return -2;
    #pragma omp parallel num_threads(nthreads)
    decode_attention_omp(q, q_stride, k_cache, v_cache, page_table, max_pages, seq_lens, B, Hq,
                         Hkv, D, S, scale, out, max_len, scores, nthreads, kv_f16);
    free(scores);
    return 0;
}

/* Causal attention for chunks of new tokens (prefill, chunked prefill), over the paged cache.
 * q: [T, Hq, D] (rows ``q_stride`` floats apart per token), sequence b owning tokens
 * [qsl[b], qsl[b + 1]), the last of its first seq_lens[b] positions (their keys and values
 * already stored); out: [T, Hq, D]. A new token at position p attends over positions [0, p]:
 * exactly what decode attention computes for a sequence of p + 1 positions (the same kernels,
 * so a prompt's last token gets the bits a decode step would give it). Work items are (token,
 * group of query heads) pairs, or tokens where rows are long (attend_seq). Returns 0, -1 on
 * lengths the arguments do not allow, -2 without memory. */
int tri_extend_attention(const float *q, int q_stride, const void *k_cache, const void *v_cache,
                         const int64_t *page_table, int max_pages, const int64_t *qsl,
                         const int64_t *seq_lens, int B, int Hq, int Hkv, int D, int S,
                         float scale, float *out, int max_len, int nthreads, int kv_f16) {
    if (!seq_lens_valid(seq_lens, B, max_len, max_pages, S) || qsl[0] != 0)
        return -1;
    for (int b = 0; b < B; b++)
        if (qsl[b + 1] < qsl[b] || qsl[b + 1] - qsl[b] > seq_lens[b])
            return -1;
    const int T = (int)qsl[B];
    int *seq_of = malloc((size_t)(T ? T : 1) * sizeof(int));
    float *scratch = malloc((size_t)nthreads * attention_scratch(max_len, Hq, D) * sizeof(float));
    if (!seq_of || !scratch) {
        free(seq_of); free(scratch);
        return -2;
    }
    for (int b = 0; b < B; b++)
        for (int64_t t = qsl[b]; t < qsl[b + 1]; t++) seq_of[t] = b;
    const int G = Hq / Hkv;
    const int per_kv = (G + GROUP_MAX - 1) / GROUP_MAX;  /* groups of query heads per KV head */
    const int whole = long_rows(Hkv, D, kv_f16);
    const int items = whole ? T : T * Hkv * per_kv;
    #pragma omp parallel num_threads(nthreads)
    {
        float *mine = scratch + (size_t)omp_get_thread_num() * attention_scratch(max_len, Hq, D);
        #pragma omp for schedule(dynamic, 4)
        for (int i = 0; i < items; i++) {
            const int t = whole ? i : i / (Hkv * per_kv);
            const int b = seq_of[t];
            const int L = (int)(seq_lens[b] - (qsl[b + 1] - t) + 1);  /* positions [0, p] */
            const float *qt = q + (size_t)t * q_stride;
            const int64_t *pages = page_table + (size_t)b * max_pages;
            float *ot = out + (size_t)t * Hq * D;
            if (whole) {
                if (kv_f16 == KV_Q4_0)
                    attend_seq(qt, k_cache, v_cache, pages, L, Hq, Hkv, D, S, scale, max_len, mine, ot, KV_Q4_0);
                else if (kv_f16 == KV_Q8_0)
                    attend_seq(qt, k_cache, v_cache, pages, L, Hq, Hkv, D, S, scale, max_len, mine, ot, KV_Q8_0);
                else if (kv_f16)
                    attend_seq(qt, k_cache, v_cache, pages, L, Hq, Hkv, D, S, scale, max_len, mine, ot, 1);
                else
                    attend_seq(qt, k_cache, v_cache, pages, L, Hq, Hkv, D, S, scale, max_len, mine, ot, 0);
                continue;
            }
            const int grp = i % (Hkv * per_kv), kh = grp / per_kv, c = grp % per_kv;
            const int h0 = kh * G + c * GROUP_MAX;
            const int R = G - c * GROUP_MAX < GROUP_MAX ? G - c * GROUP_MAX : GROUP_MAX;
            attend_heads(qt, k_cache, v_cache, pages, L, h0, R, G, Hkv, D, S, scale, max_len, mine,
                         ot, kv_f16);
        }
    }
    free(seq_of); free(scratch);
    return 0;
}

/* -- A whole decode step in one call --------------------------------------------------------------
 *
 * A decode step of a small model is ~10 ops per layer; called one by one from Python, each costs a
 * dispatch and a fork/join of the threads, ~6 ms of a 15 ms step for a 135M model. Here the step
 * (embedding, every layer, the final norm, the lm_head) runs in one parallel region; the threads
 * meet at a barrier between ops. Each op is the same code the op-by-op path runs, in the same
 * order, so the logits are bitwise the same. Only for a step of B sequences decoding one token
 * each, with every linear weight packed (tri_pack). */

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm;  /* per-head norms (Qwen3), or NULL */
    tri_lin qkv, o, gate_up, down;
} tri_layer;

typedef struct {
    int num_layers, H, Hq, Hkv, D, I, page_size;
    int kv_f16;               /* the KV cache's kind: KV_F32, KV_F16, KV_Q8_0 or KV_Q4_0 */
    float eps, scale;
    int embed_fmt;            /* a block format (with FMT_X8 or FMT_X16 in that layout), or 0: fp32 rows */
    const uint8_t *embed;
    size_t embed_row_bytes;
    int64_t embed_rows;       /* the table's rows (where its groups end) */
    const float *final_norm;
    tri_lin lm_head;
    const float *cos_sin;
    const tri_layer *layers;  /* num_layers of them */
} tri_model;

/* logits [B, vocab] for B sequences each decoding one token: ids, positions and KV slots of the
 * new tokens, the page table [B, max_pages] and context lengths (after this token) of each.
 * Returns 0, -1 on a context length the arguments do not allow, -2 without memory. */
int tri_decode_step(const tri_model *m, void *const *k_caches, void *const *v_caches, int B,
                    const int64_t *ids, const int64_t *positions, const int64_t *slots,
                    const int64_t *page_table, int max_pages, const int64_t *seq_lens,
                    int max_len, float *logits, int nthreads) {
    if (!seq_lens_valid(seq_lens, B, max_len, max_pages, m->page_size))
        return -1;
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
    float *scores = malloc((size_t)nthreads * attention_scratch(max_len, Hq, D) * sizeof(float));
    lin_scratch s;
    int rc = -2;
    const int have = scratch_alloc(&s, B, widest, nthreads);
    if (!have || !hidden || !residual || !normed || !qkv || !attn || !gate_up || !act || !scores)
        goto done;
    for (int b = 0; b < B; b++) {
        float *row = residual + (size_t)b * H;  /* the embedding is layer 0's residual */
        if (m->embed_fmt)
            dequant_row(m->embed_fmt & 0xFF,
                        row_in_row_layout(m->embed_fmt, m->embed, m->embed_row_bytes, m->embed_rows,
                                          ids[b], H, s.xq /* free until the first linear */), H, row);
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
            linear_omp(&L->qkv, normed, B, qkv, &s);
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
                                 k_caches[l], v_caches[l], m->kv_f16);
            }
            decode_attention_omp(qkv, QKV, k_caches[l], v_caches[l], page_table, max_pages,
                                 seq_lens, B, Hq, Hkv, D, m->page_size, m->scale, attn, max_len,
                                 scores, omp_get_num_threads(), m->kv_f16);
            linear_omp(&L->o, attn, B, hidden, &s);
            rms_norm_omp(hidden, residual, residual, L->post_norm, B, H, m->eps, normed);
            linear_omp(&L->gate_up, normed, B, gate_up, &s);
            silu_and_mul_omp(gate_up, B, I, act);
            linear_omp(&L->down, act, B, hidden, &s);
        }
        rms_norm_omp(hidden, residual, residual, m->final_norm, B, H, m->eps, normed);
        linear_omp(&m->lm_head, normed, B, logits, &s);
    }
    rc = 0;
done:
    free(hidden); free(residual); free(normed); free(qkv); free(attn); free(gate_up);
    free(act); free(scores);
    scratch_free(&s);
    return rc;
}

/* 1 if every linear of the model is a valid description whose shapes fit the model's. */
int tri_model_valid(const tri_model *m) {
    const int H = m->H, QKV = (m->Hq + 2 * m->Hkv) * m->D;
    if (m->num_layers < 1 || m->D % 8 || m->Hkv < 1 || m->Hq % m->Hkv || m->page_size < 1)
        return 0;
    const int ef = m->embed_fmt, eb = ef & 0xFF;
    if (ef && (tri_row_bytes(eb, H) == 0 || (ef & ~(0xFF | FMT_X8 | FMT_X16))
               || ((ef & FMT_X8) && (ef & FMT_X16))
               || ((ef & FMT_X8) && !x8_format(eb)) || ((ef & FMT_X16) && !x16_format(eb))
               || ((ef & (FMT_X8 | FMT_X16)) && m->embed_row_bytes != tri_row_bytes(eb, H))))
        return 0;
    if (!lin_valid(&m->lm_head) || m->lm_head.K != H)
        return 0;
    for (int l = 0; l < m->num_layers; l++) {
        const tri_layer *L = &m->layers[l];
        if (!lin_valid(&L->qkv) || !lin_valid(&L->o) || !lin_valid(&L->gate_up) || !lin_valid(&L->down))
            return 0;
        if (L->qkv.K != H || L->qkv.N != QKV || L->o.K != m->Hq * m->D || L->o.N != H
            || L->gate_up.K != H || L->gate_up.N != 2 * m->I || L->down.K != m->I || L->down.N != H)
            return 0;
    }
    return 1;
}

/* sizeof the structs of the ctypes boundary (0: tri_lin, 1: tri_layer, 2: tri_model), which
 * kernels/cpu.py compares with its own mirrors at load. */
size_t tri_struct_size(int which) {
    switch (which) {
    case 0: return sizeof(tri_lin);
    case 1: return sizeof(tri_layer);
    case 2: return sizeof(tri_model);
    default: return 0;
    }
}
