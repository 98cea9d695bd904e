"""spec-replay: tell the truth about llama.cpp's speculative decoding."""
__version__ = "0.1.0"
