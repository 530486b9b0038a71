#!/usr/bin/env bash
# A simulated cluster on this one machine: K "nodes" as Linux network namespaces, each with one
# veth link to a bridge in a namespace of its own (the "switch"), the inter-node links shaped with
# tc's token bucket (tbf: bandwidth; this kernel has no netem, so no added latency), and mpirun
# across them: Open MPI's rsh agent is a wrapper around `ip netns exec`, so each node's ranks start
# in its namespace, and a host name of its own (a UTS namespace: Open MPI names its shared-memory
# files by host, and two nodes of one name overwrote each other's); TCP between nodes, shared
# memory within one. Every namespace, link and file it
# makes is removed when it ends, however it ends. Addresses (10.213.0.0/24) exist only inside
# those namespaces: nothing leaves the machine. Needs root (CAP_NET_ADMIN) and iproute2.
#
#   scripts/netns_cluster.sh [--nodes K] [--ranks-per-node R] [--rate RATE] [--bytes FILE] -- COMMAND [ARGS...]
#
#   --nodes K            nodes (default 2)
#   --ranks-per-node R   ranks on each node (default 2): mpirun -np K*R, ranks numbered node by node
#   --rate RATE          each node's outbound link, as tc writes rates (1gbit, 10gbit, 500mbit);
#                        default: unshaped
#   --bytes FILE         writes {"nodes": K, "sent_bytes": [node 0's, ...]}: the bytes each node sent
#                        over its link while COMMAND ran (what crossed between nodes)
#
# COMMAND runs as each rank (mpirun's program and arguments). The exit status is mpirun's.
# Example: scripts/netns_cluster.sh --rate 1gbit -- build/release/trainer/coshard-train --zero-stage 3
set -euo pipefail

nodes=2
per_node=2
rate=""
bytes_file=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --ranks-per-node) per_node="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --bytes) bytes_file="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "netns_cluster.sh: unknown option '$1' (expected --nodes, --ranks-per-node, --rate, --bytes, then -- COMMAND)" >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "netns_cluster.sh: no command (expected -- COMMAND [ARGS...])" >&2
  exit 2
fi
if ! [[ "$nodes" =~ ^[0-9]+$ ]] || (( nodes < 1 || nodes > 200 )); then
  echo "netns_cluster.sh: --nodes $nodes: expected 1 to 200" >&2; exit 2
fi
if ! [[ "$per_node" =~ ^[0-9]+$ ]] || (( per_node < 1 || per_node > 64 )); then
  echo "netns_cluster.sh: --ranks-per-node $per_node: expected 1 to 64" >&2; exit 2
fi
if [[ -n "$rate" ]] && ! [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]]; then
  echo "netns_cluster.sh: --rate $rate: expected a rate such as 500mbit, 1gbit or 10gbit" >&2; exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "netns_cluster.sh: needs root (network namespaces, veth links, tc)" >&2; exit 2
fi
command -v ip >/dev/null && command -v tc >/dev/null || { echo "netns_cluster.sh: needs iproute2 (ip, tc)" >&2; exit 2; }
mpirun_bin="${MPIRUN:-$(command -v mpirun || true)}"
[[ -n "$mpirun_bin" ]] || { echo "netns_cluster.sh: needs Open MPI's mpirun (scripts/install-deps.sh installs it)" >&2; exit 2; }

# Names unique to this run (interface names: 15 characters at most).
id="cs$$"
switch="${id}sw"
work="$(mktemp -d "${TMPDIR:-/tmp}/netns_cluster.XXXXXX")"
made=()
cleanup() {
  local status=$?
  for ns in "${made[@]}"; do ip netns del "$ns" 2>/dev/null || true; done  # (its links go with it)
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

address() { echo "10.213.0.$(( $1 + 1 ))"; }

ip netns add "$switch"; made+=("$switch")
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
for (( i = 0; i < nodes; i++ )); do
  ns="${id}n$i"
  ip netns add "$ns"; made+=("$ns")
  ip link add "${id}a$i" netns "$ns" type veth peer name "${id}b$i" netns "$switch"
  ip -n "$ns" link set "${id}a$i" name eth0
  ip -n "$ns" addr add "$(address "$i")/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$switch" link set "${id}b$i" master br0
  ip -n "$switch" link set "${id}b$i" up
  if [[ -n "$rate" ]]; then
    # A bucket of 10 ms at the rate (at least 64 KiB), queueing bounded at 100 ms.
    bits=$(echo "$rate" | awk '{ v = $0 + 0; u = $0; sub(/^[0-9.]+/, "", u);
      m = (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1; printf "%.0f", v * m }')
    burst=$(( bits / 8 / 100 )); (( burst < 65536 )) && burst=65536
    tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms
  fi
done

# Open MPI's agent: `agent HOST COMMAND...` runs COMMAND in the namespace of the node at HOST.
cat >"$work/agent" <<EOF
#!/bin/sh
host="\$1"; shift
case "\$host" in
$(for (( i = 0; i < nodes; i++ )); do echo "  $(address "$i")) exec ip netns exec ${id}n$i unshare --uts /bin/sh -c \"hostname ${id}-node$i && \$*\" ;;"; done)
esac
echo "netns_cluster agent: unknown host \$host" >&2
exit 1
EOF
chmod +x "$work/agent"
for (( i = 0; i < nodes; i++ )); do echo "$(address "$i") slots=$per_node"; done >"$work/hosts"

sent() {  # bytes each node has sent over its link so far
  for (( i = 0; i < nodes; i++ )); do ip netns exec "${id}n$i" cat /sys/class/net/eth0/statistics/tx_bytes; done
}
exports=()  # the environment each rank needs, where set here
for v in PATH LD_LIBRARY_PATH OPENBLAS_NUM_THREADS COSHARD_LOG; do [[ -n "${!v:-}" ]] && exports+=(-x "$v"); done
before=($(sent))
status=0
# mpirun runs in node 0's namespace (node 0's ranks start beside it, the others through the agent).
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  ip netns exec "${id}n0" unshare --uts -- /bin/bash -c 'hostname "$0" && exec "$@"' "${id}-node0" \
    "$mpirun_bin" --oversubscribe --bind-to none --map-by "ppr:$per_node:node" \
    -np $(( nodes * per_node )) --hostfile "$work/hosts" \
    --mca plm_rsh_agent "$work/agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl self,vader,tcp --mca btl_tcp_if_include 10.213.0.0/24 --mca oob_tcp_if_include 10.213.0.0/24 \
    "${exports[@]}" "$@" || status=$?
after=($(sent))
if [[ -n "$bytes_file" ]]; then
  {
    printf '{"nodes": %d, "ranks_per_node": %d, "rate": "%s", "sent_bytes": [' "$nodes" "$per_node" "${rate:-unshaped}"
    for (( i = 0; i < nodes; i++ )); do
      (( i > 0 )) && printf ', '
      printf '%d' $(( after[i] - before[i] ))
    done
    printf ']}\n'
  } >"$bytes_file"
fi
exit "$status"
