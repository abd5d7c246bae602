"""The Numba kernels behind the coordinate baselines (train.eval.baselines, train.eval.context_baselines):
arrays in, arrays out, no I/O.

- ``vivaldi``: Vivaldi springs over all train pings, both ends moving (Dabek et al. 2004);
- ``sgd_factorize``: biased matrix factorization of log RTT by SGD (DMFSGD-style);
- ``place_in_contexts``: new-node placement, per context: the context's source joins a
  fitted Vivaldi space, moved by springs to its context's replies while every other node
  stays put, and answers each query from the replies before it.

The settings travel as one tuple each (the constants live in train.eval.baselines).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def shuffle(src, dst, y, s_src, s_dst, s_y):
    """Copy the samples into s_* in a fresh random order. The pass then reads them
    sequentially: three scattered reads per sample would cost more than the update."""
    order = np.random.permutation(len(src))
    for m in range(len(order)):
        k = order[m]
        s_src[m], s_dst[m], s_y[m] = src[k], dst[k], y[k]


@njit(cache=True)
def vivaldi(src, dst, rtt, n_nodes, spring, seed):
    """Vivaldi (Dabek et al. 2004, Figure 3) on height vectors (section 5.4), replaying the
    samples in a fresh random order each round. A sample is one spring between i and j: it
    moves both, each by its share of the blame, w = e_i / (e_i + e_j), from the same
    pre-sample state (destinations are mostly ping targets, which never measure, so
    updating only the source would leave them at the origin)."""
    dims, rounds, cc, ce, error0, h_min, floor = spring  # the settings, as one tuple
    np.random.seed(seed)
    x = np.zeros((n_nodes, dims))
    h = np.full(n_nodes, h_min)
    err = np.full(n_nodes, error0)
    s_src, s_dst, s_rtt = np.empty_like(src), np.empty_like(dst), np.empty_like(rtt)
    unit = np.empty(dims)
    for _ in range(rounds):
        shuffle(src, dst, rtt, s_src, s_dst, s_rtt)
        for k in range(len(s_src)):
            i, j, rtt_k = s_src[k], s_dst[k], s_rtt[k]
            planar = 0.0
            for d in range(dims):
                unit[d] = x[i, d] - x[j, d]
                planar += unit[d] * unit[d]
            planar = np.sqrt(planar)
            dist = planar + h[i] + h[j]
            # In the height-vector norm, [x_i - x_j, h_i + h_j] / dist is the unit vector:
            # a spring moves the planes apart and the heights up alike. On top of each
            # other (as all nodes start) the paper's rule picks a random direction; we pick
            # it in the plane, as a pure height direction would never separate the nodes.
            if planar > 1e-9:
                for d in range(dims):
                    unit[d] /= dist
                up = (h[i] + h[j]) / dist
            else:
                norm = 0.0
                for d in range(dims):
                    unit[d] = np.random.normal()
                    norm += unit[d] * unit[d]
                for d in range(dims):
                    unit[d] /= np.sqrt(norm)
                up = 0.0
            e_i, e_j = err[i], err[j]
            w_i = e_i / (e_i + e_j) if e_i + e_j > 0 else 0.5
            w_j = 1.0 - w_i
            sample_err = abs(dist - rtt_k) / max(rtt_k, floor)
            err[i] = min(sample_err * ce * w_i + e_i * (1.0 - ce * w_i), error0)
            err[j] = min(sample_err * ce * w_j + e_j * (1.0 - ce * w_j), error0)
            f_i = cc * w_i * (rtt_k - dist)  # adaptive timestep delta = c_c * w
            f_j = cc * w_j * (rtt_k - dist)
            for d in range(dims):
                x[i, d] += f_i * unit[d]
                x[j, d] -= f_j * unit[d]
            h[i], h[j] = max(h[i] + f_i * up, h_min), max(h[j] + f_j * up, h_min)
    return x, h


@njit(cache=True)
def sgd_factorize(src, dst, y, n_nodes, sgd, seed):
    """Biased matrix factorization by SGD on squared error plus L2 (DMFSGD's update, with
    Koren et al.'s biases and a Huber clip on the residual), samples in a fresh random
    order each epoch. mu stays the mean of y; the rest starts near 0."""
    rank, epochs, lr, decay, reg, huber, init = sgd  # the settings, as one tuple
    np.random.seed(seed)
    mu = y.mean()
    b, c = np.zeros(n_nodes), np.zeros(n_nodes)
    u, v = np.empty((n_nodes, rank)), np.empty((n_nodes, rank))
    for i in range(n_nodes):
        for r in range(rank):
            u[i, r] = init * np.random.normal()
            v[i, r] = init * np.random.normal()
    s_src, s_dst, s_y = np.empty_like(src), np.empty_like(dst), np.empty_like(y)
    for epoch in range(epochs):
        if epoch:
            lr *= decay
        shuffle(src, dst, y, s_src, s_dst, s_y)
        for k in range(len(s_src)):
            i, j = s_src[k], s_dst[k]
            pred = mu + b[i] + c[j]
            for r in range(rank):
                pred += u[i, r] * v[j, r]
            e = min(max(s_y[k] - pred, -huber), huber)
            b[i] += lr * (e - reg * b[i])
            c[j] += lr * (e - reg * c[j])
            for r in range(rank):
                ui, vj = u[i, r], v[j, r]
                u[i, r] += lr * (e * vj - reg * ui)
                v[j, r] += lr * (e * ui - reg * vj)
    return mu, b, c, u, v


@njit(cache=True)
def place_in_contexts(starts, src, dst, rtt, coords, heights, trained, place):
    """Per query, the distance from its context's source, placed by the context's earlier
    replies, to its destination; NaN where no earlier reply reached a node with
    coordinates (or the destination has none).

    A context (queries starts[c]:starts[c + 1], in context order) is one new node. It starts
    at its source's trained coordinates if it has them, else at the centroid of the trained
    nodes, at the minimum height. After each usable reply (not failed, to another node with
    trained coordinates) it replays all its usable replies so far ``rounds`` times as
    springs that move only itself (the others are a running system's settled nodes), with
    a timestep of ``cc``: a few rounds warm-started from the last placement are a
    least-squares fit of its position and height to those replies."""
    rounds, cc, h_min = place
    n, dims = len(src), coords.shape[1]
    out = np.full(n, np.nan)
    centre = np.zeros(dims)
    n_trained = 0
    for k in range(len(trained)):
        if trained[k]:
            n_trained += 1
            for d in range(dims):
                centre[d] += coords[k, d]
    if n_trained == 0:
        return out
    for d in range(dims):
        centre[d] /= n_trained
    x = np.empty(dims)
    unit = np.empty(dims)
    # the usable replies so far, copied in a row so the replays read them sequentially
    u_x, u_h, u_rtt = np.empty((n, dims)), np.empty(n), np.empty(n)
    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        s = src[a]
        for d in range(dims):
            x[d] = coords[s, d] if trained[s] else centre[d]
        h = heights[s] if trained[s] else h_min
        m = 0
        for i in range(a, b):
            j = dst[i]
            if m and trained[j]:  # answer from the replies before this query
                planar = 0.0
                for d in range(dims):
                    planar += (x[d] - coords[j, d]) ** 2
                out[i] = np.sqrt(planar) + h + heights[j]
            if rtt[i] < 0 or not trained[j] or j == s:
                continue
            for d in range(dims):
                u_x[m, d] = coords[j, d]
            u_h[m], u_rtt[m] = heights[j], rtt[i]
            m += 1
            for _ in range(rounds):
                for u in range(m):
                    planar = 0.0
                    for d in range(dims):
                        unit[d] = x[d] - u_x[u, d]
                        planar += unit[d] * unit[d]
                    planar = np.sqrt(planar)
                    dist = planar + h + u_h[u]
                    f = cc * (u_rtt[u] - dist)
                    if planar > 1e-9:
                        step = f / dist
                        for d in range(dims):
                            x[d] += step * unit[d]
                        h = max(h + step * (h + u_h[u]), h_min)
                    else:  # on top of the node: any planar direction, the same every time
                        x[0] += f
    return out
