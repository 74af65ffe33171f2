#include "resident.h"

#include <fcntl.h>
#if defined(__linux__)
#include <sys/sysmacros.h>  // major, minor (sys/types.h has them elsewhere; no /proc/self/smaps there: known = false)
#endif
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace vktrain {
namespace {

std::mutex ranges_mutex;
std::map<uintptr_t, uint64_t>& ranges() {  // start address -> bytes
  static std::map<uintptr_t, uint64_t> noted;
  return noted;
}

// Bytes of the pages in [begin, end) present in this process's page tables (pagemap bit 63), page-aligned range.
uint64_t present_bytes(int pagemap, uintptr_t begin, uintptr_t end, uint64_t page) {
  uint64_t present = 0;
  uint64_t entries[512];
  for (uintptr_t at = begin; at < end;) {
    size_t n = std::min<uint64_t>(512, (end - at) / page);
    ssize_t got = pread(pagemap, entries, n * 8, off_t(at / page * 8));
    if (got <= 0) break;
    for (ssize_t i = 0; i < got / 8; ++i) present += (entries[i] >> 63) ? page : 0;
    at += uint64_t(got / 8) * page;
  }
  return present;
}

struct Mapping {
  uintptr_t begin = 0, end = 0;
  unsigned major = 0, minor = 0;
  uint64_t inode = 0;
  std::string path;
  uint64_t rss = 0;
};

}  // namespace

void note_device_mapping(const void* address, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(ranges_mutex);
  ranges()[reinterpret_cast<uintptr_t>(address)] = bytes;
}

void forget_device_mapping(const void* address) {
  std::lock_guard<std::mutex> lock(ranges_mutex);
  ranges().erase(reinterpret_cast<uintptr_t>(address));
}

ResidentBytes resident_bytes(dev_t file_device, ino_t file_inode) {
  ResidentBytes out;
  FILE* smaps = std::fopen("/proc/self/smaps", "re");
  if (!smaps) return out;
  std::map<uintptr_t, uint64_t> noted;
  {
    std::lock_guard<std::mutex> lock(ranges_mutex);
    noted = ranges();
  }
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  int pagemap = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  auto account = [&](const Mapping& m) {
    out.total += m.rss;
    if (m.inode && m.inode == uint64_t(file_inode) && m.major == major(file_device) && m.minor == minor(file_device)) {
      out.file += m.rss;
      return;
    }
    if (m.path.rfind("/dev/nvidia", 0) == 0 || m.path.rfind("/dev/dri/", 0) == 0) {
      out.device += m.rss;
      return;
    }
    // The noted ranges' whole pages inside this mapping, merged (small buffers may share a page).
    std::vector<std::pair<uintptr_t, uintptr_t>> pages;
    auto first = noted.lower_bound(m.begin);
    if (first != noted.begin()) --first;  // a range starting before the mapping may reach into it
    for (auto it = first; it != noted.end() && it->first < m.end; ++it) {
      uintptr_t a = std::max(it->first, m.begin) / page * page;
      uintptr_t b = std::min<uintptr_t>((it->first + it->second + page - 1) / page * page, m.end);
      if (a >= b) continue;
      if (!pages.empty() && a <= pages.back().second) pages.back().second = std::max(pages.back().second, b);
      else pages.emplace_back(a, b);
    }
    if (pages.empty()) return;
    if ((pages.size() == 1 && pages[0].first == m.begin && pages[0].second == m.end) || pagemap < 0) {
      out.device += m.rss;  // all of it device memory (or no pagemap to tell the pages apart: take it whole)
      return;
    }
    uint64_t present = 0;
    for (const auto& [a, b] : pages) present += present_bytes(pagemap, a, b, page);
    out.device += std::min(present, m.rss);
  };
  char line[4096];
  Mapping m;
  bool open_mapping = false;
  while (std::fgets(line, sizeof line, smaps)) {
    uintptr_t begin, end;
    char perms[8];
    unsigned long long offset, inode;
    unsigned major_number, minor_number;
    int path_at = 0;
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s %llx %x:%x %llu %n", &begin, &end, perms, &offset,
                    &major_number, &minor_number, &inode, &path_at) >= 7) {
      if (open_mapping) account(m);
      m = Mapping{begin, end, major_number, minor_number, inode, "", 0};
      if (path_at > 0) {
        m.path = line + path_at;
        while (!m.path.empty() && (m.path.back() == '\n' || m.path.back() == ' ')) m.path.pop_back();
      }
      open_mapping = true;
      continue;
    }
    unsigned long long kib;
    if (std::sscanf(line, "Rss: %llu kB", &kib) == 1) m.rss = kib * 1024;
  }
  if (open_mapping) account(m);
  std::fclose(smaps);
  if (pagemap >= 0) ::close(pagemap);
  out.known = true;
  return out;
}

}  // namespace vktrain
