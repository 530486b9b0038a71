// Every tensor of a safetensors file (f32), by name, as the trainer tests compare exports.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "coshard/modules/safetensors.hpp"

namespace coshard::testing {

inline std::map<std::string, std::vector<float>> tensors_in(const std::filesystem::path& path) {
  std::map<std::string, std::vector<float>> out;
  auto file = modules::SafetensorsFile::load(path);
  EXPECT_TRUE(file) << path << ": " << file.error().message();
  if (!file) return out;
  for (const auto& t : file->tensors()) {
    const auto bytes = file->data(t);
    std::vector<float> v(bytes.size() / sizeof(float));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
    out[t.name] = std::move(v);
  }
  return out;
}

}  // namespace coshard::testing
