// What of this process's resident set is not host memory: pages of a mapped file (the .pte) and pages of device
// memory mapped into the process (vkMapMemory's mappings, and the drivers' own mappings of /dev/nvidia* and
// /dev/dri/*). On a GPU with host-visible device-local memory (resizable BAR) or on a CPU device (lavapipe),
// device memory written through its mapping counts in RSS although it is no host allocation of the runtime.
#pragma once

#include <cstdint>
#include <sys/types.h>

namespace vktrain {

// Buffers record what they map (vkMapMemory) and forget it when they unmap; the ranges of all devices.
void note_device_mapping(const void* address, uint64_t bytes);
void forget_device_mapping(const void* address);

struct ResidentBytes {
  bool known = false;   // false where /proc/self/smaps cannot be read (no Linux procfs): all counts 0
  uint64_t total = 0;   // the sum of smaps' Rss over all mappings: the current resident set
  uint64_t file = 0;    // of it, in mappings of the file (dev, inode): the .pte
  uint64_t device = 0;  // of it, in device-memory mappings (the ranges noted above, /dev/nvidia*, /dev/dri/*)
  uint64_t host() const { return total - file - device; }
};

// The current resident set split as above (smaps' Rss per mapping; where a noted range covers only part of a
// mapping, the pages of the range present in /proc/self/pagemap, at most that mapping's Rss).
ResidentBytes resident_bytes(dev_t file_device, ino_t file_inode);

}  // namespace vktrain
