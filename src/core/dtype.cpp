#include "core/dtype.h"

#include "core/error.h"

namespace merlin {
namespace {
constexpr DTypeInfo kTypes[] = {
    {DType::F32, "f32", 1, 4},        {DType::F16, "f16", 1, 2},
    {DType::Q4_0, "q4_0", 32, 18},    {DType::Q4_1, "q4_1", 32, 20},
    {DType::Q5_0, "q5_0", 32, 22},    {DType::Q5_1, "q5_1", 32, 24},
    {DType::Q8_0, "q8_0", 32, 34},    {DType::Q8_1, "q8_1", 32, 36},
    {DType::Q2_K, "q2_k", 256, 84},   {DType::Q3_K, "q3_k", 256, 110},
    {DType::Q4_K, "q4_k", 256, 144},  {DType::Q5_K, "q5_k", 256, 176},
    {DType::Q6_K, "q6_k", 256, 210},  {DType::Q8_K, "q8_k", 256, 292},
    {DType::I8, "i8", 1, 1},          {DType::I16, "i16", 1, 2},
    {DType::I32, "i32", 1, 4},        {DType::I64, "i64", 1, 8},
    {DType::F64, "f64", 1, 8},        {DType::BF16, "bf16", 1, 2},
    {DType::TQ1_0, "tq1_0", 256, 54}, {DType::TQ2_0, "tq2_0", 256, 66},
    {DType::MXFP4, "mxfp4", 32, 17},
};
}  // namespace

const DTypeInfo* dtype_info(uint32_t id) {
  for (const auto& t : kTypes)
    if ((uint32_t)t.type == id) return &t;
  return nullptr;
}

const DTypeInfo& dtype_info(DType t) {
  const DTypeInfo* info = dtype_info((uint32_t)t);
  MERLIN_CHECK(info != nullptr, "unknown tensor type id ", (uint32_t)t);
  return *info;
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& t : kTypes)
    if (name == t.name) return t.type;
  return std::nullopt;
}

uint64_t dtype_row_bytes(DType t, uint64_t n) {
  const DTypeInfo& info = dtype_info(t);
  MERLIN_CHECK(n % info.block_size == 0, "row of ", n, " elements is not a multiple of ", info.name,
               "'s block size ", info.block_size);
  return n / info.block_size * info.block_bytes;
}

}  // namespace merlin
