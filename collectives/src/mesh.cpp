#include "coshard/collectives/mesh.hpp"

#include <sstream>

namespace coshard::collectives {

Result<void> validate(const MeshShape& shape, int world) {
  if (world < 1) return fail(ErrorCode::invalid_argument, "mesh: a world of ", world, " ranks (expected at least 1)");
  if (shape.tensor < 1 || world % shape.tensor != 0)
    return fail(ErrorCode::invalid_argument, "mesh: tensor-parallel size ", shape.tensor,
                " does not divide the world of ", world, " ranks (expected a divisor of ", world, ")");
  const int data = world / shape.tensor;
  if (shape.shard < 0 || (shape.shard > 0 && data % shape.shard != 0))
    return fail(ErrorCode::invalid_argument, "mesh: shard group size ", shape.shard, " does not divide the ", data,
                " data-parallel ranks (world ", world, " / tensor ", shape.tensor, "; expected 0 or a divisor of ", data,
                ")");
  if (shape.expert < 1 || data % shape.expert != 0)
    return fail(ErrorCode::invalid_argument, "mesh: expert-parallel size ", shape.expert, " does not divide the ", data,
                " data-parallel ranks (world ", world, " / tensor ", shape.tensor, "; expected a divisor of ", data, ")");
  return {};
}

Result<Mesh> Mesh::create(Communicator& world, MeshShape shape) {
  COSHARD_TRY(validate(shape, world.size()));
  Mesh mesh;
  mesh.world_ = &world;
  mesh.shape_ = shape;
  if (mesh.shape_.shard == 0) mesh.shape_.shard = world.size() / shape.tensor;
  const int tensor_index = world.rank() % shape.tensor;
  const int data_index = world.rank() / shape.tensor;
  // Both splits on every rank, in the same order (split is collective over the world).
  if (shape.tensor == 1) {
    mesh.data_ = &world;
  } else {
    COSHARD_TRY_ASSIGN(mesh.owned_data_, world.split(tensor_index, data_index));
    mesh.data_ = mesh.owned_data_.get();
  }
  COSHARD_TRY_ASSIGN(mesh.owned_tensor_, world.split(data_index, tensor_index));
  mesh.tensor_ = mesh.owned_tensor_.get();
  if (shape.expert == 1) {
    COSHARD_TRY_ASSIGN(mesh.owned_expert_, world.split(world.rank(), 0));  // (a group of one; split on every rank alike)
  } else {
    // Within this rank's data group: data ranks d with the same d % run, ranked by d.
    const int run = mesh.data_size() / shape.expert;
    COSHARD_TRY_ASSIGN(mesh.owned_expert_, world.split(tensor_index * run + data_index % run, data_index));
  }
  mesh.expert_ = mesh.owned_expert_.get();
  if (!mesh.data_ || !mesh.tensor_ || !mesh.expert_)
    return fail(ErrorCode::internal, "mesh: a split gave no communicator (rank ", world.rank(), ")");
  // Named apart in the flight recorder: the data group of tensor index t, the tensor group of
  // data index d (their ranks' dumps would otherwise share the world's file names).
  if (mesh.owned_data_) COSHARD_TRY(label_split(world, *mesh.owned_data_, "data" + std::to_string(tensor_index)));
  COSHARD_TRY(label_split(world, *mesh.owned_tensor_, "tensor" + std::to_string(data_index)));
  if (shape.expert > 1) {
    const int run = mesh.data_size() / shape.expert;
    COSHARD_TRY(label_split(world, *mesh.owned_expert_, "expert" + std::to_string(tensor_index * run + data_index % run)));
  }
  return mesh;
}

std::string Mesh::describe() const {
  std::ostringstream s;
  s << "data " << data_size() << " x tensor " << tensor_size();
  if (shard_group_size() > 0 && shape_.expert > 1)
    s << " (shards over " << shard_group_size() << " data ranks; experts over " << shape_.expert << ")";
  else if (shard_group_size() > 0)
    s << " (shards over " << shard_group_size() << " data ranks)";
  else if (shape_.expert > 1)
    s << " (experts over " << shape_.expert << " data ranks)";
  return s.str();
}

}  // namespace coshard::collectives
