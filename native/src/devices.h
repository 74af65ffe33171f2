// A Vulkan device probe: the instance's physical devices and the limits the runtime will plan against.
#pragma once

#include <string>

namespace vktrain {

// One block of text per device; throws LoadError(kUnsupported) when no Vulkan instance can be created.
std::string describe_vulkan_devices();

}  // namespace vktrain
