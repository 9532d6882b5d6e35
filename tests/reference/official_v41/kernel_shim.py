"""Our torch-1.13 stand-in for DeepSeek-V4.1's `inference/kernel.py` (tilelang), written from the kernels'
semantics (the call sites in the official `inference/model.py`, and the torch CPU port `kernel_cpu.py` in
tenstorrent/tt-metal, whose code is not used), for running the official `model.py` on CPU.

The official code imports six names from `kernel`: act_quant, fp4_act_quant, fp8_gemm, fp4_gemm,
sparse_attn and hc_split_sinkhorn. Torch 1.13 has no float8 / float4 dtypes, so the "fp8 tensors" that
pass between act_quant and the GEMMs here are float32 tensors whose values lie on the e4m3 grid, and
quantized weights arrive as uint8 codes (e4m3 bytes, or two e2m1 nibbles per byte, the even element in
the low nibble) with uint8 E8M0 exponents as scales; see run_official.py for how the weights get there.

Numerics:
- e4m3 / e2m1 casts are round-to-nearest-even with saturation (±448 / ±6), computed from the binade of
  each value: e4m3 has 3 mantissa bits and a smallest normal exponent of -6, e2m1 has 1 mantissa bit and
  a smallest normal exponent of 0.
- a power-of-two ("ue8m0") scale is 2^ceil(log2(v)) taken from the fp32 bits of v = amax * fp32(1/max):
  the biased exponent, plus one when the mantissa is non-zero.
- the GEMMs sum each 32-wide K block in fp32, multiply the block sum by its two scales, and add the
  scaled partials in K order; the block sums are exact products of short mantissas, so only the order
  inside a block can differ from the tensor-core kernel (at most about one bf16 ulp of the output).
- sparse_attn is an online softmax over blocks of 64 indices: the running max starts at -1e30, the
  probabilities relative to the running max are rounded to bf16 before P·V while their fp32 sum feeds
  the denominator, index -1 is skipped, and the sink adds exp(sink - max) to the denominator only.
- hc_split_sinkhorn is the V4 routine, unchanged in V4.1, all in fp32.
"""

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
SPARSE_BLOCK = 64  # indices per online-softmax step in the attention kernel

# Diagnostic switch (run_official.py --exact): no bf16 rounding inside the kernels and no bf16-only input
# checks, so REF's graph can run in float32. Off for every REF-numerics run.
EXACT = False

# Sentinels for the dtype names the official code uses; run_official.py installs them on `torch` when the
# installed torch lacks the real ones. Equality is identity.


class FakeDtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name} (shim)"


def dtype_e4m3():
    return getattr(torch, "float8_e4m3fn")


# ---------------------------------------------------------------------------------------------------
# codecs (lookup tables built from the bit layouts)
# ---------------------------------------------------------------------------------------------------


def _e4m3_lut():
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            vals.append(float("nan"))
        elif e == 0:
            vals.append(sign * m * 2.0**-9)
        else:
            vals.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float32)


E4M3_LUT = _e4m3_lut()  # [256] float32, code -> value
E2M1_POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
E2M1_LUT = torch.cat([E2M1_POS, -E2M1_POS])  # [16]: bit 3 is the sign


def e8m0_to_f32(b):
    """uint8 biased exponents -> float32 2^(b-127); 0xFF would be NaN and is refused."""
    b = b.to(torch.int32)
    if bool((b == 255).any()):
        raise ValueError("E8M0 scale byte 0xFF (NaN)")
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), (b - 127).double()).float()


def decode_e4m3(codes):
    return E4M3_LUT[codes.long()]


def decode_fp4_packed(packed):
    """uint8 [..., K/2] -> float32 [..., K]; element 2j in the low nibble, 2j+1 in the high nibble."""
    p = packed.long()
    return torch.stack([E2M1_LUT[p & 0xF], E2M1_LUT[p >> 4]], dim=-1).flatten(-2)


def _floor_log2(a):
    """floor(log2(a)) for a > 0 (exact, from frexp: a = m 2^e with 0.5 <= m < 1); 0 gives -1."""
    _, e = torch.frexp(a)
    return e.to(torch.float32) - 1.0


def round_e4m3(v):
    """float32 -> nearest e4m3fn value (ties to even), saturating at ±448."""
    v = v.float().clamp(-FP8_MAX, FP8_MAX)
    step = torch.exp2(torch.clamp(_floor_log2(v.abs()), min=-6.0) - 3.0)
    return torch.round(v / step) * step  # torch.round is half-to-even; v/step and *step are exact


def round_e2m1(v):
    """float32 -> nearest e2m1 value (ties to even), saturating at ±6."""
    v = v.float().clamp(-FP4_MAX, FP4_MAX)
    step = torch.exp2(torch.clamp(_floor_log2(v.abs()), min=0.0) - 1.0)
    return torch.round(v / step) * step


