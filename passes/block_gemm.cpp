/* Quantized linears in llama.cpp's manner: activations quantized to int8 per block of 32 input
 * features, int8 x int8 (int4 x int8) dot products with AVX-512 VNNI (vpdpbusd), one fp32
 * scale step per block. Built by autoopt.passes.block_kernels (torch.utils.cpp_extension) on
 * the machine that runs it; the CPU kernels of the ops that module defines.
 *
 * Weights are laid out in panels of 16 output rows so that one vpdpbusd computes 4 input
 * features of 16 rows, its activation operand one 32-bit broadcast:
 *   int8: panel p, chunk j (4 features): 64 bytes, byte 4r+b = q[16p+r][4j+b] + 128 (unsigned);
 *   int4: panel p, pair i (8 features): 64 bytes, byte 4r+b = q[16p+r][8i+b]
 *         | q[16p+r][8i+4+b] << 4 (codes 0..15); each group's pairs are followed by its 16
 *         rows' bf16 scales, then their bf16 zeros (one stream per panel: scales kept apart,
 *         [groups][rows], made one load stream per group and ran 25% slower).
 * int8's per-row scales are bf16, [rows].
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#define BLOCK 32
/* Bytes read ahead of the block in hand: one thread's stream from memory ran at 7.6 GB/s
 * without, 11-13 with 4-8 KiB (an Intel Xeon without AMX, int4 decode shapes). */
#define AHEAD 4096
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

static bool supported() {
    // Asked once: every call checks it.
    static const bool here = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }();
    return here;
}

/* x: rows m of k fp32 (row stride ldx). xq: int8 codes, xs: scale of each block, xsum: the
 * sum of each block's codes (as fp32). */
TARGET static void quantize(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *xq,
                                float *xs, float *xsum) {
    const int64_t blocks = k / BLOCK;
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * ldx;
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = row + b * BLOCK;
            __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
            __m512 amax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
            float a = _mm512_reduce_max_ps(amax);
            float scale = a / 127.0f;
            float inv = a > 0.0f ? 127.0f / a : 0.0f;
            __m512 iv = _mm512_set1_ps(inv);
            __m512i ql = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, iv),
                                                                 _MM_FROUND_TO_NEAREST_INT));
            __m512i qh = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, iv),
                                                                 _MM_FROUND_TO_NEAREST_INT));
            int8_t *out = xq + r * k + b * BLOCK;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(ql));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qh));
            xs[r * blocks + b] = scale;
            xsum[r * blocks + b] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
        }
    }
}

static inline __m512 TARGET bf16_to_ps(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void TARGET store_rows(float *y, __m512 acc, const float *bias, int64_t n0,
                                     int64_t n) {
    int64_t left = n - n0;
    __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
    if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias + n0));
    _mm512_mask_storeu_ps(y + n0, mask, acc);
}

/* y[m][n] = sum_k dequantized(w)[n][k] * xq[m][k] * xs (+ bias[n]), for n < n_out.
 * w8: panels as above, n_pad rows; ws: bf16 scale per row. */
TARGET static void gemm_int8(const int8_t *xq, const float *xs, const float *xsum, int64_t m,
                             int64_t k, const uint8_t *w8, const uint16_t *ws,
                             const float *bias, int64_t n_out, float *y, int64_t ldy,
                             int64_t first, int64_t last) {
    const int64_t blocks = k / BLOCK;
    for (int64_t p = first; p < last; p++) {
        const uint8_t *panel = w8 + p * 16 * k;
        __m512 scale = bf16_to_ps(ws + p * 16);
        for (int64_t r = 0; r < m; r++) {
            const int32_t *a = (const int32_t *)(xq + r * k);
            const float *sa = xs + r * blocks, *suma = xsum + r * blocks;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *wb = panel + b * BLOCK * 16;
                for (int i = 0; i < 8; i++)
                    _mm_prefetch((const char *)wb + AHEAD + i * 64, _MM_HINT_T0);
                __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {
                    d0 = _mm512_dpbusd_epi32(d0, _mm512_loadu_si512(wb + j * 64),
                                             _mm512_set1_epi32(a[b * 8 + j]));
                    d1 = _mm512_dpbusd_epi32(d1, _mm512_loadu_si512(wb + (j + 1) * 64),
                                             _mm512_set1_epi32(a[b * 8 + j + 1]));
                }
                /* The weights were shifted by 128: subtract 128 * the block's code sum. */
                __m512 dot = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)),
                                           _mm512_set1_ps(128.0f * suma[b]));
                acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(sa[b]), acc);
            }
            store_rows(y + r * ldy, _mm512_mul_ps(acc, scale), bias, p * 16, n_out);
        }
    }
}

