// Four host threads calling gradops' C surface at once (tests/test_capi.py builds and runs this).
//
// Each thread has its own stream, tensors and executors and runs aclnnRmsNormGrad and aclnnHardswishBackward many
// times, with a refused call (a gamma of the wrong length, 561002) between them; it checks every result against a
// float64 reference computed here and against the same call made alone before the threads started (bit for bit),
// and that aclGetRecentErrMsg gives each thread its own refusal. Prints "ok <thread> <calls>" per thread; exit 0
// when every check held.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_hardswish_backward.h"
#include "aclnnop/aclnn_rms_norm_grad.h"

namespace {

constexpr int kRows = 8, kCols = 16, kThreads = 4, kRounds = 150;

struct Buffer {
  std::vector<int64_t> shape;
  void* device = nullptr;
  aclTensor* tensor = nullptr;
  size_t count() const {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
};

bool make(Buffer& b, std::vector<int64_t> shape, const std::vector<float>& host) {
  b.shape = std::move(shape);
  std::vector<int64_t> strides(b.shape.size(), 1);
  for (int i = static_cast<int>(b.shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * b.shape[i + 1];
  const size_t bytes = b.count() * sizeof(float);
  if (aclrtMalloc(&b.device, bytes, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) return false;
  if (aclrtMemcpy(b.device, bytes, host.data(), bytes, ACL_MEMCPY_HOST_TO_DEVICE) != ACL_SUCCESS) return false;
  b.tensor = aclCreateTensor(b.shape.data(), b.shape.size(), ACL_FLOAT, strides.data(), 0, ACL_FORMAT_ND,
                             b.shape.data(), b.shape.size(), b.device);
  return b.tensor != nullptr;
}

std::vector<float> read(const Buffer& b) {
  std::vector<float> out(b.count());
  aclrtMemcpy(out.data(), out.size() * sizeof(float), b.device, out.size() * sizeof(float), ACL_MEMCPY_DEVICE_TO_HOST);
  return out;
}

void release(Buffer& b) {
  aclDestroyTensor(b.tensor);
  aclrtFree(b.device);
}

struct Inputs {
  std::vector<float> dy, x, rstd, gamma;
};

Inputs inputs_of(int t) {
  Inputs in;
  for (int i = 0; i < kRows * kCols; ++i) {
    in.dy.push_back(std::sin(0.37f * i + t));
    in.x.push_back(std::cos(0.11f * i - 2.0f * t));
  }
  for (int r = 0; r < kRows; ++r) in.rstd.push_back(0.5f + 0.1f * r + 0.01f * t);
  for (int c = 0; c < kCols; ++c) in.gamma.push_back(1.0f + 0.05f * c - 0.1f * t);
  return in;
}

// dx = rstd * (dy*g - x*rstd * mean(dy*g*x*rstd)), dgamma = sum_rows(dy*x*rstd); hardswish'(x) * dy.
void reference(const Inputs& in, std::vector<double>& dx, std::vector<double>& dgamma, std::vector<double>& dh) {
  dx.assign(kRows * kCols, 0), dgamma.assign(kCols, 0), dh.assign(kRows * kCols, 0);
  for (int r = 0; r < kRows; ++r) {
    double mean = 0;
    for (int c = 0; c < kCols; ++c) {
      const int i = r * kCols + c;
      mean += double(in.dy[i]) * in.gamma[c] * in.x[i] * in.rstd[r];
    }
    mean /= kCols;
    for (int c = 0; c < kCols; ++c) {
      const int i = r * kCols + c;
      dx[i] = in.rstd[r] * (double(in.dy[i]) * in.gamma[c] - double(in.x[i]) * in.rstd[r] * mean);
      dgamma[c] += double(in.dy[i]) * in.x[i] * in.rstd[r];
      const double x = in.x[i];
      dh[i] = in.dy[i] * (x < -3 ? 0.0 : x > 3 ? 1.0 : x / 3 + 0.5);
    }
  }
}

bool close(const std::vector<float>& got, const std::vector<double>& want) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::fabs(got[i] - want[i]) > 1e-5 * (1 + std::fabs(want[i]))) return false;
  }
  return true;
}

// One thread's work; returns "" or what failed. `expected` (dx, dgamma, dh) is filled when empty, else compared.
std::string work(int t, int rounds, std::vector<std::vector<float>>& expected) {
  aclrtStream stream = nullptr;
  if (aclrtCreateStream(&stream) != ACL_SUCCESS) return "aclrtCreateStream";
  const Inputs in = inputs_of(t);
  std::vector<double> want_dx, want_dgamma, want_dh;
  reference(in, want_dx, want_dgamma, want_dh);
  Buffer dy, x, rstd, gamma, short_gamma, dx, dgamma, dh;
  if (!make(dy, {kRows, kCols}, in.dy) || !make(x, {kRows, kCols}, in.x) || !make(rstd, {kRows}, in.rstd) ||
      !make(gamma, {kCols}, in.gamma) || !make(short_gamma, {kCols - 1}, in.gamma) ||
      !make(dx, {kRows, kCols}, std::vector<float>(kRows * kCols)) || !make(dgamma, {kCols}, std::vector<float>(kCols)) ||
      !make(dh, {kRows, kCols}, std::vector<float>(kRows * kCols))) {
    return "tensors";
  }
  std::string failed;
  for (int round = 0; round < rounds && failed.empty(); ++round) {
    uint64_t size = 0;
    aclOpExecutor* executor = nullptr;
    void* workspace = nullptr;
    aclnnStatus s = aclnnRmsNormGradGetWorkspaceSize(dy.tensor, x.tensor, rstd.tensor, gamma.tensor, dx.tensor,
                                                     dgamma.tensor, &size, &executor);
    if (s == 0 && size > 0) s = aclrtMalloc(&workspace, size, ACL_MEM_MALLOC_HUGE_FIRST);
    if (s == 0) s = aclnnRmsNormGrad(workspace, size, executor, stream);
    if (s == 0) s = aclrtSynchronizeStream(stream);
    if (workspace != nullptr) aclrtFree(workspace);
    if (s != 0) return "aclnnRmsNormGrad " + std::to_string(s) + ": " + (aclGetRecentErrMsg() ?: "");

    s = aclnnRmsNormGradGetWorkspaceSize(dy.tensor, x.tensor, rstd.tensor, short_gamma.tensor, dx.tensor,
                                         dgamma.tensor, &size, &executor);
    const char* message = aclGetRecentErrMsg();
    if (s != ACLNN_ERR_INNER_TILING_ERROR || executor != nullptr || message == nullptr ||
        std::strstr(message, "gamma") == nullptr || std::strstr(message, "(15,)") == nullptr) {
      return "the refused call: status " + std::to_string(s) + ", message " + (message ? message : "(none)");
    }

    s = aclnnHardswishBackwardGetWorkspaceSize(dy.tensor, x.tensor, dh.tensor, &size, &executor);
    if (s == 0) s = aclnnHardswishBackward(nullptr, size, executor, stream);
    if (s != 0) return "aclnnHardswishBackward " + std::to_string(s);

    std::vector<std::vector<float>> got = {read(dx), read(dgamma), read(dh)};
    if (!close(got[0], want_dx) || !close(got[1], want_dgamma) || !close(got[2], want_dh)) {
      failed = "results differ from the float64 reference";
    } else if (expected.empty()) {
      expected = got;
    } else if (got != expected) {
      failed = "results differ from the same call made alone";
    }
  }
  for (Buffer* b : {&dy, &x, &rstd, &gamma, &short_gamma, &dx, &dgamma, &dh}) release(*b);
  aclrtDestroyStream(stream);
  return failed;
}

}  // namespace

int main() {
  if (aclInit(nullptr) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS) return 2;
  std::vector<std::vector<std::vector<float>>> expected(kThreads);
  for (int t = 0; t < kThreads; ++t) {  // alone first: the bits each thread must reproduce
    const std::string failed = work(t, 1, expected[t]);
    if (!failed.empty()) {
      std::printf("alone %d: %s\n", t, failed.c_str());
      return 1;
    }
  }
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back([t, &expected, &failures] {
    failures[t] = work(t, kRounds, expected[t]);
  });
  for (auto& th : threads) th.join();
  int bad = 0;
  for (int t = 0; t < kThreads; ++t) {
    if (failures[t].empty()) {
      std::printf("ok %d %d\n", t, kRounds * 3);
    } else {
      std::printf("thread %d: %s\n", t, failures[t].c_str());
      ++bad;
    }
  }
  aclrtResetDevice(0);
  aclFinalize();
  return bad == 0 ? 0 : 1;
}
