"""Numba kernels of the context-mixing draft chooser (:class:`das.drafter.DASDrafter`, ``chooser="mix"``).

Why mixing. The ``walk`` chooser follows one anchor (one context suffix, in one tree) greedily and
keeps the walk with the best sum of path probabilities: every draft token rests on the counts of a
single context. Here each draft token is chosen from the counts of every context at once, the way
PPM/PAQ-style compressors predict the next symbol (context mixing: Mahoney, "Adaptive weighing of
context models for lossless data compression", 2005): every suffix of the request's context
(prompt + output + draft so far, up to ``max_depth - 1`` tokens; in the global tree, which is
shallower, up to ``global_depth - 1``) is looked up in every scope, each
lookup gives a probability to each candidate token, and a logistic mixer turns them into one
acceptance probability, with weights learned online from the engine's accept/reject outcomes.

Scopes (trees): 0 the problem tree (the request's own rollout, its live GRPO siblings and the
problem's history window), 1 the request tree (its prompt and own output), 2 the global tree
(the live rollouts of every problem as they are verified, and recent finished ones). The request's
sequence is in all three, so a scope's loci at the start of a draft are its sequence's active loci
(no lookups); they are tracked as the draft grows (the locus of the suffix of length ``L`` moves to
that of length ``L + 1`` with the drafted token; a new length-1 locus is looked up at the root), so
a draft token costs one child lookup per locus and candidate, and the loci then move to the children
that scoring the drafted token found (its most frequent child, or a lookup's result: no second probe).
Most of a draft token's time is cache misses on the trees' rows, and a locus's reads depend on each
other, so the kernel prefetches what the next position reads first of every locus at once (its
most frequent child's row, and each tree's hash slot of the new length-1 locus), and the
candidates' outcome-table rows before it scores them: those misses overlap instead of coming one
after the other (docs/benchmarks.md, "Step cost").

Mixer inputs for candidate token ``t`` at draft position ``j`` (:data:`NIN` floats):

* ``[0]`` bias 1;
* ``[1 + s * NB + b]``: for scope ``s``'s kept locus whose match length falls in bucket ``b``
  (1, 2, 3-4, 5-8, 9-16, 17+ tokens; one locus per bucket: the longest at the draft's first
  token, and after each draft token the loci that followed it thinned to the longest of each
  bucket again, which drafts faster at the same acceptance), ``stretch(p)``, ``p = count(t) / (count(all) + prior_s)``
  clipped to ``[0.002, 0.998]`` (``stretch(p) = ln(p / (1 - p))``, read from a table in steps of
  1/4096); 0 where no locus is there;
* ``[LONGEST + l * NT + s]``: ``stretch(p)`` at scope ``s``'s longest locus, where ``l`` is that
  locus's count level (:func:`_count_level`);
* ``[NIN - 3]`` (:data:`PAIR_RATE`) and ``[NIN - 2]`` (:data:`TOKEN_RATE`): the engine's own
  outcomes so far, ``stretch((accepted + 1) / (drafted + 2))`` of ``t`` as a draft token after
  the context's last token ``prev`` (the pair hashed), and of ``t`` after any token: the trees
  count what rollouts wrote, these count what the current policy accepted when it was drafted
  (a token the policy keeps rejecting where the history repeats it, e.g. a number in a worked
  solution, is drafted with less confidence everywhere: more acceptance at the same or fewer
  drafted tokens per accepted token on the replays, docs/benchmarks.md); the
  counts fade by the drafter's ``decay`` per policy version, as its rollouts do;
* ``[NIN - 4]`` (:data:`SUPPORT_RATE`): the same for ``t``'s *support profile*, per scope the
  match-length bucket of the longest context at which ``t`` has a count (or none; one of
  :data:`SUPPORT_ROWS` rows): how often a token with that profile was accepted. The other inputs
  enter the logit linearly; this one learns the acceptance of each combination of scopes and
  depths (e.g. deep in the problem tree but unseen in the global tree) on its own, as a PAQ
  secondary estimate keyed by context order does;
* ``[NIN - 1]``: agreement, ``2 * (share of all loci whose most frequent next token is t) - 1``.

Count levels. A locus's total weighted count (``count(all)``) says how much evidence its ``p``
rests on: ``1 / 1`` and ``90 / 100`` stretch to nearly the same input, and the prior shrinks the
first only a little. So each scope's longest-locus input comes in :data:`COUNT_LEVELS` copies,
one per level of that locus's total (below 2, 2 to 8, 8 and more), and the mixer learns a weight
for each: how far a long context seen once can be trusted against one seen often (PAQ's mixers
select their weights by such context confidence too; docs/benchmarks.md, "Evidence from code comments").

Candidates: the most frequent next tokens of the loci (the first :data:`MAX_CAND` distinct ones,
scopes in order, longest locus first). The mixer's logit is ``w[set] . x`` with
one weight set per draft position (0, 1, 2, 3+: later tokens are conditioned on earlier ones);
the token with the largest logit is drafted with conditional probability ``q``, the mixer's
``sigmoid(logit)`` through a calibration map (:func:`calibrated`; at most 0.998, the inputs'
clip); the draft stops before its path probability (product of those) falls below ``min_prob``.

Calibration (PAQ's adaptive probability maps, APM / SSE): two maps, one per weight set and one per
support profile, each with knots at logits -6, -5.5, ..., 6 whose values are the acceptance rates
counted there (outcome table 3, starting from the mixer's own probability with
:data:`APM_PRIOR` pseudo-drafts, fading as the other tables do); ``q`` is their interpolated
mean, 3 : 1 with ``sigmoid(logit)``. The path probability is a product of ``q``'s, so an
overconfident mixer drafts too far and an underconfident one stops too soon; the map corrects
both from the outcomes (docs/benchmarks.md, "Evidence from code comments").

Learning (:func:`learn_rows`): logistic regression with AdaGrad steps on each drafted token whose
outcome is known (accepted tokens, then the first rejected one), conditional on the tokens before
it; each such outcome also counts in the outcome tables. A draft that stopped by its probability
keeps the token it would have drafted next (its inputs too): when every draft token is accepted,
the engine's bonus token is the policy's own sample at that position, so it is an outcome of that
token as well (accepted iff equal: the chance of either is the policy's probability of the token).
These outcomes lie below the stopping threshold, where drafted tokens never are, so without them
the mixer and the maps never learn that tokens it stopped before were likely after all. (For
the same reason a draft the engine cut short is learned from up to the token after the cut.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from das.trie_kernels import (
    C_BEST,
    C_DEPTH,
    C_TOKEN,
    M_HASH_SHIFT,
    M_MAX_DEPTH,
    NCOL,
    R_GLOBAL_SLOT,
    R_PROBLEM_SLOT,
    R_PROBLEM_TREE,
    R_REQUEST_SLOT,
    R_REQUEST_TREE,
    S_BASE,
    S_LEN,
    S_LOCI,
    address_of,
    borrow,
    child_key,
    edge_token,
    fetch_add,
    find_child,
    find_locus_in,
    hash_slot,
    prefetch,
    views_at,
)

NT = 3  # scopes: problem tree, request tree, global tree
NB = 6  # match-length buckets: 1, 2, 3-4, 5-8, 9-16, 17+
COUNT_LEVELS = 3  # levels of a locus's total weighted count: below LEVEL_2, below LEVEL_3, the rest
LEVEL_2 = 2.0
LEVEL_3 = 8.0
NCTX = NT * NB  # scope x match-length bucket inputs
LONGEST = 1 + NCTX  # first of the longest-locus inputs (count level x scope)
NIN = 5 + NCTX + COUNT_LEVELS * NT  # mixer inputs (see the module docstring)
NSETS = 4  # weight sets, by draft position 0, 1, 2, 3+
AGREE = NIN - 1
TOKEN_RATE = NIN - 2
PAIR_RATE = NIN - 3
SUPPORT_RATE = NIN - 4
OUTCOME_SLOTS = 1 << 16  # rows of each outcome table (token ids, (previous, token) pairs hashed into them)
SUPPORT_ROWS = (NB + 1) ** NT  # support profiles: per scope, none or the bucket of its longest supporting context
_CLIP = 0.002
APM_KNOTS = 25  # calibration knots per weight set, at logits -6, -5.5, ..., 6 (outcome table 3)
APM_PRIOR = 4.0  # pseudo-drafts at each knot's starting value, the mixer's own probability there
APM_SHARE = 0.75  # weight of the calibrated probability (the rest: the mixer's own)
MAX_CAND = 4  # candidate tokens per draft position (the first distinct most-frequent tokens of the loci)
_LEVELS = 4096  # stretch() from a table over probabilities in steps of 1/4096, as PAQ's mixers do
_P = np.clip((np.arange(_LEVELS) + 0.5) / _LEVELS, _CLIP, 1.0 - _CLIP)
_STRETCH = np.log(_P / (1.0 - _P))
_ST0 = _STRETCH[0]  # stretch of a count of 0
_APM_START = 1.0 / (1.0 + np.exp(-(np.arange(APM_KNOTS) * 0.5 - 6.0)))  # each knot's starting value: sigmoid(its logit)


class MixModel(NamedTuple):
    """What the mixer has learned (:class:`das.mixer_state.MixerState` builds it once; the arrays
    are updated in place)."""

    weights: np.ndarray  # float64[NSETS * NIN], one weight set per draft position 0, 1, 2, 3+
    grad_sq: np.ndarray  # float64[NSETS * NIN], AdaGrad sums of squared gradients
    outcomes: np.ndarray  # float64[4, OUTCOME_SLOTS, 2], (accepted, drafted) per token, pair, support profile, calibration knot


class Pending(NamedTuple):
    """Each request handle's last draft, waiting for its outcome (rows by handle)."""

    tokens: np.ndarray  # int32[handles, K], the draft's tokens
    inputs: np.ndarray  # float64[handles, K, NIN], each token's mixer inputs
    sets: np.ndarray  # int64[handles, K], each token's weight-set offset
    lengths: np.ndarray  # int64[handles], draft lengths (0: none pending)
    prev: np.ndarray  # int64[handles], the context's last token when it drafted
    profiles: np.ndarray  # int64[handles, K], each token's support profile
    stop: np.ndarray  # int64[handles], the token the draft stopped before (-1: none)


