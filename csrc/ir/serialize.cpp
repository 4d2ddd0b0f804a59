#include "ir/serialize.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/hash.h"

namespace rannc::ir {
namespace {

constexpr char kMagic[6] = {'R', 'A', 'N', 'N', 'C', '\0'};
constexpr const char* kGraphKind = "graph";

uint64_t checksum(const std::string& payload) {
  return Fnv1a().bytes(payload.data(), payload.size()).digest();
}

}  // namespace

void BinaryWriter::u8(uint8_t v) { buf_.push_back(static_cast<char>(v)); }

void BinaryWriter::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
}

void BinaryWriter::u64(uint64_t v) {
  for (int i = 0; i < 8; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
}

void BinaryWriter::f64(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  u64(bits);
}

void BinaryWriter::str(const std::string& s) {
  u64(s.size());
  buf_.append(s);
}

void BinaryWriter::i64s(const std::vector<int64_t>& v) {
  u64(v.size());
  for (int64_t x : v) i64(x);
}

void BinaryWriter::i32s(const std::vector<int32_t>& v) {
  u64(v.size());
  for (int32_t x : v) i32(x);
}

void BinaryReader::need(size_t n, const std::string& field) {
  if (n > buf_.size() - pos_) {
    throw SerializationError(field + ": truncated data, needed " + std::to_string(n) +
                             " more bytes at offset " + std::to_string(pos_) + " of " +
                             std::to_string(buf_.size()));
  }
}

uint8_t BinaryReader::u8(const std::string& field) {
  need(1, field);
  return static_cast<uint8_t>(buf_[pos_++]);
}

uint32_t BinaryReader::u32(const std::string& field) {
  need(4, field);
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(buf_[pos_++])) << (8 * i);
  return v;
}

uint64_t BinaryReader::u64(const std::string& field) {
  need(8, field);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(buf_[pos_++])) << (8 * i);
  return v;
}

double BinaryReader::f64(const std::string& field) {
  uint64_t bits = u64(field);
  double v;
  std::memcpy(&v, &bits, sizeof bits);
  return v;
}

uint64_t BinaryReader::count(const std::string& field, size_t min_element_bytes) {
  const uint64_t n = u64(field + " count");
  // Divide rather than multiply: n * size can wrap around to a small number.
  if (min_element_bytes > 0 && n > remaining() / min_element_bytes) {
    throw SerializationError(field + ": count " + std::to_string(n) + " needs at least " +
                             std::to_string(min_element_bytes) + " bytes each, but only " +
                             std::to_string(remaining()) + " bytes are left");
  }
  return n;
}

std::string BinaryReader::str(const std::string& field) {
  const uint64_t n = count(field, 1);
  std::string s = buf_.substr(pos_, n);
  pos_ += n;
  return s;
}

std::vector<int64_t> BinaryReader::i64s(const std::string& field) {
  std::vector<int64_t> v(count(field, 8));
  for (auto& x : v) x = i64(field);
  return v;
}

std::vector<int32_t> BinaryReader::i32s(const std::string& field) {
  std::vector<int32_t> v(count(field, 4));
  for (auto& x : v) x = i32(field);
  return v;
}

std::string frame(const std::string& kind, uint32_t version, const std::string& payload) {
  BinaryWriter w;
  std::string out(kMagic, sizeof kMagic);
  w.str(kind);
  w.u32(version);
  w.str(payload);
  w.u64(checksum(payload));
  return out + w.bytes();
}

std::string unframe(const std::string& bytes, const std::string& kind, uint32_t version,
                    const std::string& origin) {
  if (bytes.size() < sizeof kMagic || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    throw SerializationError(origin + ": not a rannc file (bad magic bytes)");
  }
  const std::string body = bytes.substr(sizeof kMagic);
  BinaryReader r(body);
  try {
    std::string found_kind = r.str("kind");
    if (found_kind != kind) {
      throw SerializationError(origin + ": holds a rannc '" + found_kind + "', expected a '" + kind +
                               "'");
    }
    uint32_t found_version = r.u32("version");
    if (found_version != version) {
      throw SerializationError(origin + ": " + kind + " format version " +
                               std::to_string(found_version) + " is not supported (this build reads version " +
                               std::to_string(version) + "); re-create the file with this version");
    }
    std::string payload = r.str("payload");
    uint64_t sum = r.u64("checksum");
    if (sum != checksum(payload)) {
      throw SerializationError(origin + ": checksum mismatch, the file is corrupt");
    }
    if (!r.atEnd()) throw SerializationError(origin + ": trailing bytes after the checksum, the file is corrupt");
    return payload;
  } catch (const SerializationError& e) {
    const std::string msg = e.what();
    if (msg.rfind(origin, 0) == 0) throw;
    throw SerializationError(origin + ": corrupt file (" + msg + ")");
  }
}

