// Prefill attention in tiles of 16 query tokens on bf16 caches.
//
// Part of kernels/cpu_ops.cpp's one translation unit: included there, in order, after
// the headers and macros it sets (SPUR_SIMD, SPUR_AVX512, SPUR_AVX2); see its header
// for the build and the ops' contracts. Not a standalone header.
#pragma once

namespace {

// ----------------------------------------------------------------- prefill attention
//
// Prefill chunks with bf16 q on a bf16 cache (head_dim 64 or 128, AVX-512 BF16 builds).
// One task = a tile of up to 16 consecutive query tokens of one chunk and one KV head,
// for each of the head's G query heads. The tile's query rows are transposed once into
// pairs, qt[D/2][16 tokens], so that one key's scores for the 16 tokens are one vector:
// vdpbf16ps of qt[p] with the key's pair p broadcast from the cache as stored (K is
// neither copied nor transposed, and there are no horizontal sums). The softmax runs
// lane-wise over the keys (a lane is a token; masked keys score -1e30). Probabilities
// are rounded to bf16 for the weighted sum, as SDPA does, and meet V in pairs of keys:
// the tile's V rows are interleaved into pairs per feature (vt[key pair][D]), and 16
// tokens' sums of a feature are one vdpbf16ps of their probability pairs with the
// feature's pair broadcast. Float32 scores, softmax and sums; exact softmax (all the
// tile's scores are kept, [keys][G][16] floats).
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
constexpr bool kPrefillTiles = true;

// Per-thread buffers of the prefill tiles, grown to the longest tile's keys.
struct PrefillScratch {
  std::vector<float> s;        // [keys][G][16] scores, then probabilities
  std::vector<uint32_t> vt;    // [key pairs][D] V pairs
  std::vector<uint32_t> qt;    // [G][D/2][16] query pairs
  std::vector<const bf16*> kr, vr;  // the keys' K and V rows (this KV head)
  void fit(int64_t keys, int32_t G, int32_t D) {
    if ((int64_t)kr.size() < keys + 1) {
      s.resize((size_t)(keys + 1) * G * 16);
      vt.resize((size_t)((keys + 2) / 2) * D);
      kr.resize(keys + 1);
      vr.resize(keys + 1);
    }
    qt.resize((size_t)G * D / 2 * 16);
  }
};

template <int D, int GB>
void prefill_tile(const bf16* q, int64_t q_row, bf16* o, int64_t o_row, const bf16* k,
                  const bf16* v, int64_t s_blk, int64_t s_off, int64_t s_head,
                  const int32_t* table, int32_t bs, int32_t h, int32_t G, int32_t nt,
                  const int32_t* firsts, const int32_t* ends, float scale, PrefillScratch& sc) {
  constexpr int P = D / 2;  // pairs of a row
  const int32_t kf = firsts[0], nk = ends[nt - 1] - kf;
  // the tile's query rows (this KV head's G heads) are in L2 or L3: fetched while the
  // key pointers below are set up (gathering them cold was 10-17% of a tile's time)
  for (int32_t i = 0; i < nt; ++i)
    for (int32_t b = 0; b < G * D * 2; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + i * q_row + (int64_t)h * G * D) + b,
                   _MM_HINT_T0);
  sc.fit(nk, G, D);
  for (int32_t t = 0, pos = kf; t < nk;) {  // block by block: no division per key
    const int32_t off = pos % bs, run = std::min(bs - off, nk - t);
    const bf16* kb = k + (int64_t)table[pos / bs] * s_blk + (int64_t)off * s_off + h * s_head;
    const bf16* vb = v + (kb - k);
    for (int32_t j = 0; j < run; ++j) sc.kr[t + j] = kb + j * s_off, sc.vr[t + j] = vb + j * s_off;
    t += run, pos += run;
  }
  // the tokens' windows, lane-wise; lanes past nt see no key
  alignas(64) int32_t fl[16], el[16];
  for (int i = 0; i < 16; ++i) fl[i] = i < nt ? firsts[i] : 0, el[i] = i < nt ? ends[i] : 0;
  const __m512i fv = _mm512_load_si512(fl), ev = _mm512_load_si512(el);
  // the query pairs, transposed by gathers: lane i of qt[g][p] is token i's pair p (0
  // past nt); q_row < 2^26 keeps the lanes' element offsets in int32
  uint32_t* qt = sc.qt.data();
  const __mmask16 tok = (__mmask16)((1u << nt) - 1);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i q_at = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int32_t)q_row));
  for (int32_t g = 0; g < G; ++g) {
    const bf16* qg = q + (int64_t)(h * G + g) * D;
    for (int p = 0; p < P; ++p)
      _mm512_storeu_si512(qt + ((int64_t)g * P + p) * 16,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tok, q_at,
                                                      qg + 2 * p, 2));
  }
  float* s = sc.s.data();
  const __m512 sv = _mm512_set1_ps(scale), masked = _mm512_set1_ps(-1e30f);
  __m512 m[16];  // running max per query head (G <= 16)
  for (int32_t g = 0; g < G; ++g) m[g] = masked;
  // Keys in groups of NK, GB query heads at once: each broadcast pair of a key serves
  // GB heads (GB * NK sums in registers).
  constexpr int NK = GB == 1 ? 16 : GB == 2 ? 12 : GB == 3 ? 8 : 6;
  for (int32_t g0 = 0; g0 < G; g0 += GB) {
    const uint32_t* qg = qt + (int64_t)g0 * P * 16;
    for (int32_t t0 = 0; t0 < nk; t0 += NK) {
      const int n = std::min<int32_t>(NK, nk - t0);
      __m512 a[GB][NK];
      const auto scores = [&](auto keys) {  // a[gb][j]: key t0 + j, head g0 + gb
        constexpr int K_ = decltype(keys)::value;
        const bf16* kr[K_];
        for (int j = 0; j < K_; ++j) {
          kr[j] = sc.kr[t0 + j];
          for (int gb = 0; gb < GB; ++gb) a[gb][j] = _mm512_setzero_ps();
        }
        for (int p = 0; p < P; ++p) {
          __m512bh qv[GB];
          for (int gb = 0; gb < GB; ++gb)
            qv[gb] = (__m512bh)_mm512_loadu_si512(qg + ((int64_t)gb * P + p) * 16);
#pragma GCC unroll 16
          for (int j = 0; j < K_; ++j) {
            int32_t pair;
            std::memcpy(&pair, kr[j] + 2 * p, 4);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
            for (int gb = 0; gb < GB; ++gb) a[gb][j] = _mm512_dpbf16_ps(a[gb][j], qv[gb], kb);
          }
        }
      };
      if (n == NK) {
        scores(std::integral_constant<int, NK>{});
      } else {  // the last group: one key at a time
        for (int j0 = 0; j0 < n; ++j0) {
          const bf16* kr = sc.kr[t0 + j0];
          for (int gb = 0; gb < GB; ++gb) {
            __m512 x = _mm512_setzero_ps();
            for (int p = 0; p < P; ++p) {
              int32_t pair;
              std::memcpy(&pair, kr + 2 * p, 4);
              x = _mm512_dpbf16_ps(
                  x, (__m512bh)_mm512_loadu_si512(qg + ((int64_t)gb * P + p) * 16),
                  (__m512bh)_mm512_set1_epi32(pair));
            }
            a[gb][j0] = x;
          }
        }
      }
      for (int j = 0; j < n; ++j) {
        const __m512i pos = _mm512_set1_epi32(kf + t0 + j);
        const __mmask16 ok = _mm512_cmpge_epi32_mask(pos, fv) & _mm512_cmplt_epi32_mask(pos, ev);
        for (int gb = 0; gb < GB; ++gb) {
          const __m512 x = _mm512_mask_mov_ps(masked, ok, _mm512_mul_ps(a[gb][j], sv));
          m[g0 + gb] = _mm512_max_ps(m[g0 + gb], x);
          _mm512_storeu_ps(s + ((int64_t)(t0 + j) * G + g0 + gb) * 16, x);
        }
      }
    }
  }
  // probabilities (unnormalised) and their sums, lane-wise; an odd key count gets a
  // zero key so that keys pair up
  alignas(64) float mf[16 * 16], lf[16 * 16];
  for (int32_t g = 0; g < G; ++g) _mm512_store_ps(mf + g * 16, m[g]), _mm512_store_ps(lf + g * 16, _mm512_setzero_ps());
  for (int32_t t = 0; t < nk; ++t)
    for (int32_t g = 0; g < G; ++g) {
      float* __restrict sg = s + ((int64_t)t * G + g) * 16;
      const float* __restrict mg = mf + g * 16;
      float* __restrict lg = lf + g * 16;
      // e^(score - max) by exp16, inline (libmvec's expf, a call per 16 lanes, was 0.9%
      // of the bf16 engine bench's samples: BENCHMARKS.md, twenty-seventh round); within
      // 2 ulp of exp, and the probabilities are rounded to bf16 below. A masked key
      // (score -1e30) is 0.
      const __m512 score = _mm512_loadu_ps(sg);
      const __mmask16 live = _mm512_cmp_ps_mask(score, _mm512_set1_ps(-1e29f), _CMP_GE_OQ);
      const __m512 x = _mm512_max_ps(_mm512_sub_ps(score, _mm512_loadu_ps(mg)), _mm512_set1_ps(-80.0f));
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(x));
      _mm512_storeu_ps(sg, e);
      _mm512_storeu_ps(lg, _mm512_add_ps(_mm512_loadu_ps(lg), e));
    }
  const int32_t pairs = (nk + 1) / 2;
  if (nk % 2) {
    for (int32_t g = 0; g < G; ++g) _mm512_storeu_ps(s + ((int64_t)nk * G + g) * 16, _mm512_setzero_ps());
  }
  // probability pairs, pp[tp][g] lane i: (bf16(p[i][2tp]), bf16(p[i][2tp + 1])), in place
  // of the scores of key 2tp (each pair is read after the two rows it comes from)
  uint32_t* pp = reinterpret_cast<uint32_t*>(s);
  for (int32_t tp = 0; tp < pairs; ++tp)
    for (int32_t g = 0; g < G; ++g) {
      const __m512 p0 = _mm512_loadu_ps(s + ((int64_t)(2 * tp) * G + g) * 16);
      const __m512 p1 = _mm512_loadu_ps(s + ((int64_t)(2 * tp + 1) * G + g) * 16);
      const __m512i w0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
      const __m512i w1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
      _mm512_storeu_si512(pp + ((int64_t)tp * G + g) * 16,
                          _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
    }
  // V rows of each key pair interleaved per feature: vt[tp][d] = (v[2tp][d], v[2tp+1][d])
  uint32_t* vt = sc.vt.data();
  alignas(64) uint16_t lo_pick[32];  // element 2i from x0[i], 2i + 1 from x1[i]
  for (int i = 0; i < 16; ++i) lo_pick[2 * i] = i, lo_pick[2 * i + 1] = 32 + i;
  const __m512i lo_idx = _mm512_load_si512(lo_pick);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int32_t tp = 0; tp < pairs; ++tp) {
    const bf16* r0 = sc.vr[2 * tp];
    const bf16* r1 = 2 * tp + 1 < nk ? sc.vr[2 * tp + 1] : nullptr;
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x0 = _mm512_loadu_si512(reinterpret_cast<const void*>(r0 + 32 * c));
      const __m512i x1 = r1 ? _mm512_loadu_si512(reinterpret_cast<const void*>(r1 + 32 * c))
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(vt + (int64_t)tp * D + 32 * c, _mm512_permutex2var_epi16(x0, lo_idx, x1));
      _mm512_storeu_si512(vt + (int64_t)tp * D + 32 * c + 16, _mm512_permutex2var_epi16(x0, hi_idx, x1));
    }
  }
  // GB heads at once, DB features: each broadcast V pair serves GB heads
  constexpr int DB = GB == 1 ? 16 : GB == 4 ? 4 : 8;
  alignas(64) uint32_t ot[GB * P * 16];  // [GB][D / 2][16] output pairs
  alignas(64) uint16_t pick[32];  // element 2i: feature j's lane i; 2i + 1: feature j + 1's
  for (int i = 0; i < 16; ++i) pick[2 * i] = i, pick[2 * i + 1] = 16 + i;
  const __m512i pair_idx = _mm512_load_si512(pick);
  const __m512i row16 = _mm512_slli_epi32(lane, 4);  // lane k: pair row k of ot
  for (int32_t g0 = 0; g0 < G; g0 += GB) {
    for (int d0 = 0; d0 < D; d0 += DB) {
      __m512 acc[GB][DB];
      for (int gb = 0; gb < GB; ++gb)
        for (int j = 0; j < DB; ++j) acc[gb][j] = _mm512_setzero_ps();
      for (int32_t tp = 0; tp < pairs; ++tp) {
        __m512bh pv[GB];
        for (int gb = 0; gb < GB; ++gb)
          pv[gb] = (__m512bh)_mm512_loadu_si512(pp + ((int64_t)tp * G + g0 + gb) * 16);
        const uint32_t* vp = vt + (int64_t)tp * D + d0;
#pragma GCC unroll 16
        for (int j = 0; j < DB; ++j) {
          const __m512bh vb = (__m512bh)_mm512_set1_epi32((int32_t)vp[j]);
          for (int gb = 0; gb < GB; ++gb) acc[gb][j] = _mm512_dpbf16_ps(acc[gb][j], pv[gb], vb);
        }
      }
      // normalised, rounded to bf16 and paired per token: ot[gb][d / 2] lane i holds
      // token i's features (d, d + 1)
      for (int gb = 0; gb < GB; ++gb) {
        const __m512 inv =
            _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(lf + (g0 + gb) * 16));
        for (int j = 0; j < DB; j += 2) {
          const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(acc[gb][j + 1], inv),
                                                           _mm512_mul_ps(acc[gb][j], inv));
          _mm512_store_si512(ot + ((int64_t)gb * P + (d0 + j) / 2) * 16,
                             _mm512_permutexvar_epi16(pair_idx, two));
        }
      }
    }
    // each token's row of each head: gathered from ot, 16 pairs (32 features) at a time
    for (int gb = 0; gb < GB; ++gb)
      for (int32_t i = 0; i < nt; ++i) {
        bf16* oi = o + i * o_row + (int64_t)(h * G + g0 + gb) * D;
        const uint32_t* og = ot + (int64_t)gb * P * 16 + i;
        for (int c = 0; c < P / 16; ++c)
          _mm512_storeu_si512(oi + 32 * c, _mm512_i32gather_epi32(row16, og + c * 256, 4));
      }
  }
}
#else
constexpr bool kPrefillTiles = false;
#endif

