#pragma once
// The MPI world: start-up, ranks, hosts, and the control channel through which a failing
// rank tells the others, so that no rank waits forever on a peer that has failed.
//
// MPI starts lazily on first use (MPI_Init_thread asking for MPI_THREAD_MULTIPLE) and
// works without mpirun (a singleton world of one rank).
//
// [Note: progress thread] MPI moves a large message (rendezvous protocol) only while both
// ends are inside MPI calls. A stage that posts a send and then computes for a while would
// hold back its peer, which waits for the data: the pipeline serialises. So while any
// non-blocking operation is in flight, a thread of the world pokes the MPI progress engine
// (MPI_Iprobe on a communicator nobody sends on) and transfers run alongside compute. It
// needs MPI_THREAD_MULTIPLE. It polls every 20 us where the host has more cores than local
// ranks, else every 1 ms, since each poke then takes a compute thread's core
// (RANNC_MPI_PROGRESS_INTERVAL_US sets it; RANNC_MPI_PROGRESS=0 turns the thread off, and
// transfers then progress only inside waits). Where Open MPI's single-copy shared memory
// (CMA) works, the receiver copies straight from the sender and this matters less.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <functional>
#include <optional>

#include <mpi.h>

namespace rannc::comm {

// The rank whose process started this one ([Note: processes a rank starts] in world.cpp).
struct ParentRank {
  long pid = 0;
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
};

class World {
 public:
  // The process-wide world; starts MPI on first call. Throws CommError if MPI fails to start,
  // or in a process that a rank started (it cannot join the world).
  static World& get();

  // The rank that started this process (a DataLoader worker, a subprocess), which inherited
  // its launcher's variables; nullopt in a rank itself or outside mpirun.
  static std::optional<ParentRank> parent();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int localRank() const { return local_rank_; }  // rank among the ranks of this host
  int localSize() const { return local_size_; }
  int node() const { return node_; }  // index of this host among the hosts, by first rank
  int numNodes() const { return num_nodes_; }
  const std::string& hostname() const { return hostname_; }
  const std::vector<int>& nodeOfRank() const { return node_of_rank_; }
  MPI_Comm dataComm() const { return data_comm_; }
  // Whether MPI may be called from several threads at once (autograd's device threads run
  // gradient hooks on CUDA).
  bool threadMultiple() const { return thread_multiple_; }
  // Whether this rank or a peer has failed: the job is ending, and NCCL communicators are
  // aborted rather than destroyed (destroying waits for kernels that never complete).
  bool failing() const { return failed_reported_; }

  // Tells every other rank that this rank failed (non-blocking, never throws); their
  // waits then raise CommError carrying `message`.
  void reportFailure(const std::string& message);

  // Throws CommError if a peer reported a failure, or if this rank or a peer failed
  // before ([Note: failures stay]). Cheap: one MPI_Iprobe.
  void checkPeers();

  // Waits for `request` while watching for peer failures; throws TimeoutError after
  // `timeout` naming `what`. Blocks the calling thread.
  void wait(MPI_Request& request, const std::string& what, std::chrono::milliseconds timeout,
            MPI_Status* status = MPI_STATUS_IGNORE);

  // Non-blocking operations in flight, counted for the progress thread ([Note: progress
  // thread]): begin when one is posted, end when it completes.
  void beginOperation();
  void endOperation();
  bool progressThreadRunning() const { return progress_.joinable(); }

  // A barrier over all ranks that fails instead of hanging (see wait).
  void barrier(std::chrono::milliseconds timeout);

  // [Note: signals while waiting] A check that the thread which set it calls every 50 ms
  // of a wait: it throws where a signal's handler raised (the Python binding's). The wait
  // reports the failure to the peers first.
  static void setInterruptCheck(std::function<void()> check);

  // Default timeout of blocking waits: RANNC_COMM_TIMEOUT seconds (default 600).
  std::chrono::milliseconds defaultTimeout() const { return timeout_; }
  void setDefaultTimeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

  World(const World&) = delete;
  World& operator=(const World&) = delete;

 private:
  World();
  ~World();
  void progressLoop();
  void stopProgress();

  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, node_ = 0, num_nodes_ = 1;
  std::string hostname_;

  std::vector<int> node_of_rank_;
  MPI_Comm data_comm_ = MPI_COMM_NULL;     // data plane (point-to-point, collectives)
  MPI_Comm control_comm_ = MPI_COMM_NULL;  // failure notices only
  MPI_Comm progress_comm_ = MPI_COMM_NULL; // never used for messages: only to make progress
  std::thread progress_;
  std::chrono::microseconds progress_interval_{20};  // between pokes ([Note: progress thread])
  std::mutex progress_mutex_;
  std::condition_variable progress_cv_;
  int in_flight_ = 0;
  bool stop_progress_ = false;
  bool owns_mpi_ = false;
  bool failed_reported_ = false;
  // [Note: failures stay] what ended the job's collectives (this rank's failure or a
  // peer's notice), once known; guarded by failure_mutex_
  std::string failure_;
  std::mutex failure_mutex_;
  bool thread_multiple_ = false;
  std::chrono::milliseconds timeout_{600000};
};

}  // namespace rannc::comm
