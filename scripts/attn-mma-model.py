#!/usr/bin/env python3
"""The tensor-core attention blocks of megakernel/ops/attention.cuh modelled lane by lane:
AttnMma (MK_ATT_MMA=1, head_dim 64) and AttnMmaT (MK_ATT_MMA=2, head_dim 64 and 128), each
lane's fragments built as the kernel builds them and every mma.sync m16n8k16 assembled from
them by PTX's fragment layouts (A row-major, B column-major, f32 C/D), over several blocks of
16 positions (the online softmax, a partial last block), then the warp's output read back as
`finish` stores it; against a float64 reference on the same bf16 K/V. Checks the index math
(which dims and positions each lane reads and where each sum lands) without a GPU: a wrong
mapping shows as an error near 1, a right one at the bf16 high + low split's ~1e-6.

usage: scripts/attn-mma-model.py   (numpy)
"""
import numpy as np
rng = np.random.default_rng(1)

def bf16(x):
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7fff + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)

def split(a, b):  # -> (hi pair, lo pair) as float tuples
    ha, hb = bf16(a), bf16(b)
    return (ha, hb), (bf16(np.float32(a) - ha), bf16(np.float32(b) - hb))

def mma(D, A, B):
    # D: list over lanes of [c0,c1,c2,c3]; A: lanes of 4 regs, each reg a pair (lo, hi elem);
    # B: lanes of 2 regs.
    Am = np.zeros((16, 16)); Bm = np.zeros((16, 8)); Cm = np.zeros((16, 8))
    for L in range(32):
        g, t = L >> 2, L & 3
        a = A[L]
        Am[g, 2*t:2*t+2] = a[0]; Am[g+8, 2*t:2*t+2] = a[1]; Am[g, 2*t+8:2*t+10] = a[2]; Am[g+8, 2*t+8:2*t+10] = a[3]
        b = B[L]
        Bm[2*t:2*t+2, g] = b[0]; Bm[2*t+8:2*t+10, g] = b[1]
        c = D[L]
        Cm[g, 2*t:2*t+2] = c[0:2]; Cm[g+8, 2*t:2*t+2] = c[2:4]
    Dm = Am @ Bm + Cm
    for L in range(32):
        g, t = L >> 2, L & 3
        D[L] = [Dm[g, 2*t], Dm[g, 2*t+1], Dm[g+8, 2*t], Dm[g+8, 2*t+1]]

def piece(HD, qd, i): return 2*qd + i if HD == 64 else qd + 4*i
def chunk_base(HD, qd, c): return 8*piece(HD, qd, c >> 1) + 4*(c & 1)

