// gguf::Value and gguf::Metadata: typed access with clear errors.
#include <cmath>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "format/gguf.h"

namespace merlin::gguf {

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::U8: return "u8";
    case ValueType::I8: return "i8";
    case ValueType::U16: return "u16";
    case ValueType::I16: return "i16";
    case ValueType::U32: return "u32";
    case ValueType::I32: return "i32";
    case ValueType::F32: return "f32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::U64: return "u64";
    case ValueType::I64: return "i64";
    case ValueType::F64: return "f64";
  }
  return "?";
}

ValueType Value::type() const {
  static constexpr ValueType kByIndex[] = {ValueType::U8,  ValueType::I8,   ValueType::U16,    ValueType::I16,
                                           ValueType::U32, ValueType::I32,  ValueType::F32,    ValueType::BOOL,
                                           ValueType::STRING, ValueType::ARRAY, ValueType::U64, ValueType::I64,
                                           ValueType::F64};
  return kByIndex[v.index()];
}

bool Value::is_integer() const {
  switch (type()) {
    case ValueType::U8: case ValueType::I8: case ValueType::U16: case ValueType::I16:
    case ValueType::U32: case ValueType::I32: case ValueType::U64: case ValueType::I64:
      return true;
    default:
      return false;
  }
}

int64_t Value::as_int(const std::string& what) const {
  return std::visit(
      [&](const auto& x) -> int64_t {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, uint64_t>) {
          MERLIN_CHECK(x <= (uint64_t)std::numeric_limits<int64_t>::max(), what, " is out of range");
          return (int64_t)x;
        } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
          return (int64_t)x;
        } else {
          fail(what, " must be an integer, got ", value_type_name(type()));
        }
      },
      v);
}

double Value::as_double(const std::string& what) const {
  if (const float* f = std::get_if<float>(&v)) return *f;
  if (const double* d = std::get_if<double>(&v)) return *d;
  if (is_integer()) return (double)as_int(what);
  fail(what, " must be a number, got ", value_type_name(type()));
}

bool Value::as_bool(const std::string& what) const {
  if (const bool* b = std::get_if<bool>(&v)) return *b;
  if (is_integer()) return as_int(what) != 0;
  fail(what, " must be a bool, got ", value_type_name(type()));
}

const std::string& Value::as_string(const std::string& what) const {
  if (const std::string* s = std::get_if<std::string>(&v)) return *s;
  fail(what, " must be a string, got ", value_type_name(type()));
}

const Array& Value::as_array(const std::string& what) const {
  if (const Array* a = std::get_if<Array>(&v)) return *a;
  fail(what, " must be an array, got ", value_type_name(type()));
}

std::string Value::to_string(size_t max_items) const {
  std::ostringstream os;
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          std::string s = x.size() > 60 ? x.substr(0, 60) + "..." : x;
          for (char& c : s)
            if ((unsigned char)c < 0x20) c = ' ';
          os << '"' << s << '"';
        } else if constexpr (std::is_same_v<T, Array>) {
          os << "[" << value_type_name(x.type) << " x " << x.items.size() << "]";
          if (max_items > 0 && !x.items.empty()) {
            os << " {";
            for (size_t i = 0; i < x.items.size() && i < max_items; ++i)
              os << (i ? ", " : "") << x.items[i].to_string(max_items > 2 ? 2 : 0);
            if (x.items.size() > max_items) os << ", ...";
            os << "}";
          }
        } else if constexpr (std::is_same_v<T, bool>) {
          os << (x ? "true" : "false");
        } else if constexpr (std::is_same_v<T, uint8_t> || std::is_same_v<T, int8_t>) {
          os << (int)x;
        } else {
          os << x;
        }
      },
      v);
  return os.str();
}

template <typename T>
static Value array_of(ValueType type, const std::vector<T>& items) {
  Array a;
  a.type = type;
  a.items.reserve(items.size());
  for (const auto& x : items) a.items.emplace_back(x);
  return Value(std::move(a));
}

Value make_array(const std::vector<std::string>& items) { return array_of(ValueType::STRING, items); }
Value make_array(const std::vector<float>& items) { return array_of(ValueType::F32, items); }
Value make_array(const std::vector<int32_t>& items) { return array_of(ValueType::I32, items); }

void Metadata::set(const std::string& key, Value v) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    entries_[it->second].second = std::move(v);
    return;
  }
  index_[key] = entries_.size();
  entries_.emplace_back(key, std::move(v));
}

const Value* Metadata::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

const Value& Metadata::at(const std::string& key) const {
  const Value* v = find(key);
  MERLIN_CHECK(v != nullptr, "missing metadata key '", key, "'");
  return *v;
}

int64_t Metadata::get_int(const std::string& key, int64_t dflt) const {
  const Value* v = find(key);
  return v ? v->as_int("metadata '" + key + "'") : dflt;
}

double Metadata::get_double(const std::string& key, double dflt) const {
  const Value* v = find(key);
  return v ? v->as_double("metadata '" + key + "'") : dflt;
}

std::string Metadata::get_string(const std::string& key, const std::string& dflt) const {
  const Value* v = find(key);
  return v ? v->as_string("metadata '" + key + "'") : dflt;
}

}  // namespace merlin::gguf
