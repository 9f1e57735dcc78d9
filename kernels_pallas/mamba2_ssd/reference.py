"""The definition of Mamba2's selective state-space scan (SSD, "state space duality"), in plain jax.numpy; also the
fallback on every backend. (The depthwise causal convolution in front of it is its own op, `causal_conv1d`, and the
gated RMSNorm after it is the layer's.)

Per head, with state S [H, Z] and one token (x [H], step dt, Mamba's input and output maps b, c [Z] of the head's
group, and the head's scalar A < 0):

    dt = clip(softplus(dt + dt_bias), *dt_limit)
    S = S * exp(dt * A) + dt * x b^T         # decay, then write the token
    y = S c + D * x                           # read, plus the D skip

`recurrent` runs that token by token (the decode form); `chunked` runs the same recurrence chunk by chunk: within a
chunk the outputs are a causal, decay-weighted product of c with b (scores c_i . b_j exp(a_i - a_j), a the
cumulative log decay), each chunk's own contribution to the state is one matmul, and only the chunks are
sequential. A position with dt = 0 after the clip (the `valid` mask sets it for padding) leaves the state exactly
as it was. Math and the state in float32.

The limits apply in both forms. (transformers' and mamba_ssm's single-token update skips them while their chunked
scans apply them; with the default limits (0, inf) the clip is the identity and the two agree.)

Letters: B batch, T tokens, N heads, H head dim (Mamba's P), G groups (each of N / G consecutive heads shares b and
c), Z state size (Mamba's d_state); C tokens of a chunk. The arguments keep Mamba's names: b and c are its B and C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 64  # tokens per chunk: the result does not depend on it beyond float32 rounding


def prepare(x, dt, A, b, c, state, D, dt_bias, dt_softplus, dt_limit, valid):
    """Checks shapes; returns float32 x [B, T, G, r, H], dt [B, T, G, r] (biased, softplus, clipped, zero at
    padding), A [G, r], b, c [B, T, G, Z], the initial state [B, G, r, H, Z] (zeros for None) and D [G, r] (zeros
    for None), r = N / G heads per group. Shared with the kernels, which start from the same inputs.

    Raises:
        ValueError: inconsistent shapes.
    """
    Bsz, T, N, H = x.shape
    G, Z = b.shape[2:]
    if dt.shape != (Bsz, T, N) or A.shape != (N,):
        raise ValueError(f"dt {dt.shape} must be [{Bsz}, {T}, {N}] and A {A.shape} [{N}] for x {x.shape}")
    if b.shape != (Bsz, T, G, Z) or c.shape != b.shape or N % G:
        raise ValueError(f"b {b.shape} and c {c.shape} must be [{Bsz}, {T}, G, Z] with G dividing {N} heads")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (N,):
            raise ValueError(f"{name} {v.shape} must be [{N}]")
    if state is not None and state.shape != (Bsz, N, H, Z):
        raise ValueError(f"state {state.shape} must be [{Bsz}, {N}, {H}, {Z}]")
    r = N // G
    f32 = jnp.float32
    dt = dt.astype(f32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(f32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = jnp.clip(dt, lo, hi)
    if valid is not None:  # padding past each row's real tokens: dt = 0, no decay and no write
        dt = jnp.where(jnp.arange(T)[None, :, None] < jnp.asarray(valid)[:, None, None], dt, 0.0)
    state = jnp.zeros((Bsz, N, H, Z), f32) if state is None else state.astype(f32)
    D = jnp.zeros((N,), f32) if D is None else D.astype(f32)
    return (x.astype(f32).reshape(Bsz, T, G, r, H), dt.reshape(Bsz, T, G, r), A.astype(f32).reshape(G, r),
            b.astype(f32), c.astype(f32), state.reshape(Bsz, G, r, H, Z), D.reshape(G, r))


def recurrent(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array, c: jax.Array,
              state: jax.Array | None = None, *, D: jax.Array | None = None, dt_bias: jax.Array | None = None,
              dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")),
              valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The scan token by token (the decode form; the definition the chunked form is tested against).

    Args:
        x: [B, T, N, H] the heads' inputs (after the convolution).
        dt: [B, T, N] the time steps, before `dt_bias` and the softplus.
        A: [N] float32, each head's (negative) continuous decay rate, -exp(A_log).
        b, c: [B, T, G, Z] the state's input and output maps, one per group of N / G consecutive heads.
        state: [B, N, H, Z] float32, the state before x; None for zeros (a sequence start).
        D: [N] the skip's weight per head; None for no skip.
        dt_bias: [N] added to dt first; None for none.
        dt_softplus: dt through a softplus after the bias (every Mamba2 model does).
        dt_limit: (low, high) dt is clipped to, after the softplus.
        valid: [B] int32 real tokens per row (None: all T); positions past it leave the state unchanged.
    Returns:
        (y [B, T, N, H] in x's dtype, final state [B, N, H, Z] float32).
    Raises:
        ValueError: inconsistent shapes.
    """
    Bsz, T, N, H = x.shape
    xf, dtf, Af, bf, cf, S0, Df = prepare(x, dt, A, b, c, state, D, dt_bias, dt_softplus, dt_limit, valid)

    def step(S, inp):  # S [B, G, r, H, Z]
        xt, dtt, bt, ct = inp  # [B, G, r, H], [B, G, r], [B, G, Z], [B, G, Z]
        S = S * jnp.exp(dtt * Af)[..., None, None] + (dtt[..., None] * xt)[..., None] * bt[:, :, None, None, :]
        return S, jnp.einsum("bgrhz,bgz->bgrh", S, ct)

    if T == 1:  # a decode step: no loop
        S, y = step(S0, (xf[:, 0], dtf[:, 0], bf[:, 0], cf[:, 0]))
        y = y[:, None]
    else:
        S, y = lax.scan(step, S0, tuple(jnp.moveaxis(a, 1, 0) for a in (xf, dtf, bf, cf)))
        y = jnp.moveaxis(y, 0, 1)
    y = y + Df[..., None] * xf
    return y.reshape(Bsz, T, N, H).astype(x.dtype), S.reshape(Bsz, N, H, -1)


