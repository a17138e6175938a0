// The kernel registry (kernels.h) and its Python binding: ``kernel(name, inputs, outputs, ints, floats)``, the
// one entry through which gradops.cpu's host functions run every CPU kernel.

#include "kernels.h"

#include <torch/csrc/utils/pybind.h>

#include <cstdio>
#include <map>
#include <optional>

namespace gradops {

bool forked = false;

namespace {

std::map<std::string, Kernel>& registry() {
  static auto* kernels = new std::map<std::string, Kernel>();  // leaked: used by static initialisers of other files
  return *kernels;
}

}  // namespace

bool register_kernel(const char* name, Kernel kernel) {
  const bool fresh = registry().emplace(name, kernel).second;
  if (!fresh) std::fprintf(stderr, "gradops.native: kernel %s registered twice; the first one is kept\n", name);
  return fresh;
}

Kernel find_kernel(const std::string& name) {
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

std::vector<std::string> kernel_names() {
  std::vector<std::string> names;
  for (const auto& item : registry()) names.push_back(item.first);
  return names;
}

namespace {

namespace py = pybind11;

// The kernel's inputs must be what the convention promises, whoever calls: a kernel reads them by address.
void require_plain(const at::Tensor& t, const std::string& name, const char* role, size_t i) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && t.has_storage(),
              "gradops.native: kernel ", name, ": ", role, " ", i, " is not a contiguous CPU tensor");
  const int64_t n = t.numel();
  if (n == 0) return;
  const c10::Storage& storage = t.storage();
  TORCH_CHECK(storage.data() != nullptr &&
                  storage.nbytes() >= static_cast<size_t>(t.storage_offset() + n) * t.element_size(),
              "gradops.native: kernel ", name, ": ", role, " ", i, "'s storage does not hold its elements");
}

int64_t run_kernel(const std::string& name, const std::vector<std::optional<at::Tensor>>& inputs,
                   const std::vector<at::Tensor>& outputs, const std::vector<int64_t>& ints,
                   const std::vector<double>& floats) {
  Kernel kernel = find_kernel(name);
  TORCH_CHECK(kernel != nullptr, "gradops.native: no kernel named ", name);
  std::vector<at::Tensor> in;
  in.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    in.push_back(inputs[i].has_value() ? *inputs[i] : at::Tensor());
    if (in.back().defined()) require_plain(in.back(), name, "input", i);
  }
  for (size_t i = 0; i < outputs.size(); ++i) require_plain(outputs[i], name, "output", i);
  py::gil_scoped_release released;  // the kernels touch no Python object
  return kernel(KernelArgs{in, outputs, ints, floats});
}

}  // namespace

void register_kernels(py::module_& m) {
  m.def("kernel", &run_kernel, "kernel(name, inputs, outputs, ints, floats): run the CPU kernel called name; -1, "
        "or the position of a value the op refuses");
  m.def("kernel_names", &kernel_names, "the names of the registered CPU kernels");
  m.attr("PARALLEL_MIN") = kParallelMin;
  m.attr("ROW_BLOCKS") = kRowBlocks;
  m.attr("BLOCK_ITEMS") = kBlockItems;
  m.def("row_blocks", &row_blocks, "the row blocks of a reduction over a rows x cols input");
}

}  // namespace gradops