/* int4 codes q in groups of `group` features: w = (q - 8) * s + z, s and z bf16.
 * Per block: s * dot(q, xq) + (z - 8 s) * sum(xq), times the block's activation scale. */
TARGET static void gemm_int4(const int8_t *xq, const float *xs, const float *xsum, int64_t m,
                             int64_t k, const uint8_t *w4, int64_t group, const float *bias,
                             int64_t n_out, float *y, int64_t ldy, int64_t first,
                             int64_t last) {
    const int64_t blocks = k / BLOCK, per_group = group / BLOCK;
    const int64_t group_bytes = group * 8 + 64;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t p = first; p < last; p++) {
        const uint8_t *panel = w4 + p * (k / group) * group_bytes;
        for (int64_t r = 0; r < m; r++) {
            const int32_t *a = (const int32_t *)(xq + r * k);
            const float *sa = xs + r * blocks, *suma = xsum + r * blocks;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t g = b / per_group;
                const uint8_t *wg = panel + g * group_bytes;
                const uint8_t *wb = wg + (b - g * per_group) * BLOCK * 8;
                for (int i = 0; i < 4; i++)
                    _mm_prefetch((const char *)wb + AHEAD + i * 64, _MM_HINT_T0);
                __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                for (int i = 0; i < 4; i++) {
                    __m512i v = _mm512_loadu_si512(wb + i * 64);
                    d0 = _mm512_dpbusd_epi32(d0, _mm512_and_si512(v, low),
                                             _mm512_set1_epi32(a[b * 8 + 2 * i]));
                    d1 = _mm512_dpbusd_epi32(d1, _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                             _mm512_set1_epi32(a[b * 8 + 2 * i + 1]));
                }
                const uint16_t *sz = (const uint16_t *)(wg + group * 8);
                __m512 s = bf16_to_ps(sz), z = bf16_to_ps(sz + 16);
                __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);
                __m512 dot = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)));
                dot = _mm512_fmadd_ps(offset, _mm512_set1_ps(suma[b]), dot);
                acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(sa[b]), acc);
            }
            store_rows(y + r * ldy, acc, bias, p * 16, n_out);
        }
    }
}

/* fp16 weights, fp32 activations: panel p holds, for each input feature, its 16 rows' fp16
 * values (32 bytes), so one vcvtph2ps and one FMA with the broadcast activation cover 16
 * rows. Four accumulators hide the FMA's latency. */
TARGET static void gemm_fp16(const float *x, int64_t m, int64_t k, const uint16_t *w16,
                             const float *bias, int64_t n_out, float *y, int64_t ldy,
                             int64_t first, int64_t last) {
    for (int64_t p = first; p < last; p++) {
        const uint16_t *panel = w16 + p * 16 * k;
        for (int64_t r = 0; r < m; r++) {
            const float *a = x + r * k;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                             _mm512_setzero_ps()};
            for (int64_t j = 0; j < k; j += 4) {
                const uint16_t *wj = panel + j * 16;
                _mm_prefetch((const char *)wj + AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)wj + AHEAD + 64, _MM_HINT_T0);
                for (int i = 0; i < 4; i++) {
                    __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wj + i * 16)));
                    acc[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(a[j + i]), acc[i]);
                }
            }
            __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            store_rows(y + r * ldy, sum, bias, p * 16, n_out);
        }
    }
}

/* fp32 weights as the model holds them, (out, in) row-major, for a few rows of activations (a
 * decode step): 8 rows of the weight at a time, each its own stream prefetched ahead, one FMA
 * per 16 features of each. On a quiet Intel Xeon without AMX (1 thread, weights from memory)
 * MKL's GEMV read a decode step's shapes at 11.7-15.2 GB/s and these 8 streams at 12.6-15.5:
 * within 4% of it on most, 8% faster on 768 x 768 and the 32000-row head; under load the
 * gap grew to 7-17%. A candidate packed_linear measures per shape. */
