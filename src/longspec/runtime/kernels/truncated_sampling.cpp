// Truncation sampling over a whole vocabulary, one row at a time: the distribution that
// top-k, then top-p, then min-p leave (processors.processed_probs), and the inverse-CDF
// draw from a distribution (processors.sample).
//
// In PyTorch each step is a pass over the 262k-token row with its own dispatch (three
// softmaxes, a growing top-k, masks, a float64 cumulative sum): a sizeable share of a decode
// forward, and a verifier pays it at every accepted node (docs/lab-notes/sampling.md#sampled-tokens-the-truncated-distribution-and-the-draw-in-a-native-kernel-issues-adaptive-speculation-external-drafters-self-speculation).
// Every one of the three warpers keeps a prefix of the row sorted by
// score (ties at the cut kept), so the kept tokens lie among the few within some margin
// of the best score: they are collected in one vectorised pass and sorted alone. Only
// top-p without top-k needs the normaliser over every token (one vectorised exp pass).
//
// truncated_probs(scores f32 [N, V], top_k, top_p, min_p) -> probs f32 [N, V]
//   top_k <= 0, top_p >= 1 and min_p <= 0 switch a warper off. Semantics are the torch
//   path's (TopK-, TopP-, MinPLogitsWarper with min_tokens_to_keep=1, then a softmax).
//   Top-p and min-p decide by the rules processors.top_p_cut and processors.min_p_kept
//   state for every sampler, in double over the float32 scores, so a token whose fate
//   sits on a cut is decided alike up to the order of float64 sums; the probabilities
//   agree with the torch path's to float rounding.
// draw_rows(probs f32|f64 [N, V], u f64 [N]) -> tokens int64 [N]
//   The first token whose float64 running sum exceeds u * total (the torch path's
//   cumsum + searchsorted(right=True), the same sums in the same order, so the same token
//   bit for bit); a draw equal to the total goes to the last token with mass. -1 marks a
//   row that is not a distribution (negative, NaN or infinite entries, zero total).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd_exp.h"

#define LONGSPEC_AVX512 __attribute__((target("avx512f")))

namespace {

struct Candidate {
  float score;
  int32_t index;
};

bool has_avx512f() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// ------------------------------------------------------------------ row passes

float scalar_row_max(const float* s, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) {
    if (std::isnan(s[v])) return s[v];
    best = std::max(best, s[v]);
  }
  return best;
}

LONGSPEC_AVX512 float avx512_row_max(const float* s, int64_t V) {
  const int64_t full = V / 16 * 16;
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t v = 0; v < full; v += 16) {
    const __m512 x = _mm512_loadu_ps(s + v);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, x);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float answer = _mm512_reduce_max_ps(best);
  for (int64_t v = full; v < V; ++v) {
    if (std::isnan(s[v])) return s[v];
    answer = std::max(answer, s[v]);
  }
  return answer;
}

// exp(x) for x <= 0 (a score minus the row's best): simd_exp.h.
using simd_exp::exp_nonpositive;

// sum over the row of exp(s - top), in double (float lanes, folded every 1024 tokens).
LONGSPEC_AVX512 double avx512_exp_sum(const float* s, int64_t V, float top) {
  const int64_t full = V / 16 * 16;
  const __m512 shift = _mm512_set1_ps(top);
  double total = 0.0;
  for (int64_t block = 0; block < full; block += 1024) {
    const int64_t end = std::min(full, block + 1024);
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t v = block; v < end; v += 16)
      lanes = _mm512_add_ps(lanes, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + v), shift)));
    total += _mm512_reduce_add_ps(lanes);
  }
  for (int64_t v = full; v < V; ++v) total += std::exp(static_cast<double>(s[v]) - top);
  return total;
}

double scalar_exp_sum(const float* s, int64_t V, float top) {
  double total = 0.0;
  for (int64_t v = 0; v < V; ++v) total += std::exp(static_cast<double>(s[v]) - top);
  return total;
}

