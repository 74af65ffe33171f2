#include "token_file.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "npy.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr const char* kTokenText = ".tokens.txt";  // data.py TOKEN_TEXT_SUFFIX

bool ends_with_lower(const std::string& path, const std::string& suffix) {
  if (path.size() < suffix.size()) return false;
  std::string tail = path.substr(path.size() - suffix.size());
  std::transform(tail.begin(), tail.end(), tail.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return tail == suffix;
}

bool is_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f); }  // str.split, ASCII

// Python's int(word) for a base-10 word; false when it is not one. *overflow: it is, but not in int64.
bool python_int(const std::string& word, int64_t* value, bool* overflow) {
  size_t i = 0;
  bool negative = false;
  if (word[i] == '+' || word[i] == '-') negative = word[i++] == '-';
  if (i == word.size()) return false;
  unsigned __int128 v = 0;
  bool last_digit = false;
  for (; i < word.size(); ++i) {
    char c = word[i];
    if (c == '_') {
      if (!last_digit) return false;
      last_digit = false;
      continue;
    }
    if (c < '0' || c > '9') return false;
    v = v * 10 + unsigned(c - '0');
    if (v > (unsigned __int128)1 << 64) v = (unsigned __int128)1 << 64;  // saturate: past int64 anyway
    last_digit = true;
  }
  if (!last_digit) return false;
  *overflow = negative ? v > (unsigned __int128)1 << 63 : v > (unsigned __int128)INT64_MAX;
  *value = negative ? int64_t(0 - uint64_t(v)) : int64_t(uint64_t(v));
  return true;
}

}  // namespace

std::vector<int64_t> parse_token_text(const std::string& text, const std::string& path) {
  std::vector<int64_t> ids;
  size_t i = 0;
  for (size_t index = 0;; ++index) {
    while (i < text.size() && is_space(uint8_t(text[i]))) ++i;
    if (i == text.size()) break;
    size_t start = i;
    while (i < text.size() && !is_space(uint8_t(text[i]))) ++i;
    const std::string word = text.substr(start, i - start);
    int64_t value = 0;
    bool overflow = false;
    if (!python_int(word, &value, &overflow))
      refuse(ErrorCode::kVerification, path + ": " + kTokenText + " files hold whitespace-separated integers; word " +
                                           num(index) + " is '" + word.substr(0, 40) + "'");
    if (overflow) refuse(ErrorCode::kVerification, path + ": a token id does not fit in int64");
    ids.push_back(value);
  }
  return ids;
}

std::vector<int64_t> load_token_file(const std::string& path) {
  if (ends_with_lower(path, ".npy")) return load_npy_tokens(path);
  if (ends_with_lower(path, kTokenText)) {
    std::ifstream file(path, std::ios::binary);
    if (!file) refuse(ErrorCode::kIo, "data file " + path + " cannot be opened: " + std::strerror(errno));
    std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (file.bad()) refuse(ErrorCode::kIo, "data file " + path + " cannot be read");
    return parse_token_text(text, path);
  }
  refuse(ErrorCode::kUnsupported, path + ": the native trainer reads token ids: a 1-D integer .npy array or a *" +
                                      kTokenText + " file (whitespace-separated ids); text and JSON data need the "
                                      "model's tokenizer (vktrain train tokenizes them; save the ids with numpy)");
}

}  // namespace vktrain
