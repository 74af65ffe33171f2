"""The delegate executor: turns a deserialized VkGraph (vktrain.serialization) into planned buffers and a
recorded schedule of kernel dispatches (kernels/ holds each kernel family's plan functions)."""