LONGSPEC_AVX512 void avx512_collect(const float* s, int64_t V, float threshold, std::vector<Candidate>& out) {
  const int64_t full = V / 16 * 16;
  const __m512 bound = _mm512_set1_ps(threshold);
  for (int64_t v = 0; v < full; v += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + v), bound, _CMP_GE_OQ);
    while (above) {
      const int lane = __builtin_ctz(above);
      out.push_back({s[v + lane], static_cast<int32_t>(v + lane)});
      above &= above - 1;
    }
  }
  for (int64_t v = full; v < V; ++v)
    if (s[v] >= threshold) out.push_back({s[v], static_cast<int32_t>(v)});
}

void scalar_collect(const float* s, int64_t V, float threshold, std::vector<Candidate>& out) {
  for (int64_t v = 0; v < V; ++v)
    if (s[v] >= threshold) out.push_back({s[v], static_cast<int32_t>(v)});
}

// ------------------------------------------------------------------ one row

// Tokens first collected lie within this many nats of the best (weights down to e^-8 =
// 3e-4 of its own), where the nuclei of real next-token distributions end; flatter rows
// double it until the kept set is held, and past kLastFiniteMargin take every token.
constexpr double kFirstMargin = 8.0;
constexpr double kLastFiniteMargin = 1e3;
// Widens min-p's exact margin, -log(min_p), past the rounding of a float32 threshold.
constexpr double kRoundingSlack = 1e-3;

struct Warpers {
  int64_t top_k;  // <= 0: off
  double top_p;   // >= 1: off
  double min_p;   // <= 0: off
};

// How many ranks top-p keeps: rank r while the weights ranked above it sum to less than `cut`.
int64_t nucleus_length(const std::vector<double>& weight, int64_t n, double cut) {
  double above = 0.0;
  int64_t kept = 0;
  while (kept < n && above < cut) above += weight[kept++];
  return kept;
}

// Relative error bound of avx512_exp_sum against the double sum of std::exp: each float exp
// is within ~2 ulps and each float lane adds at most 64 positive terms before its fold into
// double (~4e-6 in all); the bound leaves a factor of 25 to spare.
constexpr double kNormaliserError = 1e-4;

// Whether a float normaliser's error could move top-p's decision: the sum above the last
// kept rank, or above the first removed one, lies within the error of the cut.
bool near_the_cut(const std::vector<double>& weight, int64_t n, int64_t kept, double cut) {
  double above = 0.0;
  for (int64_t i = 0; i + 1 < kept; ++i) above += weight[i];
  const double slack = kNormaliserError * cut;
  if (kept >= 1 && above >= cut - slack) return true;
  if (kept < n && above + weight[kept - 1] < cut + slack) return true;
  return false;
}

// The first `n` candidates and every later one tied with the n-th (a warper's cut keeps ties).
int64_t with_ties(const std::vector<Candidate>& c, int64_t n) {
  const float cut = c[n - 1].score;
  while (n < static_cast<int64_t>(c.size()) && c[n].score >= cut) ++n;
  return n;
}