#define STRIP 8
#define AHEAD_F32 1024
TARGET static void gemv_fp32(const float *x, int64_t m, int64_t k, const float *w,
                             const float *bias, int64_t n_out, float *y, int64_t first,
                             int64_t last) {
    const int64_t whole = k / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (k - whole)) - 1u);
    for (int64_t s = first; s < last; s++) {
        const int64_t n0 = s * STRIP, rows = std::min<int64_t>(STRIP, n_out - n0);
        const float *strip = w + n0 * k;
        for (int64_t r = 0; r < m; r++) {
            const float *a = x + r * k;
            float *out = y + r * n_out + n0;
            if (rows == STRIP) {
                __m512 acc[STRIP];
                for (int i = 0; i < STRIP; i++) acc[i] = _mm512_setzero_ps();
                int64_t j = 0;
                for (; j < whole; j += 16) {
                    const __m512 xv = _mm512_loadu_ps(a + j);
                    for (int i = 0; i < STRIP; i++) {
                        const float *wi = strip + i * k + j;
                        _mm_prefetch((const char *)wi + AHEAD_F32, _MM_HINT_T0);
                        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(wi), xv, acc[i]);
                    }
                }
                if (tail) {
                    const __m512 xv = _mm512_maskz_loadu_ps(tail, a + j);
                    for (int i = 0; i < STRIP; i++)
                        acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, strip + i * k + j),
                                                 xv, acc[i]);
                }
                for (int i = 0; i < STRIP; i++)
                    out[i] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[n0 + i] : 0.0f);
                continue;
            }
            for (int64_t i = 0; i < rows; i++) {  // the last rows, fewer than a strip
                __m512 acc = _mm512_setzero_ps();
                int64_t j = 0;
                for (; j < whole; j += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(strip + i * k + j),
                                          _mm512_loadu_ps(a + j), acc);
                if (tail)
                    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, strip + i * k + j),
                                          _mm512_maskz_loadu_ps(tail, a + j), acc);
                out[i] = _mm512_reduce_add_ps(acc) + (bias ? bias[n0 + i] : 0.0f);
            }
        }
    }
}

/* fp32 (or bf16) weights as the model holds them, one row at a time and no software
 * prefetch: the weight read as one sequential stream, which the hardware prefetcher follows.
 * On an AMD EPYC (Zen 5, 1 thread, weights from memory) the 8 prefetched streams above read a
 * decode step's fp32 shapes at 19-28 GB/s and this one stream at 25-33, where oneDNN's packed
 * GEMV reads 20-28; the Intel Xeon that chose the 8 streams may choose otherwise.
 * ``packed_linear`` measures both. bf16 weights are widened to fp32 in registers (exact) and
 * multiplied with fp32 activations: 21-30 GB/s on that EPYC where oneDNN's bf16 GEMV read
 * 20-26 and FBGEMM's fp16 one 17-29 (bench/decode_gemv.py). Up to 4 activation rows share
 * each weight load; 2 accumulators a row hide the FMA's latency. Each output is one thread's
 * sum, in the same order at any thread count. */
static inline __m512 TARGET load16(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 TARGET load16(const uint16_t *p) { return bf16_to_ps(p); }
static inline __m512 TARGET load16(const float *p, __mmask16 lanes) {
    return _mm512_maskz_loadu_ps(lanes, p);
}
static inline __m512 TARGET load16(const uint16_t *p, __mmask16 lanes) {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int M, typename W, typename Y>
TARGET static void gemv_stream_rows(const float *x, int64_t k, const W *w, const float *bias,
                                    int64_t n_out, Y *y, int64_t first, int64_t last) {
    const int64_t whole = k / 32 * 32;
    for (int64_t o = first; o < last; o++) {
        const W *row = w + o * k;
        __m512 acc[M][2];
        for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j < whole; j += 32) {
            const __m512 w0 = load16(row + j), w1 = load16(row + j + 16);
            for (int r = 0; r < M; r++) {
                acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * k + j), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * k + j + 16), acc[r][1]);
            }
        }
        for (; j < k; j += 16) {  // the last features, fewer than 32: masked where below 16
            const __mmask16 lanes =
                k - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - j)) - 1u);
            const __m512 w0 = load16(row + j, lanes);
            for (int r = 0; r < M; r++)
                acc[r][0] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(lanes, x + r * k + j),
                                            acc[r][0]);
        }
        for (int r = 0; r < M; r++)  // rounded once, to nearest even, where Y is bf16
            y[r * n_out + o] = Y(_mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) +
                                 (bias ? bias[o] : 0.0f));
    }
}

template <typename W, typename Y>
TARGET static void gemv_stream(const float *x, int64_t m, int64_t k, const W *w,
                               const float *bias, int64_t n_out, Y *y, int64_t first,
                               int64_t last) {
    for (int64_t r = 0; r < m; r += 4) {  // activation rows in fours: each group one sweep
        const float *xr = x + r * k;
        Y *yr = y + r * n_out;
        switch (std::min<int64_t>(4, m - r)) {
        case 1: gemv_stream_rows<1>(xr, k, w, bias, n_out, yr, first, last); break;
        case 2: gemv_stream_rows<2>(xr, k, w, bias, n_out, yr, first, last); break;
        case 3: gemv_stream_rows<3>(xr, k, w, bias, n_out, yr, first, last); break;
        default: gemv_stream_rows<4>(xr, k, w, bias, n_out, yr, first, last); break;
        }
    }
}