class Scopes(NamedTuple):
    """Where a step's rows draft from: the requests' places in the drafter's trees (the trees
    themselves, a numba typed List, come beside it: in a tuple, numba's dispatcher would type the
    List in Python on every call, about 0.1 ms)."""

    refs: np.ndarray  # int64[handles, R_COLS], per handle its trees and slots (das.request_table.RequestTable.tree_refs)
    tree_prior: np.ndarray  # float64[tree indices], a problem tree's prior in its weight units
    request_prior: float  # the request trees' prior
    global_index: int  # the global tree's index (-1: none)
    global_prior: float  # the global tree's prior
    max_depth: int  # the largest max_depth of the trees (sizes the scratch)


class RowScopes(NamedTuple):
    """One row's scopes as :func:`_mix` reads them (scratch of :func:`_mix_rows`, int64[NT] / float64[NT])."""

    addr: np.ndarray  # scope -> its tree buffer's address (an absent scope's: a placeholder)
    tix: np.ndarray  # scope -> tree index (-1: scope absent)
    priors: np.ndarray  # scope -> prior


class Loci(NamedTuple):
    """A row's loci per scope, longest first (scratch, ``[NT, D + 1]`` and ``[NT]``)."""

    node: np.ndarray  # int64, the node at or below the locus
    depth: np.ndarray  # int64, the locus's string depth (below the node's when inside its edge)
    length: np.ndarray  # int64, the context suffix's length (match length)
    count: np.ndarray  # int64[NT], loci per scope


