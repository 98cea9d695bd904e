"""Bit-exact reproductions of the C and C++ arithmetic the server's numbers come from: its
pre-sampling softmax (glibc expf, partial_sort summation order), the libstdc++ random streams,
and libstdc++'s unordered_map iteration order. Pure: numpy and the C library only."""
