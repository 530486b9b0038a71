#include "coshard/modules/safetensors.hpp"


#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "coshard/async/json_limits.hpp"
#include "coshard/async/files.hpp"
#include "coshard/async/replacing_file.hpp"

namespace coshard::modules {
namespace {

using json = nlohmann::json;

// A header above this is not a weight file (the reference implementation caps it at 100 MB).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeName {
  SafeDType type;
  std::string_view name;
  std::size_t size;
};
constexpr DTypeName kDTypes[] = {
    {SafeDType::f64, "F64", 8}, {SafeDType::f32, "F32", 4}, {SafeDType::f16, "F16", 2},
    {SafeDType::bf16, "BF16", 2}, {SafeDType::i64, "I64", 8}, {SafeDType::i32, "I32", 4},
    {SafeDType::i16, "I16", 2}, {SafeDType::i8, "I8", 1}, {SafeDType::u8, "U8", 1}, {SafeDType::boolean, "BOOL", 1},
};

// Multiplies shape dimensions and the element size, refusing negatives and overflow.
Result<std::size_t> byte_count(const std::string& source, const std::string& name, const std::vector<std::int64_t>& shape,
                               std::size_t element) {
  std::size_t n = element;
  for (std::int64_t d : shape) {
    if (d < 0) return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' has a negative dimension ", d);
    const auto u = static_cast<std::size_t>(d);
    if (u != 0 && n > std::numeric_limits<std::size_t>::max() / u) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' shape overflows a byte count");
    }
    n *= u;
  }
  return n;
}

}  // namespace

std::string_view to_string(SafeDType t) noexcept {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

std::size_t size_of(SafeDType t) noexcept {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.size;
  return 0;
}

std::optional<SafeDType> parse_safe_dtype(std::string_view name) noexcept {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

const SafeTensorInfo* SafetensorsFile::find(std::string_view name) const noexcept {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::span<const std::byte> SafetensorsFile::data(const SafeTensorInfo& t) const noexcept {
  return std::span(bytes_).subspan(data_start_ + t.begin, t.end - t.begin);
}

Result<SafetensorsFile> SafetensorsFile::load(const std::filesystem::path& path) {
  // A regular file only (a device such as /dev/zero would read without end).
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, std::numeric_limits<std::size_t>::max(),
                                                          "safetensors file"));
  return parse(std::move(bytes), path.string());
}

Result<SafetensorsFile> SafetensorsFile::parse(std::vector<std::byte> bytes, std::string source) {
  if (bytes.size() < 8) {
    return fail(ErrorCode::invalid_argument, source, ": ", bytes.size(), " bytes is too short for a safetensors file (needs at least 8)");
  }
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<std::uint64_t>(bytes[static_cast<std::size_t>(i)]) << (8 * i);
  if (header_len > kMaxHeaderBytes) {
    return fail(ErrorCode::invalid_argument, source, ": header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes);
  }
  if (header_len > bytes.size() - 8) {
    return fail(ErrorCode::invalid_argument, source, ": header length ", header_len, " runs past the end of the file (",
                bytes.size(), " bytes)");
  }
  const std::string_view header_text(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(header_len));
  COSHARD_TRY(async::check_json_nesting(header_text, source));
  json header = json::parse(header_text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return fail(ErrorCode::invalid_argument, source, ": the header is not a JSON object");
  }

  SafetensorsFile file;
  file.data_start_ = 8 + static_cast<std::size_t>(header_len);
  const std::size_t data_size = bytes.size() - file.data_start_;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) return fail(ErrorCode::invalid_argument, source, ": __metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          return fail(ErrorCode::invalid_argument, source, ": __metadata__ value of '", m.key(), "' is not a string");
        }
        file.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' is not an object");
    for (auto k = entry.begin(); k != entry.end(); ++k) {
      if (k.key() != "dtype" && k.key() != "shape" && k.key() != "data_offsets") {
        return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' has an unknown field '", k.key(), "'");
      }
    }
    SafeTensorInfo t;
    t.name = name;
    const auto dtype = entry.find("dtype");
    if (dtype == entry.end() || !dtype->is_string()) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' has no dtype string");
    }
    const auto parsed = parse_safe_dtype(dtype->get<std::string>());
    if (!parsed) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' has unknown dtype '", dtype->get<std::string>(),
                  "' (expected F64, F32, F16, BF16, I64, I32, I16, I8, U8 or BOOL)");
    }
    t.dtype = *parsed;
    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array()) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' has no shape array");
    }
    for (const json& d : *shape) {
      if (!d.is_number_integer()) return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' has a non-integer dimension");
      t.shape.push_back(d.get<std::int64_t>());
    }
    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned()) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' needs data_offsets [begin, end] of non-negative integers");
    }
    const auto begin = (*offsets)[0].get<std::uint64_t>();
    const auto end = (*offsets)[1].get<std::uint64_t>();
    if (begin > end || end > data_size) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' data_offsets [", begin, ", ", end,
                  "] lie outside the data section of ", data_size, " bytes (truncated file?)");
    }
    t.begin = static_cast<std::size_t>(begin);
    t.end = static_cast<std::size_t>(end);
    auto bytes_needed = byte_count(source, name, t.shape, size_of(t.dtype));
    if (!bytes_needed) return fail(std::move(bytes_needed).error());
    if (*bytes_needed != t.end - t.begin) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", name, "' is ", to_string(t.dtype), " of ", *bytes_needed,
                  " bytes by its shape but its data_offsets span ", t.end - t.begin);
    }
    file.tensors_.push_back(std::move(t));
  }

  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const SafeTensorInfo& a, const SafeTensorInfo& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  std::size_t covered = 0;
  for (std::size_t i = 0; i < file.tensors_.size(); ++i) {
    const auto& t = file.tensors_[i];
    if (t.begin < covered) {
      return fail(ErrorCode::invalid_argument, source, ": tensor '", t.name, "' [", t.begin, ", ", t.end,
                  ") overlaps tensor '", file.tensors_[i - 1].name, "' (ends at ", covered, ")");
    }
    if (t.begin > covered) {
      return fail(ErrorCode::invalid_argument, source, ": bytes [", covered, ", ", t.begin, ") of the data section belong to no tensor");
    }
    covered = t.end;
  }
  if (covered != data_size) {
    return fail(ErrorCode::invalid_argument, source, ": bytes [", covered, ", ", data_size, ") of the data section belong to no tensor");
  }
  file.bytes_ = std::move(bytes);
  return file;
}

