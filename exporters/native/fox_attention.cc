// FoX attention over the gated cache as one onnxruntime custom op: kvg.fox FoxAttention, of the version the build
// names (KVG_FOX_OP_VERSION: exporters/native_library.py passes runtime/contract.py's OP_VERSION), which the op
// declares to onnxruntime as its since-version and the library exports as KvgFoxOpVersion() for the manifest.
//
// A layer's step in one node: FoX-Pro's work before attention (token shift, QK-norm) on the new queries, keys and
// values; the new keys, values and log forget gates written into the cache buffers (in place where the runtime binds
// one buffer as past and present); every new query attending its head's own window with the decay c_i - c_j added
// to its scaled scores; then FoX-Pro's output norm and output gate:
//
//   g_i = -softplus(-(z_i + b))   (0 for a padding token)
//   logit_ij = q_i . k_j / sqrt(d) + sum_{l in (j, i]} g_l,   j <= i, j a real token or i itself,
//   o_i = softmax_j(logit_ij) v
//
// The sums are taken in double from the window's start, so a 6,000-token prompt in one run is as precise as a
// chunked one. Where the decay leaves every weight of a block of keys below what float's exp resolves, the block's
// values are not read (its weights are exactly 0): what FoX has forgotten costs one pass over its keys. Each kv head
// h reads its buffer rows from slot 0, which is the window's slot window_starts[h] (forget-gate pruning dropped the
// slots before), so heads of one layer may hold windows of different lengths.
//
// Inputs and outputs: see the `Input` and `Output` enums below, which name them in the node's order (B rows, S new
// tokens, H query heads, K kv heads, D head_dim, L buffer slots, W window slots).
// Attributes: num_heads (H), kv_num_heads (K); qk_norm_epsilon (1e-5), output_norm_epsilon (1e-6),
//   output_gate_activation ("sigmoid" or "silu"); packed_offsets, optional: 7 column offsets (-1: not packed) of
//   query, key, value, gate_logits, key_shift_logits, value_shift_logits and output_gate_logits in the query, which is
//   then the layer's joined projection [B, S, N] holding them side by side (their own inputs left out), so that the
//   graph needs no Split to cut it.
// A present bound to its past's buffer is written in place; otherwise the past is copied into it first and its slots
// after the past are zero.
//
// Threads: onnxruntime's intra-op pool, across rows, heads and blocks of queries, and across blocks of keys
// for a decode step's long window (split-K), whose partial softmaxes are then merged.

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