class MixScratch(NamedTuple):
    """Per draft position scratch of :func:`_mix`: one entry per locus (``tops`` ... ``topn``),
    per candidate and locus (``kids``), per candidate (``cand``), per input (``sums``, ``cnts``)."""

    tops: np.ndarray  # int64, the locus's most frequent next token (-1: none)
    topc: np.ndarray  # float64, that token's weighted count
    totr: np.ndarray  # float64, the locus's total weighted count
    totp: np.ndarray  # float64, that total plus the scope's prior
    feat: np.ndarray  # int64, the locus's scope x bucket input
    only: np.ndarray  # bool, the locus is inside an edge (one continuation)
    topn: np.ndarray  # int64, the node of the most frequent token
    kids: np.ndarray  # int64, per candidate and locus: the child a lookup found
    cand: np.ndarray  # int64, the candidate tokens
    sums: np.ndarray  # float64[NIN], a candidate's inputs
    cnts: np.ndarray  # float64[NIN], 1 where some locus gives an input
    srange: np.ndarray  # float64[2], the support table's range of inputs


class RowDraft(NamedTuple):
    """Where :func:`_mix` writes one row's draft: its tokens and path probabilities (the row of
    the output), and for learning its tokens' inputs, weight sets and support profiles (the
    handle's pending row) and the token it stopped before (``stop[0]``)."""

    tokens: np.ndarray
    probs: np.ndarray
    inputs: np.ndarray
    sets: np.ndarray
    profiles: np.ndarray
    stop: np.ndarray


def initial_weights() -> np.ndarray:
    """``float64[NSETS * NIN]`` starting weights: 0.3 on every scope x length input (a plain
    average of the contexts' stretched probabilities), 0 elsewhere. Learned online from there."""
    w = np.zeros(NSETS * NIN)
    for s in range(NSETS):
        w[s * NIN + 1 : s * NIN + 1 + NCTX] = 0.3
    return w


# The helpers below are plain njit functions, which LLVM inlines, not numba's inline="always":
# numba's own inlining binds each array argument to a new variable and counts a reference to it
# per call (a call and an atomic operation per locus in _mix; docs/benchmarks.md, "Evidence from
# code comments").
@njit(cache=True)
def _bucket(L):
    if L <= 2:
        return L - 1
    if L <= 4:
        return 2
    if L <= 8:
        return 3
    if L <= 16:
        return 4
    return 5


@njit(cache=True)
def _count_level(tot):
    """Count level (0, 1, 2) of a locus whose continuations' total weighted count is ``tot``."""
    return (tot >= LEVEL_2) + (tot >= LEVEL_3)


@njit(cache=True)
def _bucket_reps(lu, ld, lL, tr, c):
    """Keep only the longest locus of each match-length bucket (the loci are longest first);
    returns how many are left. Shorter loci of a bucket mostly repeat the longest one's counts,
    and each kept locus costs a child lookup per candidate token."""
    m = 0
    last = -1
    for i in range(c):
        b = _bucket(lL[tr, i])
        if b != last:
            lu[tr, m] = lu[tr, i]
            ld[tr, m] = ld[tr, i]
            lL[tr, m] = lL[tr, i]
            m += 1
            last = b
    return m


@njit(cache=True)
def _seq_loci(a, s, lu, ld, lL, tr):
    """Loci of slot ``s``'s context suffixes (its active loci) in the tree buffer at address ``a``,
    longest first, into row ``tr`` (at most the tree's own ``max_depth - 1``: the global tree is
    shallower than the others)."""
    meta, nodes, weights, hash_table, seqs, pool = views_at(a)
    w = min(seqs[s, S_LEN], meta[M_MAX_DEPTH] - 1)
    c = 0
    for L in range(w, 0, -1):
        u = seqs[s, S_LOCI + L]
        if u >= 0:
            lu[tr, c] = u
            ld[tr, c] = L  # an active locus ends exactly at a node of depth L
            lL[tr, c] = L
            c += 1
    return _bucket_reps(lu, ld, lL, tr, c)


@njit(cache=True)
def _context_loci(ga, ca, cs, lu, ld, lL, tr):
    """Loci in the tree at address ``ga`` of the context suffixes of slot ``cs``'s sequence in the
    tree at address ``ca`` (up to ``ga``'s ``max_depth - 1`` tokens), looked up from the root,
    longest first, into row ``tr``; returns how many (after :func:`_bucket_reps`). For a tree
    that does not hold the context's latest tokens (the deferred global tree,
    :class:`das.drafter.DASDrafter` ``defer_global``): a locus may end inside an edge."""
    gmeta, gnodes, gweights, ghash, gseqs, gpool = views_at(ga)
    meta, nodes, weights, hash_table, seqs, pool = views_at(ca)
    n = seqs[cs, S_LEN]
    end = seqs[cs, S_BASE] + n
    w = min(n, gmeta[M_MAX_DEPTH] - 1)
    found = 0  # a suffix absent from the tree has no longer one there either
    for L in range(1, w + 1):
        u, d = find_locus_in(gnodes, ghash, gmeta, gseqs, gpool, pool, end - L, end)
        if u < 0:
            break
        lu[tr, w - L] = u
        ld[tr, w - L] = d
        lL[tr, w - L] = L
        found = L
    c = 0
    for i in range(w - found, w):  # longest first, from index 0
        lu[tr, c] = lu[tr, i]
        ld[tr, c] = ld[tr, i]
        lL[tr, c] = lL[tr, i]
        c += 1
    return _bucket_reps(lu, ld, lL, tr, c)


