// The cost of one aclnn call through gradops' C surface: phase 1 + phase 2 of an operator on 8x8 float32
// tensors (8 indices / tokens for the embedding and the MoE permute), from C, as a CANN host program makes it
// (tensors created once, a workspace of phase 1's size). Built and run by scripts/bench_cann_c.py; prints one JSON
// line per operator: median µs per call over batches.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_embedding_dense_backward.h"
#include "aclnnop/aclnn_hardswish_backward.h"
#include "aclnnop/aclnn_layer_norm_backward.h"
#include "aclnnop/aclnn_moe_token_permute_grad.h"
#include "aclnnop/aclnn_rms_norm_grad.h"

namespace {

template <class T>
aclTensor* tensor(std::vector<T>& data, std::vector<int64_t> shape, aclDataType dtype = ACL_FLOAT) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
  return aclCreateTensor(shape.data(), shape.size(), dtype, strides.data(), 0, ACL_FORMAT_ND, shape.data(),
                         shape.size(), data.data());
}

// Phase 1 then phase 2 with a workspace of phase 1's size, then the stream synchronised.
template <class Phase1, class Phase2>
int two_phase(Phase1 phase1, Phase2 phase2, std::vector<char>& workspace, aclrtStream stream) {
  uint64_t size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus s = phase1(&size, &executor);
  if (s != 0 || size > workspace.size()) return s ? s : -1;
  s = phase2(size ? workspace.data() : nullptr, size, executor, stream);
  return s ? s : aclrtSynchronizeStream(stream);
}

template <class Call>
double median_us(Call call, int batches, int per_batch) {
  std::vector<double> us;
  for (int b = 0; b < batches; ++b) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < per_batch; ++i) {
      if (call() != 0) {
        std::printf("{\"error\": \"call failed: %s\"}\n", aclGetRecentErrMsg());
        std::exit(1);
      }
    }
    const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
    us.push_back(took.count() / per_batch);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int batches = argc > 1 ? std::atoi(argv[1]) : 15, per_batch = argc > 2 ? std::atoi(argv[2]) : 2000;
  const int n = 8;
  if (aclInit(nullptr) != 0 || aclrtSetDevice(0) != 0) return 1;
  aclrtStream stream = nullptr;
  aclrtCreateStream(&stream);
  std::vector<float> dy(n * n), x(n * n), rstd(n), gamma(n), dx(n * n), dgamma(n), out(n * n);
  for (int i = 0; i < n * n; ++i) dy[i] = 0.01f * i - 0.3f, x[i] = 0.02f * (i % 11) - 0.1f;
  for (int i = 0; i < n; ++i) rstd[i] = 1.0f + 0.1f * i, gamma[i] = 0.5f + 0.05f * i;
  aclTensor *tdy = tensor(dy, {n, n}), *tx = tensor(x, {n, n}), *tr = tensor(rstd, {n}), *tg = tensor(gamma, {n});
  aclTensor *tdx = tensor(dx, {n, n}), *tdg = tensor(dgamma, {n}), *tout = tensor(out, {n, n});
  std::vector<char> workspace(1 << 16);

  // LayerNormBackward's statistics, the embedding's indices, the permute's destinations.
  std::vector<float> mean(n), weight_grad(n), bias_grad(n), table(n * n);
  std::vector<int64_t> ids(n), norm = {n};
  std::vector<int32_t> rows(n);
  for (int i = 0; i < n; ++i) mean[i] = 0.01f * i, ids[i] = (3 * i) % n, rows[i] = (5 * i + 1) % n;
  bool mask_values[3] = {true, true, true};
  aclIntArray* normalized = aclCreateIntArray(norm.data(), 1);
  aclBoolArray* mask = aclCreateBoolArray(mask_values, 3);
  aclTensor *tmean = tensor(mean, {n}), *tdw = tensor(weight_grad, {n}), *tdb = tensor(bias_grad, {n});
  aclTensor *tids = tensor(ids, {n}, ACL_INT64), *ttable = tensor(table, {n, n}), *trows = tensor(rows, {n}, ACL_INT32);

  struct Case {
    const char* op;
    std::function<int()> call;
  };
  std::vector<Case> cases = {
      {"aclnnRmsNormGrad", [&] {
         return two_phase([&](uint64_t* size, aclOpExecutor** ex) {
           return aclnnRmsNormGradGetWorkspaceSize(tdy, tx, tr, tg, tdx, tdg, size, ex);
         }, aclnnRmsNormGrad, workspace, stream);
       }},
      {"aclnnHardswishBackward", [&] {
         return two_phase([&](uint64_t* size, aclOpExecutor** ex) {
           return aclnnHardswishBackwardGetWorkspaceSize(tdy, tx, tout, size, ex);
         }, aclnnHardswishBackward, workspace, stream);
       }},
      {"aclnnLayerNormBackward", [&] {
         return two_phase([&](uint64_t* size, aclOpExecutor** ex) {
           return aclnnLayerNormBackwardGetWorkspaceSize(tdy, tx, normalized, tmean, tr, tg, nullptr, mask, tdx, tdw,
                                                         tdb, size, ex);
         }, aclnnLayerNormBackward, workspace, stream);
       }},
      {"aclnnEmbeddingDenseBackward", [&] {
         return two_phase([&](uint64_t* size, aclOpExecutor** ex) {
           return aclnnEmbeddingDenseBackwardGetWorkspaceSize(tdy, tids, n, UINT64_MAX, false, ttable, size, ex);
         }, aclnnEmbeddingDenseBackward, workspace, stream);
       }},
      {"aclnnMoeTokenPermuteGrad", [&] {  // 8 tokens, top-1: the rows back in token order
         return two_phase([&](uint64_t* size, aclOpExecutor** ex) {
           return aclnnMoeTokenPermuteGradGetWorkspaceSize(tdy, trows, 1, false, tout, size, ex);
         }, aclnnMoeTokenPermuteGrad, workspace, stream);
       }},
  };
  for (int i = 0; i < 200; ++i) {  // the first call starts Python
    for (auto& c : cases) c.call();
  }
  for (auto& c : cases) {
    std::printf("{\"op\": \"%s\", \"shape\": \"8x8\", \"dtype\": \"float32\", \"us\": %.2f}\n", c.op,
                median_us(c.call, batches, per_batch));
  }
  for (aclTensor* t : {tdy, tx, tr, tg, tdx, tdg, tout, tmean, tdw, tdb, tids, ttable, trows}) aclDestroyTensor(t);
  aclDestroyIntArray(normalized);
  aclDestroyBoolArray(mask);
  aclrtDestroyStream(stream);
  aclrtResetDevice(0);
  aclFinalize();
  return 0;
}