std::string serializeGraph(const Graph& graph) {
  BinaryWriter w;
  w.i64(graph.batchSize());
  w.u64(graph.values().size());
  for (const Value& v : graph.values()) {
    w.str(v.name);
    w.u8(static_cast<uint8_t>(v.kind));
    w.u8(static_cast<uint8_t>(v.role));
    w.u8(static_cast<uint8_t>(v.dtype));
    w.i64s(v.shape);
    w.i32(v.batch_dim);
    w.i64(v.batch_multiple);
    w.u8(v.batch_dependent);
    w.u8(v.is_loss);
    w.u8(v.requires_grad);
    w.str(v.constant);
    w.i64s(v.int_values);
    w.i64s(v.int_batch_multiples);
  }
  w.u64(graph.tasks().size());
  for (const Task& t : graph.tasks()) {
    w.str(t.op);
    w.i32s(t.inputs);
    w.i32s(t.outputs);
    w.str(t.scope);
    w.str(t.source);
  }
  w.i32s(graph.inputs());
  w.i32s(graph.outputs());
  w.u64(graph.contentHash());
  return frame(kGraphKind, kGraphFormatVersion, w.bytes());
}

Graph deserializeGraph(const std::string& bytes, const std::string& origin) {
  const std::string payload = unframe(bytes, kGraphKind, kGraphFormatVersion, origin);
  BinaryReader r(payload);
  Graph g;
  // An enumeration stored as a byte, checked against its last member.
  auto enumByte = [&r](const std::string& field, int last) {
    const uint8_t b = r.u8(field);
    if (b > last) {
      throw SerializationError(field + ": " + std::to_string(b) + " is not a known value (0.." +
                               std::to_string(last) + ")");
    }
    return b;
  };
  try {
    const int64_t batch = r.i64("batch_size");
    if (batch < 0) throw SerializationError("batch_size: " + std::to_string(batch) + " is negative");
    g.setBatchSize(batch);
    // Smallest encodings: a value is 58 bytes with empty strings and lists, a task 40.
    const uint64_t nvalues = r.count("values", 58);
    for (uint64_t i = 0; i < nvalues; ++i) {
      const std::string f = "values[" + std::to_string(i) + "].";
      Value v;
      v.name = r.str(f + "name");
      v.kind = static_cast<ValueKind>(enumByte(f + "kind", static_cast<int>(ValueKind::Other)));
      v.role = static_cast<ValueRole>(enumByte(f + "role", static_cast<int>(ValueRole::Intermediate)));
      v.dtype = static_cast<DType>(enumByte(f + "dtype", static_cast<int>(DType::Complex128)));
      v.shape = r.i64s(f + "shape");
      v.batch_dim = r.i32(f + "batch_dim");
      v.batch_multiple = r.i64(f + "batch_multiple");
      v.batch_dependent = r.u8(f + "batch_dependent");
      v.is_loss = r.u8(f + "is_loss");
      v.requires_grad = r.u8(f + "requires_grad");
      v.constant = r.str(f + "constant");
      v.int_values = r.i64s(f + "int_values");
      v.int_batch_multiples = r.i64s(f + "int_batch_multiples");
      g.addValue(std::move(v));
    }
    const uint64_t ntasks = r.count("tasks", 40);
    for (uint64_t i = 0; i < ntasks; ++i) {
      const std::string f = "tasks[" + std::to_string(i) + "].";
      std::string op = r.str(f + "op");
      auto inputs = r.i32s(f + "inputs");
      auto outputs = r.i32s(f + "outputs");
      std::string scope = r.str(f + "scope");
      std::string source = r.str(f + "source");
      g.addTask(std::move(op), std::move(inputs), std::move(outputs), std::move(scope),
                std::move(source));
    }
    g.setInputs(r.i32s("inputs"));
    g.setOutputs(r.i32s("outputs"));
    const uint64_t stored_hash = r.u64("content_hash");
    if (!r.atEnd()) throw SerializationError("trailing bytes after content_hash");
    g.validate();
    if (g.contentHash() != stored_hash) {
      throw SerializationError(origin + ": the graph read back does not match its stored hash");
    }
  } catch (const InvalidGraphError& e) {
    throw SerializationError(origin + ": the stored graph is invalid: " + e.what());
  } catch (const SerializationError& e) {
    const std::string msg = e.what();
    if (msg.rfind(origin, 0) == 0) throw;
    throw SerializationError(origin + ": corrupt graph: " + msg);
  }
  return g;
}

void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw SerializationError("cannot open '" + path + "' for writing");
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw SerializationError("failed writing '" + path + "'");
}

std::string readFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw SerializationError("cannot open '" + path + "' for reading");
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

void saveGraph(const Graph& graph, const std::string& path) {
  writeFile(path, serializeGraph(graph));
}

Graph loadGraph(const std::string& path) { return deserializeGraph(readFile(path), path); }

}  // namespace rannc::ir