def encode_e4m3(v):
    """values already on the e4m3 grid -> uint8 codes (the sign of -0.0 is kept)."""
    pos = E4M3_LUT[:127]  # codes 0x00..0x7e ascend from 0 to 448
    a = v.float().abs()
    idx = torch.searchsorted(pos, a)
    if not bool((pos[idx.clamp(max=126)] == a).all()):
        raise ValueError("encode_e4m3: value not on the e4m3 grid")
    return (idx | (torch.signbit(v).long() << 7)).to(torch.uint8)


def encode_e2m1(v):
    """values already on the e2m1 grid -> 4-bit codes in uint8."""
    a = v.float().abs()
    idx = torch.searchsorted(E2M1_POS, a)
    if not bool((E2M1_POS[idx.clamp(max=7)] == a).all()):
        raise ValueError("encode_e2m1: value not on the e2m1 grid")
    return (idx | (torch.signbit(v).long() << 3)).to(torch.uint8)


def pow2_scale(amax, inv_max):
    """2^ceil(log2(amax * inv_max)) with the product formed in fp32, from its bits."""
    x = (amax.float() * torch.tensor(inv_max, dtype=torch.float32)).contiguous()
    bits = x.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------------
# the six kernels
# ---------------------------------------------------------------------------------------------------


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=None, inplace=False):
    """Per-token FP8 quantization of the last dim in blocks of `block_size`.
    -> (e4m3-grid values as float32 [..., K], scales float32 [..., K/block]); inplace: x <- bf16(q*s)."""
    assert EXACT or x.dtype == torch.bfloat16, "the kernel takes bf16 input"
    k = x.size(-1)
    assert k % block_size == 0, (k, block_size)
    xb = x.float().unflatten(-1, (-1, block_size))  # [..., K/block, block]
    amax = xb.abs().amax(-1).clamp_min(1e-4)
    if scale_fmt is not None:
        s = pow2_scale(amax, 1.0 / FP8_MAX)
    else:
        s = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    q = round_e4m3(xb / s.unsqueeze(-1))
    if inplace:
        x.copy_((q * s.unsqueeze(-1)).flatten(-2).to(x.dtype))
        return x
    return q.flatten(-2), s


def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=None):
    """FP4 (e2m1) quantize-dequantize of the last dim in groups of `block_size`. E8M0 scales
    (the default, the indexer): 2^ceil(log2(max(amax, 6*2^-126)/6)); E4M3 scales (compressed KV,
    scale_dtype=float8_e4m3fn): e4m3(max(amax, 6*2^-9) / 6)."""
    assert EXACT or x.dtype == torch.bfloat16, "the kernel takes bf16 input"
    k = x.size(-1)
    assert k % block_size == 0, (k, block_size)
    xb = x.float().unflatten(-1, (-1, block_size))
    amax = xb.abs().amax(-1)
    if scale_dtype is not None and scale_dtype is dtype_e4m3():
        s = round_e4m3(amax.clamp_min(6 * 2.0**-9) / FP4_MAX)
    else:
        s = pow2_scale(amax.clamp_min(6 * 2.0**-126), 1.0 / FP4_MAX)
    q = round_e2m1(xb / s.unsqueeze(-1))
    if inplace:
        x.copy_((q * s.unsqueeze(-1)).flatten(-2).to(x.dtype))
        return x
    return q.flatten(-2), s


