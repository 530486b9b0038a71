#include "kernels/cuda/cudnn/graph.hpp"

namespace coshard::modules::detail::cudnn {

ChosenPlan GraphBuilder::plan(const PlanTarget& target) {
  ChosenPlan chosen;
  std::string tried;
  auto graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<std::int64_t>(ops_.size()),
      ops_.data(), "operation graph ops");
  if (target.handle) set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &target.handle, "graph handle");
  finalize(graph, "operation graph");
  auto heuristics = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
  set_desc(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics graph");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  set(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  if (target.device_properties)
    set_desc(heuristics, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, target.device_properties, "heuristics device");
  finalize(heuristics, "heuristics");
  if (error_) return chosen;

  std::int64_t count = 0;
  if (const cudnnStatus_t st =
          lib_.get_attribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
      st != CUDNN_STATUS_SUCCESS) {
    fail_with("heuristics results: " + lib_.describe(st));
    return chosen;
  }
  std::vector<cudnnBackendDescriptor_t> configs;
  for (std::int64_t i = 0; i < count; ++i) configs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
  if (error_) return chosen;
  if (const cudnnStatus_t st = lib_.get_attribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, configs.data());
      st != CUDNN_STATUS_SUCCESS) {
    fail_with("heuristics results: " + lib_.describe(st));
    return chosen;
  }
  for (std::int64_t i = 0; i < count; ++i) {
    auto candidate = Descriptor::make(lib_, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    if (!candidate) {
      fail_with(candidate.error().message());
      return chosen;
    }
    cudnnBackendDescriptor_t config = configs[static_cast<std::size_t>(i)];
    cudnnStatus_t st = lib_.set_attribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config);
    if (st == CUDNN_STATUS_SUCCESS && target.handle)
      st = lib_.set_attribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &target.handle);
    if (st == CUDNN_STATUS_SUCCESS && target.device_properties)
      st = lib_.set_attribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                             &target.device_properties);
    if (st == CUDNN_STATUS_SUCCESS) st = lib_.finalize(candidate->get());
    if (st != CUDNN_STATUS_SUCCESS) {
      tried += "\n  configuration " + std::to_string(i) + ": " + lib_.describe(st);
      continue;
    }
    std::int64_t n = 0;
    lib_.get_attribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &chosen.workspace_bytes);
    cudnnBackendDescriptor_t engine_desc = nullptr;
    if (lib_.create_descriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine_desc) == CUDNN_STATUS_SUCCESS) {
      if (lib_.get_attribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                            &engine_desc) == CUDNN_STATUS_SUCCESS)
        lib_.get_attribute(engine_desc, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &chosen.engine);
      lib_.destroy_descriptor(engine_desc);
    }
    chosen.plan = std::move(*candidate);
    return chosen;
  }
  fail_with("cuDNN's heuristics offered " + std::to_string(count) + " engine configurations and none took the graph" +
              tried);
  return chosen;
}

}  // namespace coshard::modules::detail::cudnn
