#include "comm/world.h"

#include <algorithm>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "common/log.h"

namespace rannc::comm {
namespace {

constexpr int kFailureTag = 7001;

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw CommError(std::string(what) + " failed: " + std::string(msg, len));
  }
}

}  // namespace

// [Note: processes a rank starts] A DataLoader worker made with the spawn or forkserver
// context, a worker_init_fn reading the rank, or an evaluation script a rank runs with
// subprocess inherits the rank's launcher variables (OMPI_*, PMIX_*): a rannc call there
// started MPI as that rank a second time, and Open MPI ended it ("orte_init failed",
// "DataLoader worker exited unexpectedly"). So a rank leaves its identity in the
// environment (RANNC_RANK_PID, RANNC_RANK_JOB: the launcher's job and rank), and a process
// that inherited both under the same launcher variables, with another pid, is a rank's
// child: it reads the rank, the world size and the local rank from them (what a worker's
// seed wants) and never starts MPI; what needs the world there is an error saying why. A
// process mpirun starts from a process that is itself a rank (or a singleton) has new
// launcher variables and is a rank like any other.
namespace {

std::string launchIdentity() {
  const char* job = std::getenv("PMIX_NAMESPACE");
  const char* rank = std::getenv("PMIX_RANK");
  if (job == nullptr || rank == nullptr) {
    job = std::getenv("OMPI_MCA_ess_base_jobid");
    rank = std::getenv("OMPI_COMM_WORLD_RANK");
  }
  if (job == nullptr || rank == nullptr) return "";
  return std::string(job) + ":" + rank;
}

int envInt(const char* name, int otherwise) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : otherwise;
}

}  // namespace

std::optional<ParentRank> World::parent() {
  const char* pid = std::getenv("RANNC_RANK_PID");
  const char* job = std::getenv("RANNC_RANK_JOB");
  if (pid == nullptr || job == nullptr || std::atol(pid) == static_cast<long>(getpid())) {
    return std::nullopt;
  }
  const std::string here = launchIdentity();
  if (here.empty() || here != job) return std::nullopt;
  ParentRank p;
  p.pid = std::atol(pid);
  p.rank = envInt("RANNC_RANK", 0);
  p.size = envInt("RANNC_WORLD_SIZE", 1);
  p.local_rank = envInt("RANNC_LOCAL_RANK", 0);
  p.local_size = envInt("RANNC_LOCAL_SIZE", 1);
  return p;
}

World& World::get() {
  if (auto p = parent()) {  // before the static: a child must not start MPI
    throw CommError("this process (pid " + std::to_string(getpid()) + ") was started by rank " +
                    std::to_string(p->rank) + " (pid " + std::to_string(p->pid) +
                    ") as a DataLoader worker or a subprocess, not by mpirun: it cannot join the "
                    "MPI world. rannc.get_rank() and get_world_size() tell the rank there; run "
                    "what needs the world (a RaNNCModule, its collectives) in the ranks, or start "
                    "the subprocess with mpirun, or without the OMPI_*/PMIX_* variables to run "
                    "it as a world of its own ([Note: processes a rank starts] in world.cpp)");
  }
  static World world;
  return world;
}

