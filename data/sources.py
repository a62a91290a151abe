"""Synthetic sources whose loss floor is known exactly.

A source turns uniforms u_BT (one row per document, drawn by the document's own rng) into symbols
x_BT in [0, alphabet) plus, per symbol, the entropy (nats) of its true conditional distribution given
everything before it: the expected loss of the Bayes-optimal predictor at that label.
"""
from __future__ import annotations

import bisect
import math
import zlib

import numpy as np

# WARN: the Markov chain lives on alphabet**order contexts and its successor draw scores every
# (context, symbol) pair, so the table costs ~8 bytes * alphabet**(order+1) at construction.
MAX_TABLE = 1 << 22
ROWS_IN_PYTHON = 32  # up to this many documents a call, MarkovSource draws each in Python (generate)


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """H(p) in nats, with 0 log 0 = 0 (a Dirichlet draw can underflow to an exact zero)."""
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=axis)


class MarkovSource:
    """Order-k chain over A symbols with sparse random transitions, fixed by the data seed.

    Each context (the k previous symbols) can be followed by `support` symbols, drawn without
    replacement, with Dirichlet(concentration) probabilities. The first k symbols are uniform.
    """

    kind = "markov"

    def __init__(self, name: str, alphabet: int, order: int, support: int, concentration: float, seed: int):
        self.name, self.alphabet, self.order = name, alphabet, order
        self.support, self.concentration = support, concentration
        A, k, S = alphabet, order, support
        self.n_ctx = A**k
        # NOTE: keyed by the source *name*, not its list position, so adding or reordering other
        # sources leaves this chain unchanged.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        scores_CA = rng.random((self.n_ctx, A))
        self.next_CS = np.argsort(scores_CA, axis=1)[:, :S]  # S distinct successors per context
        self.p_CS = rng.dirichlet(np.full(S, concentration), size=self.n_ctx)
        self.cdf_CS = np.cumsum(self.p_CS, axis=1)
        self.H_C = _entropy(self.p_CS)
        # context c encodes (x_{t-k+1}, ..., x_t) in base A, most recent symbol least significant,
        # so appending y is c' = (c*A + y) mod A^k.
        self.succ_CS = (np.arange(self.n_ctx)[:, None] * A + self.next_CS) % self.n_ctx
        self._rate: float | None = None
        self._lists: tuple | None = None  # the tables as Python lists, for _chain_rows

    def generate(self, u_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        A, k = self.alphabet, self.order
        B, T = u_BT.shape
        x_BT = np.empty((B, T), dtype=np.int64)
        ctx_BT = np.zeros((B, T), dtype=np.int64)  # the context each symbol was drawn from (t >= k)
        k0 = min(k, T)
        x_BT[:, :k0] = np.minimum((u_BT[:, :k0] * A).astype(np.int64), A - 1)
        ctx_B = np.zeros(B, dtype=np.int64)
        for t in range(k0):
            ctx_B = ctx_B * A + x_BT[:, t]
        # Inverse CDF: the next symbol is the first j with u < cdf_j, i.e. j = #{cdf <= u}. The chain is sequential
        # in t; across documents it is vectorised, unless there are few of them (a training batch's share of
        # this source), where one bisection per symbol in Python beats a dozen numpy calls per position.
        if B <= ROWS_IN_PYTHON:
            self._chain_rows(u_BT, x_BT, ctx_BT, ctx_B)
        else:
            for t in range(k, T):
                j_B = np.minimum((self.cdf_CS[ctx_B] <= u_BT[:, t, None]).sum(axis=1), self.support - 1)
                ctx_BT[:, t] = ctx_B
                x_BT[:, t] = self.next_CS[ctx_B, j_B]  # NOTE: min: cdf[-1] can round to just below 1
                ctx_B = self.succ_CS[ctx_B, j_B]
        floor_BT = np.empty((B, T), dtype=np.float64)
        floor_BT[:, :k0] = math.log(A)
        floor_BT[:, k0:] = self.H_C[ctx_BT[:, k0:]]
        return x_BT, floor_BT

    def _chain_rows(self, u_BT: np.ndarray, x_BT: np.ndarray, ctx_BT: np.ndarray, ctx_B: np.ndarray) -> None:
        """The same draws as the vectorised loop, one document at a time (bisect_right(cdf, u) = #{cdf <= u})."""
        if self._lists is None:
            self._lists = (self.cdf_CS.tolist(), self.next_CS.tolist(), self.succ_CS.tolist())
        cdf, nxt, succ = self._lists
        last, k = self.support - 1, self.order
        for b, row in enumerate(u_BT[:, k:].tolist()):
            ctx, xs, cs = int(ctx_B[b]), [], []
            for u in row:
                j = min(bisect.bisect_right(cdf[ctx], u), last)
                cs.append(ctx)
                xs.append(nxt[ctx][j])
                ctx = succ[ctx][j]
            x_BT[b, k:], ctx_BT[b, k:] = xs, cs

    def _propagate(self, pi_C: np.ndarray, P_weight_CS: np.ndarray) -> np.ndarray:
        return np.bincount(self.succ_CS.ravel(), weights=(pi_C[:, None] * P_weight_CS).ravel(),
                           minlength=self.n_ctx)

    def position_floors(self, T: int) -> np.ndarray:
        """f_t = E[H(next | context)] at label position t, from the uniform start (exact)."""
        A, k = self.alphabet, self.order
        f_T = np.full(T, math.log(A))
        pi_C = np.full(self.n_ctx, 1.0 / self.n_ctx)  # the first k symbols are uniform
        for t in range(k, T):
            f_T[t] = pi_C @ self.H_C
            pi_C = self._propagate(pi_C, self.p_CS)
        return f_T

    def entropy_rate(self, tol: float = 1e-13, max_iter: int = 200_000) -> float:
        """lim_n (1/n) sum_t f_t from the uniform start.

        NOTE: a sparse chain on A^k contexts can be reducible (several closed classes: which one a
        document falls into depends on its start) and periodic (f_t oscillates). "The" stationary
        distribution is then not unique, but the Cesaro limit pi* = lim (1/n) sum_t pi_0 P^t from the
        uniform start pi_0 always exists, and it is what a long document's average loss converges to.
        The lazy chain (P + I)/2 has the same closed classes, the same absorption probabilities and the
        same stationary law within each class, and is aperiodic, so pi_0 ((P+I)/2)^t -> pi* geometrically.
        """
        if self._rate is None:
            pi_C = np.full(self.n_ctx, 1.0 / self.n_ctx)
            for _ in range(max_iter):
                nxt = 0.5 * (pi_C + self._propagate(pi_C, self.p_CS))
                done = np.abs(nxt - pi_C).sum() < tol
                pi_C = nxt
                if done:
                    break
            self._rate = float(pi_C @ self.H_C)
        return self._rate

    def summary(self) -> str:
        return (f"order-{self.order} Markov, alphabet {self.alphabet}, support {self.support}, "
                f"Dirichlet({self.concentration:g})")


class CopySource:
    """Induction: a fresh uniform segment, then an exact copy of it, repeated to the document's end."""

    kind = "copy"

    def __init__(self, name: str, alphabet: int, segment: int):
        self.name, self.alphabet, self.segment = name, alphabet, segment

    def _fresh_T(self, T: int) -> np.ndarray:
        return (np.arange(T) // self.segment) % 2 == 0

    def generate(self, u_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        B, T = u_BT.shape
        fresh_BT = np.minimum((u_BT * self.alphabet).astype(np.int64), self.alphabet - 1)
        fresh_T = self._fresh_T(T)
        src_T = np.where(fresh_T, np.arange(T), np.arange(T) - self.segment)
        floor_T = np.where(fresh_T, math.log(self.alphabet), 0.0)
        return fresh_BT[:, src_T], np.broadcast_to(floor_T, (B, T)).copy()

    def position_floors(self, T: int) -> np.ndarray:
        return np.where(self._fresh_T(T), math.log(self.alphabet), 0.0)

    def entropy_rate(self) -> float:
        return math.log(self.alphabet) / 2  # half the symbols are fresh, half are free

    def summary(self) -> str:
        return f"copy, alphabet {self.alphabet}, segment {self.segment}"
