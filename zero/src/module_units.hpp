// Which fetch unit holds each module's parameters, where each module of a coalesced unit sits in
// it (FetchUnit::module_runs), and which other units a module declared it reads
// (Module::use_parameters_of: fetched, and their gradient taken and reduced, around it as if their
// owner ran): what the hooks look up as each module runs. Filled once in Engine::create.
// Private: not installed.
#pragma once

#include <cstddef>
#include <unordered_map>
#include <vector>

#include "coshard/modules/module.hpp"

namespace coshard::zero::detail {

struct ModuleUnits {
  std::unordered_map<const modules::Module*, std::size_t> unit_of, position_in_unit;
  std::unordered_map<const modules::Module*, std::vector<std::size_t>> borrowed;

  // m's unit's index, or null when m has no parameters of its own.
  const std::size_t* unit_index(const modules::Module& m) const {
    auto it = unit_of.find(&m);
    return it == unit_of.end() ? nullptr : &it->second;
  }
  const std::vector<std::size_t>* borrowed_of(const modules::Module& m) const {
    auto it = borrowed.find(&m);
    return it == borrowed.end() ? nullptr : &it->second;
  }
  bool any_coalesced() const noexcept { return !position_in_unit.empty(); }
};

}  // namespace coshard::zero::detail