void truncate_row(const float* s, float* out, int64_t V, const Warpers& w, bool vector, std::vector<Candidate>& c) {
  const float top = vector ? avx512_row_max(s, V) : scalar_row_max(s, V);
  TORCH_CHECK(std::isfinite(top), "truncated_probs: a row's best score is not finite (", top, ")");
  const bool top_k_on = w.top_k > 0 && w.top_k < V, top_p_on = w.top_p < 1.0, min_p_on = w.min_p > 0.0;
  // Top-p's mass is relative to every token top-k left; without top-k, the whole row.
  const double everything =
      top_p_on && !top_k_on ? (vector ? avx512_exp_sum(s, V, top) : scalar_exp_sum(s, V, top)) : 0.0;
  // Min-p keeps exp(score - top) >= min_p: nothing below log(min_p) (widened past rounding)
  // survives, whatever the warpers before it did. Without it, widen until enough is held.
  double margin = min_p_on ? -std::log(w.min_p) + kRoundingSlack : kFirstMargin;
  int64_t n;
  while (true) {
    c.clear();
    const float threshold =
        std::isfinite(margin) ? static_cast<float>(top - margin) : -std::numeric_limits<float>::infinity();
    if (vector) avx512_collect(s, V, threshold, c); else scalar_collect(s, V, threshold, c);
    const bool all = c.size() == static_cast<size_t>(V) || !std::isfinite(margin);
    std::sort(c.begin(), c.end(), [](const Candidate& a, const Candidate& b) {
      return a.score > b.score || (a.score == b.score && a.index < b.index);
    });
    n = static_cast<int64_t>(c.size());
    bool enough;
    if (all) {
      enough = true;
    } else if (top_k_on) {  // the top-k set held, every later warper only shortens it
      enough = n >= w.top_k;
    } else if (min_p_on) {
      enough = true;
    } else if (top_p_on) {  // the held ranks must reach past the nucleus's last rank
      double held = 0.0;
      for (int64_t i = 0; i + 1 < n; ++i) held += std::exp(static_cast<double>(c[i].score) - top);
      // Past the nucleus's last rank by more than the float normaliser's error, so the
      // double one (near_the_cut below) cannot move the cut beyond the held ranks.
      enough = held >= w.top_p * everything * (vector ? 1.0 + kNormaliserError : 1.0);
    } else {
      enough = false;  // no warper: every token
    }
    if (enough) break;
    margin = margin > kLastFiniteMargin ? std::numeric_limits<double>::infinity() : 2.0 * margin;
  }
  // c[0..n) holds, best first, every token that can survive; each warper shortens the prefix.
  std::vector<double> weight(n);
  for (int64_t i = 0; i < n; ++i) weight[i] = std::exp(static_cast<double>(c[i].score) - top);
  double mass = everything;
  if (top_k_on && n >= w.top_k) {
    n = with_ties(c, w.top_k);
    mass = 0.0;
    for (int64_t i = 0; i < n; ++i) mass += weight[i];
  }
  if (top_p_on) {
    // Top-p's rule as processors.top_p_cut states it for every sampler: keep rank r while
    // the ranks above it (a running sum in rank order) hold less than top_p * mass, in
    // double. If every held rank qualifies, top-p keeps them all (min-p removes the rest).
    int64_t kept = nucleus_length(weight, n, w.top_p * mass);
    if (vector && !top_k_on && near_the_cut(weight, n, kept, w.top_p * mass)) {
      // The vectorised normaliser is a float sum, within kNormaliserError of the double
      // one: where a rank lies that close to the cut, decide it with the double sum.
      mass = scalar_exp_sum(s, V, top);
      kept = nucleus_length(weight, n, w.top_p * mass);
    }
    n = with_ties(c, std::max<int64_t>(kept, 1));
  }
  if (min_p_on) {
    // Min-p's rule as processors.min_p_kept states it for every sampler: score - top >=
    // ln(min_p) in double over the float32 scores.
    const double floor = std::log(w.min_p);
    int64_t kept = 1;  // the best token always stays
    while (kept < n && static_cast<double>(c[kept].score) - static_cast<double>(top) >= floor) ++kept;
    n = with_ties(c, kept);
  }
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += weight[i];
  for (int64_t i = 0; i < n; ++i) out[c[i].index] = static_cast<float>(weight[i] / total);
}

at::Tensor truncated_probs(const at::Tensor& scores, int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.dim() == 2 && scores.is_contiguous(),
              "scores: contiguous float32 [rows, V]");
  TORCH_CHECK(scores.size(1) > 0 && scores.size(1) <= std::numeric_limits<int32_t>::max(), "1 <= V < 2^31");
  TORCH_CHECK(top_p > 0.0 && min_p <= 1.0, "top_p in (0, 1] (>= 1: off), min_p <= 1 (<= 0: off)");
  const int64_t rows = scores.size(0), V = scores.size(1);
  at::Tensor out = at::zeros({rows, V}, scores.options());
  const float* s = scores.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const bool vector = has_avx512f();
  const Warpers w{top_k, top_p, min_p};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> candidates;
    for (int64_t r = begin; r < end; ++r) truncate_row(s + r * V, o + r * V, V, w, vector, candidates);
  });
  return out;
}

