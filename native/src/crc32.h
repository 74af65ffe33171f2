// CRC-32 as zlib computes it (polynomial 0xEDB88320, reflected), continuable like zlib.crc32(data, crc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace vktrain {

uint32_t crc32(const uint8_t* data, size_t size, uint32_t crc = 0);

}  // namespace vktrain
