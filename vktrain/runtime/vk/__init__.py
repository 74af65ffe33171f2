"""The Vulkan layer: instance/device, buffers, pipelines, recorded command buffers and the schedule as
data (Dispatch, BufferBinding, barriers). Knows nothing of graphs, ops or .pte files."""
