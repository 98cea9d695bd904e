"""Which CPU kernels computed a transcript, and replaying on them.

A release build of llama.cpp carries one ggml CPU backend per x86 level and loads the best one the
host runs; two machines then compute a quantized model's logits with different code (measured up to
0.1 nats apart on SmolLM2 Q4_1). `variants` is the table of those backends and which this host can
run (pure), `probe` evaluates a transcript's first real entry under each of them (one worker process
per variant: a process holds one ggml), and `choice` decides which one reproduces the server and
what the report says.
"""
