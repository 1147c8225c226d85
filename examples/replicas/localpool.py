"""An in-process page pool with the interface of cudapool.kv.Replica that the example
uses (alloc, seal, match, release, hashes, kv_caches): a slab tensor in this process's own
memory with KV-SPEC.md's layout [layers][2][pages][tokens_per_page][kv_heads][head_dim] and
a free list. It stands in for the owner where there is none: the model's checks, the
reference runs, and a replica whose owner died (it recomputes into these pages).
"""

import hashlib
import struct
from dataclasses import dataclass


def prefix_hashes(tokens, tokens_per_page, namespace=""):
    """KV-SPEC.md's page hashes: h_i = SHA-256(h_{i-1} || le32 tokens of page i)[:16],
    h_-1 = SHA-256("cudapool/kv/v1\\0" + namespace)[:16]; full pages only."""
    h = hashlib.sha256(b"cudapool/kv/v1\x00" + namespace.encode()).digest()[:16]
    out = []
    for i in range(len(tokens) // tokens_per_page):
        page = tokens[i * tokens_per_page:(i + 1) * tokens_per_page]
        h = hashlib.sha256(h + struct.pack("<%dI" % tokens_per_page, *[t & 0xFFFFFFFF for t in page])).digest()[:16]
        out.append(h)
    return out


@dataclass
class Lease:
    pages: tuple
    id: int
    writable: bool

    def __len__(self):
        return len(self.pages)


@dataclass
class SealResult:
    visible: int
    duplicates: int


class NoSpace(Exception):
    pass


class LocalPool:
    def __init__(self, layers, kv_heads, head_dim, tokens_per_page, pages, device, namespace=""):
        import torch
        self.slab = torch.zeros(layers, 2, pages, tokens_per_page, kv_heads, head_dim,
                                dtype=torch.bfloat16, device=device)
        self.tokens_per_page, self.namespace = tokens_per_page, namespace
        self.free = list(range(pages - 1, -1, -1))
        self.index = {}  # hash -> page (sealed)
        self.leases = {}
        self.next_id = 1
        self.alive = True

    def kv_caches(self):
        return [(self.slab[i, 0], self.slab[i, 1]) for i in range(self.slab.shape[0])]

    def hashes(self, tokens):
        return prefix_hashes(list(tokens), self.tokens_per_page, self.namespace)

    def _lease(self, pages, writable):
        lease = Lease(tuple(pages), self.next_id, writable)
        self.next_id += 1
        self.leases[lease.id] = lease
        return lease

    def alloc(self, n, timeout=None):
        if n > len(self.free):
            raise NoSpace("%d pages asked, %d free" % (n, len(self.free)))
        return self._lease([self.free.pop() for _ in range(n)], True)

    def seal(self, lease, hashes, stream=None, wait=False):
        """The first len(hashes) pages become matchable under hashes; the rest are freed;
        a hash already sealed is a duplicate (its new page is freed)."""
        del self.leases[lease.id]
        visible = dup = 0
        for i, p in enumerate(lease.pages):
            if i < len(hashes) and hashes[i] not in self.index:
                self.index[hashes[i]] = p
                visible += 1
            else:
                dup += i < len(hashes)
                self.free.append(p)
        return SealResult(visible, dup)

    def match(self, hashes, stream=None):
        pages = []
        for h in hashes:
            if h not in self.index:
                break
            pages.append(self.index[h])
        return self._lease(pages, False) if pages else Lease((), 0, False)

    def release(self, *leases, stream=None):
        for lease in leases:
            if lease.id == 0:
                continue
            del self.leases[lease.id]
            if lease.writable:
                self.free.extend(lease.pages)

    def close(self):
        self.slab = None
