// N processes rendezvous through the TCP store on loopback; one killed, the others fail in time.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

// A port nobody listens on right now (bind to 0, read it, release it).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Peer {
  pid_t pid = -1;
  std::string log;
};

Peer spawn_peer(int rank, int world, int port, int timeout_ms, int hang_rank) {
  Peer p;
  p.log = ::testing::TempDir() + "peer_" + std::to_string(port) + "_" + std::to_string(rank) + ".log";
  std::vector<std::string> env = {"RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world),
                                  "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                                  "COSHARD_STORE_TIMEOUT_MS=" + std::to_string(timeout_ms),
                                  "COSHARD_TEST_HANG_RANK=" + std::to_string(hang_rank)};
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string path = COSHARD_RENDEZVOUS_PEER;
  char* argv[] = {path.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, p.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  EXPECT_EQ(posix_spawn(&p.pid, path.c_str(), &actions, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  return p;
}

int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Rendezvous, ProcessesOnLoopbackExchangeBlobsThroughTheStore) {
  constexpr int kWorld = 4;
  const int port = free_port();
  std::vector<Peer> peers;
  for (int r = 0; r < kWorld; ++r) peers.push_back(spawn_peer(r, kWorld, port, 30000, -1));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(wait_exit(peers[static_cast<std::size_t>(r)].pid), 0) << slurp(peers[static_cast<std::size_t>(r)].log);
  }
}

TEST(Rendezvous, WhenOneProcessIsKilledTheOthersFailWithinTheTimeout) {
  constexpr int kWorld = 3;
  constexpr int kTimeoutMs = 1500;
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Peer> peers;
  for (int r = 0; r < kWorld; ++r) peers.push_back(spawn_peer(r, kWorld, port, kTimeoutMs, /*hang_rank=*/1));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(peers[1].pid, SIGKILL);
  EXPECT_EQ(wait_exit(peers[1].pid), 128 + SIGKILL);
  for (int r : {0, 2}) {
    const auto& p = peers[static_cast<std::size_t>(r)];
    EXPECT_EQ(wait_exit(p.pid), 3) << slurp(p.log);
    const std::string log = slurp(p.log);
    EXPECT_NE(log.find("'blob/1'"), std::string::npos) << "rank " << r << " should name the missing key: " << log;
  }
  const double elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(elapsed_ms, kTimeoutMs * 3.0) << "the survivors took too long to give up";
}

}  // namespace
