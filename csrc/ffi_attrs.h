// ffi_attrs.h: each op's XLA FFI attributes as one struct, and their decoding in constant time.
//
// XLA's own struct decoding (XLA_FFI_REGISTER_STRUCT_ATTR_DECODING) looks every member up by name on
// every call, a binary search of string compares that cost about a tenth of a tiny launch on the CPU.
// XLA hands a handler its attributes sorted by name (its positional decoding relies on that too), and
// an op's attribute names are fixed, so each member's position is known at compile time: the decoding
// checks the count and the name at each position and decodes the value found there. A missing, extra,
// renamed or mistyped attribute is a decoding error naming it (tests/test_ffi_direct.py).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace kvcanary {
namespace ffi = ::xla::ffi;

// The real-KV attributes as XLA decodes them: mode:i32 and the per-source geometry
// page_size/bytes_per_token/read_bytes/offset_bytes: i64[4].
struct RealKvAttrSpans {
  int32_t mode = 0;
  ffi::Span<const int64_t> page_size, bytes_per_token, read_bytes, offset_bytes;
};
struct VerifyAttrs : RealKvAttrSpans {
  int64_t tag = 0;
  bool check_token = false;
};
struct WriteAttrs : RealKvAttrSpans {
  int64_t tag = 0;
  bool input_assert = false;
};
struct PlanAttrs {
  int64_t window = 0, token_offset = 0;
  bool has_lut = false, has_pool = false, has_row_starts = false, report_evicted = false;
};

// ---- decoding --------------------------------------------------------------------------------------
template <class S, class M>
struct AttrField {
  std::string_view name;
  M S::*member;
};
template <class S, class M>
constexpr AttrField<S, M> attr_field(std::string_view name, M S::*member) {
  return {name, member};
}

// The fields of each op's attribute struct: AttrSchema<S>::fields, a tuple of AttrField<S, ...>.
template <class S>
struct AttrSchema;

// verify and write: the launch tag, the op's one flag, and the real-KV mode and geometry
template <class S>
constexpr auto log_op_attr_fields(std::string_view flag_name, bool S::*flag) {
  return std::make_tuple(attr_field<S, int64_t>("tag", &S::tag), attr_field<S, bool>(flag_name, flag),
                         attr_field<S, int32_t>("mode", &S::mode),
                         attr_field<S, ffi::Span<const int64_t>>("page_size", &S::page_size),
                         attr_field<S, ffi::Span<const int64_t>>("bytes_per_token", &S::bytes_per_token),
                         attr_field<S, ffi::Span<const int64_t>>("read_bytes", &S::read_bytes),
                         attr_field<S, ffi::Span<const int64_t>>("offset_bytes", &S::offset_bytes));
}
template <>
struct AttrSchema<VerifyAttrs> {
  static constexpr auto fields = log_op_attr_fields("check_token", &VerifyAttrs::check_token);
};
template <>
struct AttrSchema<WriteAttrs> {
  static constexpr auto fields = log_op_attr_fields("input_assert", &WriteAttrs::input_assert);
};
template <>
struct AttrSchema<PlanAttrs> {
  static constexpr auto fields = std::make_tuple(
      attr_field("window", &PlanAttrs::window), attr_field("token_offset", &PlanAttrs::token_offset),
      attr_field("has_lut", &PlanAttrs::has_lut), attr_field("has_pool", &PlanAttrs::has_pool),
      attr_field("has_row_starts", &PlanAttrs::has_row_starts),
      attr_field("report_evicted", &PlanAttrs::report_evicted));
};

template <class S>
class SortedAttrsDecoding {
  static constexpr auto fields = AttrSchema<S>::fields;
  static constexpr size_t kSize = std::tuple_size_v<decltype(fields)>;

  // position of each field among the names sorted as XLA sorts them (std::string's order)
  template <size_t... I>
  static constexpr std::array<size_t, kSize> sorted_positions(std::index_sequence<I...>) {
    const std::string_view names[kSize] = {std::get<I>(fields).name...};
    std::array<size_t, kSize> pos{};
    for (size_t k = 0; k < kSize; ++k)
      for (size_t j = 0; j < kSize; ++j) pos[k] += names[j] < names[k] ? 1 : 0;
    return pos;
  }
  static constexpr std::array<size_t, kSize> kPositions = sorted_positions(std::make_index_sequence<kSize>{});

  static bool same_name(const XLA_FFI_ByteSpan* a, std::string_view b) {
    if (a->len != b.size()) return false;
    for (size_t i = 0; i < b.size(); ++i)
      if (a->ptr[i] != b[i]) return false;
    return true;
  }

  template <size_t I>
  static bool decode_field(const XLA_FFI_Attrs* attrs, S& out, ffi::DiagnosticEngine& diagnostic) {
    constexpr auto field = std::get<I>(fields);
    constexpr size_t pos = kPositions[I];
    if (XLA_FFI_PREDICT_FALSE(!same_name(attrs->names[pos], field.name))) {
      diagnostic.Emit("Attribute name mismatch: ")
          << std::string_view{attrs->names[pos]->ptr, attrs->names[pos]->len} << " vs " << field.name;
      return false;
    }
    using M = std::remove_reference_t<decltype(out.*field.member)>;
    std::optional<M> value = ffi::AttrDecoding<M>::Decode(attrs->types[pos], attrs->attrs[pos], diagnostic);
    if (XLA_FFI_PREDICT_FALSE(!value.has_value())) return false;
    out.*field.member = *value;
    return true;
  }

  template <size_t... I>
  static bool decode_fields(const XLA_FFI_Attrs* attrs, S& out, ffi::DiagnosticEngine& diagnostic,
                            std::index_sequence<I...>) {
    return (decode_field<I>(attrs, out, diagnostic) && ...);
  }

 public:
  using Type = S;
  static std::optional<S> Decode(XLA_FFI_AttrType type, void* attr, ffi::DiagnosticEngine& diagnostic) {
    if (XLA_FFI_PREDICT_FALSE(type != XLA_FFI_AttrType_DICTIONARY)) {
      diagnostic.Emit("Wrong attribute type: expected ") << XLA_FFI_AttrType_DICTIONARY << " but got " << type;
      return std::nullopt;
    }
    const auto* attrs = static_cast<const XLA_FFI_Attrs*>(attr);
    if (XLA_FFI_PREDICT_FALSE(attrs->size != static_cast<int64_t>(kSize))) {
      diagnostic.Emit("Wrong number of attributes: expected ") << kSize << " attributes but got " << attrs->size;
      return std::nullopt;
    }
    S out;
    if (!decode_fields(attrs, out, diagnostic, std::make_index_sequence<kSize>{})) return std::nullopt;
    return out;
  }
};

}  // namespace kvcanary

namespace xla::ffi {
template <>
struct AttrDecoding<::kvcanary::VerifyAttrs> : ::kvcanary::SortedAttrsDecoding<::kvcanary::VerifyAttrs> {};
template <>
struct AttrDecoding<::kvcanary::WriteAttrs> : ::kvcanary::SortedAttrsDecoding<::kvcanary::WriteAttrs> {};
template <>
struct AttrDecoding<::kvcanary::PlanAttrs> : ::kvcanary::SortedAttrsDecoding<::kvcanary::PlanAttrs> {};
}  // namespace xla::ffi