def run(HD, G, n, mode):
    q = rng.standard_normal((G, HD)).astype(np.float32)
    K = bf16(rng.standard_normal((n, HD)).astype(np.float32))
    V = bf16(rng.standard_normal((n, HD)).astype(np.float32))
    scale = 1 / np.sqrt(HD)
    # reference
    S = (q.astype(np.float64) @ K.T.astype(np.float64)) * scale
    P = np.exp(S - S.max(1, keepdims=True)); ref = (P / P.sum(1, keepdims=True)) @ V.astype(np.float64)
    KC = HD // 16
    # q frags
    qa = []
    for L in range(32):
        r, qd = L >> 2, L & 3
        regs = []
        for c in range(KC):
            x = [q[r, chunk_base(HD, qd, c) + e] if r < G else 0.0 for e in range(4)]
            h01, l01 = split(x[0], x[1]); h23, l23 = split(x[2], x[3])
            regs.append([h01, l01, h23, l23])
        qa.append(regs)
    NO = 8 if mode == 1 else HD // 16
    o = [[[0.0]*4 for _ in range(NO)] for _ in range(32)]
    m = [-np.inf]*32; l = [0.0]*32
    for b0 in range(0, n, 16):
        rows = min(16, n - b0)
        Kb, Vb = K[b0:b0+rows], V[b0:b0+rows]
        s = [[[0, 0], [0, 0]] for _ in range(32)]
        for j in range(2):
            D = [[0.0]*4 for _ in range(32)]
            if j == 0 or rows > 8:
                for c in range(KC):
                    A = [qa[L][c] for L in range(32)]
                    B = []
                    for L in range(32):
                        r, qd = L >> 2, L & 3
                        row = min(8*j + r, rows - 1)
                        base = chunk_base(HD, qd, c)
                        B.append([(Kb[row, base], Kb[row, base+1]), (Kb[row, base+2], Kb[row, base+3])])
                    mma(D, A, B)
            for L in range(32):
                s[L][j] = [D[L][0] + D[L][2], D[L][1] + D[L][3]]
        corr = [0]*32
        for L in range(32):
            qd = L & 3
            for j in range(2):
                for e in range(2):
                    s[L][j][e] = s[L][j][e]*scale if 8*j + 2*qd + e < rows else -np.inf
        mxs = [max(max(max(s[Q][0]), max(s[Q][1])) for Q in [L & ~3 | k for k in range(4)]) for L in range(32)]
        for L in range(32):
            mx = mxs[L]
            mn = max(m[L], mx); corr[L] = np.exp(m[L] - mn) if m[L] > -np.inf else 0.0
            ps = 0
            for j in range(2):
                for e in range(2):
                    s[L][j][e] = np.exp(s[L][j][e] - mn); ps += s[L][j][e]
            l[L] = l[L]*corr[L] + ps; m[L] = mn
        if mode == 1:
            pa = []
            for L in range(32):
                h0, l0 = split(s[L][0][0], s[L][0][1]); h1, l1 = split(s[L][1][0], s[L][1][1])
                pa.append([h0, l0, h1, l1])
            for t in range(8):
                B = []
                for L in range(32):
                    r, qd = L >> 2, L & 3
                    d = 8*r + t
                    rw = lambda k: min(k, rows - 1)
                    B.append([(Vb[rw(2*qd), d], Vb[rw(2*qd+1), d]), (Vb[rw(2*qd+8), d], Vb[rw(2*qd+9), d])])
                    o[L][t] = [v*corr[L] for v in o[L][t]]
                Dl = [o[L][t] for L in range(32)]
                mma(Dl, pa, B)
                for L in range(32): o[L][t] = Dl[L]
        else:
            HALF = 4 if HD == 64 else 8
            his = []; los = []
            for L in range(32):
                h0, l0 = split(s[L][0][0], s[L][0][1]); h1, l1 = split(s[L][1][0], s[L][1][1])
                his.append((h0, h1)); los.append((l0, l1))
            B = []
            for L in range(32):
                r = L >> 2
                B.append(list(his[L]) if r < 4 else list(los[L ^ 16]))
            c0 = [corr[4*((2*(L & 3)) & 3)] for L in range(32)]
            c1 = [corr[4*((2*(L & 3) + 1) & 3)] for L in range(32)]
            for t in range(HD // 16):
                A = []
                for L in range(32):
                    r, qd = L >> 2, L & 3
                    rw = lambda k: min(k, rows - 1)
                    def el(row, e):  # element e of the lane's words of V row `row`
                        return Vb[row, 8*r + (e if HD == 64 else (e % 8) + 64*(e // 8))]
                    e0, e1 = t, HALF + t
                    A.append([(el(rw(2*qd), e0), el(rw(2*qd+1), e0)), (el(rw(2*qd), e1), el(rw(2*qd+1), e1)),
                              (el(rw(2*qd+8), e0), el(rw(2*qd+9), e0)), (el(rw(2*qd+8), e1), el(rw(2*qd+9), e1))])
                    oo = o[L][t]; o[L][t] = [oo[0]*c0[L], oo[1]*c1[L], oo[2]*c0[L], oo[3]*c1[L]]
                Dl = [o[L][t] for L in range(32)]
                mma(Dl, A, B)
                for L in range(32): o[L][t] = Dl[L]
    # finish
    out = np.zeros((G, HD)); Ls = np.zeros(G); Ms = np.zeros(G)
    lq = [sum(l[L & ~3 | k] for k in range(4)) for L in range(32)]
    if mode == 1:
        for L in range(32):
            r, qd = L >> 2, L & 3
            if r < G:
                for t in range(8):
                    out[r, 16*qd + t] = o[L][t][0] + o[L][t][2]
                    out[r, 16*qd + 8 + t] = o[L][t][1] + o[L][t][3]
                Ls[r] = lq[L]
    else:
        o2 = [[[o[L][t][e] + o[L ^ 2][t][e] for e in range(4)] for t in range(HD // 16)] for L in range(32)]
        for L in range(32):
            r, qd = L >> 2, L & 3
            for e in range(2):
                h = 2*qd + e
                if qd < 2 and h < G:
                    for t in range(HD // 16):
                        if HD == 64:
                            out[h, 8*r + t] = o2[L][t][e]; out[h, 8*r + 4 + t] = o2[L][t][2+e]
                        else:
                            out[h, 8*r + t] = o2[L][t][e]; out[h, 64 + 8*r + t] = o2[L][t][2+e]
            if r < G: Ls[r] = lq[L]
    got = out / Ls[:, None]
    return np.abs(got - ref).max() / np.abs(ref).max()

worst = 0.0
for HD, G, n, mode in [(64, 3, 37, 1), (64, 4, 16, 1), (64, 3, 37, 2), (64, 4, 40, 2), (128, 3, 37, 2),
                       (128, 4, 29, 2), (128, 2, 7, 2)]:
    err = run(HD, G, n, mode)
    worst = max(worst, err)
    print(f"MK_ATT_MMA={mode} head_dim {HD}, {G} heads, {n} positions: max error {err:.2e} of the output's largest")
if worst > 1e-4:
    raise SystemExit(f"the model's output is off by {worst:.2e}: an index is wrong")
