// A Llama layer's MLP: dense (gate_up, swiglu, down) or a SparseMoe block, as the config says
// for that layer (private to the model builders).
#pragma once

#include <cstdint>
#include <memory>

#include "coshard/modules/llama.hpp"
#include "coshard/modules/moe.hpp"

namespace coshard::modules::detail {

// Residual(norm, then the dense MLP or the layer's SparseMoe sharing `balance`).
Result<std::unique_ptr<Module>> make_llama_mlp(const LlamaConfig& c, std::int64_t layer,
                                               const std::shared_ptr<RouterBalance>& balance,
                                               collectives::Communicator* expert_group = nullptr);
// make_llama, its experts over `expert_group` when given (make_llama_expert_parallel).
Result<std::unique_ptr<Sequential>> build_llama(const LlamaConfig& c, collectives::Communicator* expert_group);
// The balance a MoE config's layers share (null without experts).
std::shared_ptr<RouterBalance> make_router_balance(const LlamaConfig& c);

}  // namespace coshard::modules::detail