std::optional<SafeDType> safe_dtype_of(async::DataType dt) noexcept {
  using async::DataType;
  switch (dt) {
    case DataType::f32: return SafeDType::f32;
    case DataType::f64: return SafeDType::f64;
    case DataType::bf16: return SafeDType::bf16;
    case DataType::f16: return SafeDType::f16;
    case DataType::i32: return SafeDType::i32;
    case DataType::u8: return SafeDType::u8;
  }
  return std::nullopt;
}

std::optional<async::DataType> float_dtype_of(SafeDType dt) noexcept {
  using async::DataType;
  switch (dt) {
    case SafeDType::f32: return DataType::f32;
    case SafeDType::f64: return DataType::f64;
    case SafeDType::bf16: return DataType::bf16;
    case SafeDType::f16: return DataType::f16;
    default: return std::nullopt;
  }
}

Result<std::vector<std::byte>> safetensors_prefix(std::span<const SafeTensorLayout> tensors,
                                                  const std::map<std::string, std::string>& metadata,
                                                  std::string_view source) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::size_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return fail(ErrorCode::invalid_argument, "save_safetensors('", source, "'): invalid tensor name '", t.name, "'");
    }
    if (header.contains(t.name)) {
      return fail(ErrorCode::invalid_argument, "save_safetensors('", source, "'): tensor '", t.name, "' appears twice");
    }
    auto need = byte_count(std::string(source), t.name, t.shape, size_of(t.dtype));
    if (!need) return fail(std::move(need).error());
    if (*need != t.bytes) {
      return fail(ErrorCode::invalid_argument, "save_safetensors('", source, "'): tensor '", t.name, "' has ",
                  t.bytes, " bytes of data but its shape needs ", *need);
    }
    header[t.name] = {{"dtype", to_string(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // pad so the data starts 8-byte aligned
  std::vector<std::byte> out(8 + text.size());
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::byte>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  return out;
}

Result<void> save_safetensors(const std::filesystem::path& path, std::span<const SafeTensorView> tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<SafeTensorLayout> layout;
  for (const auto& t : tensors) layout.push_back({t.name, t.dtype, t.shape, t.data.size()});
  COSHARD_TRY_ASSIGN(const auto prefix, safetensors_prefix(layout, metadata, path.string()));
  COSHARD_TRY_ASSIGN(auto file, async::ReplacingFile::create(path, "save_safetensors"));
  COSHARD_TRY(file.write(std::span<const std::byte>(prefix)));
  for (const auto& t : tensors) COSHARD_TRY(file.write(t.data));
  return file.commit();
}

}  // namespace coshard::modules
