#pragma once
// FNV-1a, 64 bit: stable across processes and platforms (std::hash is not).
#include <cstdint>
#include <string_view>

namespace rannc {

class Fnv1a {
 public:
  Fnv1a& bytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ULL;
    }
    return *this;
  }
  Fnv1a& str(std::string_view s) {
    u64(s.size());
    return bytes(s.data(), s.size());
  }
  Fnv1a& u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      unsigned char b = static_cast<unsigned char>(v >> (8 * i));
      bytes(&b, 1);
    }
    return *this;
  }
  Fnv1a& i64(int64_t v) { return u64(static_cast<uint64_t>(v)); }
  uint64_t digest() const { return h_; }

 private:
  uint64_t h_ = 14695981039346656037ULL;
};

}  // namespace rannc
