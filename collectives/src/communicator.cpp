#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/flight_recorder.hpp"

#include <limits>

namespace coshard::collectives {

std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "unknown-op";
}

std::string_view to_string(CollectiveKind kind) noexcept {
  switch (kind) {
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::barrier: return "barrier";
    case CollectiveKind::all_to_all: return "all_to_all";
    case CollectiveKind::all_to_allv: return "all_to_allv";
  }
  return "unknown-collective";
}

std::string CollectiveOp::signature() const {
  std::string s(to_string(kind));
  if (kind == CollectiveKind::barrier) return s + "()";
  if (kind == CollectiveKind::all_to_allv)
    return s + "(send=" + std::to_string(sent_elements()) + ", recv=" + std::to_string(received_elements()) + ", " +
           std::string(to_string(dtype)) + ")";
  s += "(count=" + std::to_string(count) + ", " + std::string(to_string(dtype));
  if (kind == CollectiveKind::reduce_scatter || kind == CollectiveKind::all_reduce) s += ", " + std::string(to_string(op));
  if (kind == CollectiveKind::broadcast) s += ", root=" + std::to_string(root);
  return s + ")";
}

std::string describe(std::span<const CollectiveOp> ops) {
  std::string s = "[";
  for (std::size_t i = 0; i < ops.size(); ++i) {
    s += (i ? ", " : "") + ops[i].signature();
    if (!ops[i].purpose_text().empty()) s += " for " + std::string(ops[i].purpose_text());
  }
  return s + "]";
}

Coalesced& Coalesced::all_gather(const void* send, void* recv, std::size_t count, DataType dtype) {
  ops_.push_back({CollectiveKind::all_gather, send, recv, count, dtype, ReduceOp::sum, 0});
  return *this;
}
Coalesced& Coalesced::reduce_scatter(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op) {
  ops_.push_back({CollectiveKind::reduce_scatter, send, recv, count, dtype, op, 0});
  return *this;
}
Coalesced& Coalesced::all_reduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op) {
  ops_.push_back({CollectiveKind::all_reduce, send, recv, count, dtype, op, 0});
  return *this;
}
Coalesced& Coalesced::broadcast(const void* send, void* recv, std::size_t count, DataType dtype, int root) {
  ops_.push_back({CollectiveKind::broadcast, send, recv, count, dtype, ReduceOp::sum, root});
  return *this;
}
Coalesced& Coalesced::all_to_all(const void* send, void* recv, std::size_t count, DataType dtype) {
  ops_.push_back({CollectiveKind::all_to_all, send, recv, count, dtype, ReduceOp::sum, 0});
  return *this;
}

Coalesced& Coalesced::all_to_allv(const void* send, std::span<const std::size_t> send_counts, void* recv,
                                  std::span<const std::size_t> recv_counts, DataType dtype) {
  ops_.push_back({CollectiveKind::all_to_allv, send, recv, 0, dtype, ReduceOp::sum, 0});
  auto& counts = ops_.back().counts;
  counts.assign(send_counts.begin(), send_counts.end());
  counts.insert(counts.end(), recv_counts.begin(), recv_counts.end());
  // (a size that is not twice the communicator's is refused by validate, naming both)
  ops_.back().count = send_counts.size() == recv_counts.size() ? 0 : 1;
  return *this;
}

std::size_t CollectiveOp::send_offset(std::size_t to) const noexcept {
  std::size_t n = 0;
  for (std::size_t q = 0; q < to && q < counts.size() / 2; ++q) n += counts[q];
  return n;
}
std::size_t CollectiveOp::sent_elements() const noexcept { return send_offset(counts.size() / 2); }
std::size_t CollectiveOp::received_elements() const noexcept {
  std::size_t n = 0;
  for (std::size_t q = counts.size() / 2; q < counts.size(); ++q) n += counts[q];
  return n;
}

Coalesced& Coalesced::barrier() {
  ops_.push_back({CollectiveKind::barrier, nullptr, nullptr, 0, DataType::u8, ReduceOp::sum, 0});
  return *this;
}

Result<void> Communicator::set_flight_label(std::string_view label) { return FlightRecorder::check_label(label); }

std::string Communicator::flight_label() const {
  const FlightRecorder* recorder = flight_recorder();
  return recorder ? recorder->label() : std::string();
}