bool prefill_tiles_supported() { return kPrefillTiles; }

// chunks: [C, 4] int32 rows (first query row, query tokens, context length, sliding
// window or 0); tables: [C, max_blocks] int32, the chunks' block tables.
void prefill_attention(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& tables,
                       const at::Tensor& chunks, double scale) {
  TORCH_CHECK(kPrefillTiles, "prefill_attention: built without AVX-512 BF16");
  check_attention_args(q, out, k_cache, v_cache);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 q, out and caches");
  const int32_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(Hq / Hkv <= 16, "prefill_attention: at most 16 query heads a KV head");
  TORCH_CHECK(D == 64 || D == 128, "prefill_attention: head_dim 64 or 128, got ", D);
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() &&
                  chunks.scalar_type() == at::kInt && chunks.is_contiguous() &&
                  chunks.dim() == 2 && chunks.size(1) == 4 && tables.size(0) == chunks.size(0),
              "prefill_attention: int32 tables [C, max_blocks] and chunks [C, 4]");
#if defined(SPUR_AVX512) && defined(__AVX512BF16__)
  const int32_t G = Hq / Hkv;
  TORCH_CHECK(q.stride(0) < (1 << 26), "prefill_attention: q rows of under 2^26 elements "
              "(the tiles gather them with int32 offsets)");
  const int32_t* cp = chunks.data_ptr<int32_t>();
  const int64_t C = chunks.size(0);
  for (int64_t c = 0; c < C; ++c)
    TORCH_CHECK(cp[c * 4 + 1] >= 1 && cp[c * 4 + 1] <= cp[c * 4 + 2] && cp[c * 4] >= 0 &&
                    cp[c * 4] + cp[c * 4 + 1] <= q.size(0) && cp[c * 4 + 3] >= 0 &&
                    cp[c * 4 + 2] <= tables.size(1) * bs,
                "prefill_attention: chunk ", c, " (row ", cp[c * 4], ", ", cp[c * 4 + 1],
                " tokens, context ", cp[c * 4 + 2], ") must have 1 to context tokens within "
                "q's rows and its table's ", tables.size(1) * bs, " positions");
  // tasks (chunk, tile, KV head), the tiles with most keys first
  std::vector<std::array<int32_t, 3>> tasks;
  for (int64_t c = 0; c < C; ++c)
    for (int32_t t = 0; t < cp[c * 4 + 1]; t += 16)
      for (int32_t h = 0; h < Hkv; ++h) tasks.push_back({(int32_t)c, t, h});
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) {
    const auto keys = [&](const auto& x) {  // the tile's last token's context
      const int32_t* ch = cp + x[0] * 4;
      return ch[2] - ch[1] + std::min(x[1] + 16, ch[1]);
    };
    return keys(a) > keys(b);
  });
  const int64_t s_blk = k_cache.stride(0), s_off = k_cache.stride(1), s_head = k_cache.stride(2);
  const bf16* qp = q.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const bf16* kp = k_cache.data_ptr<bf16>();
  const bf16* vp = v_cache.data_ptr<bf16>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t t_row = tables.stride(0), q_row = q.stride(0), o_row = out.stride(0);
  std::atomic<int64_t> next{0};
  const int64_t n = (int64_t)tasks.size();
  const int64_t team = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    PrefillScratch sc;
    for (;;) {
      const int64_t task = next.fetch_add(1, std::memory_order_relaxed);
      if (task >= n) break;
      const auto [c, t, h] = tasks[task];
      const int32_t* ch = cp + c * 4;
      const int32_t row0 = ch[0], q_len = ch[1], seq_len = ch[2], window = ch[3];
      const int32_t nt = std::min(16, q_len - t);
      int32_t firsts[16], ends[16];
      for (int32_t i = 0; i < nt; ++i) {
        ends[i] = seq_len - q_len + t + i + 1;  // token t + i sees [first, end)
        firsts[i] = window > 0 ? std::max(0, ends[i] - window) : 0;
      }
      const bf16* qi = qp + (int64_t)(row0 + t) * q_row;
      bf16* oi = op + (int64_t)(row0 + t) * o_row;
      const auto run = [&](auto d, auto gb) {
        prefill_tile<decltype(d)::value, decltype(gb)::value>(
            qi, q_row, oi, o_row, kp, vp, s_blk, s_off, s_head, tp + c * t_row, bs, h, G, nt,
            firsts, ends, (float)scale, sc);
      };
      using D64 = std::integral_constant<int, 64>;
      using D128 = std::integral_constant<int, 128>;
      const auto heads = [&](auto d) {  // query heads at once: the largest of 4..1 dividing G
        if (G % 4 == 0) run(d, std::integral_constant<int, 4>{});
        else if (G % 3 == 0) run(d, std::integral_constant<int, 3>{});
        else if (G % 2 == 0) run(d, std::integral_constant<int, 2>{});
        else run(d, std::integral_constant<int, 1>{});
      };
      if (D == 64) heads(D64{});
      else heads(D128{});
    }
  });
#endif
}

}  // namespace
