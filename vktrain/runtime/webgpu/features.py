"""What the WebGPU device sets up and its programs rely on (device.py opens it, program.py records into it)."""

INSIDE_PASS_FEATURE = "timestamp-query-inside-passes"  # native wgpu: per-dispatch timestamps in one pass
UNIFORM_SLOT_ALIGNMENT = 256  # every dispatch's params start at a multiple of this (browser WebGPU's maximum)
