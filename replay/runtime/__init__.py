"""libllama in-process (llama-cpp-python's ctypes bindings): owning wrappers for models,
contexts and batches (llama.py), the server's sampler chain built from a request (sampler.py),
and the GGUF completeness check run before libllama maps a file (gguf.py)."""