// ------------------------------------------------------------------ the draw

// Blocks of 16 entries that are all zero leave a float64 running sum exactly as it was, so
// they are skipped; the rest is summed in order, as torch's cumsum does.
template <typename T>
int64_t draw_row(const T* p, int64_t V, double u) {
  double total = 0.0;
  int64_t last_with_mass = -1;
  for (int64_t v = 0; v < V; ++v) {
    const double x = static_cast<double>(p[v]);
    if (!(x >= 0.0) || std::isinf(x)) return -1;  // negative or NaN or infinite
    if (x > 0.0) total += x, last_with_mass = v;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double target = u * total;
  double running = 0.0;
  for (int64_t v = 0; v <= last_with_mass; ++v) {
    running += static_cast<double>(p[v]);
    if (running > target) return v;
  }
  return last_with_mass;
}

LONGSPEC_AVX512 int64_t avx512_draw_row_f32(const float* p, int64_t V, double u) {
  const int64_t full = V / 16 * 16;
  const __m512 zero = _mm512_setzero_ps();
  // Pass 1: validity (no negative, NaN or infinite entry) and the total over the nonzero blocks.
  __mmask16 bad = 0;
  double total = 0.0;
  int64_t last_with_mass = -1;
  for (int64_t v = 0; v < full; v += 16) {
    const __m512 x = _mm512_loadu_ps(p + v);
    bad |= _mm512_cmp_ps_mask(x, zero, _CMP_NGE_UQ);  // x < 0 or NaN
    bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    if (_mm512_cmp_ps_mask(x, zero, _CMP_NEQ_UQ)) {
      for (int64_t i = v; i < v + 16; ++i)
        if (p[i] != 0.0f) total += static_cast<double>(p[i]), last_with_mass = i;
    }
  }
  if (bad) return -1;
  for (int64_t v = full; v < V; ++v) {
    const double x = static_cast<double>(p[v]);
    if (!(x >= 0.0) || std::isinf(x)) return -1;
    if (x > 0.0) total += x, last_with_mass = v;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double target = u * total;
  double running = 0.0;
  for (int64_t v = 0; v <= last_with_mass; v += 16) {
    const int64_t end = std::min(last_with_mass + 1, v + 16);
    if (end == v + 16 && !_mm512_cmp_ps_mask(_mm512_loadu_ps(p + v), zero, _CMP_NEQ_UQ)) continue;
    for (int64_t i = v; i < end; ++i) {
      running += static_cast<double>(p[i]);
      if (p[i] != 0.0f && running > target) return i;
    }
  }
  return last_with_mass;
}

at::Tensor draw_rows(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK((probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble) && probs.dim() == 2 &&
                  probs.is_contiguous(), "probs: contiguous float32 or float64 [rows, V]");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.dim() == 1 && u.size(0) == probs.size(0) && u.is_contiguous(),
              "u: contiguous float64 [rows]");
  const int64_t rows = probs.size(0), V = probs.size(1);
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  int64_t* tokens = out.data_ptr<int64_t>();
  const double* draws = u.data_ptr<double>();
  const bool vector = has_avx512f();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (probs.scalar_type() == at::kDouble)
        tokens[r] = draw_row(probs.data_ptr<double>() + r * V, V, draws[r]);
      else if (vector)
        tokens[r] = avx512_draw_row_f32(probs.data_ptr<float>() + r * V, V, draws[r]);
      else
        tokens[r] = draw_row(probs.data_ptr<float>() + r * V, V, draws[r]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("truncated_probs(Tensor scores, int top_k, float top_p, float min_p) -> Tensor");
  m.impl("truncated_probs", c10::DispatchKey::CPU, TORCH_FN(truncated_probs));
  m.def("draw_rows(Tensor probs, Tensor u) -> Tensor");
  m.impl("draw_rows", c10::DispatchKey::CPU, TORCH_FN(draw_rows));
}
