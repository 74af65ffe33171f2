#include "checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>

#include "file_map.h"
#include "json.h"
#include "safetensors.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

// --- SHA-256 (FIPS 180-4) ---------------------------------------------------------------------------------
class Sha256 {
 public:
  void update(const uint8_t* p, size_t n) {
    bits_ += uint64_t(n) * 8;
    while (n) {
      size_t take = std::min(n, size_t(64) - used_);
      std::memcpy(block_ + used_, p, take);
      used_ += take, p += take, n -= take;
      if (used_ == 64) { compress(); used_ = 0; }
    }
  }
  void update(const std::string& s) { update(reinterpret_cast<const uint8_t*>(s.data()), s.size()); }
  std::string hex() {
    uint64_t bits = bits_;
    uint8_t pad = 0x80;
    update(&pad, 1);
    pad = 0;
    while (used_ != 56) update(&pad, 1);
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = uint8_t(bits >> (56 - 8 * i));
    update(length, 8);
    std::string out;
    char b[9];
    for (uint32_t v : h_) { std::snprintf(b, sizeof b, "%08x", v); out += b; }
    return out;
  }

 private:
  static uint32_t rotr(uint32_t x, int n) { return x >> n | x << (32 - n); }
  void compress() {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
        0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
        0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
        0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
        0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
        0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
        0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(block_[4 * i]) << 24 | uint32_t(block_[4 * i + 1]) << 16 | uint32_t(block_[4 * i + 2]) << 8 | block_[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    uint32_t add[8] = {a, b, c, d, e, f, g, h};
    for (int i = 0; i < 8; ++i) h_[i] += add[i];
  }
  uint32_t h_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint8_t block_[64];
  size_t used_ = 0;
  uint64_t bits_ = 0;
};

struct DtypeNames { int dtype; const char* numpy; const char* safetensors; };
const DtypeNames kDtypes[] = {{kFloat32, "<f4", "F32"}, {kFloat16, "<f2", "F16"}, {kInt32, "<i4", "I32"},
                              {kInt64, "<i8", "I64"}, {kUint8, "|u1", "U8"},   {kUint32, "<u4", "U32"},
                              {kBool, "|b1", "BOOL"}, {kInt8, "|i1", "I8"}};

const DtypeNames& names_of(int dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d;
  refuse(ErrorCode::kUnsupported, std::string("a checkpoint cannot hold ") + data_type_name(dtype) + " tensors");
}

std::string shortest(double v) {  // Python's repr of a float (JSON's number)
  char b[40];
  auto r = std::to_chars(b, b + sizeof b, v);
  std::string s(b, r.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string shape_list(const std::vector<int64_t>& shape) {  // Python's repr of a list of ints
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + num(shape[i]);
  return out + "]";
}

[[noreturn]] void bad(const std::string& path, const std::string& message) {
  refuse(ErrorCode::kVerification, path + ": " + message);
}

int64_t metadata_int(const std::map<std::string, std::string>& m, const std::string& key, const std::string& path) {
  auto it = m.find(key);
  if (it == m.end()) bad(path, "checkpoint metadata has no '" + key + "'");
  char* end = nullptr;
  long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end) bad(path, "checkpoint metadata '" + key + "' is not an integer: '" + it->second + "'");
  return v;
}

}  // namespace

std::string sha256_file(const std::string& path) {
  FileMap map(path);
  return sha256_bytes(map.bytes().data, map.bytes().size);
}

std::string sha256_bytes(const uint8_t* data, size_t size) {
  Sha256 h;
  h.update(data, size);
  return h.hex();
}

std::string batcher_fingerprint(const std::vector<int64_t>& tokens, int64_t batch, int64_t seq, bool shuffle) {
  Sha256 h;
  h.update("vktrain-batcher:B=" + num(batch) + ":S=" + num(seq) + ":shuffle=" + (shuffle ? "1" : "0") + ":");
  h.update(reinterpret_cast<const uint8_t*>(tokens.data()), tokens.size() * 8);  // little-endian hosts only
  return h.hex();
}

std::string run_config_json(const LRSchedule& lr, const double adamw[4], int64_t batch, int64_t seq, bool shuffle) {
  std::string optimizer = "{\"beta1\": " + shortest(adamw[0]) + ", \"beta2\": " + shortest(adamw[1]) +
                          ", \"eps\": " + shortest(adamw[2]) + ", \"weight_decay\": " + shortest(adamw[3]) + "}";
  std::string schedule = "{\"base_lr\": " + shortest(lr.base_lr) + ", \"kind\": " + json_quote(lr.kind) +
                         (lr.kind == "constant" ? "" : ", \"min_lr_ratio\": " + shortest(lr.min_lr_ratio)) +
                         (lr.kind == "constant" ? "" : ", \"total_steps\": " + num(lr.total_steps)) +
                         ", \"warmup_steps\": " + num(lr.warmup_steps) + "}";
  return "{\"batch_size\": " + num(batch) + ", \"optimizer\": " + optimizer + ", \"schedule\": " + schedule +
         ", \"seq_len\": " + num(seq) + ", \"shuffle\": " + (shuffle ? "true" : "false") + "}";
}

std::string tensor_checksum(const HostTensor& t) {
  Sha256 h;
  h.update(std::string(names_of(t.dtype).numpy) + ":" + shape_list(t.shape) + ":");
  h.update(t.data.data(), t.data.size());
  return h.hex();
}

void save_checkpoint(const std::string& path, const Checkpoint& c) {
  std::string records = "[";
  for (size_t i = 0; i < c.records.size(); ++i) {
    const auto& r = c.records[i];
    records += std::string(i ? ", " : "") + "{\"step\": " + num(r.step) + ", \"loss\": " + shortest(r.loss) +
               ", \"lr\": " + shortest(r.lr) + ", \"seconds\": " + shortest(r.seconds) + "}";
  }
  records += "]";
  std::string checksums = "{";
  for (const auto& [name, t] : c.tensors)  // std::map: sorted keys, as json.dumps(sort_keys=True)
    checksums += std::string(checksums.size() > 1 ? ", " : "") + json_quote(name) + ": \"" + tensor_checksum(t) + "\"";
  checksums += "}";
  const std::map<std::string, std::string> metadata = {
      {"format", "vktrain-checkpoint"}, {"version", "2"}, {"step", num(c.step)},
      {"data_position", num(c.data_position)}, {"program_sha256", c.program_sha256}, {"data_sha256", c.data_sha256},
      {"data_seed", num(c.data_seed)}, {"config", c.config_json}, {"records", records}, {"checksums", checksums}};
  std::vector<std::pair<std::string, const HostTensor*>> tensors;
  for (const auto& [name, t] : c.tensors) tensors.emplace_back(name, &t);
  write_file_atomically(path, safetensors_bytes(metadata, tensors), "--checkpoint");
}

Checkpoint load_checkpoint(const std::string& path) {
  FileMap map(path);
  Bytes b = map.bytes();
  if (b.size < 8) bad(path, "not a safetensors checkpoint (" + num(b.size) + " bytes)");
  const uint64_t n = le64(b.data);
  if (n > b.size - 8) bad(path, "not a safetensors checkpoint (header length " + num(n) + " past the file's end)");
  Json header = Json::parse(std::string(reinterpret_cast<const char*>(b.data + 8), n), path + "'s safetensors header",
                            ErrorCode::kVerification);
  if (header.kind != Json::kObject) bad(path, "the safetensors header is not an object");
  std::map<std::string, std::string> meta;
  auto m = header.fields.find("__metadata__");
  if (m != header.fields.end() && m->second.kind == Json::kObject)
    for (const auto& [k, v] : m->second.fields)
      if (v.kind == Json::kString) meta[k] = v.text;
  if (meta["format"] != "vktrain-checkpoint" || meta["version"] != "2")
    bad(path, "not a vktrain checkpoint of version 2 (format '" + meta["format"] + "', version '" + meta["version"] + "')");
  Checkpoint c;
  const Bytes data = b.sub(8 + n, b.size - 8 - n);
  for (const auto& [name, t] : header.fields) {
    if (name == "__metadata__") continue;
    const std::string where = "tensor '" + name + "'";
    if (t.kind != Json::kObject || !t.fields.count("dtype") || !t.fields.count("shape") || !t.fields.count("data_offsets"))
      bad(path, where + " has no dtype, shape and data_offsets");
    HostTensor h;
    bool known = false;
    for (const auto& d : kDtypes)
      if (t.fields.at("dtype").text == d.safetensors) { h.dtype = d.dtype; known = true; }
    if (!known) bad(path, where + " has dtype '" + t.fields.at("dtype").text + "'");
    unsigned __int128 count = 1;
    for (const Json& v : t.fields.at("shape").items) {
      if (v.kind != Json::kInt || v.integer < 0) bad(path, where + " has a bad shape");
      h.shape.push_back(v.integer);
      count *= uint64_t(v.integer);
      if (count > data.size) bad(path, where + " is larger than the file");
    }
    const auto& off = t.fields.at("data_offsets").items;
    if (off.size() != 2 || off[0].kind != Json::kInt || off[1].kind != Json::kInt || off[0].integer < 0 ||
        off[1].integer < off[0].integer || uint64_t(off[1].integer) > data.size ||
        uint64_t(off[1].integer - off[0].integer) != uint64_t(count) * data_type_size(h.dtype))
      bad(path, where + ": its data_offsets do not hold its " + num(uint64_t(count)) + " elements inside the file");
    h.data.assign(data.data + off[0].integer, data.data + off[1].integer);
    if (h.dtype == kFloat32)
      for (uint64_t i = 0; i < uint64_t(count); ++i)
        if (!std::isfinite(h.item<float>(i))) bad(path, where + " holds NaN or infinity; a checkpoint holds finite state only");
    c.tensors[name] = std::move(h);
  }
  Json checksums = Json::parse(meta["checksums"], path + "'s checksums", ErrorCode::kVerification);
  for (const auto& [name, t] : c.tensors) {
    auto it = checksums.fields.find(name);
    if (it == checksums.fields.end() || it->second.text != tensor_checksum(t))
      bad(path, "tensor '" + name + "' does not match its checksum (the file was modified or corrupted)");
  }
  if (checksums.fields.size() != c.tensors.size()) bad(path, "the checksums name tensors the file does not hold");
  c.step = metadata_int(meta, "step", path);
  c.data_position = metadata_int(meta, "data_position", path);
  c.data_seed = metadata_int(meta, "data_seed", path);
  c.program_sha256 = meta["program_sha256"];
  c.data_sha256 = meta["data_sha256"];
  c.config_json = meta["config"];
  Json records = Json::parse(meta["records"], path + "'s records", ErrorCode::kVerification);
  if (records.kind != Json::kArray || int64_t(records.items.size()) != c.step)
    bad(path, "records must be a list of one record per step 1.." + num(c.step));
  auto number = [&](const Json& r, const char* key, int64_t step) {
    auto it = r.fields.find(key);
    if (it == r.fields.end()) return 0.0;
    if (it->second.kind == Json::kInt) return double(it->second.integer);
    if (it->second.kind != Json::kReal || !std::isfinite(it->second.real))
      bad(path, "record of step " + num(step) + ": '" + key + "' must be a finite number");
    return it->second.real;
  };
  for (size_t i = 0; i < records.items.size(); ++i) {
    const Json& r = records.items[i];
    const int64_t step = int64_t(i) + 1;
    if (r.kind != Json::kObject || !r.fields.count("step") || r.fields.at("step").integer != step)
      bad(path, "record " + num(i) + " must be an object with step " + num(step));
    if (r.fields.count("skipped") && !r.fields.at("skipped").items.empty())
      bad(path, "step " + num(step) + " follows skipped batches (--on-nonfinite skip); this trainer resumes runs without");
    c.records.push_back({step, number(r, "loss", step), number(r, "lr", step), number(r, "seconds", step)});
  }
  if (c.data_position != c.step)
    bad(path, "data_position " + num(c.data_position) + " does not match step " + num(c.step));
  return c;
}

}  // namespace vktrain