def _block_gemm(a, a_s, b, b_s, block):
    """sum over K blocks, in order, of (a_blk @ b_blk^T) * a_s[:, k] * b_s[:, k]; all float32.
    a [M, K], a_s [M, K/block], b [N, K], b_s [N, K/block] -> [M, N]"""
    m, n = a.size(0), b.size(0)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for kb in range(a.size(1) // block):
        sl = slice(kb * block, (kb + 1) * block)
        acc += (a[:, sl] @ b[:, sl].t()) * a_s[:, kb : kb + 1] * b_s[:, kb].unsqueeze(0)
    return acc


def fp8_gemm(a, a_s, b, b_s, scale_dtype=None, block_size=128):
    """y = a @ W^T for an FP8 weight: b uint8 e4m3 codes [N, K], b_s uint8 E8M0 [ceil(N/32), K/32].
    Output in the default dtype (bf16 under the official run setup)."""
    k = a.size(-1)
    n = b.size(0)
    am = a.reshape(-1, k).float()
    w = decode_e4m3(b)  # [N, K]
    ws = e8m0_to_f32(b_s).repeat_interleave(block_size, 0)[:n]  # [N, K/block]
    y = _block_gemm(am, a_s.reshape(am.size(0), -1).float(), w, ws, block_size)
    return y.to(torch.get_default_dtype()).view(*a.shape[:-1], n)


def fp4_gemm(a, a_s, b, b_s, scale_dtype=None, act_block_size=128):
    """y = a @ W^T for an FP4 weight: b uint8 packed e2m1 [N, K/2], b_s uint8 E8M0 [N, K/32]; the
    activation scale of block k//(act_block/32) applies to weight block k."""
    k = a.size(-1)
    n = b.size(0)
    am = a.reshape(-1, k).float()
    a_s32 = a_s.reshape(am.size(0), -1).float().repeat_interleave(act_block_size // 32, 1)
    y = _block_gemm(am, a_s32, decode_fp4_packed(b), e8m0_to_f32(b_s), 32)
    return y.to(torch.get_default_dtype()).view(*a.shape[:-1], n)


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """Single-latent (K = V) sparse attention with a per-head sink.
    q [b, m, h, d] bf16, kv [b, n, d] bf16, attn_sink [h] f32, topk_idxs [b, m, k] int32 (-1 = skip)
    -> [b, m, h, d] bf16"""
    b, m, h, d = q.shape
    qf, kvf = q.float(), kv.float()
    run_max = torch.full((b, m, h), -1e30, dtype=torch.float32)
    denom = torch.zeros(b, m, h, dtype=torch.float32)
    acc = torch.zeros(b, m, h, d, dtype=torch.float32)
    rows = torch.arange(b).view(b, 1, 1)
    for start in range(0, topk_idxs.size(-1), SPARSE_BLOCK):
        idx = topk_idxs[:, :, start : start + SPARSE_BLOCK].long()  # [b, m, blk]
        ok = idx >= 0
        keys = kvf[rows, idx.clamp_min(0)] * ok.unsqueeze(-1)  # [b, m, blk, d]
        s = torch.einsum("bmhd,bmkd->bmhk", qf, keys) * softmax_scale
        s = s.masked_fill(~ok.unsqueeze(2), float("-inf"))
        new_max = torch.maximum(run_max, s.amax(-1))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(s - new_max.unsqueeze(-1))  # [b, m, h, blk]
        denom = denom * rescale + p.sum(-1)
        pv = p if EXACT else p.bfloat16().float()
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", pv, keys)
        run_max = new_max
    denom = denom + torch.exp(attn_sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(q.dtype if EXACT else torch.bfloat16)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """mixes [..., (2+n)n] -> pre [..., n], post [..., n], comb [..., n, n] (fp32):
    pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb = row softmax + eps, a column normalization,
    then (iters-1) x (row, column) normalizations, each dividing by (sum + eps)."""
    n = hc_mult
    mx, sc, bs = mixes.float(), hc_scale.float(), hc_base.float()
    pre = torch.sigmoid(mx[..., :n] * sc[0] + bs[:n]) + eps
    post = 2.0 * torch.sigmoid(mx[..., n : 2 * n] * sc[1] + bs[n : 2 * n])
    c = (mx[..., 2 * n :] * sc[2] + bs[2 * n :]).unflatten(-1, (n, n))
    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def _nearest_even_f64(v, grid_pos):
    """float64 brute force: nearest value of a symmetric grid (ascending non-negatives grid_pos), ties to the
    even index, saturating; an independent formulation of round_e4m3 / round_e2m1."""
    a = v.abs().clamp(max=grid_pos[-1].item())
    d = (a.unsqueeze(-1) - grid_pos).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best) & (torch.arange(len(grid_pos)) % 2 == 0)
    idx = torch.where(cand.any(-1), cand.float().argmax(-1), d.argmin(-1))
    return grid_pos[idx] * torch.where(torch.signbit(v), -1.0, 1.0).double()


def selftest(seed=0):
    """Hand cases for the tie rules and the scale rounding, then each kernel against a float64 formulation of
    the same semantics on random data; raises AssertionError on a mismatch."""
    t = torch.tensor
    e2 = round_e2m1(t([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.5]))
    assert e2.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -6.0], e2
    # e4m3: 1 + 1/16 lies halfway between 1 and 1.125 (ties to even -> 1); 1 + 3/16 -> 1.25;
    # subnormal step 2^-9; 460 saturates to 448
    e4 = round_e4m3(t([1.0625, 1.1875, 3 * 2.0**-10, 460.0, -2.0**-10]))
    assert e4.tolist() == [1.0, 1.25, 2 * 2.0**-9, 448.0, -0.0], e4
    assert torch.equal(decode_e4m3(encode_e4m3(E4M3_LUT[:127])), E4M3_LUT[:127])
    s = pow2_scale(t([448.0, 449.0, 1e-4]), 1.0 / FP8_MAX)
    assert s[0].item() == 1.0 and s[1].item() == 2.0 and s[2].item() == 2.0**-22, s
    assert torch.equal(E2M1_LUT[encode_e2m1(E2M1_LUT).long()], E2M1_LUT)

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, 96, generator=g) * torch.logspace(-3, 2, 96)).float()
    assert torch.equal(round_e4m3(x).double(), _nearest_even_f64(x.double(), E4M3_LUT[:127].double()))
    y = torch.randn(6, 96, generator=g) * 4
    assert torch.equal(round_e2m1(y).double(), _nearest_even_f64(y.double(), E2M1_POS.double()))

    # act_quant + fp8_gemm == bf16( QDQ(x) @ W ) up to one bf16 ulp (fp32 block sums vs float64)
    xb = (torch.randn(5, 64, generator=g) * 3).bfloat16()
    q, sc = act_quant(xb, 32, "ue8m0")
    xf = xb.double().unflatten(-1, (-1, 32))
    amax = xf.abs().amax(-1).clamp_min(1e-4)
    s64 = torch.exp2(torch.ceil(torch.log2(amax * float(torch.tensor(1 / FP8_MAX, dtype=torch.float32)))))
    assert torch.equal(sc.double(), s64)
    qdq = (_nearest_even_f64(xf / s64.unsqueeze(-1), E4M3_LUT[:127].double()) * s64.unsqueeze(-1)).flatten(-2)
    assert torch.equal((q.double().unflatten(-1, (-1, 32)) * s64.unsqueeze(-1)).flatten(-2), qdq)
    codes = torch.randint(0, 256, (40, 64), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    wsc = torch.randint(120, 130, (2, 2), generator=g, dtype=torch.uint8)
    w64 = decode_e4m3(codes).double() * e8m0_to_f32(wsc).double().repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        out = fp8_gemm(q, sc, codes, wsc, None, 32).double()
        ref = (qdq @ w64.t())
        assert ((out - ref).abs() <= ref.abs() * 2.0**-8 + 1e-30).all(), (out - ref).abs().max()
        packed = torch.randint(0, 256, (24, 32), generator=g, dtype=torch.uint8)
        psc = torch.randint(124, 130, (24, 2), generator=g, dtype=torch.uint8)
        w4 = decode_fp4_packed(packed).double() * e8m0_to_f32(psc).double().repeat_interleave(32, 1)
        out4 = fp4_gemm(q, sc, packed, psc, None, 32).double()
        ref4 = qdq @ w4.t()
        assert ((out4 - ref4).abs() <= ref4.abs() * 2.0**-8 + 1e-30).all(), (out4 - ref4).abs().max()
    finally:
        torch.set_default_dtype(prev)

    # sparse_attn == softmax over the picked keys with the sink in the denominator (bf16 level)
    b, m, h, d, n, k = 1, 3, 2, 32, 70, 80
    qa = torch.randn(b, m, h, d, generator=g).bfloat16()
    kva = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(-1, n, (b, m, k), generator=g, dtype=torch.int32)
    idx[0, 2] = -1  # a row with nothing to attend: zeros
    o = sparse_attn(qa, kva, sink, idx, d**-0.5).double()
    for r in range(m):
        sel = [i for i in idx[0, r].tolist() if i >= 0]
        if not sel:
            assert (o[0, r] == 0).all()
            continue
        kk = kva[0, sel].double()
        sc_ = qa[0, r].double() @ kk.t() * d**-0.5  # [h, picks]
        mx = torch.maximum(sc_.amax(-1), sink.double())
        e = torch.exp(sc_ - mx[:, None])
        ref = (e @ kk) / (e.sum(-1) + torch.exp(sink.double() - mx))[:, None]
        assert ((o[0, r] - ref).abs() <= 2.0**-7 * ref.abs().max()).all(), (o[0, r] - ref).abs().max()

    # hc_split_sinkhorn against float64
    n_ = 4
    mixes = torch.randn(3, (2 + n_) * n_, generator=g)
    hsc, hba = torch.rand(3, generator=g) + 0.5, torch.randn((2 + n_) * n_, generator=g)
    pre, post, comb = hc_split_sinkhorn(mixes, hsc, hba, n_, 20, 1e-6)
    md, sd, bd = mixes.double(), hsc.double(), hba.double()
    c = torch.softmax((md[:, 2 * n_:] * sd[2] + bd[2 * n_:]).view(3, n_, n_), -1) + 1e-6
    c = c / (c.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + 1e-6)
        c = c / (c.sum(-2, keepdim=True) + 1e-6)
    assert (comb.double() - c).abs().max() < 1e-5
    assert (pre.double() - torch.sigmoid(md[:, :n_] * sd[0] + bd[:n_]) - 1e-6).abs().max() < 1e-6
    assert (post.double() - 2 * torch.sigmoid(md[:, n_:2 * n_] * sd[1] + bd[n_:2 * n_])).abs().max() < 1e-6
