/* meshlm's C kernels as C++ implementations of their torch operators meshlm::<name>
   (meshlm.kernels.operators), compiled on the machine that runs them against the installed torch.

   A compiled decode step calls each kernel through its operator. Implemented in Python, every call
   goes from the dispatcher back into the interpreter (~8 us on a 2-core Zen 5); here it stays in
   C++ (~4 us): 49 calls a token at d = 768 (and Inductor's C++ wrapper could call it without
   Python at all; measured, not turned on: docs/quantize.md). Each implementation does what the
   kernel's Python product does around the C function (meshlm.kernels.fp32_rows, .bf16_rows,
   meshlm.quant.row_kernel, .int4_kernel, .int4_bf16_kernel, .int8_bf16_kernel): the same checks,
   the same output
   allocation, the same arguments, so the numbers are the same bit for bit.

   meshlm_register(name, function, error, size) registers the CPU implementation of meshlm::<name>
   (its schema and fake are Python's, defined at import) the first time and (re)binds it to the C
   function at `function`, the kernel as this process loaded it; 0 once done, else 1 with the reason
   written to `error`. Registering at run time, not in a static initializer, keeps a failure a
   return value rather than an abort while the library loads. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Fp32Rows = int (*)(const void *, const void *, const void *, void *, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int);
using Bf16Rows = int (*)(const void *, const void *, const void *, void *, int64_t, int64_t,
                         int64_t, int);
using Int8Row = int (*)(const void *, const void *, const void *, void *, int64_t, int64_t,
                        int64_t, int);
using Int4Rows = int (*)(const void *, const void *, const void *, void *, int64_t, int64_t,
                         int64_t, int64_t, int);

Fp32Rows fp32_rows_function = nullptr;
Bf16Rows bf16_rows_function = nullptr;
Int8Row int8_row_function = nullptr;
Int4Rows int4_rows_function = nullptr;
Int4Rows int4_bf16_rows_function = nullptr;  // int4_bf16_rows.c: int4_rows.c's arguments
Int8Row int8_bf16_rows_function = nullptr;  // int8_bf16_rows.c: int8_rows.c's argument types

constexpr int64_t LANES = 16;                           // int4_rows.c's outputs per block
constexpr int64_t MAX_K = (2147483647LL) / (255 * 128);  // int8_rows.c's widest exact row

at::Tensor fp32_out(int64_t rows, int64_t columns) {
    return at::empty({rows, columns}, at::TensorOptions().dtype(at::kFloat));
}

const void *optional_data(const std::optional<at::Tensor> &t) {
    return t.has_value() ? t->data_ptr() : nullptr;
}

at::Tensor fp32_rows(const at::Tensor &rows_in, const at::Tensor &blocks,
                     const std::optional<at::Tensor> &bias, c10::SymInt out_symbol) {
    const at::Tensor rows = rows_in.contiguous();
    const int64_t out_features = out_symbol.expect_int();
    at::Tensor y = fp32_out(rows.size(0), out_features);
    if (fp32_rows_function(rows.data_ptr(), blocks.data_ptr(), optional_data(bias), y.data_ptr(),
                           rows.size(0), blocks.size(0), blocks.size(1), blocks.size(2),
                           out_features, at::get_num_threads()))
        throw std::invalid_argument("fp32 row product: blocks " + std::to_string(blocks.size(2)) +
                                    " wide, at most 32");  // fp32_rows.c's TILE
    return y;
}

at::Tensor bf16_rows(const at::Tensor &rows_in, const at::Tensor &weight,
                     const std::optional<at::Tensor> &bias) {
    const at::Tensor rows = rows_in.to(at::kBFloat16).contiguous();
    at::Tensor y = fp32_out(rows.size(0), weight.size(0));
    if (bf16_rows_function(rows.data_ptr(), weight.data_ptr(), optional_data(bias), y.data_ptr(),
                           rows.size(0), weight.size(1), weight.size(0), at::get_num_threads()))
        throw std::invalid_argument("bf16 row product: in_features " +
                                    std::to_string(weight.size(1)) +
                                    " is not a multiple of the kernel's");
    return y;
}

at::Tensor int8_row(const at::Tensor &x_in, const at::Tensor &weight,
                    const std::optional<at::Tensor> &sums_in) {
    const at::Tensor rows = weight.t().contiguous(), x = x_in.contiguous();
    if (rows.size(1) > MAX_K)  // the layers do not give such rows the kernel (row_kernel.MAX_K)
        throw std::invalid_argument("int8 row product: " + std::to_string(rows.size(1)) +
                                    " inputs overflow its int32 sums; use the torch ops");
    const at::Tensor sums =
        (sums_in.has_value() ? *sums_in : weight.sum(0, false, at::kInt)).contiguous();
    at::Tensor y = fp32_out(x.size(0), rows.size(0));
    if (int8_row_function(x.data_ptr(), rows.data_ptr(), sums.data_ptr(), y.data_ptr(),
                          x.size(0), rows.size(0), rows.size(1), at::get_num_threads()))
        throw std::bad_alloc();
    return y;
}

// the int4 kernels' product: the rows (x, in the kernel's dtype) times the packed weights
at::Tensor int4_product(Int4Rows function, const at::Tensor &x, const at::Tensor &packed,
                        const at::Tensor &sz, int64_t n, int64_t group) {
    const int64_t blocks = sz.size(0);
    at::Tensor y = fp32_out(x.size(0), blocks * LANES);
    if (function(x.data_ptr(), packed.data_ptr(), sz.data_ptr(), y.data_ptr(), x.size(0),
                 x.size(1), blocks, group, at::get_num_threads()))
        throw std::bad_alloc();
    return n == blocks * LANES ? y : y.slice(1, 0, n).contiguous();
}
at::Tensor int4_rows(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &sz,
                     int64_t n, int64_t group) {
    return int4_product(int4_rows_function, x.contiguous(), packed, sz, n, group);
}
at::Tensor int4_bf16_rows(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &sz,
                          int64_t n, int64_t group) {
    return int4_product(int4_bf16_rows_function, x.to(at::kBFloat16).contiguous(), packed, sz, n,
                        group);
}

at::Tensor int8_bf16_rows(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scales) {
    const at::Tensor rows = x.to(at::kBFloat16).contiguous(), w = weight.contiguous();
    at::Tensor y = fp32_out(rows.size(0), w.size(0));
    if (int8_bf16_rows_function(rows.data_ptr(), w.data_ptr(), scales.contiguous().data_ptr(),
                                y.data_ptr(), rows.size(0), w.size(0), w.size(1),
                                at::get_num_threads()))
        throw std::bad_alloc();
    return y;
}

// the registrations made (each kept alive: a Library's destruction removes them)
std::vector<std::unique_ptr<torch::Library>> registrations;

// binds `target` to `function`; the first time, registers `implementation` as meshlm::<name>'s
template <typename Function, typename Implementation>
void bind(const char *name, Function &target, void *function, Implementation implementation) {
    if (target == nullptr) {
        auto library = std::make_unique<torch::Library>(
            torch::Library::IMPL, "meshlm", c10::DispatchKey::CPU, __FILE__, __LINE__);
        library->impl(name, implementation);
        registrations.push_back(std::move(library));
    }
    target = reinterpret_cast<Function>(function);
}

}  // namespace

extern "C" int meshlm_register(const char *name, void *function, char *error, size_t size) {
    try {
        if (!std::strcmp(name, "fp32_rows"))
            bind(name, fp32_rows_function, function, TORCH_FN(fp32_rows));
        else if (!std::strcmp(name, "bf16_rows"))
            bind(name, bf16_rows_function, function, TORCH_FN(bf16_rows));
        else if (!std::strcmp(name, "int8_row"))
            bind(name, int8_row_function, function, TORCH_FN(int8_row));
        else if (!std::strcmp(name, "int4_rows"))
            bind(name, int4_rows_function, function, TORCH_FN(int4_rows));
        else if (!std::strcmp(name, "int4_bf16_rows"))
            bind(name, int4_bf16_rows_function, function, TORCH_FN(int4_bf16_rows));
        else if (!std::strcmp(name, "int8_bf16_rows"))
            bind(name, int8_bf16_rows_function, function, TORCH_FN(int8_bf16_rows));
        else
            throw std::invalid_argument(std::string("no operator meshlm::") + name + " here");
        return 0;
    } catch (const std::exception &err) {
        std::snprintf(error, size, "%s", err.what());
        return 1;
    }
}