/* The ops (schemas in block_kernels.py): x (..., k) in any float dtype, y (..., out) in x's. */
struct Quantized {
    at::Tensor rows, codes, scales, sums;
};

static Quantized quantized(const at::Tensor &x) {
    TORCH_CHECK(supported(), "autoopt_blocks: this CPU has no AVX-512 VNNI");
    const int64_t k = x.size(-1);
    TORCH_CHECK(k % BLOCK == 0, "autoopt_blocks: the input width ", k,
                " is not a multiple of ", BLOCK);
    at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
    const int64_t m = rows.size(0);
    Quantized q{rows, at::empty({m, k}, rows.options().dtype(at::kChar)),
                at::empty({m, k / BLOCK}, rows.options()), at::empty({m, k / BLOCK}, rows.options())};
    quantize(rows.data_ptr<float>(), m, k, k, q.codes.data_ptr<int8_t>(),
             q.scales.data_ptr<float>(), q.sums.data_ptr<float>());
    return q;
}

static const float *bias_of(const std::optional<at::Tensor> &bias, at::Tensor &keep) {
    if (!bias.has_value()) return nullptr;
    keep = bias->to(at::kFloat).contiguous();
    return keep.data_ptr<float>();
}

static at::Tensor shaped(const at::Tensor &y, const at::Tensor &x, int64_t out) {
    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = out;
    return y.view(sizes).to(x.scalar_type());
}

// Panels per task: 4 (64 rows) keeps a task's weights streaming.
static constexpr int64_t GRAIN = 4;

static at::Tensor int8_linear(const at::Tensor &x, const at::Tensor &panels,
                              const at::Tensor &scales, const std::optional<at::Tensor> &bias,
                              int64_t out) {
    Quantized q = quantized(x);
    const int64_t m = q.rows.size(0), k = q.rows.size(1);
    TORCH_CHECK(panels.dtype() == at::kByte && panels.is_contiguous() && panels.dim() == 2 &&
                    panels.size(1) == 16 * k && panels.size(0) * 16 >= out,
                "autoopt_blocks.int8_linear: panels do not match the input");
    at::Tensor keep, y = at::empty({m, out}, q.rows.options());
    const float *b = bias_of(bias, keep);
    const uint8_t *w = panels.data_ptr<uint8_t>();
    const uint16_t *s = reinterpret_cast<const uint16_t *>(scales.data_ptr<at::BFloat16>());
    at::parallel_for(0, panels.size(0), GRAIN, [&](int64_t first, int64_t last) {
        gemm_int8(q.codes.data_ptr<int8_t>(), q.scales.data_ptr<float>(),
                  q.sums.data_ptr<float>(), m, k, w, s, b, out, y.data_ptr<float>(), out, first,
                  last);
    });
    return shaped(y, x, out);
}

static at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &panels, int64_t group,
                              const std::optional<at::Tensor> &bias, int64_t out) {
    Quantized q = quantized(x);
    const int64_t m = q.rows.size(0), k = q.rows.size(1);
    TORCH_CHECK(group % BLOCK == 0 && k % group == 0 && panels.dtype() == at::kByte &&
                    panels.is_contiguous() && panels.dim() == 3 && panels.size(1) == k / group &&
                    panels.size(2) == group * 8 + 64 && panels.size(0) * 16 >= out,
                "autoopt_blocks.int4_linear: panels do not match the input");
    at::Tensor keep, y = at::empty({m, out}, q.rows.options());
    const float *b = bias_of(bias, keep);
    const uint8_t *w = panels.data_ptr<uint8_t>();
    at::parallel_for(0, panels.size(0), GRAIN, [&](int64_t first, int64_t last) {
        gemm_int4(q.codes.data_ptr<int8_t>(), q.scales.data_ptr<float>(),
                  q.sums.data_ptr<float>(), m, k, w, group, b, out, y.data_ptr<float>(), out,
                  first, last);
    });
    return shaped(y, x, out);
}

