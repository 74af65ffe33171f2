// The token files `vktrain train --data` reads without a tokenizer (vktrain/train/data.py load_tokens): a 1-D
// integer .npy array (npy.h), or *.tokens.txt, token ids as whitespace-separated decimal integers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vktrain {

// The token stream of `path` as int64, chosen by its name (case-insensitive) as load_tokens chooses; LoadError
// kIo / kVerification naming the file and what is wrong, kUnsupported for text that needs a tokenizer.
std::vector<int64_t> load_token_file(const std::string& path);

// The ids of a *.tokens.txt file's text: Python's int() of each word of str.split() (a sign, digits, single
// underscores between digits); `path` names it in errors.
std::vector<int64_t> parse_token_text(const std::string& text, const std::string& path);

}  // namespace vktrain
