"""The iteration order of libstdc++'s std::unordered_map<int, int> (GCC's _Hashtable), emulated.

ngram-cache picks, among a part map's tokens with the same count, the first one in
the map's iteration order (common/ngram-cache.cpp try_draft: strictly greater
wins), so a bit-exact replay needs that order. libstdc++ keeps one singly
linked list; a bucket's nodes are contiguous in it:

    insert k (bucket b = k % n):  b has nodes -> k goes first in b's run
                                  b is empty  -> k goes to the front of the list
    rehash to n':  walk the old list; a node whose new bucket is empty goes to the
                   front, else first in its bucket's run
    growth (_Prime_rehash_policy, max_load_factor 1):
                   n = 1 until the first insert, which makes it 13 (fast table
                   for n < 14, 11 elements minimum); when size + 1 > n the table
                   becomes the first prime >= max(size + 2, 2 n) from the prime list

std::hash<int> is the identity. Verified against g++'s libstdc++ in tests/test_stdmap.py.
"""
from __future__ import annotations

# libstdc++ src/shared/hashtable-aux.cc __prime_list (the 64-bit table), the part we can reach
_PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103,
           109, 113, 127, 137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359,
           383, 409, 439, 467, 503, 541, 577, 619, 661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381,
           1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549, 2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703, 5087,
           5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273, 11113, 12011, 12983, 14033, 15173, 16411,
           17749, 19183, 20753, 22447, 24281, 26267, 28411, 30727, 33223, 35933, 38873, 42043, 45481, 49201,
           53201, 57557, 62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731, 126271, 136607,
           147793, 159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503, 351061,
           379787, 410857, 444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049, 834181, 902483,
           976369]
_FAST = [2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13]


def _next_bkt(n: int) -> tuple[int, int]:
    """(_M_next_bkt(n), the next resize threshold) for max_load_factor 1."""
    if n < len(_FAST):
        if n == 0:
            return 1, 0
        return _FAST[n], _FAST[n]
    for p in _PRIMES[6:]:
        if p >= n:
            return p, p
    raise OverflowError("unordered_map grew past the emulated prime table")


class StdIntMap:
    """std::unordered_map<int, int32_t> with libstdc++'s iteration order."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.counts: dict[int, int] = {}
        self.n_bkt = 1
        self.next_resize = 0

    def __contains__(self, key: int) -> bool:
        return key in self.counts

    def __len__(self) -> int:
        return len(self.order)

    def items(self):
        return [(k, self.counts[k]) for k in self.order]

    def get(self, key: int, default=None):
        return self.counts.get(key, default)

    def increment(self, key: int) -> None:
        """`find(k) == end ? emplace(k, 1) : ++it->second` (common/ngram-cache.cpp:33-41)."""
        if key in self.counts:
            self.counts[key] += 1
        else:
            self._insert(key)
            self.counts[key] = 1

    def _insert(self, key: int) -> None:
        n_elt = len(self.order)
        if n_elt + 1 > self.next_resize:  # _Prime_rehash_policy::_M_need_rehash
            min_bkts = max(n_elt + 1, 0 if self.next_resize else 11)
            if min_bkts >= self.n_bkt:
                n, self.next_resize = _next_bkt(max(min_bkts + 1, self.n_bkt * 2))
                self._rehash(n)
            else:
                self.next_resize = self.n_bkt
        self.order = self._placed(self.order, key, self.n_bkt)

    @staticmethod
    def _placed(order: list[int], key: int, n_bkt: int) -> list[int]:
        b = key % n_bkt
        for i, k in enumerate(order):
            if k % n_bkt == b:
                return order[:i] + [key] + order[i:]
        return [key] + order

    def _rehash(self, n: int) -> None:
        new: list[int] = []
        for k in self.order:
            new = self._placed(new, k, n)
        self.order, self.n_bkt = new, n
