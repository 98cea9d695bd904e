"""The distribution lab (`spec-replay dist`): which speculative loops keep the target's
distribution (distribution.py), with llama-speculative's defective loop reimplemented
(example_loop.py)."""
