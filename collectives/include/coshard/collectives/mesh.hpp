// A mesh of ranks: data x tensor, made once from the world's communicator.
//
// Rank r sits at data index r / tensor and tensor index r % tensor: a tensor-parallel group is
// `tensor` consecutive ranks (on one node, where launchers number a node's ranks together), a
// data-parallel group is the ranks of one tensor index. Each dimension's communicator is split
// from the world once, here. Hybrid sharding lives in the same description: `shard` data ranks
// (consecutive within the data group) share a unit's shards and the data group holds
// data / shard copies (the engine's shard_group_size).
//
// Expert parallelism splits each data group once more: `expert` data ranks at a stride of
// data / expert form an expert group (SparseMoe's all-to-all), so that the data / expert
// consecutive data ranks holding the same experts (a node's) shard them, and only the routed
// rows cross between those runs.
//
//   world 8, tensor 2, shard 2:   tensor groups {0,1} {2,3} {4,5} {6,7}
//                                 data groups   {0,2,4,6} {1,3,5,7}, each sharded over pairs
//   world 4, expert 2:            expert groups {0,2} {1,3}; ranks {0,1} hold experts 0..E/2-1
#pragma once

#include <memory>
#include <string>

#include "coshard/async/result.hpp"
#include "coshard/collectives/communicator.hpp"

namespace coshard::collectives {

struct MeshShape {
  int tensor = 1;  // tensor-parallel ranks (consecutive); must divide the world
  int shard = 0;   // data ranks a unit is sharded over (hybrid sharding); 0: the whole data group
  int expert = 1;  // expert-parallel ranks (at a stride within the data group); must divide it
};

class Mesh {
 public:
  // Collective over `world` (every rank calls it from its own thread, as split): refused by name
  // when tensor does not divide the world or shard the data size. `world` must outlive the mesh.
  static Result<Mesh> create(Communicator& world, MeshShape shape);

  Mesh(Mesh&&) noexcept = default;
  Mesh& operator=(Mesh&&) noexcept = default;
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  Communicator& world() const noexcept { return *world_; }
  // This rank's data-parallel group (the world itself when tensor is 1).
  Communicator& data() const noexcept { return *data_; }
  // This rank's tensor-parallel group (one rank when tensor is 1).
  Communicator& tensor() const noexcept { return *tensor_; }
  // This rank's expert-parallel group (one rank when expert is 1): data ranks d with the same
  // d % (data / expert), ranked by d.
  Communicator& expert() const noexcept { return *expert_; }
  int expert_size() const noexcept { return shape_.expert; }

  int tensor_size() const noexcept { return shape_.tensor; }
  int data_size() const noexcept { return world_->size() / shape_.tensor; }
  int tensor_rank() const noexcept { return world_->rank() % shape_.tensor; }
  int data_rank() const noexcept { return world_->rank() / shape_.tensor; }
  // The engine's shard_group_size over data(): 0 when units shard over the whole data group.
  int shard_group_size() const noexcept { return shape_.shard == data_size() ? 0 : shape_.shard; }
  const MeshShape& shape() const noexcept { return shape_; }  // (shard resolved: 0 became the data size)
  std::string describe() const;  // "data 4 x tensor 2 (shards over 2 data ranks; experts over 2)"

 private:
  Mesh() = default;
  Communicator* world_ = nullptr;
  Communicator* data_ = nullptr;
  Communicator* tensor_ = nullptr;
  Communicator* expert_ = nullptr;
  std::unique_ptr<Communicator> owned_data_, owned_tensor_, owned_expert_;
  MeshShape shape_;
};

// The checks of Mesh::create without a communicator: what a world of `world` ranks can take.
Result<void> validate(const MeshShape& shape, int world);

}  // namespace coshard::collectives
