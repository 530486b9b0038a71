// Runs the coshard-train binary as a user does, for the binary tests: a scratch folder per test,
// the child's output captured, its exit code.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace coshard::testing {

namespace fs = std::filesystem;

inline const std::vector<std::string> kTiny = {"--layers", "1", "--dim", "16", "--heads", "2", "--seq", "8",
                                        "--batch", "12", "--vocab", "32", "--lr", "0.01"};

inline fs::path scratch(const std::string& name) {
  const fs::path p = fs::current_path() / "binary_test_scratch" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

inline pid_t start(std::vector<std::string> args, const fs::path& output) {
  args.insert(args.begin(), COSHARD_TRAIN_BIN);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

struct Exit {
  int code = -1;
  std::string output;
};

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline Exit run(std::vector<std::string> args, const fs::path& dir) {
  const fs::path out = dir / "output.txt";
  const pid_t pid = start(std::move(args), out);
  if (pid < 0) return {};
  int status = 0;
  waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out)};
}

inline std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// `a` without the option `name` and its value (text data takes no --vocab: bytes are 256).
inline std::vector<std::string> without(std::vector<std::string> a, const std::string& name) {
  for (auto it = a.begin(); it != a.end(); ++it)
    if (*it == name) {
      a.erase(it, it + 2 <= a.end() ? it + 2 : a.end());
      break;
    }
  return a;
}

// The "loss" of every line of a metrics file.
inline std::vector<double> losses_in(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string line;
  std::vector<double> losses;
  while (std::getline(in, line)) losses.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return losses;
}

// Forks coshard-train with `args`, its output into `out`; in the child, `before_exec` runs just
// before the exec (a limit, ptrace). OpenBLAS starts a thread per core as it loads, before main;
// under an address-space limit on a machine of many cores their buffers alone fail it (seen on 16
// cores at 2 GiB), which is not what these tests are about: 2 threads.
template <class BeforeExec>
pid_t fork_train(std::vector<std::string> args, const fs::path& out, BeforeExec before_exec) {
  args.insert(args.begin(), COSHARD_TRAIN_BIN);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::setenv("OPENBLAS_NUM_THREADS", "2", 1);
    before_exec();
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// A forked run's exit and output. Bounded: a run that hangs is killed after 10 minutes and
// reported as exit -2.
inline Exit wait_for_train(pid_t pid, const fs::path& out) {
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return {-2, "(hung: killed after 10 minutes)\n" + slurp(out)};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : (WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1), slurp(out)};
}

// Like run(), with a resource limit set in the child: RLIMIT_FSIZE (a full disk, as the process
// sees it: writes past it fail with EFBIG) or RLIMIT_AS (too little memory).
inline Exit run_with_limit(std::vector<std::string> args, const fs::path& dir, int resource, rlim_t value) {
  const fs::path out = dir / "output.txt";
  const pid_t pid = fork_train(std::move(args), out, [&] {
    ::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead of killing
    rlimit limit{value, value};
    ::setrlimit(resource, &limit);
  });
  return wait_for_train(pid, out);
}

// Like run(), with the environment variable `name` set to `value` in the child.
inline Exit run_with_env(std::vector<std::string> args, const fs::path& dir, const char* name, const char* value) {
  const fs::path out = dir / "output.txt";
  return wait_for_train(fork_train(std::move(args), out, [&] { ::setenv(name, value, 1); }), out);
}

// The peak address space (VmPeak, bytes) of coshard-train run with `args`, as run_with_limit
// runs it but without a limit: read at its exit through ptrace's exit stop, where its memory is
// still mapped. 0 where the system refuses ptrace. Limits relative to it test the same thing on
// any machine, whatever its libraries map (a CUDA build maps ~700 MiB of cuBLAS and NCCL).
inline std::uint64_t peak_address_space(std::vector<std::string> args, const fs::path& dir) {
  const pid_t pid = fork_train(std::move(args), dir / "peak_output.txt", [] {
    if (::ptrace(PTRACE_TRACEME, 0, nullptr, nullptr) != 0) ::_exit(126);
  });
  std::uint64_t peak = 0;
  bool options_set = false;
  int status = 0;
  while (::waitpid(pid, &status, 0) == pid && WIFSTOPPED(status)) {
    int deliver = WSTOPSIG(status);
    if (deliver == SIGTRAP) {  // an exec (the first, or the BLAS kernels' restart) or the exit stop
      deliver = 0;
      if (!options_set) options_set = ::ptrace(PTRACE_SETOPTIONS, pid, nullptr, PTRACE_O_TRACEEXIT | PTRACE_O_EXITKILL) == 0;
      if ((status >> 16) == PTRACE_EVENT_EXIT) {
        std::ifstream in("/proc/" + std::to_string(pid) + "/status");
        std::string key;
        std::uint64_t kb = 0;
        while (in >> key)
          if (key == "VmPeak:" && in >> kb) peak = kb * 1024;
      }
    }
    ::ptrace(PTRACE_CONT, pid, nullptr, deliver);
  }
  return peak;
}

// Whether a run under an address-space limit ended before coshard's code ran: the loader could not
// map a library (127), or a library's constructor failed on the limit (OpenBLAS's names its thread;
// in a CUDA build cuBLAS's and cuBLASLt's die of SIGSEGV with nothing said).
inline bool ended_before_main(const Exit& r) {
  return (r.code == 127 && r.output.find("error while loading shared libraries") != std::string::npos) ||
         (r.code >= 128 && r.output.empty()) || r.output.rfind("OpenBLAS blas_thread_init", 0) == 0;
}

inline Exit run_with_file_limit(std::vector<std::string> args, const fs::path& dir, rlim_t max_file_bytes) {
  return run_with_limit(std::move(args), dir, RLIMIT_FSIZE, max_file_bytes);
}

// Waits (up to two minutes) until `path` holds `text`, or anything when `text` is empty (a run
// under way once a step is in its metrics); whether it does.
inline bool wait_for_text(const fs::path& path, const std::string& text = {}) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  auto there = [&] {
    const std::string now = slurp(path);
    return text.empty() ? !now.empty() : now.find(text) != std::string::npos;
  };
  while (!there() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return there();
}

// llm.c's .bin (version 1, uint16 ids).
inline void write_llmc(const fs::path& path, const std::vector<std::uint16_t>& ids) {
  std::vector<std::int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<std::int32_t>(ids.size());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
  out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 2));
}

inline std::int64_t latest_step(const fs::path& ck) {
  std::ifstream in(ck / "latest");
  std::string name;
  in >> name;
  return name.size() > 5 ? std::stoll(name.substr(5)) : -1;
}

}  // namespace coshard::testing
