//! The argument behind the megakernel's in-launch draw (megakernel/ops/sample.cuh), checked on
//! the CPU: each LM-head block sends its top c1 keys first (any c1 from min(k, 6) to 12, as
//! its threshold search may stop anywhere in that range) and keeps the rest of its top c2
//! (any c2 from min(k, rows) to 160) as extras; the draw takes the k-th largest sent key T,
//! reads the extras of every block that has some and whose first keys all lie above T (or of
//! every such block when fewer than k keys were sent), and takes the top k again. That must
//! be the exact top k of all keys, whatever the counts, for random logits, for logits where
//! one block holds the whole top k, and for logits with many ties. (The GPU test,
//! tests/gpu_sample_in_launch.rs, checks the CUDA code against the host's draws.)

/// The device's key: the logit's order-preserving bits above, the inverted token below.
fn key(logit: f32, token: u32) -> u64 {
    let u = logit.to_bits();
    let k = if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    };
    (u64::from(k) << 32) | u64::from(!token)
}

/// The k largest keys, largest first.
fn top(mut keys: Vec<u64>, k: usize) -> Vec<u64> {
    keys.sort_unstable_by(|a, b| b.cmp(a));
    keys.truncate(k);
    keys
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

/// The draw's candidate set for `logits` cut into blocks of `rows`, with random counts.
/// Also returns how many blocks had their extras read, and how many keys were sent first.
fn merged(logits: &[f32], rows: usize, k: usize, rng: &mut Rng) -> (Vec<u64>, usize, usize) {
    let mut prefixes = Vec::new();
    let mut extras = Vec::new();
    for (b, block) in logits.chunks(rows).enumerate() {
        let keys: Vec<u64> = block
            .iter()
            .enumerate()
            .map(|(j, &l)| key(l, (b * rows + j) as u32))
            .collect();
        let n = keys.len();
        let c1 = if n <= 12 { n } else { rng.range(k.min(6), 12) };
        let c2 = if n <= 160 {
            n
        } else {
            rng.range(k.min(n), 160)
        };
        let sorted = top(keys, n);
        prefixes.push(sorted[..c1].to_vec());
        extras.push(sorted[c1..c1.max(c2)].to_vec());
    }
    let sent: Vec<u64> = prefixes.concat();
    let kk = k.min(sent.len());
    let t = top(sent.clone(), kk).last().copied().unwrap_or(0);
    let mut read = 0;
    let mut all = sent.clone();
    for (p, e) in prefixes.iter().zip(&extras) {
        let whole_prefix_above = p.iter().min().is_some_and(|&m| m > t);
        if !e.is_empty() && (sent.len() < k || whole_prefix_above) {
            all.extend(e);
            read += 1;
        }
    }
    (top(all, k), read, sent.len())
}

#[test]
fn sent_keys_and_read_extras_hold_the_exact_top_k() {
    let mut rng = Rng(7);
    let mut second_rounds = 0;
    let mut cases = 0;
    for &vocab in &[40usize, 1000, 9000, 49_152] {
        for &rows in &[5usize, 13, 97, 376, 972] {
            for &k in &[1usize, 3, 6, 40, 128] {
                for shape in 0..4 {
                    let logits: Vec<f32> = (0..vocab)
                        .map(|i| match shape {
                            // Random logits.
                            0 => (rng.next() % 20_000) as f32 / 1000.0 - 10.0,
                            // Increasing: the last block holds the whole top k.
                            1 => i as f32 / vocab as f32,
                            // Many ties: equal logits are ordered by token.
                            2 => (rng.next() % 4) as f32,
                            // A few large logits clustered in one block, the rest random.
                            _ => {
                                if i / rows == 2 && i % 3 == 0 {
                                    50.0 + (rng.next() % 100) as f32
                                } else {
                                    (rng.next() % 1000) as f32 / 100.0
                                }
                            }
                        })
                        .collect();
                    let exact = top(
                        logits
                            .iter()
                            .enumerate()
                            .map(|(i, &l)| key(l, i as u32))
                            .collect(),
                        k,
                    );
                    let (got, read, sent) = merged(&logits, rows, k, &mut rng);
                    assert_eq!(
                        got, exact,
                        "vocab {vocab}, rows {rows}, k {k}, shape {shape}: not the top k"
                    );
                    // The second round stays small when at least k keys were sent: every
                    // block read again sent min(k, 6) or more keys, all above T, and only
                    // k - 1 sent keys are.
                    if sent >= k {
                        assert!(
                            read <= (k - 1) / k.min(6),
                            "vocab {vocab}, rows {rows}, k {k}: {read} blocks read a second time"
                        );
                    }
                    second_rounds += usize::from(read > 0);
                    cases += 1;
                }
            }
        }
    }
    println!("{cases} cases, {second_rounds} with a second round");
    assert!(second_rounds > 0, "no case reached the second round");
}
