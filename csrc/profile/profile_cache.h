#pragma once
// Profiles already measured, keyed by what makes a measurement reusable: the piece's
// content (ir::contentHash: identical layers share one entry, across models too), the
// micro-batch rows, the dtype, the device kind and whether the backward recomputes.
// In memory, and saved to / loaded from a versioned file (ir/serialize.h framing,
// kind "profiles"). Thread-safe.
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "profile/profiler.h"

namespace rannc::profile {

// 2: backward timed adding into existing parameter gradients ([Note: accumulating backward]).
// 3: the weight part of a split backward ([Note: weight part measured] in profiler.cpp).
inline constexpr uint32_t kProfileFormatVersion = 3;

struct ProfileKey {
  uint64_t content_hash = 0;
  int64_t rows = 0;
  std::string dtype;   // "Float32", ... (ir::dtypeName of the model's floating tensors)
  std::string device;  // "cpu"
  bool recompute = false;

  bool operator==(const ProfileKey& o) const {
    return content_hash == o.content_hash && rows == o.rows && dtype == o.dtype &&
           device == o.device && recompute == o.recompute;
  }
};

struct ProfileKeyHash {
  size_t operator()(const ProfileKey& k) const;
};

// What is wrong with an entry as "<field>: <why>" (rows below 1, a NaN or negative time,
// an infinite one without out_of_memory, negative bytes), or "" when nothing is.
std::string profileEntryProblem(const ProfileKey& key, const ProfileRecord& record);

class ProfileCache {
 public:
  std::optional<ProfileRecord> find(const ProfileKey& key) const;
  void insert(const ProfileKey& key, const ProfileRecord& record);
  // Every entry, ordered by key (content hash, rows, dtype, device, recompute), so the
  // order does not depend on the hash table.
  std::vector<std::pair<ProfileKey, ProfileRecord>> entries() const;
  size_t size() const;
  void clear();

  // Lookups that found / did not find an entry since construction.
  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }

  std::string serialize() const;
  // Adds the entries of a serialized cache (existing keys are overwritten). Throws
  // SerializationError on a corrupt or foreign file.
  void merge(const std::string& bytes, const std::string& origin);
  void save(const std::string& path) const;
  // Merges the file's entries; a missing file is not an error (returns false).
  bool load(const std::string& path);

 private:
  mutable std::mutex mutex_;
  std::unordered_map<ProfileKey, ProfileRecord, ProfileKeyHash> entries_;
  mutable int64_t hits_ = 0;
  mutable int64_t misses_ = 0;
};

}  // namespace rannc::profile