namespace {

// The op's inputs, in the node's order (runtime/contract.py's OP_INPUTS names the same, in snake case)
enum Input : size_t {
  kQuery,       // [B, S, H*D] float
  kKey,         // [B, S, K*D] float
  kValue,       // [B, S, K*D] float
  kGateLogits,  // [B, S, H] float: the forget gate's pre-activation z, less its bias
  kGateBias,    // [H] float, optional (absent: 0; +inf: no forget gate)
  kPastKey,     // [B, K, L, D]
  kPastValue,   // [B, K, L, D]
  kPastGate,    // [B, H, L] float (log forget gates)
  kAttentionMask,  // [B or 1, W] int64: which window slots hold real tokens (0: padding, or another row's slot)
  kCachePosition,  // [S] int64: the window slots of the new tokens, consecutive
  kWindowStarts,   // [K] int64, optional (absent: all 0)
  // FoX-Pro's, each optional (absent: not done). The key's token shift: with r_t the token's key (0 for a padding
  // token) and a = sigmoid(logit) per kv head, the key is a r_{t-1} + (1 - a) r_t, r before the first new token being
  // the past shift state
  kKeyShiftLogits,    // [B, S, K]
  kPastKeyShift,      // [B, K*D]
  kValueShiftLogits,  // [B, S, K]: the same for the value
  kPastValueShift,    // [B, K*D]
  // QK-norm, x / sqrt(mean(x^2) + qk_norm_epsilon) * weight per head, after the shift
  kQueryNorm,  // [D or H*D]
  kKeyNorm,    // [D or K*D]
  kOutputNorm,        // [D or H*D]: the same per head of the output (output_norm_epsilon)
  kOutputGateLogits,  // [B, S, H*D]: the output times their activation (output_gate_activation)
  kInputCount
};

// The op's outputs, in the node's order (runtime/contract.py's OP_OUTPUTS); P = max(L, W - min(window_starts))
enum Output : size_t {
  kOutput,        // [B, S, H*D]
  kPresentKey,    // [B, K, P, D]
  kPresentValue,  // [B, K, P, D]
  kPresentGate,   // [B, H, P]
  // optional: the last new token's r ([B, 0] without a shift)
  kPresentKeyShift,    // [B, K*D]
  kPresentValueShift,  // [B, K*D]
  // optional: each new token's r, the state after it, where a speculative run keeps only its first tokens
  kKeyShiftStates,    // [B, S, K*D]
  kValueShiftStates,  // [B, S, K*D]
  kOutputCount
};

constexpr bool integer_input(size_t index) {  // every other input is float
  return index == kAttentionMask || index == kCachePosition || index == kWindowStarts;
}
// The inputs packed_offsets places, in its order (runtime/contract.py's OP_PACKED_INPUTS)
constexpr Input kPacked[] = {kQuery, kKey, kValue, kGateLogits, kKeyShiftLogits, kValueShiftLogits, kOutputGateLogits};

#ifndef KVG_FOX_OP_VERSION
#error "build with -DKVG_FOX_OP_VERSION=<runtime/contract.py's OP_VERSION> (exporters/native_library.py does)"
#endif
constexpr int kVersion = KVG_FOX_OP_VERSION;
constexpr const char* kDomain = "kvg.fox";
constexpr int64_t kQueryBlock = 64;    // queries that share one transposed block of keys
constexpr int64_t kKeyBlock = 128;     // keys scored at once
constexpr int kTileRows = 4;          // queries a register tile holds
constexpr int64_t kRowQueries = 9;     // queries up to which they read the keys row by row (a decode step, drafts)
constexpr int64_t kSplitKeys = 2048;   // a decode step's window is split into parts of about this many keys
constexpr int64_t kMaxSplits = 32;
constexpr int64_t kSplitQueries = 4;   // steps of at most this many queries a row split their windows
constexpr double kSerialWork = 1 << 15;  // multiply-adds under which a run stays on the calling thread
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp for the softmax, in arithmetic the compiler vectorizes (Cephes' expf: range reduction by ln 2 and a
// degree-6 polynomial, within 2 ulp); 0 below float's smallest normal exponent, as for -inf
constexpr float kExpUnderflow = -87.33654f;  // exp_approx is 0 below this

inline float exp_approx(float x) {
  const float clamped = std::min(std::max(x, kExpUnderflow), 88.37626f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r2 + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < kExpUnderflow ? 0.0f : y * scale;
}

// A float input as the kernel reads it: its own tensor, or its columns of the joined projection copied out
struct View {
  const float* data = nullptr;
  std::vector<int64_t> shape;
};

// One run's shapes, pointers and working buffers. Each calling thread keeps one between runs (see `compute`), so
// that a decode step reuses the buffers' memory rather than allocating it: every field is set anew each run.
struct Problem {
  int64_t batch, seq, heads, kv_heads, dim, past, window, length;
  const float *query, *key, *value, *gate_logits;
  std::vector<float> gate_bias;  // per head
  const int64_t* mask;          // the attention_mask as given: nonzero where a slot holds a real token
  int64_t mask_row;             // its row stride (0: one row for every row)
  const int64_t* positions;
  std::vector<int64_t> starts;  // per kv head
  float *keys, *values, *gates, *out;
  std::vector<double> sums;     // [B, H, length]: the gates summed from a row's first slot through each slot
  int64_t query_blocks, splits;
  std::vector<float> partial;   // split-K: per (row, head, query, split) the max, the sum and D accumulators
  float scale;
  // FoX-Pro's work where the node has it (null: not done; see the contract): its inputs, the present shift states
  const float *key_shift_logits, *past_key_shift, *value_shift_logits, *past_value_shift;
  const float *query_norm, *key_norm, *output_norm, *output_gate;
  int64_t query_norm_size, key_norm_size, output_norm_size;
  float *next_key_shift, *next_value_shift;
  float *key_shift_states, *value_shift_states;  // each new token's shift states where the node has them (else null)
  std::vector<float> prepared;  // the new queries, keys and values after the shift and QK-norm
  std::array<View, kInputCount> inputs;
  std::vector<float> unpacked;  // the packed inputs' columns, one after another

  int64_t group() const { return heads / kv_heads; }
  int64_t start(int64_t head) const { return starts[head / group()]; }
  int64_t own_window(int64_t head) const { return window - start(head); }
  const float* keys_of(int64_t row, int64_t kv_head) const { return keys + (row * kv_heads + kv_head) * length * dim; }
  const float* values_of(int64_t row, int64_t kv_head) const {
    return values + (row * kv_heads + kv_head) * length * dim;
  }
  const int64_t* real_of(int64_t row) const { return mask + row * mask_row; }
  // The first of own slots [begin, end) that query i of `row` may attend (a real token's, or its own), else end
  int64_t first_seen(int64_t row, int64_t i, int64_t start, int64_t begin, int64_t end) const {
    const int64_t* slots = real_of(row) + start;
    const int64_t found = std::find_if(slots + begin, slots + end, [](int64_t flag) { return flag != 0; }) - slots;
    const int64_t mine = positions[i] - start;
    return mine >= begin && mine < found ? mine : found;
  }
};

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// One head's `dim` channels scaled to unit RMS and by the norm's weights for that head (a shared norm's `size` is dim)
void rms_normalize(float* x, int64_t dim, const float* norm, int64_t size, int64_t head, float eps) {
  const float* weight = norm + (size == dim ? 0 : head * dim);
  float squares = 0.0f;
  for (int64_t d = 0; d < dim; ++d) squares += x[d] * x[d];
  const float root = std::sqrt(squares / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) x[d] = x[d] / root * weight[d];
}

// A projection's token shift, row by row: `raw` [B, S, K*D] mixed with the token before's into `mixed`, each row's
// last r into `last` [B, K*D] (which may be `state`'s buffer: a row's state is read before its last is written), and,
// where `each` is not null, every token's r into it [B, S, K*D]
void shift(const Problem& p, const float* raw, const float* logits, const float* state, float* mixed, float* last,
           float* each) {
  const int64_t width = p.kv_heads * p.dim;
  for (int64_t b = 0; b < p.batch; ++b) {
    const float* before = state + b * width;
    float kept_before = 1.0f;  // r of a padding token is 0
    for (int64_t i = 0; i < p.seq; ++i) {
      const int64_t token = b * p.seq + i;
      const float* now = raw + token * width;
      const float kept = p.real_of(b)[p.positions[i]] ? 1.0f : 0.0f;
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        const float a = sigmoid(logits[token * p.kv_heads + h]);
        for (int64_t d = h * p.dim; d < (h + 1) * p.dim; ++d)
          mixed[token * width + d] = a * (kept_before * before[d]) + (1.0f - a) * (kept * now[d]);
      }
      if (each != nullptr)
        for (int64_t d = 0; d < width; ++d) each[token * width + d] = kept * now[d];
      before = now;
      kept_before = kept;
    }
    if (last != nullptr)
      for (int64_t d = 0; d < width; ++d) last[b * width + d] = kept_before * before[d];
  }
}

// Each new token's heads of `x` ([B*S, heads*D]) normalized in place
void normalize_heads(const Problem& p, float* x, int64_t heads, const float* norm, int64_t size, float eps) {
  for (int64_t t = 0; t < p.batch * p.seq; ++t)
    for (int64_t h = 0; h < heads; ++h) rms_normalize(x + (t * heads + h) * p.dim, p.dim, norm, size, h, eps);
}

// FoX-Pro's work before attention: the token shift of keys and values, then QK-norm; the attention then reads the
// prepared copies
void prepare(Problem& p, float eps) {
  const bool norms = p.query_norm != nullptr || p.key_norm != nullptr;
  if (p.key_shift_logits == nullptr && p.value_shift_logits == nullptr && !norms) return;
  const int64_t tokens = p.batch * p.seq, query_width = p.heads * p.dim, width = p.kv_heads * p.dim;
  p.prepared.resize(tokens * (query_width + 2 * width));
  float* query = p.prepared.data();
  float* key = query + tokens * query_width;
  float* value = key + tokens * width;
  if (p.key_shift_logits != nullptr) {
    shift(p, p.key, p.key_shift_logits, p.past_key_shift, key, p.next_key_shift, p.key_shift_states);
    p.key = key;
  }
  if (p.value_shift_logits != nullptr) {
    shift(p, p.value, p.value_shift_logits, p.past_value_shift, value, p.next_value_shift, p.value_shift_states);
    p.value = value;
  }
  if (p.query_norm != nullptr) {
    std::copy(p.query, p.query + tokens * query_width, query);
    normalize_heads(p, query, p.heads, p.query_norm, p.query_norm_size, eps);
    p.query = query;
  }
  if (p.key_norm != nullptr) {
    if (p.key != key) std::copy(p.key, p.key + tokens * width, key);
    normalize_heads(p, key, p.kv_heads, p.key_norm, p.key_norm_size, eps);
    p.key = key;
  }
}

// FoX-Pro's work after attention: each head's output normalized, then times the output gate's activation
void finish(const Problem& p, float eps, bool silu) {
  if (p.output_norm != nullptr) normalize_heads(p, p.out, p.heads, p.output_norm, p.output_norm_size, eps);
  if (p.output_gate == nullptr) return;
  for (int64_t e = 0; e < p.batch * p.seq * p.heads * p.dim; ++e) {
    const float z = p.output_gate[e];
    p.out[e] *= silu ? z * sigmoid(z) : sigmoid(z);
  }
}

// out = a . b (kAccumulate: out += a . b) for `rows` rows of `a` (a multiple of kTileRows) and `cols` columns of `b`
// (a multiple of 16), over `inner` products, kTileRows rows by 16 columns at a time in registers. A chunk's scores
// are queries . transposed keys, and its output weights . values: one small matrix product in two layouts. A row
// stride given as a template argument (0: the one passed) is a constant the compiler folds into the addressing.
template <bool kAccumulate, int64_t kAStride, int64_t kBStride, int64_t kOutStride>
void tile_product(const float* a, const float* b, int64_t rows, int64_t inner, int64_t cols, float* out,
                  int64_t stride) {
  const int64_t a_stride = kAStride ? kAStride : stride, b_stride = kBStride ? kBStride : stride;
  const int64_t out_stride = kOutStride ? kOutStride : stride;
  for (int64_t i0 = 0; i0 < rows; i0 += kTileRows)
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      float sum[kTileRows][16] = {};
      for (int64_t k = 0; k < inner; ++k) {
        const float* bk = b + k * b_stride + c0;
        for (int r = 0; r < kTileRows; ++r) {
          const float x = a[(i0 + r) * a_stride + k];
#pragma omp simd
          for (int c = 0; c < 16; ++c) sum[r][c] += x * bk[c];
        }
      }
      for (int r = 0; r < kTileRows; ++r) {
        float* row = out + (i0 + r) * out_stride + c0;
        for (int c = 0; c < 16; ++c) row[c] = kAccumulate ? row[c] + sum[r][c] : sum[r][c];
      }
    }
}

// Eight floats as one register of the x86-64-v3 build (two halves in the baseline one): the vector extension GCC and
// Clang share, so that a key's products accumulate in registers rather than, as the compiler made of an array of
// them, in memory (a store and a reload each multiply-add: measured, half a decode step's attention time)
using Vec8 = float __attribute__((vector_size(32)));
using Lanes8 = int32_t __attribute__((vector_size(32)));

inline Vec8 load8(const float* from) {
  Vec8 v;
  std::memcpy(&v, from, sizeof v);
  return v;
}

#if defined(__clang__)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, Lanes8{__VA_ARGS__})
#endif

// Lane r of the result is the sum of a[r]'s lanes: eight dot products finished at once, in three rounds of adding
// neighbouring lanes of two vectors
inline Vec8 lane_sums(const Vec8 (&a)[8]) {
  Vec8 pairs[4], quads[2];
  for (int k = 0; k < 4; ++k)  // lane 2m + e: a[2k + e]'s lanes 2m and 2m + 1 (m < 4, e < 2)
    pairs[k] = SHUFFLE8(a[2 * k], a[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE8(a[2 * k], a[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int k = 0; k < 2; ++k)  // lane 4h + e: a[4k + e]'s lanes 4h to 4h + 3 (h < 2, e < 4)
    quads[k] = SHUFFLE8(pairs[2 * k], pairs[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE8(pairs[2 * k], pairs[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUFFLE8(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         SHUFFLE8(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// The largest of `count` floats (-inf for none), eight lanes at a time: the compiler makes a chain of scalar
// comparisons of a max reduction, each waiting on the last (measured: 13% of a 9-query step)
inline float largest(const float* x, int64_t count) {
  Vec8 lanes = Vec8{} + kNegInf;
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const Vec8 next = load8(x + j);
    lanes = lanes > next ? lanes : next;
  }
  float best = kNegInf;
  for (int c = 0; c < 8; ++c) best = std::max(best, lanes[c]);
  for (; j < count; ++j) best = std::max(best, x[j]);
  return best;
}

// Scores of `queries` queries (a token and its drafts) against `count` keys, 8 keys at a time: a dot product's
// additions form a chain, and eight independent chains (a key each, each in its own register) keep the
// multiply-add units busy where one would wait on each. Each group of 8 keys is read for every query while it is in
// L1, so a few queries cost little more than one. kDim, where not 0, is the head dim known when compiled, so the
// products unroll. Rows of `out` are kKeyBlock apart.
template <int64_t kDim>
void score_keys(const float* query, int64_t queries, const float* keys, int64_t count, int64_t runtime_dim,
                float* out) {
  const int64_t dim = kDim != 0 ? kDim : runtime_dim, body = dim / 8 * 8;
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const float* group = keys + j * dim;
    for (int64_t i = 0; i < queries; ++i) {
      const float* q = query + i * dim;
      Vec8 acc[8] = {};
      for (int64_t d0 = 0; d0 < body; d0 += 8) {
        const Vec8 part = load8(q + d0);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) acc[r] += part * load8(group + r * dim + d0);
      }
      Vec8 dots = lane_sums(acc);
      for (int64_t d = body; d < dim; ++d)
        for (int r = 0; r < 8; ++r) dots[r] += q[d] * group[r * dim + d];
      std::memcpy(out + i * kKeyBlock + j, &dots, sizeof dots);
    }
  }
  for (; j < count; ++j)
    for (int64_t i = 0; i < queries; ++i) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += query[i * dim + d] * keys[j * dim + d];
      out[i * kKeyBlock + j] = dot;
    }
}

void score_rows(const float* queries, int64_t count, const float* keys, int64_t keys_count, int64_t dim, float* out) {
  if (dim == 64) return score_keys<64>(queries, count, keys, keys_count, dim, out);
  if (dim == 128) return score_keys<128>(queries, count, keys, keys_count, dim, out);
  score_keys<0>(queries, count, keys, keys_count, dim, out);
}

// acc[i, d] += sum_j weights[i, j] values[j, d] for kQueries queries and channels [d0, dim) in runs of kWidth held in
// registers across the keys, each value row's run read once for every query; returns where the runs stopped. Rows
// of `weights` are kKeyBlock apart, of `acc` dim apart.
template <int64_t kQueries, int64_t kWidth>
int64_t add_weighted(const float* weights, const float* values, int64_t count, int64_t dim, int64_t d0, float* acc) {
  for (; d0 + kWidth <= dim; d0 += kWidth) {
    float sum[kQueries][kWidth] = {};
    for (int64_t j = 0; j < count; ++j) {
      const float* v = values + j * dim + d0;
      for (int64_t i = 0; i < kQueries; ++i) {
        const float w = weights[i * kKeyBlock + j];
#pragma omp simd
        for (int64_t c = 0; c < kWidth; ++c) sum[i][c] += w * v[c];
      }
    }
    for (int64_t i = 0; i < kQueries; ++i)
      for (int64_t c = 0; c < kWidth; ++c) acc[i * dim + d0 + c] += sum[i][c];
  }
  return d0;
}

// The weighted values of kQueries queries over `count` keys into acc: one query's 64 channels stay in registers
// across the keys; a few queries take 16 channels at a time, all their sums in registers (each value row's 16 read
// once for them, each weight broadcast once per 16: the loads, not the multiply-adds, bound this loop)
template <int64_t kQueries>
void weighted_values(const float* weights, const float* values, int64_t count, int64_t dim, float* acc) {
  int64_t d = kQueries == 1 ? add_weighted<1, 64>(weights, values, count, dim, 0, acc) : 0;
  d = add_weighted<kQueries, 16>(weights, values, count, dim, d, acc);
  d = add_weighted<kQueries, 8>(weights, values, count, dim, d, acc);
  add_weighted<kQueries, 1>(weights, values, count, dim, d, acc);
}

constexpr int64_t kValueQueries = 4;  // queries whose sums of 16 channels fill 8 of the 16 vector registers

// weighted_values for the queries kValueQueries at a time: the query count is then a constant of each copy, so that
// its loops unroll without a test a query (measured: a third of a 9-query step's time)
void value_rows(const float* weights, int64_t queries, const float* values, int64_t count, int64_t dim, float* acc) {
  static constexpr std::array kByCount{&weighted_values<1>, &weighted_values<2>, &weighted_values<3>,
                                       &weighted_values<kValueQueries>};
  for (int64_t i = 0; i < queries; i += kValueQueries)
    kByCount[std::min(kValueQueries, queries - i) - 1](weights + i * kKeyBlock, values, count, dim, acc + i * dim);
}

// A task's working memory, kept by each thread between runs: a decode step allocates nothing
struct Scratch {
  std::vector<float> floats;
  std::vector<int64_t> seen;
};
thread_local Scratch scratch;

// One task's share of the attention: queries [first, first + count) of (row, head), and the keys [key_begin, key_end)
// of part `split` of their window
struct Task {
  int64_t row, head, split, first, count, key_begin, key_end;
};

// A task's working memory laid out: the running softmax of each query (its maximum, its sum and its D accumulators)
// over its rows, a chunk's queries and zero rows up to a multiple of kTileRows; a decode step's one query, or a few (a
// token and its drafts), read each key and value row from L1 instead, sparing the block's transposition
struct Tiles {
  bool tiled;
  int64_t rows;
  float* queries;  // scaled
  float* acc;
  float* transposed;
  float* scores;  // a row per query, its weights once exponentiated
  float* maxima;
  float* totals;
  float* decay;     // a block's gate sums from its first slot
  int64_t* seen_by;  // how many of a block's keys each query reads (0: none it may attend)
};

// Task `index`'s queries and keys: from the first slot any of its queries may attend (a row's padding and the slots
// before its prompt are skipped, so a row reads its own window however long the others' are) to the latest it reads,
// cut into p.splits parts
Task task_of(const Problem& p, int64_t index) {
  const int64_t split = index % p.splits;
  int64_t rest = index / p.splits;
  const int64_t block = rest % p.query_blocks;
  rest /= p.query_blocks;
  const int64_t head = rest % p.heads, row = rest / p.heads;
  const int64_t first = block * kQueryBlock, last = std::min(p.seq, first + kQueryBlock);
  const int64_t start = p.start(head), own = p.own_window(head);
  int64_t oldest = own, newest = 0;
  for (int64_t i = first; i < last; ++i) {
    const int64_t end = std::min(own, p.positions[i] - start + 1);
    oldest = std::min(oldest, p.first_seen(row, i, start, 0, end));
    newest = std::max(newest, end);
  }
  const int64_t part = (std::max<int64_t>(newest - oldest, 0) + p.splits - 1) / p.splits;
  const int64_t key_begin = oldest + split * part;
  return Task{row, head, split, first, last - first, key_begin, std::min(newest, key_begin + part)};
}

// The task's working memory from the thread's scratch: its queries scaled, the running softmaxes empty
Tiles tiles_for(const Problem& p, const Task& t) {
  const int64_t dim = p.dim, count = t.count;
  Tiles w;
  w.tiled = count > kRowQueries;
  w.rows = w.tiled ? (count + kTileRows - 1) / kTileRows * kTileRows : count;
  const int64_t rows = w.rows;
  scratch.floats.resize(2 * rows * dim + dim * kKeyBlock + rows * kKeyBlock + 2 * rows + kKeyBlock);
  scratch.seen.resize(count);
  w.queries = scratch.floats.data();
  w.acc = w.queries + rows * dim;
  w.transposed = w.acc + rows * dim;
  w.scores = w.transposed + dim * kKeyBlock;
  w.maxima = w.scores + rows * kKeyBlock;
  w.totals = w.maxima + rows;
  w.decay = w.totals + rows;
  w.seen_by = scratch.seen.data();
  std::fill(w.queries, w.queries + 2 * rows * dim, 0.0f);
  std::fill(w.maxima, w.maxima + rows, kNegInf);
  std::fill(w.totals, w.totals + rows, 0.0f);
  for (int64_t i = 0; i < count; ++i) {
    const float* q = p.query + ((t.row * p.seq + t.first + i) * p.heads + t.head) * dim;
    for (int64_t d = 0; d < dim; ++d) w.queries[i * dim + d] = q[d] * p.scale;
  }
  return w;
}

// How many of the block's keys [begin, begin + width) each query reads; whether any query may attend one (a block
// none may, a gap in a row's window holding other rows' slots, is skipped)
bool see_block(const Problem& p, const Task& t, const Tiles& w, int64_t begin, int64_t width) {
  const int64_t start = p.start(t.head), own = p.own_window(t.head);
  bool any = false;
  for (int64_t i = 0; i < t.count; ++i) {
    const int64_t seen = std::min(width, std::min(own, p.positions[t.first + i] - start + 1) - begin);
    w.seen_by[i] = seen > 0 && p.first_seen(t.row, t.first + i, start, begin, begin + seen) < begin + seen ? seen : 0;
    any = any || w.seen_by[i] > 0;
  }
  return any;
}

// The block's scaled scores into w.scores: a small matrix product over the transposed keys for a chunk, the keys
// read row by row for a few queries
void score_block(const Problem& p, const Task& t, const Tiles& w, const float* block_keys, int64_t width) {
  const int64_t dim = p.dim;
  if (w.tiled) {
    const int64_t padded = (width + 15) / 16 * 16;
    for (int64_t j = 0; j < padded; ++j)  // read along the keys' rows; the writes' lines stay in L1
      for (int64_t d = 0; d < dim; ++d) w.transposed[d * kKeyBlock + j] = j < width ? block_keys[j * dim + d] : 0.0f;
    tile_product<false, 0, kKeyBlock, kKeyBlock>(w.queries, w.transposed, w.rows, dim, padded, w.scores, dim);
  } else {
    score_rows(w.queries, t.count, block_keys, *std::max_element(w.seen_by, w.seen_by + t.count), dim, w.scores);
  }
}

// The block's scores made weights: the decay added, the slots a query may not attend masked, and each query's
// running maximum and sum brought up to date (its accumulators rescaled); whether any query gives a key a weight above
// 0 (else the block's values are not read)
bool weigh_block(const Problem& p, const Task& t, const Tiles& w, int64_t begin, int64_t width) {
  const int64_t dim = p.dim, start = p.start(t.head);
  const double* sums = p.sums.data() + (t.row * p.heads + t.head) * p.length;
  // The block's gate sums from its first slot, each rounded once from double: a query's decay to key j is then
  // its own sum less key j's, both small where the weights are not
  const int64_t* real = p.real_of(t.row) + start + begin;
  const bool all_real = std::find(real, real + width, 0) == real + width;
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) w.decay[j] = static_cast<float>(sums[begin + j] - sums[begin]);
  bool weighed = false;
  for (int64_t i = 0; i < w.rows; ++i) {  // each query's weights, its running maximum and sum brought up to date
    float* weights = w.scores + i * kKeyBlock;
    const int64_t seen = i < t.count ? w.seen_by[i] : 0;
    const int64_t mine = i < t.count ? p.positions[t.first + i] - start : 0;  // the query's own slot
    const float at_query = seen > 0 ? static_cast<float>(sums[mine] - sums[begin]) : 0.0f;
#pragma omp simd
    for (int64_t j = 0; j < seen; ++j) weights[j] += at_query - w.decay[j];
    if (!all_real)
      for (int64_t j = 0; j < seen; ++j)  // a padding query attends its own slot alone
        weights[j] = real[j] || begin + j == mine ? weights[j] : kNegInf;
    const float block_max = largest(weights, seen);
    // Nothing to attend, or every weight below the running maximum by more than exp_approx resolves: all 0, and
    // the maximum, sum and values stay as they are
    if (block_max == kNegInf || block_max - w.maxima[i] < kExpUnderflow) {
      std::fill(weights, weights + width, 0.0f);
      continue;
    }
    weighed = true;
    const float new_max = std::max(w.maxima[i], block_max);
    const float correction = w.maxima[i] == kNegInf ? 0.0f : exp_approx(w.maxima[i] - new_max);
    float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t j = 0; j < seen; ++j) {
      weights[j] = exp_approx(weights[j] - new_max);
      block_sum += weights[j];
    }
    std::fill(weights + seen, weights + width, 0.0f);
    w.totals[i] = w.totals[i] * correction + block_sum;
    w.maxima[i] = new_max;
    for (int64_t d = 0; d < dim; ++d) w.acc[i * dim + d] *= correction;
  }
  return weighed;
}

// The block's values, each times its weight, added to the queries' accumulators
void add_values(const Problem& p, const Task& t, const Tiles& w, const float* block_values, int64_t width) {
  const int64_t dim = p.dim;
  if (!w.tiled) {
    value_rows(w.scores, t.count, block_values, *std::max_element(w.seen_by, w.seen_by + t.count), dim, w.acc);
  } else if (dim % 16 == 0) {
    tile_product<true, kKeyBlock, 0, 0>(w.scores, block_values, w.rows, width, dim, w.acc, dim);
  } else {
    for (int64_t i = 0; i < t.count; ++i)
      for (int64_t j = 0; j < width; ++j) {
        const float weight = w.scores[i * kKeyBlock + j];
        if (weight == 0.0f) continue;
        const float* v = block_values + j * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) w.acc[i * dim + d] += weight * v[d];
      }
  }
}

// Each query's output, its accumulators over its sum; or, split-K, its maximum, sum and accumulators for `merge`
void write_out(Problem& p, const Task& t, const Tiles& w) {
  const int64_t dim = p.dim;
  for (int64_t i = 0; i < t.count; ++i) {
    const int64_t query = t.first + i;
    if (p.splits == 1) {
      float* out = p.out + ((t.row * p.seq + query) * p.heads + t.head) * dim;
      const float inverse = w.totals[i] > 0.0f ? 1.0f / w.totals[i] : 0.0f;
      for (int64_t d = 0; d < dim; ++d) out[d] = w.acc[i * dim + d] * inverse;
    } else {
      float* slot = p.partial.data() + (((t.row * p.heads + t.head) * p.seq + query) * p.splits + t.split) * (dim + 2);
      slot[0] = w.maxima[i];
      slot[1] = w.totals[i];
      std::memcpy(slot + 2, w.acc + i * dim, dim * sizeof(float));
    }
  }
}

// One task (`task_of`): its working memory laid out (`tiles_for`), then its keys in blocks of kKeyBlock, each block
// seen (`see_block`), scored (`score_block`), weighed into a running softmax per query (`weigh_block`) and its values
// added (`add_values`); then its outputs written (`write_out`)
void attend(Problem& p, int64_t index) {
  const Task t = task_of(p, index);
  const Tiles w = tiles_for(p, t);
  const float* keys = p.keys_of(t.row, t.head / p.group());
  const float* values = p.values_of(t.row, t.head / p.group());
  // The newest block first: its keys decay least, so a query's running maximum is at once near its final one, and an
  // older block whose every weight then rounds to 0 skips its exponentials and its values. The rest follow oldest
  // first, the order the memory prefetcher streams best (newest to oldest measured 12% slower at 16k keys).
  const int64_t blocks = (std::max<int64_t>(t.key_end - t.key_begin, 0) + kKeyBlock - 1) / kKeyBlock;
  for (int64_t step = 0; step < blocks; ++step) {
    const int64_t begin = t.key_begin + (step == 0 ? blocks - 1 : step - 1) * kKeyBlock;
    const int64_t width = std::min(kKeyBlock, t.key_end - begin);
    if (!see_block(p, t, w, begin, width)) continue;
    score_block(p, t, w, keys + begin * p.dim, width);
    if (!weigh_block(p, t, w, begin, width)) continue;
    add_values(p, t, w, values + begin * p.dim, width);
  }
  write_out(p, t, w);
}

// Split-K: one query's parts, merged by their maxima
void merge(const Problem& p, int64_t index) {  // index: (row, head, query)
  const int64_t query = index % p.seq, head = (index / p.seq) % p.heads, row = index / (p.seq * p.heads);
  const int64_t dim = p.dim;
  const float* parts = p.partial.data() + index * p.splits * (dim + 2);
  float max = kNegInf;
  for (int64_t s = 0; s < p.splits; ++s) max = std::max(max, parts[s * (dim + 2)]);
  float* out = p.out + ((row * p.seq + query) * p.heads + head) * dim;
  std::fill(out, out + dim, 0.0f);
  float sum = 0.0f;
  for (int64_t s = 0; s < p.splits; ++s) {
    const float* part = parts + s * (dim + 2);
    if (part[0] == kNegInf) continue;
    const float weight = exp_approx(part[0] - max);
    sum += weight * part[1];
    for (int64_t d = 0; d < dim; ++d) out[d] += weight * part[2 + d];
  }
  const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
}

// The gates of (row, head) summed in double, from the first slot a query of the row may attend (only differences
// of the sums are used) through the latest slot a query reads
void sum_gates(Problem& p, int64_t index) {
  const int64_t head = index % p.heads, row = index / p.heads, start = p.start(head);
  const float* gates = p.gates + index * p.length;
  double* sums = p.sums.data() + index * p.length;
  const int64_t end = std::min(p.own_window(head), p.positions[p.seq - 1] - start + 1);
  int64_t first = end;
  for (int64_t i = 0; i < p.seq && first > 0; ++i) first = std::min(first, p.first_seen(row, i, start, 0, first));
  double total = 0.0;
  for (int64_t s = first; s < end; ++s) sums[s] = total += gates[s];
}

template <typename Fn>
void parallel(Ort::KernelContext& context, int64_t total, double work, Fn fn) {
  if (work < kSerialWork || total == 1) {
    for (int64_t i = 0; i < total; ++i) fn(i);
    return;
  }
  context.ParallelFor([](void* data, size_t index) { (*static_cast<Fn*>(data))(static_cast<int64_t>(index)); },
                      static_cast<size_t>(total), 0, &fn);
}

// Copy a past into its present where they are different buffers: [outer, past, inner] into [outer, length, inner]
void carry_over(const float* past, float* present, int64_t outer, int64_t past_len, int64_t length, int64_t inner) {
  if (past == present) return;
  const int64_t kept = std::min(past_len, length);
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(present + o * length * inner, past + o * past_len * inner, kept * inner * sizeof(float));
    std::fill(present + (o * length + kept) * inner, present + (o + 1) * length * inner, 0.0f);
  }
}

struct FoxAttentionKernel {
  const OrtApi& api;
  int64_t heads, kv_heads;
  float qk_norm_epsilon, output_norm_epsilon;
  bool silu_gate;
  std::vector<int64_t> packed;  // packed_offsets, or empty

  OrtStatusPtr fail(const std::string& message) const {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("FoxAttention: " + message).c_str());
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      return compute(raw);
    } catch (const Ort::Exception& error) {
      return api.CreateStatus(error.GetOrtErrorCode(), error.what());
    } catch (const std::exception& error) {
      return api.CreateStatus(ORT_RUNTIME_EXCEPTION, error.what());
    }
  }

  OrtStatusPtr compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    thread_local Problem kept;
    Problem& p = kept;  // the workers' tasks capture this reference: they read the calling thread's run
    if (OrtStatusPtr refused = view_inputs(context, p)) return refused;
    auto shape = [&](Input index) {
      return integer_input(index) ? context.GetInput(index).GetTensorTypeAndShapeInfo().GetShape()
                                  : p.inputs[index].shape;
    };
    auto given = [&](Input index) { return context.GetInputCount() > index && context.GetInput(index) != nullptr; };
    const auto query = shape(kQuery), key = shape(kKey), logits = shape(kGateLogits), past_key = shape(kPastKey),
               past_gate = shape(kPastGate), mask = shape(kAttentionMask), positions = shape(kCachePosition);
    if (query.size() != 3 || key.size() != 3 || shape(kValue) != key || logits.size() != 3 || past_key.size() != 4 ||
        shape(kPastValue) != past_key || past_gate.size() != 3 || mask.size() != 2 || positions.size() != 1)
      return fail("inputs of the wrong rank (see the op's contract)");
    p.batch = query[0];
    p.seq = query[1];
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.dim = past_key[3];
    p.past = past_key[2];
    p.window = mask[1];
    if (p.seq < 1 || query[2] != heads * p.dim || key[0] != p.batch || key[1] != p.seq || key[2] != kv_heads * p.dim ||
        logits != std::vector<int64_t>{p.batch, p.seq, heads} || past_key[0] != p.batch || past_key[1] != kv_heads ||
        past_gate != std::vector<int64_t>{p.batch, heads, p.past} || (mask[0] != 1 && mask[0] != p.batch) ||
        positions[0] != p.seq || (given(kGateBias) && shape(kGateBias) != std::vector<int64_t>{heads}))
      return fail("input shapes do not agree (see the op's contract)");
    p.gate_bias.assign(heads, 0.0f);
    if (given(kGateBias)) std::memcpy(p.gate_bias.data(), p.inputs[kGateBias].data, heads * sizeof(float));
    p.starts.assign(kv_heads, 0);
    if (given(kWindowStarts)) {
      if (shape(kWindowStarts) != std::vector<int64_t>{kv_heads}) return fail("window_starts must be [kv_num_heads]");
      const int64_t* starts = context.GetInput(kWindowStarts).GetTensorData<int64_t>();
      std::memcpy(p.starts.data(), starts, kv_heads * sizeof(int64_t));
    }
    const int64_t earliest = *std::min_element(p.starts.begin(), p.starts.end());
    if (earliest < 0 || *std::max_element(p.starts.begin(), p.starts.end()) >= p.window)
      return fail("window_starts must lie inside the window");
    p.length = std::max(p.past, p.window - earliest);
    p.query = p.inputs[kQuery].data;
    p.key = p.inputs[kKey].data;
    p.value = p.inputs[kValue].data;
    p.gate_logits = p.inputs[kGateLogits].data;
    // read in place: a step copies nothing of the window
    p.mask = context.GetInput(kAttentionMask).GetTensorData<int64_t>();
    p.mask_row = mask[0] == 1 ? 0 : p.window;
    p.positions = context.GetInput(kCachePosition).GetTensorData<int64_t>();
    for (int64_t i = 0; i < p.seq; ++i)
      if (p.positions[i] != p.positions[0] + i || p.positions[i] >= p.window)
        return fail("cache_position must be consecutive slots inside the window");
    for (int64_t h = 0; h < kv_heads; ++h)
      if (p.positions[0] < p.starts[h]) return fail("a new token lies before its head's window start");
    p.scale = 1.0f / std::sqrt(static_cast<float>(p.dim));
    if (OrtStatusPtr refused = take_pro_inputs(p)) return refused;

    auto out = context.GetOutput(kOutput, query);
    auto present_key = context.GetOutput(kPresentKey, {p.batch, kv_heads, p.length, p.dim});
    auto present_value = context.GetOutput(kPresentValue, {p.batch, kv_heads, p.length, p.dim});
    auto present_gate = context.GetOutput(kPresentGate, {p.batch, heads, p.length});
    p.out = out.GetTensorMutableData<float>();
    p.keys = present_key.GetTensorMutableData<float>();
    p.values = present_value.GetTensorMutableData<float>();
    p.gates = present_gate.GetTensorMutableData<float>();
    p.next_key_shift = shift_state(context, kPresentKeyShift, p.key_shift_logits != nullptr, false, p);
    p.next_value_shift = shift_state(context, kPresentValueShift, p.value_shift_logits != nullptr, false, p);
    p.key_shift_states = shift_state(context, kKeyShiftStates, p.key_shift_logits != nullptr, true, p);
    p.value_shift_states = shift_state(context, kValueShiftStates, p.value_shift_logits != nullptr, true, p);
    if ((p.key_shift_logits != nullptr && p.next_key_shift == nullptr) ||
        (p.value_shift_logits != nullptr && p.next_value_shift == nullptr))
      return fail("a token shift needs its present state among the outputs");
    prepare(p, qk_norm_epsilon);
    carry_over(p.inputs[kPastKey].data, p.keys, p.batch * kv_heads, p.past, p.length, p.dim);
    carry_over(p.inputs[kPastValue].data, p.values, p.batch * kv_heads, p.past, p.length, p.dim);
    carry_over(p.inputs[kPastGate].data, p.gates, p.batch * heads, p.past, p.length, 1);
    write_new(p);

    const int64_t longest = p.window - earliest;
    p.sums.resize(p.batch * heads * p.length);  // each (row, head) writes the slots it reads before they are read
    parallel(context, p.batch * heads, static_cast<double>(p.batch * heads * longest),
             [&p](int64_t index) { sum_gates(p, index); });
    p.query_blocks = (p.seq + kQueryBlock - 1) / kQueryBlock;
    p.splits = 1;
    if (p.seq <= kSplitQueries)
      p.splits = std::clamp<int64_t>((longest + kSplitKeys - 1) / kSplitKeys, 1, kMaxSplits);
    if (p.splits > 1) p.partial.resize(p.batch * heads * p.seq * p.splits * (p.dim + 2));
    const double work = static_cast<double>(p.batch * heads) * p.seq * longest * p.dim * 2;
    parallel(context, p.batch * heads * p.query_blocks * p.splits, work, [&p](int64_t task) { attend(p, task); });
    if (p.splits > 1)
      parallel(context, p.batch * heads * p.seq, static_cast<double>(p.batch * heads * p.seq * p.splits * p.dim),
               [&p](int64_t index) { merge(p, index); });
    finish(p, output_norm_epsilon, silu_gate);
    return nullptr;
  }

