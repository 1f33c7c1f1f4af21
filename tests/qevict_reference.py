"""A slow, obvious QEvict: dicts of windows per KV head, routed by sorting Python lists. The tests
drive it and the jitted policy with the same attention stream and compare everything."""

import numpy as np

from kvjax.quant import (
    dequantize_per_channel,
    dequantize_per_token,
    quantize_per_channel,
    quantize_per_token,
)


class Ledger:
    """One window's low-bit codes, computed once."""

    def __init__(self, k, v, bits, value_group):
        kc, ks, kz = quantize_per_channel(k, bits)
        vc, vs, vz = quantize_per_token(v, bits, value_group)
        self.codes = (np.asarray(kc), np.asarray(vc))
        self.stats = tuple(np.asarray(a) for a in (ks, kz, vs, vz))
        self.k = np.asarray(dequantize_per_channel(kc, ks, kz))
        self.v = np.asarray(dequantize_per_token(vc, vs, vz))


class Head:
    """QEvict state of one KV head."""

    def __init__(self, policy, lay, value_group):
        self.p, self.lay, self.vg = policy, lay, value_group
        self.recent = {}  # pos -> [k, v, score]: sinks and ring
        self.fp = {}  # win -> [k [ω, D], v, token scores [ω]]
        self.low = {}  # win -> score (attended low-bit windows)
        self.ledger = {}  # win -> Ledger (active and dormant)
        self.promotions = 0

    def attended(self):
        """{pos: tier} with tier 1 = full precision, 2 = low-bit."""
        w, s = self.lay.window, self.lay.sinks
        out = {p: 1 for p in self.recent}
        for j in self.fp:
            out.update({s + j * w + i: 1 for i in range(w)})
        for j in self.low:
            out.update({s + j * w + i: 2 for i in range(w)})
        return out

    def call(self, ks, vs, n0, mass):
        """Tokens n0.. with data ks/vs [T, D]; mass(pos) is this call's attention on pos."""
        w, s = self.lay.window, self.lay.sinks
        for p in self.recent:
            self.recent[p][2] += mass(p)
        for j, (_, _, sc) in self.fp.items():
            for i in range(w):
                sc[i] += mass(s + j * w + i)
        for j in self.low:
            self.low[j] += sum(np.float32(mass(s + j * w + i)) for i in range(w))
        for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
            self.recent[n0 + i] = [k, v, np.float32(mass(n0 + i))]
        left = lambda n: max(n - s - self.p.local_band, 0) // w
        l0, l1 = left(n0), left(n0 + len(ks))
        if l1 > l0:
            new = {}
            for j in range(l0, l1):
                toks = [self.recent.pop(s + j * w + i) for i in range(w)]
                new[j] = [np.stack([t[0] for t in toks]), np.stack([t[1] for t in toks])]
                new[j].append(np.array([t[2] for t in toks], np.float32))
            self.route(new)

    def route(self, new):
        lay = self.lay
        cands = [
            (np.float32(np.sum(sc)), j, "fp", j in self.ledger) for j, (*_, sc) in self.fp.items()
        ]
        cands += [(sc, j, "low", True) for j, sc in self.low.items()]
        cands += [(np.float32(np.sum(d[2])), j, "new", False) for j, d in new.items()]
        cands.sort(key=lambda c: (-c[0], -c[1]))
        n = len(cands)
        cost = [lay.fp_window_bytes + lay.page_bytes * c[3] for c in cands]
        k = 0
        while (
            k < n
            and k + 1 <= lay.fp_windows
            and sum(cost[: k + 1]) + min(lay.quant_bytes, lay.page_bytes * (n - k - 1))
            <= lay.budget_bytes
        ):
            k += 1
        left = lay.budget_bytes - sum(cost[:k])
        n_low = min(n - k, left // lay.page_bytes, lay.pages)
        fp, low = cands[:k], cands[k : k + n_low]
        old_fp = self.fp
        self.fp, self.low = {}, {}
        bits = self.p.bits
        for sc, j, src, _ in fp:
            if src == "fp":
                self.fp[j] = old_fp[j]
            elif src == "new":
                self.fp[j] = new[j]
            else:  # promotion: the ledger, dequantized; its score on the first token
                led = self.ledger[j]
                self.fp[j] = [led.k, led.v, np.array([sc] + [0] * (lay.window - 1), np.float32)]
                self.promotions += 1
        for sc, j, src, _ in low:
            if src != "low" and j not in self.ledger:
                data = old_fp[j] if src == "fp" else new[j]
                self.ledger[j] = Ledger(data[0], data[1], bits, self.vg)
            self.low[j] = sc
        for j in list(self.ledger):
            if j not in self.fp and j not in self.low:
                del self.ledger[j]
