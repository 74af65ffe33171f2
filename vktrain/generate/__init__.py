"""Text generation on the Vulkan device: the prefill + decode program (vktrain/export/decode.py) run by
the torch-free runtime (runner.py), host-side sampling in numpy (sampling.py), and `vktrain generate`
(command.py, which exports the program on the host first)."""
