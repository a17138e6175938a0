// The cost of one aclnn call through gradops' C surface: phase 1 + phase 2 of an operator on 8x8 float32
// tensors, from C, as a CANN host program makes it (tensors created once, a workspace of phase 1's size).
// Built and run by scripts/bench_cann_c.py; prints one JSON line per operator: median µs per call over batches.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_hardswish_backward.h"
#include "aclnnop/aclnn_rms_norm_grad.h"

namespace {

aclTensor* tensor(std::vector<float>& data, std::vector<int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
  return aclCreateTensor(shape.data(), shape.size(), ACL_FLOAT, strides.data(), 0, ACL_FORMAT_ND, shape.data(),
                         shape.size(), data.data());
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

  auto rms_norm_grad = [&] {
    uint64_t size = 0;
    aclOpExecutor* executor = nullptr;
    aclnnStatus s = aclnnRmsNormGradGetWorkspaceSize(tdy, tx, tr, tg, tdx, tdg, &size, &executor);
    if (s != 0 || size > workspace.size()) return s ? s : -1;
    s = aclnnRmsNormGrad(size ? workspace.data() : nullptr, size, executor, stream);
    return s ? s : aclrtSynchronizeStream(stream);
  };
  auto hardswish_backward = [&] {
    uint64_t size = 0;
    aclOpExecutor* executor = nullptr;
    aclnnStatus s = aclnnHardswishBackwardGetWorkspaceSize(tdy, tx, tout, &size, &executor);
    if (s != 0 || size > workspace.size()) return s ? s : -1;
    s = aclnnHardswishBackward(size ? workspace.data() : nullptr, size, executor, stream);
    return s ? s : aclrtSynchronizeStream(stream);
  };
  for (int i = 0; i < 200; ++i) rms_norm_grad(), hardswish_backward();  // the first call starts Python
  std::printf("{\"op\": \"aclnnRmsNormGrad\", \"shape\": \"8x8\", \"dtype\": \"float32\", \"us\": %.2f}\n",
              median_us(rms_norm_grad, batches, per_batch));
  std::printf("{\"op\": \"aclnnHardswishBackward\", \"shape\": \"8x8\", \"dtype\": \"float32\", \"us\": %.2f}\n",
              median_us(hardswish_backward, batches, per_batch));
  for (aclTensor* t : {tdy, tx, tr, tg, tdx, tdg, tout}) aclDestroyTensor(t);
  aclrtDestroyStream(stream);
  aclrtResetDevice(0);
  aclFinalize();
  return 0;
}
