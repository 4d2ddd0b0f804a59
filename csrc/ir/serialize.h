#pragma once
// Versioned binary files for the IR (and, through the framing helpers, for profiles and
// deployments). A file is: magic "RANNC\0", kind tag, format version, payload length,
// payload, FNV-1a checksum of the payload. Reading a file of another kind, another
// version, a truncated or a corrupt file throws SerializationError saying which.
#include <cstdint>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace rannc::ir {

inline constexpr uint32_t kGraphFormatVersion = 1;

// Little-endian primitive encoding of a payload.
class BinaryWriter {
 public:
  void u8(uint8_t v);
  void u32(uint32_t v);
  void i32(int32_t v) { u32(static_cast<uint32_t>(v)); }
  void u64(uint64_t v);
  void i64(int64_t v) { u64(static_cast<uint64_t>(v)); }
  void f64(double v);
  void str(const std::string& s);
  void i64s(const std::vector<int64_t>& v);
  void i32s(const std::vector<int32_t>& v);
  const std::string& bytes() const { return buf_; }

 private:
  std::string buf_;
};

// Reads what BinaryWriter wrote. Every read names its `field` ("stages[2].tasks"), so a
// bad file is refused with "<field>: <what is wrong>"; throws SerializationError on
// running past the end, and on a count that the bytes left cannot hold (checked before
// allocating, so a corrupt count never asks for terabytes).
class BinaryReader {
 public:
  explicit BinaryReader(const std::string& bytes) : buf_(bytes) {}
  uint8_t u8(const std::string& field = "a byte");
  uint32_t u32(const std::string& field = "a 32-bit integer");
  int32_t i32(const std::string& field = "a 32-bit integer") { return static_cast<int32_t>(u32(field)); }
  uint64_t u64(const std::string& field = "a 64-bit integer");
  int64_t i64(const std::string& field = "a 64-bit integer") { return static_cast<int64_t>(u64(field)); }
  double f64(const std::string& field = "a float");
  std::string str(const std::string& field = "a string");
  std::vector<int64_t> i64s(const std::string& field = "a list");
  std::vector<int32_t> i32s(const std::string& field = "a list");
  // A count of elements of at least `min_element_bytes` each that follow; refused when the
  // bytes left cannot hold that many.
  uint64_t count(const std::string& field, size_t min_element_bytes);
  size_t remaining() const { return buf_.size() - pos_; }
  bool atEnd() const { return pos_ == buf_.size(); }

 private:
  void need(size_t n, const std::string& field);
  const std::string& buf_;
  size_t pos_ = 0;
};

// Wraps a payload in the framed file format.
std::string frame(const std::string& kind, uint32_t version, const std::string& payload);
// Checks magic, kind, version and checksum and returns the payload.
std::string unframe(const std::string& bytes, const std::string& kind, uint32_t version,
                    const std::string& origin);

std::string serializeGraph(const Graph& graph);
Graph deserializeGraph(const std::string& bytes, const std::string& origin = "<memory>");

void saveGraph(const Graph& graph, const std::string& path);
Graph loadGraph(const std::string& path);

// Whole-file helpers shared by every kind of saved file.
void writeFile(const std::string& path, const std::string& bytes);
std::string readFile(const std::string& path);

}  // namespace rannc::ir
