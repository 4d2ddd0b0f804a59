#include "profile/profile_cache.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <tuple>

#include "common/error.h"
#include "ir/serialize.h"

namespace rannc::profile {

size_t ProfileKeyHash::operator()(const ProfileKey& k) const {
  size_t h = std::hash<uint64_t>()(k.content_hash);
  h ^= std::hash<int64_t>()(k.rows) * 1000003u;
  h ^= std::hash<std::string>()(k.dtype) * 31u;
  h ^= std::hash<std::string>()(k.device) * 131u;
  return h ^ (k.recompute ? 0x9e3779b97f4a7c15ULL : 0);
}

std::optional<ProfileRecord> ProfileCache::find(const ProfileKey& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    ++misses_;
    return std::nullopt;
  }
  ++hits_;
  return it->second;
}

void ProfileCache::insert(const ProfileKey& key, const ProfileRecord& record) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_[key] = record;
}

std::vector<std::pair<ProfileKey, ProfileRecord>> ProfileCache::entries() const {
  std::vector<std::pair<ProfileKey, ProfileRecord>> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    out.assign(entries_.begin(), entries_.end());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    const ProfileKey &x = a.first, &y = b.first;
    return std::tie(x.content_hash, x.rows, x.dtype, x.device, x.recompute) <
           std::tie(y.content_hash, y.rows, y.dtype, y.device, y.recompute);
  });
  return out;
}

std::string profileEntryProblem(const ProfileKey& key, const ProfileRecord& rec) {
  if (key.rows < 1) return "rows: " + std::to_string(key.rows) + " is not a number of rows (>= 1)";
  for (auto [name, t] : {std::pair{"forward_time", rec.forward_time}, {"backward_time", rec.backward_time}}) {
    // A piece that ran out of memory is stored with infinite times; nothing else is.
    if (t >= 0.0 && (std::isfinite(t) || (rec.out_of_memory && std::isinf(t)))) continue;
    std::ostringstream os;
    os << name << ": " << t << " seconds is not a measured time (finite, >= 0"
       << (rec.out_of_memory ? ", or infinite when out of memory)" : ")");
    return os.str();
  }
  for (auto [name, b] : {std::pair{"activation_bytes", rec.activation_bytes}, {"peak_bytes", rec.peak_bytes}}) {
    if (b < 0) return std::string(name) + ": " + std::to_string(b) + " bytes is negative";
  }
  // -1 where the weight part was not measured; else at most the backward it is part of.
  const double w = rec.weight_time;
  if (!(w == -1.0 || (w >= 0.0 && (w <= rec.backward_time * (1.0 + 1e-9) || std::isinf(rec.backward_time))))) {
    std::ostringstream os;
    os << "weight_time: " << w << " seconds is neither -1 (not measured) nor a part of backward_time ("
       << rec.backward_time << ")";
    return os.str();
  }
  return "";
}

size_t ProfileCache::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

void ProfileCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.clear();
}

std::string ProfileCache::serialize() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ir::BinaryWriter w;
  w.u64(entries_.size());
  for (const auto& [k, r] : entries_) {
    w.u64(k.content_hash);
    w.i64(k.rows);
    w.str(k.dtype);
    w.str(k.device);
    w.u8(k.recompute ? 1 : 0);
    w.f64(r.forward_time);
    w.f64(r.backward_time);
    w.i64(r.activation_bytes);
    w.i64(r.peak_bytes);
    w.u8(r.out_of_memory ? 1 : 0);
    w.f64(r.weight_time);
  }
  return ir::frame("profiles", kProfileFormatVersion, w.bytes());
}

void ProfileCache::merge(const std::string& bytes, const std::string& origin) {
  const std::string payload = ir::unframe(bytes, "profiles", kProfileFormatVersion, origin);
  ir::BinaryReader r(payload);
  std::unordered_map<ProfileKey, ProfileRecord, ProfileKeyHash> read;
  // Every value is checked before the cache takes any: a measurement the planner would
  // believe (a NaN or negative time, negative bytes) is refused naming the entry's field.
  try {
    // An entry is at least 74 bytes (empty dtype and device names).
    const uint64_t n = r.count("entries", 74);
    for (uint64_t i = 0; i < n; ++i) {
      const std::string f = "entries[" + std::to_string(i) + "].";
      ProfileKey k;
      k.content_hash = r.u64(f + "content_hash");
      k.rows = r.i64(f + "rows");
      k.dtype = r.str(f + "dtype");
      k.device = r.str(f + "device");
      k.recompute = r.u8(f + "recompute") != 0;
      ProfileRecord rec;
      rec.forward_time = r.f64(f + "forward_time");
      rec.backward_time = r.f64(f + "backward_time");
      rec.activation_bytes = r.i64(f + "activation_bytes");
      rec.peak_bytes = r.i64(f + "peak_bytes");
      rec.out_of_memory = r.u8(f + "out_of_memory") != 0;
      rec.weight_time = r.f64(f + "weight_time");
      const std::string problem = profileEntryProblem(k, rec);
      if (!problem.empty()) throw SerializationError(f + problem);
      read[k] = rec;
    }
    if (!r.atEnd()) throw SerializationError("trailing bytes after the last entry");
  } catch (const SerializationError& e) {
    const std::string msg = e.what();
    if (msg.rfind(origin, 0) == 0) throw;
    throw SerializationError(origin + ": corrupt profile cache: " + msg);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [k, rec] : read) entries_[k] = rec;
}

void ProfileCache::save(const std::string& path) const { ir::writeFile(path, serialize()); }

bool ProfileCache::load(const std::string& path) {
  if (!std::ifstream(path).good()) return false;
  merge(ir::readFile(path), path);
  return true;
}

}  // namespace rannc::profile
