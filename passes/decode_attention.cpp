/* Attention of a few queries over a KV cache (a decode step), as one kernel of autoopt's own:
 * ATen's CPU flash kernel spends ~30 us on a step's layer whose arithmetic is ~1 us (1 query,
 * 12 heads of 64 over 100 positions), and a static cache is mostly positions not yet written.
 * Here each key the mask hides from every query is never read (no window to find first), the
 * query heads sharing a key head (grouped-query attention) read its keys and values once, and
 * scores, softmax and the weighted sum of the values stay in L1.
 *
 * q (B, H, Q, D), k and v (B, KV, L, D) with H a multiple of KV, mask broadcastable to
 * (B, H, Q, L): bool (true: attend) or additive float; fp32 or bf16 (computed in fp32).
 * A query whose mask hides every position gets zeros, as ATen's kernel gives it.
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#define ATTN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

static inline float ATTN_TARGET to_float(float x) { return x; }
static inline float ATTN_TARGET to_float(at::BFloat16 x) { return static_cast<float>(x); }

/* 16 values at p as fp32. */
static inline __m512 ATTN_TARGET load16(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 ATTN_TARGET load16(const at::BFloat16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
static inline float ATTN_TARGET dot(const float *q, const T *k, int64_t d) {
    int64_t i = 0;
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < d; i++) s += q[i] * to_float(k[i]);
    return s;
}

template <typename T>
static inline void ATTN_TARGET axpy(float *y, float a, const T *x, int64_t d) {
    int64_t i = 0;
    __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, load16(x + i), _mm512_loadu_ps(y + i)));
    for (; i < d; i++) y[i] += a * to_float(x[i]);
}

/* Lane i: the sum of v[i]'s 16 lanes (16 dot products' partial sums reduced at once: 45
 * shuffles and adds where 16 horizontal reductions take ~130). */
static inline __m512 ATTN_TARGET sums16(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per block: the block's sum of each of 4 vectors
        quads[i] = _mm512_add_ps(
            _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
            _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp of 16 values (Cephes' expf polynomial, within 2 ulp); below -87.3, exactly 0 (the
 * positions a float mask hides with -inf). */
static inline __m512 ATTN_TARGET exp16(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(p, n));
}

/* The tensors and sizes of one call, read once (at::Tensor's accessors are calls). */
template <typename T>
struct Problem {
    const T *q, *k, *v;
    const bool *mb;
    const float *mf;
    int64_t H, Q, D, KV, L, G;
    int64_t qs[4], ks[4], vs[4], ms[4];
    float scale;
    T *out;
};

/* One batch entry and key head: its G query heads x Q queries over L positions. */
template <typename T>
static void ATTN_TARGET attend(const Problem<T> &p, int64_t b, int64_t g) {
    const int64_t Q = p.Q, D = p.D, L = p.L, G = p.G, rows = G * Q;
    std::vector<float> qs(rows * D), scores(rows * L), acc(rows * D, 0.0f), total(rows, 0.0f);
    std::vector<int64_t> seen(L), mrow(rows);  // positions some query may see; mask rows
    for (int64_t r = 0; r < rows; r++) {
        const int64_t h = g * G + r / Q, i = r % Q;
        const T *row = p.q + b * p.qs[0] + h * p.qs[1] + i * p.qs[2];
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = to_float(row[d * p.qs[3]]) * p.scale;
        mrow[r] = b * p.ms[0] + h * p.ms[1] + i * p.ms[2];
    }
    // Rows reading the same mask row (heads and queries it broadcasts over) are read once.
    bool shared = true;
    for (int64_t r = 1; r < rows; r++) shared = shared && mrow[r] == mrow[0];
    const int64_t mstep = p.ms[3];
    int64_t n = 0;
    for (int64_t j = 0; j < L; j++) {
        bool any = !p.mb;
        for (int64_t r = 0; r < (shared ? 1 : rows) && !any; r++) any = p.mb[mrow[r] + j * mstep];
        if (any) seen[n++] = j;
    }
    const float hidden = -std::numeric_limits<float>::infinity();
    const T *keys = p.k + b * p.ks[0] + g * p.ks[1];
    const bool lanes = D % 16 == 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = qs.data() + r * D;
        float *sr = scores.data() + r * L;
        int64_t t = 0;
        if (lanes) {  // 16 positions at once
            for (; t + 16 <= n; t += 16) {
                __m512 part[16];
                for (int u = 0; u < 16; u++) part[u] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 16) {
                    const __m512 qd = _mm512_loadu_ps(qr + d);
                    for (int u = 0; u < 16; u++)
                        part[u] = _mm512_fmadd_ps(qd, load16(keys + seen[t + u] * p.ks[2] + d),
                                                  part[u]);
                }
                _mm512_storeu_ps(sr + t, sums16(part));
            }
        }
        for (; t < n; t++) sr[t] = dot(qr, keys + seen[t] * p.ks[2], D);
        for (t = 0; t < n; t++) {
            const int64_t at = mrow[r] + seen[t] * mstep;
            if (p.mb && !shared && !p.mb[at]) sr[t] = hidden;
            else if (p.mf) sr[t] += p.mf[at];
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *sr = scores.data() + r * L, top = hidden;
        for (int64_t t = 0; t < n; t++) top = std::max(top, sr[t]);
        if (top == hidden) continue;  // hides every position: zeros
        float sum = 0.0f;
        int64_t t = 0;
        const __m512 shift = _mm512_set1_ps(top);
        __m512 vsum = _mm512_setzero_ps();
        for (; t + 16 <= n; t += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + t), shift));
            _mm512_storeu_ps(sr + t, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (t < n) {
            const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1u);
            __m512 e = _mm512_maskz_mov_ps(
                tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + t), shift)));
            _mm512_mask_storeu_ps(sr + t, tail, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        sum = _mm512_reduce_add_ps(vsum);
        total[r] = sum;
    }
    const T *values = p.v + b * p.vs[0] + g * p.vs[1];
    for (int64_t r = 0; r < rows; r++) {
        if (total[r] <= 0.0f) continue;
        const float *sr = scores.data() + r * L;
        float *ar = acc.data() + r * D;
        int64_t d = 0;
        if (lanes) {  // 64 columns of the row in registers over every position
            for (; d + 64 <= D; d += 64) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t t = 0; t < n; t++) {
                    const __m512 w = _mm512_set1_ps(sr[t]);
                    const T *value = values + seen[t] * p.vs[2] + d;
                    a0 = _mm512_fmadd_ps(w, load16(value), a0);
                    a1 = _mm512_fmadd_ps(w, load16(value + 16), a1);
                    a2 = _mm512_fmadd_ps(w, load16(value + 32), a2);
                    a3 = _mm512_fmadd_ps(w, load16(value + 48), a3);
                }
                _mm512_storeu_ps(ar + d, a0);
                _mm512_storeu_ps(ar + d + 16, a1);
                _mm512_storeu_ps(ar + d + 32, a2);
                _mm512_storeu_ps(ar + d + 48, a3);
            }
            for (; d < D; d += 16) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t t = 0; t < n; t++)
                    a = _mm512_fmadd_ps(_mm512_set1_ps(sr[t]),
                                        load16(values + seen[t] * p.vs[2] + d), a);
                _mm512_storeu_ps(ar + d, a);
            }
        } else {
            for (int64_t t = 0; t < n; t++)
                if (sr[t] != 0.0f) axpy(ar, sr[t], values + seen[t] * p.vs[2], D);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t h = g * G + r / Q, i = r % Q;
        T *row = p.out + ((b * p.H + h) * Q + i) * D;
        const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
        for (int64_t d = 0; d < D; d++) row[d] = static_cast<T>(acc[r * D + d] * inv);
    }
}

