// Tensor: a view (pointer, shape, dtype, device) over memory owned elsewhere.
//
// Not a general tensor library: contiguous, row-major, up to 4 dimensions, and only the dtypes
// the layers use (f32, f64, bf16, f16, and i32 for token ids). A Tensor may share ownership of
// its memory (a stream-ordered Block from the Context's allocator: the memory returns to the
// pool when the last Tensor over it goes, and is reused only after the stream has passed that
// point), or be a plain view (a parameter inside a flat buffer, a gathered fetch unit).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/device.hpp"
#include "coshard/async/dtype.hpp"

namespace coshard::modules {

using async::DataType;
using async::size_of;
using async::to_string;

class Shape {
 public:
  static constexpr int kMaxRank = 4;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) {
    for (auto d : dims) dims_[static_cast<std::size_t>(rank_++)] = d;
  }
  static Shape from(std::span<const std::int64_t> dims) {
    Shape s;
    for (auto d : dims) s.dims_[static_cast<std::size_t>(s.rank_++)] = d;
    return s;
  }

  int rank() const noexcept { return rank_; }
  std::int64_t operator[](int i) const noexcept { return dims_[static_cast<std::size_t>(i)]; }
  std::int64_t back() const noexcept { return rank_ == 0 ? 1 : dims_[static_cast<std::size_t>(rank_ - 1)]; }
  std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<std::size_t>(i)];
    return n;
  }
  // Product of every dimension but the last (the rows of a [..., C] activation).
  std::int64_t rows() const noexcept { return rank_ == 0 ? 1 : numel() / back(); }
  std::span<const std::int64_t> dims() const noexcept { return {dims_.data(), static_cast<std::size_t>(rank_)}; }
  // The same shape with the last dimension replaced.
  Shape with_back(std::int64_t last) const {
    Shape s = *this;
    if (s.rank_ == 0) s.rank_ = 1;
    s.dims_[static_cast<std::size_t>(s.rank_ - 1)] = last;
    return s;
  }
  std::string to_string() const;

  friend bool operator==(const Shape& a, const Shape& b) noexcept {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[static_cast<std::size_t>(i)] != b.dims_[static_cast<std::size_t>(i)]) return false;
    return true;
  }

 private:
  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  // A non-owning view.
  Tensor(void* data, Shape shape, DataType dtype, async::Device device)
      : data_(data), shape_(shape), dtype_(dtype), device_(device) {}
  // A view that keeps `owner` alive.
  Tensor(std::shared_ptr<void> owner, void* data, Shape shape, DataType dtype, async::Device device)
      : owner_(std::move(owner)), data_(data), shape_(shape), dtype_(dtype), device_(device) {}

  void* data() const noexcept { return data_; }
  template <class T>
  T* data_as() const noexcept {
    return static_cast<T*>(data_);
  }
  const Shape& shape() const noexcept { return shape_; }
  DataType dtype() const noexcept { return dtype_; }
  async::Device device() const noexcept { return device_; }
  std::int64_t numel() const noexcept { return shape_.numel(); }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(numel()) * size_of(dtype_); }
  bool defined() const noexcept { return data_ != nullptr || (shape_.rank() > 0 && numel() == 0); }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  // Host-visible elements (CPU tensors only; the caller orders access with the stream).
  template <class T>
  std::span<T> span() const noexcept {
    return {static_cast<T*>(data_), static_cast<std::size_t>(numel())};
  }
  // The same memory under another shape with the same element count.
  Tensor view(Shape shape) const {
    Tensor t = *this;
    t.shape_ = shape;
    return t;
  }
  // Elements [offset, offset + shape.numel()) of this tensor's memory, viewed as `shape`.
  Tensor slice(std::int64_t offset, Shape shape) const {
    Tensor t = *this;
    t.data_ = static_cast<std::byte*>(data_) + offset * static_cast<std::int64_t>(size_of(dtype_));
    t.shape_ = shape;
    return t;
  }
  const std::shared_ptr<void>& owner() const noexcept { return owner_; }
  std::string describe() const;  // "f32[4, 64] on cpu"

 private:
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  Shape shape_;
  DataType dtype_ = DataType::f32;
  async::Device device_;
};

// Host conversions between doubles and the bytes of a dtype (f32, f64, bf16, f16, i32).
std::vector<std::byte> encode_values(std::span<const double> values, DataType dtype);
std::vector<double> decode_values(std::span<const std::byte> bytes, DataType dtype);

}  // namespace coshard::modules