@njit(cache=True)
def _last_token(a, s):
    """The last token of slot ``s``'s sequence in the tree buffer at address ``a`` (-1: empty)."""
    meta, nodes, weights, hash_table, seqs, pool = views_at(a)
    n = seqs[s, S_LEN]
    return pool[seqs[s, S_BASE] + n - 1] if n > 0 else -1


@njit(cache=True)
def _set_input(x, f, s, st, first, tot):
    """A candidate's inputs ``x``: a locus's stretched probability ``st`` is its scope x bucket
    input ``f`` (one locus per bucket) and, for the scope's first (longest) locus, whose total
    weighted count is ``tot``, the scope's longest-locus input of that count level; returns False
    (the next locus of the scope is not the first)."""
    x[f] = st
    if first:
        x[LONGEST + _count_level(tot) * NT + s] = st
    return False


@njit(cache=True)
def _outcome_slots(prev, t):
    """Rows of draft token ``t`` (after context token ``prev``) in outcome tables 0 and 1: the
    token id, and the pair hashed (Fibonacci-style multipliers; collisions only blur the rate).
    Table 2's row, the support profile, is found while scoring ``t`` (:func:`_mix`)."""
    return t & (OUTCOME_SLOTS - 1), ((prev * 0x9E3779B1) ^ (t * 0x85EBCA77)) & (OUTCOME_SLOTS - 1)


@njit(cache=True)
def _rate_input(outcomes, table, i):
    """``stretch`` of the acceptance rate in row ``i`` of outcome table ``table`` (with one accepted
    and one rejected pseudo-count: 0 for a row never drafted)."""
    p = (outcomes[table, i, 0] + 1.0) / (outcomes[table, i, 1] + 2.0)
    return _STRETCH[min(int(p * _LEVELS), _LEVELS - 1)]


@njit(cache=True)
def apm_knot(key, z):
    """Outcome table 3's row of the knot at or below logit ``z`` for calibration map ``key``,
    and the interpolation weight of the next knot."""
    x = (min(max(z, -6.0), 6.0) + 6.0) * 2.0
    i = min(int(x), APM_KNOTS - 2)
    return key * APM_KNOTS + i, x - i


@njit(cache=True)
def _apm_value(outcomes, row):
    """Knot ``row``'s value: its counted acceptance rate, from its starting value with APM_PRIOR pseudo-drafts."""
    return (outcomes[3, row, 0] + APM_PRIOR * _APM_START[row % APM_KNOTS]) / (outcomes[3, row, 1] + APM_PRIOR)


@njit(cache=True)
def _apm_read(outcomes, key, z):
    """Calibration map ``key`` at logit ``z``: its two nearest knots' values, interpolated."""
    row, w = apm_knot(key, z)
    return (1.0 - w) * _apm_value(outcomes, row) + w * _apm_value(outcomes, row + 1)


