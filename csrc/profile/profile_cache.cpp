#include "profile/profile_cache.h"

#include <fstream>

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
  }
  return ir::frame("profiles", kProfileFormatVersion, w.bytes());
}

void ProfileCache::merge(const std::string& bytes, const std::string& origin) {
  const std::string payload = ir::unframe(bytes, "profiles", kProfileFormatVersion, origin);
  ir::BinaryReader r(payload);
  const uint64_t n = r.u64();
  std::unordered_map<ProfileKey, ProfileRecord, ProfileKeyHash> read;
  for (uint64_t i = 0; i < n; ++i) {
    ProfileKey k;
    k.content_hash = r.u64();
    k.rows = r.i64();
    k.dtype = r.str();
    k.device = r.str();
    k.recompute = r.u8() != 0;
    ProfileRecord rec;
    rec.forward_time = r.f64();
    rec.backward_time = r.f64();
    rec.activation_bytes = r.i64();
    rec.peak_bytes = r.i64();
    rec.out_of_memory = r.u8() != 0;
    read[k] = rec;
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