World::World() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    owns_mpi_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  thread_multiple_ = provided == MPI_THREAD_MULTIPLE;
  // Errors come back as codes (and become exceptions) instead of aborting the job.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  check(MPI_Comm_dup(MPI_COMM_WORLD, &data_comm_), "MPI_Comm_dup");
  check(MPI_Comm_dup(MPI_COMM_WORLD, &control_comm_), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(data_comm_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(control_comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);

  char name[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  MPI_Get_processor_name(name, &len);
  hostname_.assign(name, len);

  // Hosts by name: gather every rank's hostname, number hosts by their first rank.
  std::vector<char> all(static_cast<size_t>(size_) * MPI_MAX_PROCESSOR_NAME, 0);
  std::vector<char> mine(MPI_MAX_PROCESSOR_NAME, 0);
  std::copy(hostname_.begin(), hostname_.end(), mine.begin());
  check(MPI_Allgather(mine.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(),
                      MPI_MAX_PROCESSOR_NAME, MPI_CHAR, control_comm_),
        "MPI_Allgather(hostnames)");
  std::map<std::string, int> node_ids;
  node_of_rank_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    std::string h(&all[static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
    auto it = node_ids.emplace(h, static_cast<int>(node_ids.size())).first;
    node_of_rank_[r] = it->second;
  }
  num_nodes_ = static_cast<int>(node_ids.size());
  node_ = node_of_rank_[rank_];
  local_rank_ = 0;
  local_size_ = 0;
  for (int r = 0; r < size_; ++r) {
    if (node_of_rank_[r] != node_) continue;
    if (r < rank_) ++local_rank_;
    ++local_size_;
  }
  // [Note: processes a rank starts]
  const std::string identity = launchIdentity();
  if (!identity.empty()) {
    setenv("RANNC_RANK_PID", std::to_string(getpid()).c_str(), 1);
    setenv("RANNC_RANK_JOB", identity.c_str(), 1);
    setenv("RANNC_RANK", std::to_string(rank_).c_str(), 1);
    setenv("RANNC_WORLD_SIZE", std::to_string(size_).c_str(), 1);
    setenv("RANNC_LOCAL_RANK", std::to_string(local_rank_).c_str(), 1);
    setenv("RANNC_LOCAL_SIZE", std::to_string(local_size_).c_str(), 1);
  }
  // The thread polls. Where no core is spare it takes the compute's: every 20 us made 2
  // ranks on 2 cores 30% slower, every 1 ms 2-4% faster than no thread (over copy in/out).
  const char* progress = std::getenv("RANNC_MPI_PROGRESS");
  const bool spare_core = std::thread::hardware_concurrency() > static_cast<unsigned>(local_size_);
  const bool want = progress == nullptr || std::string(progress) != "0";
  if (!spare_core) progress_interval_ = std::chrono::microseconds(1000);
  if (const char* us = std::getenv("RANNC_MPI_PROGRESS_INTERVAL_US")) {
    progress_interval_ = std::chrono::microseconds(std::max(1, std::atoi(us)));
  }
  if (provided == MPI_THREAD_MULTIPLE && want) {
    check(MPI_Comm_dup(MPI_COMM_WORLD, &progress_comm_), "MPI_Comm_dup");
    progress_ = std::thread([this] { progressLoop(); });
  } else if (size_ > 1) {
    logDebug("MPI transfers progress only inside waits (no MPI_THREAD_MULTIPLE, or "
             "RANNC_MPI_PROGRESS=0)");
  }
  if (const char* t = std::getenv("RANNC_COMM_TIMEOUT")) {
    timeout_ = std::chrono::milliseconds(static_cast<int64_t>(std::atof(t) * 1000));
  }
  setLogContext(rank_, -1);
  logDebug("MPI world: rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           " on " + hostname_ + " (local rank " + std::to_string(local_rank_) + ")");
}

World::~World() {
  stopProgress();
  // Finalize only what we started; a peer that failed may leave messages unmatched.
  if (owns_mpi_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      if (failed_reported_) {
        MPI_Abort(MPI_COMM_WORLD, 1);  // at exit only: peers may be gone mid-collective
      }
      MPI_Finalize();
    }
  }
}

void World::beginOperation() {
  if (!progress_.joinable()) return;
  std::lock_guard<std::mutex> lock(progress_mutex_);
  if (in_flight_++ == 0) progress_cv_.notify_one();
}

void World::endOperation() {
  if (!progress_.joinable()) return;
  std::lock_guard<std::mutex> lock(progress_mutex_);
  --in_flight_;
}

void World::progressLoop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(progress_mutex_);
      progress_cv_.wait(lock, [this] { return stop_progress_ || in_flight_ > 0; });
      if (stop_progress_) return;
    }
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, progress_comm_, &flag, MPI_STATUS_IGNORE);
    std::this_thread::sleep_for(progress_interval_);
  }
}

void World::stopProgress() {
  if (!progress_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    stop_progress_ = true;
  }
  progress_cv_.notify_one();
  progress_.join();
}