Result<void> label_split(const Communicator& parent, Communicator& child, std::string_view name) {
  const std::string above = parent.flight_label();
  return child.set_flight_label(above.empty() ? std::string(name) : above + "-" + std::string(name));
}

namespace {

Result<void> validate_all_to_allv(const CollectiveOp& op, int rank, int size) {
  const auto n = static_cast<std::size_t>(size);
  if (op.count != 0 || op.counts.size() != 2 * n)
    return fail(ErrorCode::invalid_argument, "all_to_allv on rank ", rank, ": ",
                op.count != 0 ? "send_counts and recv_counts differ in length" : "counts for ", op.counts.size() / 2,
                " ranks on a communicator of ", size, " (expected one send and one receive count per rank)");
  const std::size_t limit = std::numeric_limits<std::size_t>::max() / size_of(op.dtype) / 2;
  std::size_t sent = 0, received = 0;
  for (std::size_t q = 0; q < n; ++q) {
    if (op.counts[q] > limit - sent || op.counts[n + q] > limit - received)
      return fail(ErrorCode::invalid_argument, op.signature(), " on rank ", rank, ": counts overflow the address space");
    sent += op.counts[q];
    received += op.counts[n + q];
  }
  if ((sent > 0 && op.send == nullptr) || (received > 0 && op.recv == nullptr))
    return fail(ErrorCode::invalid_argument, op.signature(), " on rank ", rank, ": send and recv must not be null");
  const auto es = size_of(op.dtype);
  const auto send = reinterpret_cast<std::uintptr_t>(op.send), recv = reinterpret_cast<std::uintptr_t>(op.recv);
  if (sent > 0 && received > 0 && send < recv + received * es && recv < send + sent * es)
    return fail(ErrorCode::invalid_argument, op.signature(), " on rank ", rank,
                ": send and recv overlap (all_to_allv is never in place)");
  return {};
}

}  // namespace

Result<void> validate(const CollectiveOp& op, int rank, int size) {
  if (size_of(op.dtype) == 0) {
    return fail(ErrorCode::invalid_argument, op.signature(), ": unknown data type ", static_cast<int>(op.dtype));
  }
  if (static_cast<int>(op.op) > static_cast<int>(ReduceOp::min)) {
    return fail(ErrorCode::invalid_argument, op.signature(), ": unknown reduce op ", static_cast<int>(op.op));
  }
  if (op.kind == CollectiveKind::all_to_allv) return validate_all_to_allv(op, rank, size);
  if (op.kind == CollectiveKind::barrier || op.count == 0) return {};
  const std::size_t limit = std::numeric_limits<std::size_t>::max() / size_of(op.dtype) / static_cast<std::size_t>(size);
  if (op.count > limit) {
    return fail(ErrorCode::invalid_argument, op.signature(), ": count overflows the address space at world size ", size);
  }
  if (op.kind == CollectiveKind::broadcast) {
    if (op.root < 0 || op.root >= size) {
      return fail(ErrorCode::invalid_argument, op.signature(), ": root=", op.root, " is not a rank in [0, ", size, ")");
    }
    if (op.recv == nullptr || (rank == op.root && op.send == nullptr)) {
      return fail(ErrorCode::invalid_argument, op.signature(), " on rank ", rank,
                  ": recv (and send on the root) must not be null");
    }
    return {};
  }
  if (op.send == nullptr || op.recv == nullptr) {
    return fail(ErrorCode::invalid_argument, op.signature(), " on rank ", rank, ": send and recv must not be null");
  }
  if (op.kind == CollectiveKind::all_to_all) {  // (each rank reads its peers' send while they write their recv)
    const auto bytes = static_cast<std::uintptr_t>(op.count * size_of(op.dtype) * static_cast<std::size_t>(size));
    const auto send = reinterpret_cast<std::uintptr_t>(op.send), recv = reinterpret_cast<std::uintptr_t>(op.recv);
    if (send < recv + bytes && recv < send + bytes)
      return fail(ErrorCode::invalid_argument, op.signature(), " on rank ", rank,
                  ": send and recv overlap (all_to_all is never in place)");
  }
  return {};
}

}  // namespace coshard::collectives