  // The float inputs as the kernel reads them: each its own tensor, or (packed_offsets) its columns of the query
  OrtStatusPtr view_inputs(Ort::KernelContext& context, Problem& p) const {
    for (size_t index = 0; index < kInputCount; ++index) {
      p.inputs[index] = View{};
      if (integer_input(index) || context.GetInputCount() <= index || context.GetInput(index) == nullptr)
        continue;
      auto input = context.GetInput(index);
      p.inputs[index] = View{input.GetTensorData<float>(), input.GetTensorTypeAndShapeInfo().GetShape()};
    }
    if (packed.empty()) {
      for (Input index : {kKey, kValue, kGateLogits})
        if (p.inputs[index].data == nullptr)
          return fail("key, value and gate_logits are inputs unless packed_offsets places them");
      return nullptr;
    }
    const View joined = p.inputs[kQuery];
    if (joined.shape.size() != 3 || p.inputs[kPastKey].shape.size() != 4)
      return fail("inputs of the wrong rank (see the op's contract)");
    const int64_t dim = p.inputs[kPastKey].shape[3], rows = joined.shape[0] * joined.shape[1], total = joined.shape[2];
    const int64_t widths[] = {heads * dim, kv_heads * dim, kv_heads * dim, heads, kv_heads, kv_heads, heads * dim};
    int64_t needed = 0;
    for (size_t k = 0; k < packed.size(); ++k) {
      if (packed[k] < 0) continue;
      if (packed[k] + widths[k] > total) return fail("packed_offsets reach past the joined projection");
      needed += rows * widths[k];
    }
    p.unpacked.resize(needed);
    float* into = p.unpacked.data();
    for (size_t k = 0; k < packed.size(); ++k) {
      if (packed[k] < 0) continue;
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(into + r * widths[k], joined.data + r * total + packed[k], widths[k] * sizeof(float));
      p.inputs[kPacked[k]] = View{into, {joined.shape[0], joined.shape[1], widths[k]}};
      into += rows * widths[k];
    }
    return nullptr;
  }

