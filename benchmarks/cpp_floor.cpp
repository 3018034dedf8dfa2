// The least a module hook written in C++ pays per call: bench_host.py's "c++ floor", the
// counterpart of its "python floor". Not a recording: one process-wide forward hook that
// summarises each recorded module's float32 output where it lies (one pass: sum, sum of
// squares, extremes, NaN, Inf and zero counts, and positives per unit of the last
// dimension), appends a fixed-size record, and hooks the output's gradient with a C++ hook,
// which summarises it the same way in the autograd engine, without the interpreter.
#include <torch/extension.h>

#include <cmath>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Record {
  int32_t module, call, kind;
  double stats[8];
};

void summarise(const at::Tensor& t, double* stats, std::vector<int64_t>* positives) {
  const float* p = t.const_data_ptr<float>();
  const int64_t n = t.numel();
  const int64_t units = positives != nullptr && t.dim() > 0 ? t.size(-1) : 0;
  const size_t first = positives != nullptr ? positives->size() : 0;
  if (units) positives->resize(first + units);
  double sum = 0, squares = 0, low = INFINITY, high = -INFINITY;
  int64_t nan = 0, inf = 0, zero = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = p[i];
    if (std::isnan(v)) { ++nan; continue; }
    if (std::isinf(v)) { ++inf; continue; }
    sum += v;
    squares += v * v;
    low = v < low ? v : low;
    high = v > high ? v : high;
    zero += v == 0;
    if (units) (*positives)[first + i % units] += v > 0;
  }
  const double out[8] = {sum, squares, low, high, double(nan), double(inf), double(zero), double(n)};
  std::copy(out, out + 8, stats);
}

struct Hooks {
  std::unordered_map<uintptr_t, int32_t> modules;
  std::vector<int32_t> calls;
  std::vector<Record> records;
  std::vector<int64_t> positives;
  std::mutex lock;

  void add(const py::object& module, int32_t index) {
    modules[reinterpret_cast<uintptr_t>(module.ptr())] = index;
    if (static_cast<int32_t>(calls.size()) <= index) calls.resize(index + 1);
  }

  void post(py::handle module, py::handle, py::handle, py::handle output) {
    auto found = modules.find(reinterpret_cast<uintptr_t>(module.ptr()));
    if (found == modules.end() || !THPVariable_Check(output.ptr())) return;
    const at::Tensor& tensor = THPVariable_Unpack(output.ptr());
    if (tensor.scalar_type() != at::kFloat || !tensor.is_cpu() || !tensor.is_contiguous()) return;
    const int32_t index = found->second, call = calls[index]++;
    Record record{index, call, 0, {}};
    {
      std::lock_guard<std::mutex> held(lock);
      summarise(tensor, record.stats, &positives);
      records.push_back(record);
    }
    if (tensor.requires_grad() && at::GradMode::is_enabled()) {
      Hooks* self = this;
      at::Tensor(tensor).register_hook([self, index, call](const at::Tensor& grad) {
        Record record{index, call, 1, {}};
        if (grad.scalar_type() == at::kFloat && grad.is_contiguous())
          summarise(grad, record.stats, nullptr);
        std::lock_guard<std::mutex> held(self->lock);
        self->records.push_back(record);
      });
    }
  }

  size_t taken() {
    std::lock_guard<std::mutex> held(lock);
    const size_t n = records.size();
    records.clear();
    positives.clear();
    std::fill(calls.begin(), calls.end(), 0);
    return n;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Hooks>(m, "Hooks")
      .def(py::init<>())
      .def("add", &Hooks::add)
      .def("post", &Hooks::post)
      .def("taken", &Hooks::taken);
}