// [Note: failures stay] Once a rank failed (its own error, or a peer's notice), the ranks
// are at different points of the step: a script that catches the error and calls again
// would pair one rank's collective with another's (MPI_ERR_TRUNCATE, a transfer into the
// wrong buffer, a full timeout per call). Every later wait fails at once with the first
// failure instead; the script should end (a rank's error that every rank raises alike is
// agreed instead, and sends no notice: failure.agreed in failure.py).
void World::reportFailure(const std::string& message) {
  // Alone there is nobody to tell, and an error the user catches must not abort the exit.
  if (failed_reported_ || size_ <= 1) return;
  failed_reported_ = true;
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (failure_.empty()) failure_ = message;
  }
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request req;
    // The request is freed at once: small messages go eagerly and we must not block here.
    if (MPI_Isend(message.data(), static_cast<int>(message.size()), MPI_CHAR, r, kFailureTag,
                  control_comm_, &req) == MPI_SUCCESS) {
      MPI_Request_free(&req);
    }
  }
}

// [Note: a timeout is a failure] A wait that timed out leaves its request in flight and
// this rank at another point of the step than its peers, as a failure does: a script that
// caught the CommTimeoutError and called again paired its next collective with a peer's
// late one (an internal error, "micro-batch 0 is already stashed"), and the peers waited
// out their own timeouts. So a timeout is reported as a failure: the peers stop at once,
// naming it, and every later wait here fails at once ([Note: failures stay]).
void World::checkPeers() {
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (!failure_.empty()) {
      throw CommError("rank " + std::to_string(rank_) + " cannot communicate: the job failed "
                      "before (" + failure_ + "); end the script");
    }
  }
  int flag = 0;
  MPI_Status status;
  MPI_Iprobe(MPI_ANY_SOURCE, kFailureTag, control_comm_, &flag, &status);
  if (!flag) return;
  int count = 0;
  MPI_Get_count(&status, MPI_CHAR, &count);
  std::string msg(static_cast<size_t>(count), '\0');
  MPI_Recv(msg.data(), count, MPI_CHAR, status.MPI_SOURCE, kFailureTag, control_comm_,
           MPI_STATUS_IGNORE);
  failed_reported_ = true;  // do not finalize cleanly: the job is failing
  const std::string notice = "rank " + std::to_string(status.MPI_SOURCE) + " failed: " + msg;
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (failure_.empty()) failure_ = notice;
  }
  throw CommError("rank " + std::to_string(rank_) + " stops because " + notice);
}

// [Note: signals while waiting] A signal that reaches a rank waiting for a peer (SIGTERM
// to a preemption handler that calls sys.exit, a KeyboardInterrupt) ran its Python handler
// only when the wait ended: with a slow or stuck peer, at comm_timeout. The wait lets the
// Python binding check for signals every 50 ms on the thread that installed the check (the
// interpreter's main thread, where Python runs handlers); an exception from it is reported
// to the peers as a failure ([Note: failures stay]) and leaves the wait.
namespace {
std::function<void()>& interruptCheck() {
  static std::function<void()> check;
  return check;
}
std::thread::id interrupt_thread;
}  // namespace

void World::setInterruptCheck(std::function<void()> check) {
  interruptCheck() = std::move(check);
  interrupt_thread = std::this_thread::get_id();
}

void World::wait(MPI_Request& request, const std::string& what, std::chrono::milliseconds timeout,
                 MPI_Status* status) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int spins = 0;
  checkPeers();  // [Note: failures stay]: not even one test of a request after a failure
  const std::function<void()>& interrupt_check = interruptCheck();
  const bool interruptible = interrupt_check && std::this_thread::get_id() == interrupt_thread;
  auto next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
  while (true) {
    int done = 0;
    check(MPI_Test(&request, &done, status), what.c_str());
    if (done) return;
    checkPeers();
    if (interruptible && std::chrono::steady_clock::now() > next_check) {
      next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
      try {
        interrupt_check();
      } catch (const std::exception& e) {  // the handler's exception, "SystemExit: ..."
        reportFailure("rank " + std::to_string(rank_) + " stopped by a signal in " + what + ": " +
                      e.what());
        throw;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::ostringstream os;
      os << "rank " << rank_ << ": " << what << " did not complete within "
         << timeout.count() / 1000.0 << " s (a peer is stuck or gone; RANNC_COMM_TIMEOUT sets the limit)";
      reportFailure(os.str());  // [Note: a timeout is a failure]
      throw TimeoutError(os.str());
    }
    // Spin briefly for latency, then yield the core (ranks may outnumber cores).
    if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void World::barrier(std::chrono::milliseconds timeout) {
  MPI_Request req;
  check(MPI_Ibarrier(data_comm_, &req), "MPI_Ibarrier");
  wait(req, "barrier", timeout);
}

}  // namespace rannc::comm