  // A token shift's state output, where the node has it: a present one after the step [B, K*D], or the states after
  // each new token [B, S, K*D] (`per_token`); null, and its last axis 0, where the model does not shift that projection
  float* shift_state(Ort::KernelContext& context, Output index, bool shifted, bool per_token, const Problem& p) const {
    if (context.GetOutputCount() <= index) return nullptr;
    const int64_t width = shifted ? kv_heads * p.dim : 0;
    auto state = per_token ? context.GetOutput(index, {p.batch, p.seq, width})
                           : context.GetOutput(index, {p.batch, width});
    return shifted ? state.GetTensorMutableData<float>() : nullptr;
  }

  // FoX-Pro's inputs into the problem, their shapes checked (null where absent)
  OrtStatusPtr take_pro_inputs(Problem& p) const {
    bool agree = true;
    auto data = [&](Input index, std::initializer_list<int64_t> expected) {
      const View& input = p.inputs[index];
      agree = agree && (input.data == nullptr || std::ranges::equal(input.shape, expected));
      return input.data;
    };
    auto norm = [&](Input index, int64_t norm_heads, int64_t& size) {
      const View& input = p.inputs[index];
      size = 1;
      for (int64_t extent : input.shape) size *= extent;
      agree = agree && (input.data == nullptr || size == p.dim || size == norm_heads * p.dim);
      return input.data;
    };
    const int64_t width = kv_heads * p.dim;
    p.key_shift_logits = data(kKeyShiftLogits, {p.batch, p.seq, kv_heads});
    p.past_key_shift = data(kPastKeyShift, {p.batch, width});
    p.value_shift_logits = data(kValueShiftLogits, {p.batch, p.seq, kv_heads});
    p.past_value_shift = data(kPastValueShift, {p.batch, width});
    p.query_norm = norm(kQueryNorm, heads, p.query_norm_size);
    p.key_norm = norm(kKeyNorm, kv_heads, p.key_norm_size);
    p.output_norm = norm(kOutputNorm, heads, p.output_norm_size);
    p.output_gate = data(kOutputGateLogits, {p.batch, p.seq, heads * p.dim});
    if (!agree)
      return fail("FoX-Pro inputs (token shift, norms, output gate) of the wrong shape (see the op's contract)");
    if ((p.key_shift_logits == nullptr) != (p.past_key_shift == nullptr) ||
        (p.value_shift_logits == nullptr) != (p.past_value_shift == nullptr))
      return fail("a token shift takes its logits and its past state together");
    return nullptr;
  }