static at::Tensor fp16_linear(const at::Tensor &x, const at::Tensor &panels,
                              const std::optional<at::Tensor> &bias, int64_t out) {
    TORCH_CHECK(supported(), "autoopt_blocks: this CPU has no AVX-512 VNNI");
    const int64_t k = x.size(-1);
    TORCH_CHECK(k % 4 == 0 && panels.dtype() == at::kHalf && panels.is_contiguous() &&
                    panels.dim() == 2 && panels.size(1) == 16 * k && panels.size(0) * 16 >= out,
                "autoopt_blocks.fp16_linear: panels do not match the input");
    at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
    const int64_t m = rows.size(0);
    at::Tensor keep, y = at::empty({m, out}, rows.options());
    const float *b = bias_of(bias, keep);
    const uint16_t *w = reinterpret_cast<const uint16_t *>(panels.data_ptr<at::Half>());
    at::parallel_for(0, panels.size(0), GRAIN, [&](int64_t first, int64_t last) {
        gemm_fp16(rows.data_ptr<float>(), m, k, w, b, out, y.data_ptr<float>(), out, first, last);
    });
    return shaped(y, x, out);
}

enum class Gemv { rows, stream, bf16_stream };

static at::Tensor own_gemv(const char *name, Gemv kind, const at::Tensor &x,
                           const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(supported(), "autoopt_blocks: this CPU has no AVX-512 VNNI");
    const int64_t k = x.size(-1), out = weight.size(0);
    const at::ScalarType held = kind == Gemv::bf16_stream ? at::kBFloat16 : at::kFloat;
    TORCH_CHECK(x.scalar_type() == held && weight.scalar_type() == held && weight.dim() == 2 &&
                    weight.is_contiguous() && weight.size(1) == k,
                "autoopt_blocks.", name, ": an input and a contiguous (out, in) weight of its "
                "width, both ", held);
    at::Tensor keep;
    const float *b = bias_of(bias, keep);
    if (kind == Gemv::bf16_stream) {
        // The activations widened here and the outputs rounded in the kernel: two tensor
        // conversions a call were ~10 us of a 50-150 us decode-step GEMV.
        const at::Tensor held_rows = x.reshape({-1, k}).contiguous();
        const int64_t m = held_rows.size(0);
        const at::BFloat16 *xb = held_rows.data_ptr<at::BFloat16>();
        std::vector<float> rows(m * k);
        for (int64_t i = 0; i < m * k; i++) rows[i] = float(xb[i]);
        at::Tensor y = at::empty({m, out}, held_rows.options());
        const uint16_t *w = reinterpret_cast<const uint16_t *>(weight.data_ptr<at::BFloat16>());
        at::BFloat16 *yb = y.data_ptr<at::BFloat16>();
        at::parallel_for(0, out, 64, [&](int64_t first, int64_t last) {
            gemv_stream(rows.data(), m, k, w, b, out, yb, first, last);
        });
        return shaped(y, x, out);  // y is in x's dtype already: a view, no conversion
    }
    at::Tensor rows = x.reshape({-1, k}).contiguous();
    const int64_t m = rows.size(0);
    at::Tensor y = at::empty({m, out}, rows.options());
    const float *w = weight.data_ptr<float>();
    if (kind == Gemv::stream) {
        at::parallel_for(0, out, 64, [&](int64_t first, int64_t last) {
            gemv_stream(rows.data_ptr<float>(), m, k, w, b, out, y.data_ptr<float>(), first,
                        last);
        });
        return shaped(y, x, out);
    }
    // Strips per task: 8 (64 rows of the weight).
    at::parallel_for(0, (out + STRIP - 1) / STRIP, 8, [&](int64_t first, int64_t last) {
        gemv_fp32(rows.data_ptr<float>(), m, k, w, b, out, y.data_ptr<float>(), first, last);
    });
    return shaped(y, x, out);
}

static at::Tensor fp32_linear(const at::Tensor &x, const at::Tensor &weight,
                              const std::optional<at::Tensor> &bias) {
    return own_gemv("fp32_linear", Gemv::rows, x, weight, bias);
}

static at::Tensor fp32_stream_linear(const at::Tensor &x, const at::Tensor &weight,
                                     const std::optional<at::Tensor> &bias) {
    return own_gemv("fp32_stream_linear", Gemv::stream, x, weight, bias);
}

static at::Tensor bf16_stream_linear(const at::Tensor &x, const at::Tensor &weight,
                                     const std::optional<at::Tensor> &bias) {
    return own_gemv("bf16_stream_linear", Gemv::bf16_stream, x, weight, bias);
}

TORCH_LIBRARY_FRAGMENT(autoopt_blocks, m) {
    m.def("supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(autoopt_blocks, CPU, m) {
    m.impl("int8_linear", &int8_linear);
    m.impl("int4_linear", &int4_linear);
    m.impl("fp16_linear", &fp16_linear);
    m.impl("fp32_linear", &fp32_linear);
    m.impl("fp32_stream_linear", &fp32_stream_linear);
    m.impl("bf16_stream_linear", &bf16_stream_linear);
}
