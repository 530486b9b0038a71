// safetensors: the weight file format of PyTorch and Hugging Face, read and written.
//
// Layout: u64 little-endian header length N, N bytes of JSON header, then the raw data. The
// header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data section) and may hold "__metadata__": {string: string}.
//
// Reading trusts nothing: a header length past the end of the file, a header that is not a JSON
// object, an unknown dtype, a shape whose byte count disagrees with its offsets, offsets past
// the end, overlapping offsets, or holes in the data (the format requires full coverage) are each
// refused with an error naming the file, the tensor and the values. Nothing is partially loaded.
// Writing goes to a temporary file in the same folder, is fsynced, then renamed over the target:
// a crash never leaves a half-written file under the real name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/result.hpp"
#include "coshard/async/dtype.hpp"

namespace coshard::modules {

enum class SafeDType : std::uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean };

std::string_view to_string(SafeDType t) noexcept;  // the file's spelling: "F32", "BF16", ...
std::size_t size_of(SafeDType t) noexcept;
std::optional<SafeDType> parse_safe_dtype(std::string_view name) noexcept;
// The file's dtype of a tensor dtype (f32, f64, bf16, f16, i32, u8).
std::optional<SafeDType> safe_dtype_of(async::DataType dt) noexcept;
// The tensor dtype of a float file dtype (F64, F32, BF16, F16); nothing for the others.
std::optional<async::DataType> float_dtype_of(SafeDType dt) noexcept;

struct SafeTensorInfo {
  std::string name;
  SafeDType dtype = SafeDType::f32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0;  // byte offsets in the data section
  std::size_t end = 0;
};

class SafetensorsFile {
 public:
  // Loads and validates a whole file.
  static Result<SafetensorsFile> load(const std::filesystem::path& path);
  // Validates bytes already in memory (`source` names them in errors).
  static Result<SafetensorsFile> parse(std::vector<std::byte> bytes, std::string source);

  // In file order of their data.
  const std::vector<SafeTensorInfo>& tensors() const noexcept { return tensors_; }
  const SafeTensorInfo* find(std::string_view name) const noexcept;
  std::span<const std::byte> data(const SafeTensorInfo& tensor) const noexcept;
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }

 private:
  std::vector<std::byte> bytes_;
  std::size_t data_start_ = 0;
  std::vector<SafeTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct SafeTensorView {
  std::string name;
  SafeDType dtype = SafeDType::f32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;  // size must equal product(shape) * size_of(dtype)
};

// The bytes before the data of a file holding `tensors` in this order: the u64 header length
// and the JSON header, padded so the data starts 8-byte aligned. The data follows, tensor after
// tensor (for writers that assemble the file themselves, e.g. into one pinned buffer).
// `source` names the file in errors. Checks names and byte counts as save_safetensors does.
struct SafeTensorLayout {
  std::string name;
  SafeDType dtype = SafeDType::f32;
  std::vector<std::int64_t> shape;
  std::size_t bytes = 0;  // must equal product(shape) * size_of(dtype)
};
Result<std::vector<std::byte>> safetensors_prefix(std::span<const SafeTensorLayout> tensors,
                                                  const std::map<std::string, std::string>& metadata,
                                                  std::string_view source);

// Writes the tensors (in the given order) atomically: temporary file, fsync, rename.
Result<void> save_safetensors(const std::filesystem::path& path, std::span<const SafeTensorView> tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace coshard::modules
