#include "step_source.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "file_map.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

bool identifier(const std::string& s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

bool define_value(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

bool cache_key(const std::string& s) {  // build.py cache_key: hex digits of a sha256
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

class FilesStepSource : public StepSource {
 public:
  FilesStepSource(const std::string& schedule_path, const std::string& dir)
      : schedule_(Schedule::load(schedule_path)), dir_(dir) {
    struct stat st;
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      refuse(ErrorCode::kIo, "SPIR-V directory " + dir + " does not exist (or is not a directory)");
    DIR* d = opendir(dir.c_str());
    if (!d) refuse(ErrorCode::kIo, "SPIR-V directory " + dir + " cannot be read: " + std::strerror(errno));
    while (dirent* e = readdir(d)) files_.push_back(e->d_name);
    closedir(d);
    std::sort(files_.begin(), files_.end());
  }

  const Schedule& schedule() const override { return schedule_; }

  std::vector<uint32_t> module(const std::string& name) const override {
    const std::string stem = shader_file_stem(name);
    std::vector<std::string> found;
    for (const auto& f : files_) {
      if (f.size() < stem.size() + 4 || f.compare(0, stem.size(), stem) != 0 || f.compare(f.size() - 4, 4, ".spv") != 0)
        continue;
      std::string rest = f.substr(stem.size(), f.size() - 4 - stem.size());  // "" or ".<key>"
      if (rest.empty() || (rest[0] == '.' && cache_key(rest.substr(1)))) found.push_back(f);
    }
    if (found.empty())
      refuse(ErrorCode::kShaderModule, "shader '" + name + "': no " + stem + ".<hash>.spv in " + dir_ +
                                           " (build the cache with python -m vktrain.runtime_shaders.build)");
    if (found.size() > 1)
      refuse(ErrorCode::kShaderModule, "shader '" + name + "': " + num(found.size()) + " modules in " + dir_ + " (" +
                                           found[0] + ", " + found[1] + "); keep one (the build removes stale ones)");
    std::string path = dir_ + "/" + found[0];
    FileMap map(path);
    Bytes b = map.bytes();
    if (b.size % 4 || b.size < 20)
      refuse(ErrorCode::kShaderModule, path + ": not SPIR-V: " + num(b.size) + " bytes (want a multiple of 4, at least 20)");
    std::vector<uint32_t> words(b.size / 4);
    for (size_t i = 0; i < words.size(); ++i) words[i] = le32(b.data + 4 * i);
    return words;
  }

 private:
  Schedule schedule_;
  std::string dir_;
  std::vector<std::string> files_;
};

}  // namespace

std::string shader_file_stem(const std::string& name) {
  auto bad = [&](const std::string& why) { refuse(ErrorCode::kShaderModule, "shader name '" + name + "': " + why); };
  size_t at = name.find('@');
  std::string base = name.substr(0, at);
  if (!identifier(base)) bad("'" + base + "' is not a valid source name ([A-Za-z_][A-Za-z0-9_]*)");
  if (at == std::string::npos) return base;
  std::string variant = name.substr(at + 1), stem = base + ".v";
  if (variant.empty()) bad("nothing after '@'");
  size_t start = 0;
  while (true) {
    size_t plus = variant.find('+', start);
    std::string token = variant.substr(start, plus == std::string::npos ? std::string::npos : plus - start);
    size_t eq = token.find('=');
    std::string key = token.substr(0, eq);
    if (!identifier(key)) bad("define '" + key + "' is not an identifier");
    stem += "." + key;
    if (eq != std::string::npos) {
      std::string value = token.substr(eq + 1);
      if (!define_value(value)) bad("define value '" + value + "' is not [A-Za-z0-9_]+");
      stem += "-" + value;
    }
    if (plus == std::string::npos) break;
    start = plus + 1;
  }
  return stem;
}

std::unique_ptr<StepSource> files_step_source(const std::string& schedule_path, const std::string& spirv_dir) {
  return std::make_unique<FilesStepSource>(schedule_path, spirv_dir);
}

}  // namespace vktrain