template <typename T>
static void run(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                const at::Tensor &m, float scale, at::Tensor &out) {
    Problem<T> p;
    p.q = q.data_ptr<T>();
    p.k = k.data_ptr<T>();
    p.v = v.data_ptr<T>();
    p.mb = m.defined() && m.scalar_type() == at::kBool ? m.data_ptr<bool>() : nullptr;
    p.mf = m.defined() && m.scalar_type() != at::kBool ? m.data_ptr<float>() : nullptr;
    p.H = q.size(1), p.Q = q.size(2), p.D = q.size(3);
    p.KV = k.size(1), p.L = k.size(2), p.G = p.H / p.KV;
    for (int d = 0; d < 4; d++) {
        p.qs[d] = q.stride(d), p.ks[d] = k.stride(d), p.vs[d] = v.stride(d);
        p.ms[d] = m.defined() ? m.stride(d) : 0;
    }
    p.scale = scale;
    p.out = out.data_ptr<T>();
    const int64_t KV = p.KV;
    // Key heads per task: a decode step's work per head is a few microseconds.
    at::parallel_for(0, q.size(0) * KV, 1, [&](int64_t first, int64_t last) {
        for (int64_t t = first; t < last; t++) attend<T>(p, t / KV, t % KV);
    });
}

static at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                   const std::optional<at::Tensor> &mask, double scale) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) &&
                    k.sizes() == v.sizes() && q.size(3) == k.size(3) && k.size(1) > 0 &&
                    q.size(1) % k.size(1) == 0,
                "autoopt_blocks.decode_attention: q (B, H, Q, D), k and v (B, KV, L, D) with H "
                "a multiple of KV");
    TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                    k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "autoopt_blocks.decode_attention: fp32 or bf16 q, k and v of one dtype");
    // The innermost dimension read with unit stride.
    at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
    at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), L = k.size(2);
    at::Tensor m;
    if (mask.has_value()) {
        m = mask->scalar_type() == at::kBool ? *mask : mask->to(at::kFloat);
        m = m.expand({B, H, Q, L});
    }
    at::Tensor out = at::empty({B, H, Q, q.size(3)}, q.options());
    if (q.scalar_type() == at::kFloat)
        run<float>(q, kc, vc, m, (float)scale, out);
    else
        run<at::BFloat16>(q, kc, vc, m, (float)scale, out);
    return out;
}

TORCH_LIBRARY_IMPL(autoopt_blocks, CPU, m) {
    m.impl("decode_attention", &decode_attention);
}