def own_outputs(x, dt, cum, b, c):
    """The outputs of a chunk from its own tokens, for chunks in leading axes: x [..., C, G, r, H], dt and the
    cumulative log decay from the chunk's start `cum` [..., C, G, r], b, c [..., C, G, Z] -> [..., C, G, r, H]:
    y_i = sum_{j <= i} (c_i . b_j) exp(cum_i - cum_j) dt_j x_j."""
    C = x.shape[-4]
    causal = jnp.tril(jnp.ones((C, C), bool))[:, :, None, None]
    # exp(cum_i - cum_j) for j <= i; -inf above the diagonal before exp, where the differences are positive.
    decay = jnp.exp(jnp.where(causal, cum[..., :, None, :, :] - cum[..., None, :, :, :], -jnp.inf))
    scores = jnp.einsum("...igz,...jgz->...ijg", c, b)  # [..., C, C, G]
    return jnp.einsum("...ijg,...ijgr,...jgr,...jgrh->...igrh", scores, decay, dt, x)


def intra_chunk(x, dt, A, b, c):
    """What each chunk computes without the incoming state, for chunks in leading axes: x [..., C, G, r, H],
    dt [..., C, G, r], A [G, r], b, c [..., C, G, Z] -> (the outputs from the chunk's own tokens [..., C, G, r, H],
    the chunk's contribution to the state at its end [..., G, r, H, Z], the decay from the chunk's start to each
    token [..., C, G, r] and to its end [..., G, r])."""
    cum = jnp.cumsum(dt * A, axis=-3)  # [..., C, G, r] log decay from the chunk's start, through each token
    y = own_outputs(x, dt, cum, b, c)
    to_end = jnp.exp(cum[..., -1:, :, :] - cum) * dt  # [..., C, G, r]
    written = jnp.einsum("...jgr,...jgrh,...jgz->...grhz", to_end, x, b)
    return y, written, jnp.exp(cum), jnp.exp(cum[..., -1, :, :])


def chunked(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array, c: jax.Array,
            state: jax.Array | None = None, *, D: jax.Array | None = None, dt_bias: jax.Array | None = None,
            dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")),
            valid: jax.Array | None = None, chunk_size: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The scan chunk by chunk (the prefill form): `recurrent`'s result up to float32 rounding.

    Every chunk's own work (`intra_chunk`) is done for all chunks at once; a `lax.scan` over the chunks carries the
    state, reading it into each chunk's outputs and adding the chunk's contribution. Chunks are `chunk_size` tokens,
    or T where that is shorter (a short prefill chunk is not padded to the model's chunk); T is padded to a multiple
    of the chunk with dt = 0, which leaves the returned state unchanged.

    Args:
        x, dt, A, b, c, state, D, dt_bias, dt_softplus, dt_limit, valid: as in `recurrent`.
        chunk_size: tokens per chunk.
    Returns:
        (y [B, T, N, H] in x's dtype, final state [B, N, H, Z] float32).
    Raises:
        ValueError: inconsistent shapes.
    """
    Bsz, T, N, H = x.shape
    xf, dtf, Af, bf, cf, S0, Df = prepare(x, dt, A, b, c, state, D, dt_bias, dt_softplus, dt_limit, valid)
    C = min(chunk_size, T)
    pad = (-T) % C
    n = (T + pad) // C

    def chunks(a):  # [B, T, ...] -> [n, B, C, ...], zero-padded (dt = 0: no decay, no write)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(Bsz, n, C, *a.shape[2:]), 1, 0)

    xc, dtc, bc, cc = (chunks(a) for a in (xf, dtf, bf, cf))
    y_own, written, from_start, through = intra_chunk(xc, dtc, Af, bc, cc)

    def step(S, inp):  # S [B, G, r, H, Z]: the state at the chunk's start
        ci, start, end, own = inp
        y = jnp.einsum("bigz,bgrhz->bigrh", ci, S) * start[..., None]
        return S * end[..., None, None] + own, y

    S, y_in = lax.scan(step, S0, (cc, from_start, through, written))
    y = y_own + y_in  # [n, B, C, G, r, H]
    y = jnp.moveaxis(y, 0, 1).reshape(Bsz, n * C, N, H)[:, :T] + (Df[..., None] * xf).reshape(Bsz, T, N, H)
    return y.astype(x.dtype), S.reshape(Bsz, N, H, -1)


def mamba2_ssd(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array, c: jax.Array,
               state: jax.Array | None = None, *, D: jax.Array | None = None, dt_bias: jax.Array | None = None,
               dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")),
               valid: jax.Array | None = None, chunk_size: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """`recurrent` for one token (decode), `chunked` otherwise (prefill); same arguments and results."""
    kwargs = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, valid=valid)
    if x.shape[1] == 1:
        return recurrent(x, dt, A, b, c, state, **kwargs)
    return chunked(x, dt, A, b, c, state, chunk_size=chunk_size, **kwargs)
