// Message formatting in the Python reader's style (lists as [1, 2], bytes as b'..', hex as 0x1).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

namespace vktrain {

template <typename T, typename = std::enable_if_t<std::is_integral<T>::value>>
std::string num(T v) { return std::to_string(v); }

// a + b, exact even past 64 bits (for messages about ranges that overflow).
inline std::string sum(uint64_t a, uint64_t b) {
  unsigned __int128 s = (unsigned __int128)a + b;
  if (s <= UINT64_MAX) return std::to_string(uint64_t(s));
  std::string out;
  while (s) { out.insert(out.begin(), char('0' + int(s % 10))); s /= 10; }
  return out;
}

inline std::string hex(uint64_t v) { char b[24]; std::snprintf(b, sizeof b, "%#llx", (unsigned long long)v); return v ? b : "0x0"; }
inline std::string hex8(uint32_t v) { char b[16]; std::snprintf(b, sizeof b, "0x%08x", v); return b; }
inline std::string real(double v) { char b[40]; std::snprintf(b, sizeof b, "%.17g", v); return b; }

template <typename T>
std::string list(const std::vector<T>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + std::to_string(items[i]);
  return out + "]";
}

inline std::string bytes_repr(const uint8_t* p, size_t n) {
  std::string out = "b'";
  for (size_t i = 0; i < n; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7F && p[i] != '\'' && p[i] != '\\') out += char(p[i]);
    else { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", p[i]); out += b; }
  }
  return out + "'";
}

// A JSON string literal of `s` (bytes past ASCII passed through: the strings are UTF-8).
inline std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') { out += '\\'; out += char(c); }
    else if (c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); out += b; }
    else out += char(c);
  }
  return out + "\"";
}

}  // namespace vktrain