@njit(cache=True)
def calibrated(outcomes, so, sup, z):
    """The mixer's acceptance probability ``sigmoid(z)`` through an adaptive calibration map
    (PAQ's APM / secondary symbol estimation): per weight set, knots over the logit whose
    values are the acceptance rates counted there (outcome table 3), interpolated, and mixed
    with the mixer's own probability."""
    a = 0.5 * (_apm_read(outcomes, so // NIN, z) + _apm_read(outcomes, NSETS + sup, z))
    return APM_SHARE * a + (1.0 - APM_SHARE) / (1.0 + math.exp(-z))


@njit(cache=True)
def _others_bound(tix, nl, scratch, ntop, nc, model, so, prev):
    """An upper bound of the mixer's logit for every candidate but the first (``cand[1:nc]``),
    from the loci's top counts alone (no child lookups): at a locus whose most frequent token is
    the first candidate, another token has at most the rest of the count, elsewhere at most the
    top count; each input lies between its value at those counts and at a count of 0, and the
    logit is bounded input by input by the larger of ``w * low`` and ``w * high``. Uses ``sums``
    (the inputs at those counts) and ``cnts`` (1 where a locus gives the input) as scratch."""
    tops, topc, totr, totp, feat, only, topn, kids, cand, sums, cnts, srange = scratch
    wt = model.weights
    outcomes = model.outcomes
    a = cand[0]
    for f in range(NIN):
        sums[f] = 0.0
        cnts[f] = 0.0
    j0 = 0
    for s in range(NT):
        if tix[s] < 0:
            continue
        first = True
        for j in range(j0, j0 + nl[s]):  # scope s's loci in tops / topc / totr / totp / feat / only
            if tops[j] < 0:
                continue
            if tops[j] != a:
                c = topc[j]
            elif only[j]:
                c = 0.0
            else:
                c = max(totr[j] - topc[j], 0.0) * (1.0 + 1e-9)  # the margin covers the rounding of the totals
            st = _STRETCH[min(int(c / totp[j] * _LEVELS), _LEVELS - 1)] if c > 0.0 else _ST0
            _set_input(cnts, feat[j], s, 1.0, first, totr[j])  # the inputs some locus gives
            first = _set_input(sums, feat[j], s, st, first, totr[j])
        j0 += nl[s]
    most = 0.0
    thi = -1e300  # the outcome-rate inputs: their range over the other candidates (two reads each)
    tlo = 1e300
    phi = -1e300
    plo = 1e300
    for ci in range(1, nc):
        ti, pi = _outcome_slots(prev, cand[ci])
        v = _rate_input(outcomes, 0, ti)
        thi = max(thi, v)
        tlo = min(tlo, v)
        v = _rate_input(outcomes, 1, pi)
        phi = max(phi, v)
        plo = min(plo, v)
    for ci in range(1, nc):
        m = 0.0
        for j in range(ntop):
            if tops[j] == cand[ci]:
                m += 1.0
        most = max(most, m)
    z = wt[so]  # the bias input is 1 for every candidate
    for f in range(1, NIN):
        if f == AGREE:
            hi = 2.0 * most / ntop - 1.0
            lo = -1.0
        elif f == TOKEN_RATE:
            hi = thi
            lo = tlo
        elif f == PAIR_RATE:
            hi = phi
            lo = plo
        elif f == SUPPORT_RATE:  # any profile: the table's range
            hi = srange[0]
            lo = srange[1]
        elif cnts[f] > 0.0:
            hi = sums[f]
            lo = _ST0
        else:
            continue
        w = wt[so + f]
        z += max(w * hi, w * lo)
    return z + 1e-9 * (1.0 + abs(z))  # a margin for the rounding of the exact logits


@njit(cache=True)
def _mix(scopes, loci, scratch, model, K, min_prob, prev, out):
    """Draft up to ``K`` tokens by mixing the loci of scopes 0, 1, 2 (tree buffers at ``addr[s]``,
    :func:`das.trie_kernels.address_of`; ``tix[s] < 0``: scope ``s`` absent, its buffer a
    placeholder). Writes the draft to ``out_tok`` / ``out_prob`` (path probabilities), each
    token's inputs to ``xrow[j]`` and weight set to ``xset[j]``; returns its length. A draft that stops by its probability
    also writes the token it stopped before to ``stop[0]`` (left as the caller set it otherwise).
    ``scopes``: :class:`RowScopes`; ``loci``: :class:`Loci`; ``scratch``: :class:`MixScratch`;
    ``model``: :class:`MixModel` (read only); ``out``: :class:`RowDraft`."""
    addr, tix, priors = scopes
    lu, ld, lL, nl = loci
    tops, topc, totr, totp, feat, only, topn, kids, cand, sums, cnts, srange = scratch
    wt = model.weights
    outcomes = model.outcomes
    out_tok, out_prob, xrow, xset, xsup, stop = out
    P = 1.0
    k = 0
    while k < K:
        # each locus once: its most frequent next token (tops), that token's count, the total + prior
        # (totp), its input (feat), whether t is its only continuation (only), longest of its scope
        ntop = 0
        nc = 0
        for s in range(NT):
            if tix[s] < 0:
                continue
            meta, nodes, weights, hash_table, seqs, pool = views_at(addr[s])
            for i in range(nl[s]):
                u = lu[s, i]
                d = ld[s, i]
                if d < nodes[u, C_DEPTH]:  # inside an edge: one continuation
                    t = edge_token(nodes, seqs, pool, u, d)
                    tot = weights[u, 0]
                    top = tot
                    only[ntop] = True
                else:
                    b = nodes[u, C_BEST]
                    tot = weights[u, 1]
                    if b < 0 or not tot > 0.0:
                        t = -1
                        top = 0.0
                    else:
                        t = nodes[b, C_TOKEN]
                        top = weights[b, 0]
                    topn[ntop] = b
                    # a node: the token is looked up as any candidate is, also where the node has one
                    # child (taking C_NCHILD == 1 for "the only continuation" changes the drafts)
                    only[ntop] = False
                tops[ntop] = t
                topc[ntop] = top
                totr[ntop] = tot
                totp[ntop] = tot + priors[s] if t >= 0 else 0.0
                feat[ntop] = 1 + s * NB + _bucket(lL[s, i])
                ntop += 1
                if t < 0:
                    continue
                new = nc < MAX_CAND
                for j in range(nc):
                    if cand[j] == t:
                        new = False
                        break
                if new:
                    cand[nc] = t
                    nc += 1
        if nc == 0:
            break
        for ci in range(nc):  # the candidates' outcome-table rows: their misses overlap the lookups below
            ti, pi = _outcome_slots(prev, cand[ci])
            prefetch(outcomes, 2 * ti)
            prefetch(outcomes, 2 * (OUTCOME_SLOTS + pi))
        so = min(k, NSETS - 1) * NIN
        bz = -1e300
        bt = -1
        bci = 0
        bsup = 0
        lw = tops.shape[0]
        for ci in range(nc):
            if ci == 1 and _others_bound(tix, nl, scratch, ntop, nc, model, so, prev) < bz:
                break  # no other candidate can beat the first: skip their lookups (the same draft)
            t = cand[ci]
            for f in range(NIN):
                sums[f] = 0.0
            agree = 0.0
            li = 0
            sup = 0  # t's support profile (SUPPORT_RATE), one base-(NB + 1) digit per scope
            for s in range(NT):
                sup *= NB + 1
                if tix[s] < 0:
                    continue
                deepest = 0
                meta, nodes, weights, hash_table, seqs, pool = views_at(addr[s])
                shift = meta[M_HASH_SHIFT]
                first = True
                for i in range(nl[s]):
                    j = li  # this locus's entry in tops / topc / totp / feat / only
                    li += 1
                    if tops[j] < 0:
                        continue
                    if tops[j] == t:
                        st = _STRETCH[min(int(topc[j] / totp[j] * _LEVELS), _LEVELS - 1)]
                        agree += 1.0
                    elif only[j]:
                        st = _ST0  # t is not this locus's continuation
                    else:
                        c = find_child(nodes, hash_table, shift, lu[s, i], t)
                        kids[ci * lw + j] = c  # where the locus goes if t is drafted
                        cnt = weights[c, 0] if c >= 0 else 0.0
                        st = _STRETCH[min(int(cnt / totp[j] * _LEVELS), _LEVELS - 1)] if cnt > 0.0 else _ST0
                    if deepest == 0 and st > _ST0:  # the loci are longest first
                        deepest = 1 + _bucket(lL[s, i])
                    first = _set_input(sums, feat[j], s, st, first, totr[j])
                sup += deepest
            sums[SUPPORT_RATE] = _rate_input(outcomes, 2, sup)
            sums[AGREE] = 2.0 * agree / ntop - 1.0
            ti, pi = _outcome_slots(prev, t)
            sums[TOKEN_RATE] = _rate_input(outcomes, 0, ti)
            sums[PAIR_RATE] = _rate_input(outcomes, 1, pi)
            sums[0] = 1.0
            z = 0.0
            for f in range(NIN):  # an absent input is 0 and adds nothing: the same logit as summing the present ones
                z += wt[so + f] * sums[f]
            if z > bz:
                bz = z
                bt = t
                bci = ci
                bsup = sup
                for f in range(NIN):
                    xrow[k, f] = sums[f]
        # clipped as the inputs are: the sum of many agreeing inputs is no certainty that a
        # sampling policy repeats a token (the cost budget prices draft tokens by these)
        q = min(calibrated(outcomes, so, bsup, bz), 1.0 - _CLIP)
        if P * q < min_prob:
            stop[0] = bt  # the token it would have drafted next: learned from if the draft is all accepted
            xset[k] = so
            xsup[k] = bsup
            break
        P *= q
        out_tok[k] = bt
        out_prob[k] = P
        prev = bt
        xset[k] = so
        xsup[k] = bsup
        k += 1
        if k == K:
            break
        for s in range(NT):  # the new length-1 loci's hash slots (the root's children are hashed): their misses at once
            if tix[s] >= 0:
                meta, nodes, weights, hash_table, seqs, pool = views_at(addr[s])
                prefetch(hash_table, 2 * hash_slot(child_key(0, bt), meta[M_HASH_SHIFT], hash_table.shape[0] - 1))
        li = 0
        for s in range(NT):  # every locus follows the drafted token
            if tix[s] < 0:
                continue
            meta, nodes, weights, hash_table, seqs, pool = views_at(addr[s])
            shift = meta[M_HASH_SHIFT]
            top = meta[M_MAX_DEPTH] - 1  # the scope's longest context (its tree's own depth)
            m = 0
            for i in range(nl[s]):
                j = li  # this locus's entry in tops / topn / only
                li += 1
                u = lu[s, i]
                d = ld[s, i]
                if lL[s, i] + 1 > top:
                    continue
                if only[j]:  # inside an edge: its one continuation
                    if tops[j] != bt:
                        continue
                else:
                    # the child was found while scoring bt (in a hashed node, a probe saved), unless
                    # the locus had no most frequent child
                    if tops[j] == bt:
                        c = topn[j]
                    elif tops[j] >= 0:
                        c = kids[bci * lw + j]
                    else:
                        c = find_child(nodes, hash_table, shift, u, bt)
                    if c < 0:
                        continue
                    u = c
                lu[s, m] = u
                ld[s, m] = d + 1
                lL[s, m] = lL[s, i] + 1
                m += 1
            r = find_child(nodes, hash_table, shift, 0, bt)
            if r >= 0:
                lu[s, m] = r
                ld[s, m] = 1
                lL[s, m] = 1
                m += 1
            # two loci in one bucket read nearly the same counts: keep the longest (the same
            # acceptance at less drafting time; docs/benchmarks.md, "Evidence from code comments")
            nl[s] = _bucket_reps(lu, ld, lL, s, m)
            for i in range(nl[s]):  # the next position reads each locus's most frequent child: start those misses at once
                b = nodes[lu[s, i], C_BEST]
                if b >= 0:
                    prefetch(nodes, b * NCOL)
    return k


@njit(cache=True)
def mix_batch(trees, scopes, handles, budgets, min_probs, model, pending, glook, out):
    """Context-mixing drafts for every row (see the module docstring): request ``handles[r]``
    drafts up to ``budgets[r]`` tokens from its problem tree (prior ``scopes.tree_prior[tree]``),
    its request tree (prior ``scopes.request_prior``) and the global tree
    ``trees[scopes.global_index]`` (``trees``: numba typed List of the tree buffers by index;
    prior ``scopes.global_prior``; index -1: none). ``scopes`` holds the fields of
    :class:`Scopes`, ``model`` of :class:`MixModel`, ``pending`` of :class:`Pending` and ``out`` of
    :class:`das.draft.DraftBatch`, each as a plain tuple in that order (numba's dispatcher types a
    plain tuple of arrays in C, a NamedTuple in Python: microseconds a call). Row ``r``'s draft
    stops before its path probability falls below ``min_probs[r]`` (float64, one per row). Writes ``out``:
    ``tokens[r, :k]`` / ``probs[r, :k]`` (the rest: -1 / 0.0) and ``lengths[r]``, and for learning
    the draft per handle in ``pending`` (:class:`Pending`): its tokens, inputs, weight-set offsets,
    support profiles, length ``k`` and the context's last token. ``model`` (:class:`MixModel`) is
    read only: the weights, and the outcome tables (accepted, drafted) per token id, per (previous
    token, token) pair and per support profile (table 3: the calibration maps). ``pending.stop[h]``:
    the token the draft stopped before by its probability (its inputs, weight set and profile at
    index ``k``), else -1. ``scopes.max_depth``: the largest ``max_depth`` of the trees (it sizes
    the scratch arrays; each scope reads contexts up to its own tree's depth). ``glook``: the
    global scope's loci are looked up from the root (:func:`_context_loci`) instead of read from
    the request's live sequence there (which lags the context when the drafter defers its appends
    to the global tree). One thread."""
    _mix_rows(trees, scopes, handles, budgets, min_probs, model, pending, glook, out, np.zeros(1, np.int64))


@njit(cache=True, parallel=True)
def mix_batch_parallel(trees, scopes, handles, budgets, min_probs, model, pending, glook, out, parts):
    """:func:`mix_batch` on ``parts`` threads (numba's ``prange``), as vLLM's n-gram proposer
    batches its rows. Each part claims the next undrafted row from a shared counter
    (:func:`das.trie_kernels.fetch_add`) until none is left, so a part that drew short drafts
    takes more rows instead of waiting for one that drew long ones. The same drafts. Rows only
    read the trees and the weights and write their own row and handle, so the handles must be
    distinct (the caller checks)."""
    claim = np.zeros(1, np.int64)
    for _p in prange(parts):
        _mix_rows(trees, scopes, handles, budgets, min_probs, model, pending, glook, out, claim)


@njit(cache=True)
def _mix_rows(trees, scopes, handles, budgets, min_probs, model, pending, glook, out, claim):
    """:func:`mix_batch` for rows claimed one at a time from the counter ``claim[0]``
    (``int64[1]``, from 0, shared by the parts; alone, a part takes every row in order) until
    every row is taken. With its own scratch arrays."""
    # the scratch arrays are views of one block per dtype: 3 allocations instead of 20, a large
    # share of a one-row call such as DASDrafter.speculate
    refs, tree_prior, request_prior, global_index, global_prior, D = scopes
    weights, grad_sq, outcomes = model
    ptok, pin, pset, plen, pprev, pprof, pstop = pending
    otok, oprob, olen = out
    W = NT * (D + 1)
    ib = np.empty((7 + MAX_CAND) * W + 3 * NT + 1, np.int64)
    fb = np.empty(3 * W + NT + 2 * NIN + 2, np.float64)
    only = np.empty(W, np.bool_)
    o = (7 + MAX_CAND) * W
    # every array borrowed (das.trie_kernels.borrow): numba counts a reference, atomically,
    # whenever a variable or an inlined helper's parameter takes an array (several times per locus
    # in _mix; both threads count on the shared weights' and tables' counters). These arrays
    # outlive the call: the arguments are the caller's, the scratch arrays this function's.
    loci = Loci(borrow(ib[0:W].reshape((NT, D + 1))), borrow(ib[W : 2 * W].reshape((NT, D + 1))),
                borrow(ib[2 * W : 3 * W].reshape((NT, D + 1))), borrow(ib[o : o + NT]))
    row = RowScopes(borrow(ib[o + 2 * NT : o + 3 * NT]), borrow(ib[o + NT : o + 2 * NT]), borrow(fb[3 * W : 3 * W + NT]))
    scratch = MixScratch(borrow(ib[3 * W : 4 * W]), borrow(fb[0:W]), borrow(fb[W : 2 * W]), borrow(fb[2 * W : 3 * W]),
                         borrow(ib[4 * W : 5 * W]), borrow(only), borrow(ib[5 * W : 6 * W]), borrow(ib[7 * W : (7 + MAX_CAND) * W]),
                         borrow(ib[6 * W : 7 * W]), borrow(fb[3 * W + NT : 3 * W + NT + NIN]),
                         borrow(fb[3 * W + NT + NIN : 3 * W + NT + 2 * NIN]), borrow(fb[3 * W + NT + 2 * NIN : 3 * W + NT + 2 * NIN + 2]))
    stop = borrow(ib[o + 3 * NT : o + 3 * NT + 1])
    mine = Scopes(borrow(refs), borrow(tree_prior), request_prior, global_index, global_prior, D)
    learned = MixModel(borrow(weights), borrow(grad_sq), borrow(outcomes))
    waiting = Pending(borrow(ptok), borrow(pin), borrow(pset), borrow(plen), borrow(pprev), borrow(pprof), borrow(pstop))
    drafts = (borrow(otok), borrow(oprob), borrow(olen))
    _mix_rows_borrowed(trees, mine, borrow(handles), borrow(budgets), borrow(min_probs), learned, waiting, glook, drafts, borrow(claim),
                       (row, loci, scratch, stop))


@njit(cache=True)
def _mix_rows_borrowed(trees, scopes, handles, budgets, min_probs, model, pending, glook, out, claim, work):
    """:func:`_mix_rows`'s row loop, on borrowed arrays (:func:`borrow`); ``work``: the scratch
    (:class:`RowScopes`, :class:`Loci`, :class:`MixScratch`, the stop token's cell)."""
    ri, tprior, req_prior, gti, gprior, D = scopes
    out_tok, out_prob, out_len = out
    dtok, dx, dset, dk, dprev, dsup, dstop = pending
    row, loci, scratch, stop = work
    addr, tix, priors = row
    lu, ld, lL, nl = loci
    srange = scratch.srange
    outcomes = model.outcomes
    width = out_tok.shape[1]
    srange[0] = -1e300
    srange[1] = 1e300
    for i in range(SUPPORT_ROWS):
        v = _rate_input(outcomes, 2, i)
        srange[0] = max(srange[0], v)
        srange[1] = min(srange[1], v)
    ga = address_of(trees[gti]) if gti >= 0 else 0
    rows = handles.shape[0]
    while True:
        r = fetch_add(claim, 0, 1)
        if r >= rows:
            break
        m = budgets[r]
        h = handles[r]
        k = 0
        stop[0] = -1
        pt = ri[h, R_PROBLEM_TREE]
        rt = ri[h, R_REQUEST_TREE]
        if m > 0 and (pt >= 0 or rt >= 0):
            tix[0] = pt
            tix[1] = rt
            tix[2] = gti
            # the scopes' buffers by address (an absent scope's: a placeholder); the global tree's
            # is taken once per call: every row reads it, and a typed List's item costs a count
            addr[0] = address_of(trees[pt]) if pt >= 0 else address_of(trees[rt])
            addr[1] = address_of(trees[rt]) if rt >= 0 else addr[0]
            addr[2] = ga if gti >= 0 else addr[0]
            nl[:] = 0
            if pt >= 0:
                priors[0] = tprior[pt]
                nl[0] = _seq_loci(addr[0], ri[h, R_PROBLEM_SLOT], lu, ld, lL, 0)
            if rt >= 0:
                priors[1] = req_prior
                nl[1] = _seq_loci(addr[1], ri[h, R_REQUEST_SLOT], lu, ld, lL, 1)
            sl = ri[h, R_PROBLEM_SLOT] if pt >= 0 else ri[h, R_REQUEST_SLOT]  # the context, in the tree at addr[0]
            if gti >= 0 and ri[h, R_GLOBAL_SLOT] >= 0:  # its live sequence in the global tree: its loci
                priors[2] = gprior
                if glook:
                    nl[2] = _context_loci(addr[2], addr[0], sl, lu, ld, lL, 2)
                else:
                    nl[2] = _seq_loci(addr[2], ri[h, R_GLOBAL_SLOT], lu, ld, lL, 2)
            prev = _last_token(addr[0], sl)
            dprev[h] = prev
            k = _mix(row, loci, scratch, model, m, min_probs[r], prev, RowDraft(out_tok[r], out_prob[r], dx[h], dset[h], dsup[h], stop))
            for j in range(k):
                dtok[h, j] = out_tok[r, j]
        dk[h] = k
        dstop[h] = stop[0]  # set only when the draft stopped by its probability (so k < m)
        out_len[r] = k
        for j in range(k, width):
            out_tok[r, j] = -1
            out_prob[r, j] = 0.0


@njit(cache=True)
def learn_rows(model, lr, handles, tokens, starts, ends, pending):
    """Learn from the outcomes of the rows' pending drafts: row ``r``'s verified tokens
    ``tokens[r, starts[r]:ends[r]]`` against request ``handles[r]``'s last draft ``dtok[h, :dk[h]]``
    (a row appending nothing leaves its draft pending).
    Draft token ``j`` was accepted iff it equals verified token ``j`` (a recovered token never
    equals the draft token it replaces), given tokens ``< j`` were; each known outcome is one
    logistic-regression step (AdaGrad: ``g2`` holds the squared gradients) on its inputs and one
    count in each ``outcomes`` table (its token's row, its (previous token, token) row, its support
    profile's row ``dsup[h, j]``, and in table 3 its two calibration maps at its logit, split
    between the two nearest knots; the first draft token's previous token is ``dprev[h]``). When
    every draft token was accepted and a token follows, the stop token ``dstop[h]`` (if any) is
    learned from it the same way. Clears ``dk[h]`` and ``dstop[h]``. Returns the outcomes learned from.
    ``model``: :class:`MixModel` (``wt`` its weights, ``g2`` its squared gradients, ``outcomes``
    its tables); ``pending``: :class:`Pending` (``dtok``, ``dx``, ``dset``, ``dk``, ``dprev``,
    ``dsup``, ``dstop`` its tokens, inputs, sets, lengths, previous tokens, profiles and stops)."""
    wt, g2, outcomes = model
    dtok, dx, dset, dk, dprev, dsup, dstop = pending
    n = 0
    for r in range(handles.shape[0]):
        h = handles[r]
        k = dk[h]
        a = starts[r]
        st = dstop[h]
        if (k <= 0 and st < 0) or ends[r] <= a:  # no draft pending, or no verification yet (nothing appended)
            continue
        dk[h] = 0
        dstop[h] = -1
        prev = dprev[h]
        for j in range(min(k + (1 if st >= 0 else 0), ends[r] - a)):
            t = dtok[h, j] if j < k else st
            y = 1.0 if t == tokens[r, a + j] else 0.0
            so = dset[h, j]
            z = 0.0
            for f in range(NIN):
                z += wt[so + f] * dx[h, j, f]
            g = 1.0 / (1.0 + math.exp(-z)) - y
            for f in range(NIN):
                gf = g * dx[h, j, f]
                if gf != 0.0:
                    g2[so + f] += gf * gf
                    wt[so + f] -= lr * gf / math.sqrt(g2[so + f])
            ti, pi = _outcome_slots(prev, t)
            outcomes[0, ti, 0] += y
            outcomes[0, ti, 1] += 1.0
            outcomes[1, pi, 0] += y
            outcomes[1, pi, 1] += 1.0
            outcomes[2, dsup[h, j], 0] += y
            outcomes[2, dsup[h, j], 1] += 1.0
            for key in (so // NIN, NSETS + dsup[h, j]):
                row, w = apm_knot(key, z)
                outcomes[3, row, 0] += y * (1.0 - w)
                outcomes[3, row, 1] += 1.0 - w
                outcomes[3, row + 1, 0] += y * w
                outcomes[3, row + 1, 1] += w
            prev = t
            n += 1
            if y == 0.0:
                break
    return n
