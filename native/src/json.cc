#include "json.h"

#include <cerrno>
#include <cstdlib>

#include "text.h"

namespace vktrain {
namespace {

constexpr int kMaxDepth = 32;

class Parser {
 public:
  Parser(const std::string& s, const std::string& where, ErrorCode code) : s_(s), where_(where), code_(code) {}

  Json document() {
    Json v = value(0);
    space();
    if (i_ != s_.size()) fail("extra data");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    refuse(code_, where_ + " is not valid JSON: " + what + " at offset " + num(i_));
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool take(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(i_, n, word) != 0) return false;
    i_ += n;
    return true;
  }
  Json value(int depth) {
    if (depth > kMaxDepth) fail("nested deeper than " + num(kMaxDepth));
    space();
    if (i_ >= s_.size()) fail("unexpected end");
    Json v;
    char c = s_[i_];
    if (c == '{') {
      v.kind = Json::kObject;
      ++i_;
      space();
      if (i_ < s_.size() && s_[i_] == '}') { ++i_; return v; }
      while (true) {
        space();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string key");
        std::string key = string();
        space();
        if (i_ >= s_.size() || s_[i_] != ':') fail("expected ':'");
        ++i_;
        v.fields[key] = value(depth + 1);
        space();
        if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
        if (i_ < s_.size() && s_[i_] == '}') { ++i_; return v; }
        fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind = Json::kArray;
      ++i_;
      space();
      if (i_ < s_.size() && s_[i_] == ']') { ++i_; return v; }
      while (true) {
        v.items.push_back(value(depth + 1));
        space();
        if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
        if (i_ < s_.size() && s_[i_] == ']') { ++i_; return v; }
        fail("expected ',' or ']'");
      }
    }
    if (c == '"') { v.kind = Json::kString; v.text = string(); return v; }
    if (take("true")) { v.kind = Json::kBool; v.boolean = true; return v; }
    if (take("false")) { v.kind = Json::kBool; return v; }
    if (take("null")) return v;
    return number();
  }
  Json number() {
    size_t start = i_;
    bool integral = true;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    auto digits = [&] {
      size_t from = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      return i_ > from;
    };
    if (i_ < s_.size() && s_[i_] == '0') ++i_;
    else if (!digits()) fail("expected a value");
    if (i_ < s_.size() && s_[i_] == '.') { ++i_; integral = false; if (!digits()) fail("expected digits after '.'"); }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      integral = false;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (!digits()) fail("expected exponent digits");
    }
    std::string text = s_.substr(start, i_ - start);
    Json v;
    errno = 0;
    if (integral) {
      long long n = std::strtoll(text.c_str(), nullptr, 10);
      if (errno != ERANGE) { v.kind = Json::kInt; v.integer = n; return v; }
    }
    v.kind = Json::kReal;  // a huge integer too: no profile field takes one, so it is refused by type
    v.real = std::strtod(text.c_str(), nullptr);
    return v;
  }
  void utf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) { *out += char(cp); return; }
    if (cp < 0x800) { *out += char(0xC0 | cp >> 6); }
    else if (cp < 0x10000) { *out += char(0xE0 | cp >> 12); *out += char(0x80 | (cp >> 6 & 0x3F)); }
    else { *out += char(0xF0 | cp >> 18); *out += char(0x80 | (cp >> 12 & 0x3F)); *out += char(0x80 | (cp >> 6 & 0x3F)); }
    *out += char(0x80 | (cp & 0x3F));
  }
  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s_[i_++];
      v = v * 16 + uint32_t(h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 :
                            h >= 'A' && h <= 'F' ? h - 'A' + 10 : (fail("bad \\u escape"), 0));
    }
    return v;
  }
  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s_[i_++]);
      if (c == '"') return out;
      if (c < 0x20) fail("control character in a string");
      if (c != '\\') { out += char(c); continue; }
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {
            size_t back = i_;
            i_ += 2;
            uint32_t low = hex4();
            if (low >= 0xDC00 && low < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            else i_ = back;
          }
          if (cp >= 0xD800 && cp < 0xE000) fail("a lone surrogate in a string");
          utf8(cp, &out);
          break;
        }
        default: fail(std::string("bad escape \\") + e);
      }
    }
  }

  const std::string& s_;
  const std::string& where_;
  ErrorCode code_;
  size_t i_ = 0;
};

}  // namespace

Json Json::parse(const std::string& text, const std::string& where, ErrorCode code) {
  return Parser(text, where, code).document();
}

}  // namespace vktrain