  // The new keys and values at each kv head's own slots, the log forget gates at their query heads' (0 for a
  // padding token): -softplus(-y) = min(y, 0) - log1p(exp(-|y|)), exact over float's range, 0 at y = +inf
  void write_new(const Problem& p) const {
    const int64_t dim = p.dim;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t i = 0; i < p.seq; ++i) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t slot = p.positions[i] - p.starts[h];
          const int64_t from = ((b * p.seq + i) * kv_heads + h) * dim, to = ((b * kv_heads + h) * p.length + slot) * dim;
          std::memcpy(p.keys + to, p.key + from, dim * sizeof(float));
          std::memcpy(p.values + to, p.value + from, dim * sizeof(float));
        }
        const bool real = p.real_of(b)[p.positions[i]];
        for (int64_t h = 0; h < heads; ++h) {
          const float y = p.gate_logits[(b * p.seq + i) * heads + h] + p.gate_bias[h];
          const float gate = std::min(y, 0.0f) - std::log1p(std::exp(-std::fabs(y)));
          p.gates[(b * heads + h) * p.length + p.positions[i] - p.start(h)] = real ? gate : 0.0f;
        }
      }
  }
};

template <typename T>
T attribute_or(const Ort::ConstKernelInfo& info, const char* name, T fallback) {
  try {
    return info.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

struct FoxAttentionOp : Ort::CustomOpBase<FoxAttentionOp, FoxAttentionKernel, true> {
  FoxAttentionOp() { start_ver_ = kVersion; }  // a graph importing kvg.fox at an older version finds no kernel
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      Ort::ConstKernelInfo attributes(info);
      const auto heads = attributes.GetAttribute<int64_t>("num_heads");
      const auto kv_heads = attributes.GetAttribute<int64_t>("kv_num_heads");
      if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, "FoxAttention: num_heads must be a multiple of kv_num_heads");
      const auto activation = attribute_or<std::string>(attributes, "output_gate_activation", "sigmoid");
      if (activation != "sigmoid" && activation != "silu")
        return api.CreateStatus(ORT_INVALID_ARGUMENT, "FoxAttention: output_gate_activation is sigmoid or silu");
      std::vector<int64_t> packed;
      try {
        packed = attributes.GetAttributes<int64_t>("packed_offsets");
      } catch (const Ort::Exception&) {
      }
      if (!packed.empty() && (packed.size() != std::size(kPacked) || packed[0] < 0))
        return api.CreateStatus(ORT_INVALID_ARGUMENT,
                                "FoxAttention: packed_offsets holds 7 offsets, the query's first");
      *kernel = new FoxAttentionKernel{api, heads, kv_heads, attribute_or(attributes, "qk_norm_epsilon", 1e-5f),
                                       attribute_or(attributes, "output_norm_epsilon", 1e-6f), activation == "silu",
                                       packed};
      return nullptr;
    } catch (const Ort::Exception& error) {
      return api.CreateStatus(error.GetOrtErrorCode(), error.what());
    }
  }
  const char* GetName() const { return "FoxAttention"; }
  size_t GetInputTypeCount() const { return kInputCount; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return integer_input(index) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    // the query and the cache's inputs; key, value and gate_logits may be packed into the query
    return index == kQuery || (index >= kPastKey && index <= kCachePosition) ? INPUT_OUTPUT_REQUIRED
                                                                             : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return kOutputCount; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index >= kPresentKeyShift ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

}  // namespace

// The op version the library implements (exporters/native_library.py writes it into the manifest)
extern "C" __attribute__((visibility("default"))) int KvgFoxOpVersion() { return kVersion; }

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static FoxAttentionOp op;
  OrtCustomOpDomain* domain = nullptr;
  const OrtApi& api = Ort::GetApi();
  if (OrtStatus* status = api.CreateCustomOpDomain(kDomain, &domain)) return status;
  if (OrtStatus* status = api.CustomOpDomain_Add(domain, &op)) return status;
  return api.AddCustomOpDomain(options, domain);
}
