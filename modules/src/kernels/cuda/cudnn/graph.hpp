// A builder of cuDNN backend graphs and their plans (cuDNN's graph API, through library.hpp):
// tensors, pointwise, reduction, matmul and reshape operations, then the heuristics' first engine
// configuration whose plan finalizes, for a device or for a device described by its properties.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cudnn/library.hpp"

namespace coshard::modules::detail::cudnn {

using Dims = std::array<std::int64_t, 4>;

// Whom plans are built for: a device (through a handle), or a device described by its
// properties (cuDNN 9.8's deviceless build: a plan compiled on a machine without the card).
struct PlanTarget {
  cudnnHandle_t handle = nullptr;
  cudnnBackendDescriptor_t device_properties = nullptr;
};

struct ChosenPlan {
  Descriptor plan;
  std::int64_t engine = -1;          // cuDNN's global engine index
  std::int64_t workspace_bytes = 0;  // the plan's own workspace
};

// Builds descriptors, keeping the first failure with what was being built; every call after a
// failure does nothing, so a graph reads as the list of its operations.
class GraphBuilder {
 public:
  // Virtual tensors are numbered from `first_virtual_uid` (above every real tensor's uid).
  GraphBuilder(const Library& lib, std::int64_t first_virtual_uid) : lib_(lib), next_virtual_(first_virtual_uid) {}

  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t type, const char* what) {
    if (error_) return nullptr;
    auto d = Descriptor::make(lib_, type);
    if (!d) {
      error_ = std::string(what) + ": " + d.error().message();
      return nullptr;
    }
    keep_.push_back(std::move(*d));
    return keep_.back().get();
  }
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           std::int64_t count, const void* value, const char* what) {
    if (error_) return;
    if (const cudnnStatus_t st = lib_.set_attribute(d, name, type, count, value); st != CUDNN_STATUS_SUCCESS)
      error_ = std::string(what) + ": attribute " + std::to_string(name) + ": " + lib_.describe(st);
  }
  void set_desc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t v,
                const char* what) {
    set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, what);
  }
  void finalize(cudnnBackendDescriptor_t d, const char* what) {
    if (error_) return;
    if (const cudnnStatus_t st = lib_.finalize(d); st != CUDNN_STATUS_SUCCESS)
      error_ = std::string(what) + ": " + lib_.describe(st);
  }

  // A tensor: real (uid given, 16-byte aligned), virtual, or a host scalar passed by value.
  cudnnBackendDescriptor_t tensor(cudnnDataType_t type, Dims dims, Dims strides, std::int64_t uid, bool is_virtual,
                                  bool by_value = false) {
    auto t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    const std::int64_t alignment = 16;
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor dtype");
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dims");
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor virtual");
    if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by value");
    finalize(t, "tensor");
    return t;
  }
  cudnnBackendDescriptor_t virtual_tensor(cudnnDataType_t type, Dims dims, Dims strides) {
    return tensor(type, dims, strides, next_virtual_++, true);
  }
  cudnnBackendDescriptor_t scalar(std::int64_t uid) {
    return tensor(CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, uid, false, true);
  }

  // y = mode(x[, b][, t]); GEN_INDEX takes the axis.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 cudnnDataType_t compute = CUDNN_DATA_FLOAT, std::optional<std::int64_t> axis = {}) {
    auto pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, "pointwise precision");
    if (axis) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &*axis, "pointwise axis");
    finalize(pw, "pointwise");
    operation(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation",
              {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw},
               {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x},
               {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b},
               {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t},
               {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y}});
  }
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto r = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction mode");
    set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &kFloat, "reduction precision");
    finalize(r, "reduction");
    operation(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation",
              {{CUDNN_ATTR_OPERATION_REDUCTION_DESC, r},
               {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x},
               {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y}});
  }
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    auto m = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &kFloat, "matmul precision");
    finalize(m, "matmul");
    operation(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation",
              {{CUDNN_ATTR_OPERATION_MATMUL_DESC, m},
               {CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
               {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
               {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c}});
  }
  // y: x's elements under another layout (a transpose through strides).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    operation(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation",
              {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x}, {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y}});
  }

  const std::optional<std::string>& error() const { return error_; }
  void fail_with(std::string why) {
    if (!error_) error_ = std::move(why);
  }
  std::vector<Descriptor> take() { return std::move(keep_); }

  // The graph of the operations built so far, made into a plan for `target`: the first engine
  // configuration cuDNN's heuristics (mode A) offer whose plan finalizes. On failure error() says
  // why, with each configuration's refusal.
  ChosenPlan plan(const PlanTarget& target);

 private:
  static constexpr cudnnDataType_t kFloat = CUDNN_DATA_FLOAT;

  // An operation of the graph: its descriptors linked (null ones left out), finalized, kept.
  void operation(cudnnBackendDescriptorType_t type, const char* what,
                 std::initializer_list<std::pair<cudnnBackendAttributeName_t, cudnnBackendDescriptor_t>> links) {
    auto op = make(type, what);
    for (const auto& [name, d] : links)
      if (d) set_desc(op, name, d, what);
    finalize(op, what);
    ops_.push_back(op);
  }

  const Library& lib_;
  std::vector<Descriptor> keep_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  std::optional<std::string> error_;
  std::int64_t next_virtual_;
};

}  // namespace coshard::modules::detail::cudnn
