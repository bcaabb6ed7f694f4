//! Per-instruction timing of decode steps (globaltimer stamps the kernel writes when a profile
//! buffer is given): a summary per instruction type, and the whole timeline as CSV or as a
//! Chrome trace (Perfetto, chrome://tracing).

use std::collections::BTreeMap;
use std::fmt::Write;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::abi::{prof, PROF_WORDS};
use super::MegakernelPath;
use crate::gpu::device::ptr;
use crate::gpu::stepping::Steps;

/// Where one decode step's time went, per instruction type (from `MegakernelPath::profile`).
pub struct Profile {
    /// Launch start (first instruction's start) to the last instruction's end, µs.
    pub step_us: f64,
    /// (type, count per step, mean µs [waiting for inputs and preparing, weight tiles (for
    /// Attention: its computation), storing], busy µs per SM: the type's instruction time
    /// summed / SM count)
    pub rows: Vec<(&'static str, usize, [f64; 3], f64)>,
    /// With `timeline`: every stamp of every profiled step.
    pub timeline: Option<Timeline>,
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "megakernel step: {:.1} µs from the first instruction's start to the last one's end",
            self.step_us
        )?;
        writeln!(
            f,
            "| instruction | count | inputs + prepare µs | tiles (attention: compute) µs | store µs | busy µs per SM |"
        )?;
        writeln!(f, "| --- | ---: | ---: | ---: | ---: | ---: |")?;
        for (k, n, [p, t, c], b) in &self.rows {
            writeln!(f, "| {k} | {n} | {p:.2} | {t:.2} | {c:.2} | {b:.1} |")?;
        }
        Ok(())
    }
}

/// One profiled instruction (an encoded position).
#[derive(Clone, Debug)]
pub struct TimelineInstr {
    pub sm: usize,
    /// Its type (`StageKind::name`).
    pub kind: &'static str,
    /// `Schedule::describe`.
    pub desc: String,
    /// Attention: profile words 4 and 5 are its own stamps (computed by rounds: the last
    /// round's scores/softmax and values done; by warps: its pages streamed and its warps'
    /// results merged), not the loader's first page wait and last tile issued.
    pub attention: bool,
}

/// Every stamp of the profiled steps.
#[derive(Clone, Debug)]
pub struct Timeline {
    pub instrs: Vec<TimelineInstr>,
    /// Per step: its first start (ns, from the first step's), and per instruction the
    /// PROF_WORDS stamps in ns from that start (0 where the kernel wrote none).
    pub steps: Vec<(u64, Vec<[u64; PROF_WORDS]>)>,
}

impl Timeline {
    /// One line per instruction and step: `step,pos,sm,kind,desc,` then the stamps (ns from
    /// the step's first start). extra1, extra2: a mat-vec's first page wait and last tile
    /// issued by the loader; attention's scores and softmax done, and its weighted values done
    /// (last round; by warps: pages streamed, warps merged).
    pub fn to_csv(&self) -> String {
        let mut csv = format!("step,pos,sm,kind,desc,{}\n", prof::NAMES.join(","));
        for (step, (_, stamps)) in self.steps.iter().enumerate() {
            for (i, (ins, r)) in self.instrs.iter().zip(stamps).enumerate() {
                let times: Vec<String> = r.iter().map(|t| t.to_string()).collect();
                writeln!(
                    csv,
                    "{step},{i},{},{},\"{}\",{}",
                    ins.sm,
                    ins.kind,
                    ins.desc.replace('"', "\"\""),
                    times.join(",")
                )
                .unwrap();
            }
        }
        csv
    }

    /// The timeline as Chrome trace-event JSON: one process, a track (thread) per SM's
    /// consumers and one per SM's loader; a slice per instruction named by its type, with its
    /// phases (inputs + prepare, tiles or attention's compute, store) as nested slices, and on
    /// the loader's track the span from a mat-vec's first page wait to its last tile issued.
    pub fn to_chrome_trace(&self) -> String {
        let us = |ns: u64| ns as f64 / 1e3;
        let sms = self.instrs.iter().map(|i| i.sm + 1).max().unwrap_or(0);
        let mut events = vec![json!({
            "ph": "M", "name": "process_name", "pid": 0, "args": {"name": "megakernel"}
        })];
        for sm in 0..sms {
            for (tid, name, order) in [
                (2 * sm, format!("SM {sm}"), 2 * sm),
                (2 * sm + 1, format!("SM {sm} loader"), 2 * sm + 1),
            ] {
                events.push(json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}));
                events.push(json!({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": order}}));
            }
        }
        let slice = |name: &str, tid: usize, t0: u64, t1: u64, args: Value| {
            json!({"ph": "X", "name": name, "cat": "megakernel", "pid": 0, "tid": tid,
                   "ts": us(t0), "dur": us(t1 - t0), "args": args})
        };
        for (step, (base, stamps)) in self.steps.iter().enumerate() {
            for (pos, (ins, r)) in self.instrs.iter().zip(stamps).enumerate() {
                let (start, stored) = (r[prof::START], r[prof::STORED]);
                if stored < start || (stored == 0 && start == 0) {
                    continue; // not run (a failed step) or not stamped
                }
                let at = |t: u64| base + t;
                let tid = 2 * ins.sm;
                let mut args = json!({"step": step, "instruction": pos, "desc": ins.desc});
                if ins.attention {
                    args["scores_softmax_done_us"] =
                        json!(us(r[prof::EXTRA1].saturating_sub(start)));
                    args["values_done_us"] = json!(us(r[prof::EXTRA2].saturating_sub(start)));
                }
                events.push(slice(ins.kind, tid, at(start), at(stored), args));
                let phases = [
                    ("inputs + prepare", prof::START, prof::PREPARED),
                    (
                        if ins.attention { "compute" } else { "tiles" },
                        prof::PREPARED,
                        prof::TILES,
                    ),
                    ("store", prof::TILES, prof::STORED),
                ];
                for (name, a, b) in phases {
                    // Clamped into the instruction's span, so the slices nest.
                    let (t0, t1) = (r[a].clamp(start, stored), r[b].clamp(start, stored));
                    if t1 > t0 {
                        events.push(slice(name, tid, at(t0), at(t1), json!({})));
                    }
                }
                let (l0, l1) = (r[prof::EXTRA1], r[prof::EXTRA2]);
                if !ins.attention && l0 > 0 && l1 >= l0 {
                    events.push(slice(
                        ins.kind,
                        tid + 1,
                        at(l0),
                        at(l1),
                        json!({"step": step, "instruction": pos, "desc": ins.desc,
                               "span": "first page wait to last tile issued"}),
                    ));
                }
            }
        }
        serde_json::to_string(&json!({"traceEvents": events, "displayTimeUnit": "ns"}))
            .expect("JSON of plain values")
    }
}

impl MegakernelPath<'_> {
    /// Runs `steps` greedy steps from `token` with per-instruction timestamps (globaltimer)
    /// and returns the mean breakdown per instruction type (and, with `timeline`, every stamp).
    pub fn profile(
        &mut self,
        token: u32,
        steps: usize,
        timeline: bool,
        sampling: Option<&crate::sampling::SamplingParams>,
    ) -> Result<Profile> {
        // Sampled steps draw inside the launch (ops/sample.cuh; their Argmax row ends with the
        // draw); the penalty's window is whatever the history holds, which changes no timing.
        let sampled = match sampling {
            Some(p) if !p.is_greedy() => {
                use super::super::stepping::Steps;
                self.prepare_sampling(p)? && self.draws_in_launch
            }
            _ => false,
        };
        // The stamps are per encoded instruction: every step must run the same streams. The
        // steps decode from the sequence's position (`next_pos` is only brought up to it when
        // the first step writes its meta, and a prefill leaves it behind).
        let pos = self.seq.pos;
        let bucket = self.bucket_at(pos);
        if self.bucket_at(pos + steps.max(1) - 1) != bucket {
            bail!(
                "profile: positions {}..{} cross into another context bucket (split-KV parts change); profile fewer steps",
                pos,
                pos + steps
            );
        }
        self.select_bucket(pos);
        let cur = &self.buckets[self.active];
        let (n, sm_offsets, kinds, descs) = (
            cur.instructions,
            cur.sm_offsets.clone(),
            cur.kinds.clone(),
            cur.descs.clone(),
        );
        let buf = self
            .gpu
            .alloc_zeros::<u64>(n * PROF_WORDS, "profile buffer")?;
        self.params.profile = ptr(&buf, &self.gpu.stream);
        let mut sums: BTreeMap<&'static str, (usize, [f64; 4])> = Default::default();
        let mut step_us = 0.0;
        let mut result = Ok(());
        let mut t = token;
        let sm_of: Vec<usize> = (0..n)
            .map(|pos| sm_offsets.partition_point(|&o| o as usize <= pos) - 1)
            .collect();
        let mut tl = timeline.then(|| Timeline {
            instrs: (0..n)
                .map(|i| TimelineInstr {
                    sm: sm_of[i],
                    kind: kinds[i],
                    desc: descs[i].clone(),
                    attention: kinds[i] == scheduler::StageKind::Attention.name(),
                })
                .collect(),
            steps: Vec::new(),
        });
        let mut first_start = None;
        for _ in 0..steps {
            self.params.sampling = u32::from(sampled);
            let r = self.decode_greedy(t, 1);
            self.params.sampling = 0;
            match r {
                Ok(v) => t = v[0],
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            let p = self.gpu.stream.clone_dtoh(&buf)?;
            if let Some(i) = (0..n).find(|&i| p[i * PROF_WORDS] == 0) {
                result = Err(anyhow::anyhow!(
                    "profile: instruction {i} of the profiled streams ({}) left no timestamp: the \
                     step ran other streams",
                    kinds[i]
                ));
                break;
            }
            let start = (0..n).map(|i| p[i * PROF_WORDS]).min().unwrap_or(0);
            let end = (0..n)
                .map(|i| p[i * PROF_WORDS + prof::STORED])
                .max()
                .unwrap_or(0);
            step_us += (end - start) as f64 / 1e3;
            let first = *first_start.get_or_insert(start);
            let mut stamps = Vec::new();
            for i in 0..n {
                let r = &p[i * PROF_WORDS..(i + 1) * PROF_WORDS];
                if tl.is_some() {
                    stamps.push(std::array::from_fn(|k| r[k].saturating_sub(start)));
                }
                let e = sums.entry(kinds[i]).or_default();
                e.0 += 1;
                for k in 0..3 {
                    e.1[k] += r[k + 1].saturating_sub(r[k]) as f64 / 1e3;
                }
                e.1[3] += r[prof::STORED].saturating_sub(r[prof::START]) as f64 / 1e3;
            }
            if let Some(tl) = &mut tl {
                tl.steps.push((start.saturating_sub(first), stamps));
            }
        }
        self.params.profile = 0;
        result?;
        let sms = (sm_offsets.len() - 1) as f64;
        let rows = sums
            .into_iter()
            .map(|(k, (c, s))| {
                let m = |x: f64| x / c as f64;
                (
                    k,
                    c / steps,
                    [m(s[0]), m(s[1]), m(s[2])],
                    s[3] / steps as f64 / sms,
                )
            })
            .collect();
        Ok(Profile {
            step_us: step_us / steps as f64,
            rows,
            timeline: tl,
        })
    }
}

impl MegakernelPath<'_> {
    /// The gaps between tokens on the GPU's clock: for each of `steps` greedy steps from
    /// `token` after the first, the time from the argmax publishing the token before to the
    /// earliest start of an SM's first instruction of the step, in µs. With `per_launch` 1
    /// each step is a launch of its own, and the gap holds the launch and its prologue; else
    /// the steps run as one generation.
    pub fn token_gaps(&mut self, token: u32, steps: usize, per_launch: usize) -> Result<Vec<f64>> {
        let pos = self.seq.pos;
        if steps < 2 || self.bucket_at(pos + steps - 1) != self.bucket_at(pos) {
            bail!("token_gaps: {steps} steps from position {pos} must be at least 2, within one context bucket");
        }
        let init: Vec<u64> = (0..steps).flat_map(|_| [0, u64::MAX]).collect();
        let buf = self.gpu.upload(&init, "gap stamps")?;
        let base = ptr(&buf, &self.gpu.stream);
        let saved = self.seq.tokens_per_launch;
        let result = if per_launch == 1 {
            // Launches queued back to back, as `decode_greedy` queues them, each with its own
            // stamps.
            let mut queue = || -> Result<()> {
                if self.seq.meta_current != Some(token) {
                    self.write_meta(token, pos)?;
                }
                for k in 0..steps {
                    self.params.gen_prof = base + 16 * k as u64;
                    self.launch()?;
                }
                self.seq.pos += steps;
                self.seq.meta_current = None;
                self.check_error()
            };
            queue()
        } else {
            self.seq.tokens_per_launch = usize::MAX;
            self.params.gen_prof = base;
            self.decode_greedy(token, steps).map(|_| ())
        };
        self.params.gen_prof = 0;
        self.seq.tokens_per_launch = saved;
        result?;
        let st = self.gpu.stream.clone_dtoh(&buf)?;
        Ok((1..steps)
            .map(|k| st[2 * k + 1].saturating_sub(st[2 * (k - 1)]) as f64 / 1e3)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two SMs: a mat-vec and attention on SM 0, an argmax (no tiles) on SM 1; two steps.
    fn synthetic() -> Timeline {
        let ins = |sm, kind, attention| TimelineInstr {
            sm,
            kind,
            desc: format!("{kind} on SM {sm}, \"quoted\""),
            attention,
        };
        Timeline {
            instrs: vec![
                ins(0, "RmsQkvRope", false),
                ins(0, "Attention", true),
                ins(1, "Argmax", false),
            ],
            steps: vec![
                (
                    0,
                    vec![
                        [0, 1000, 3000, 3500, 200, 2500],
                        [3500, 5000, 9000, 9200, 6000, 8000],
                        [100, 9500, 9500, 9800, 0, 0],
                    ],
                ),
                (
                    20_000,
                    vec![[0, 900, 2900, 3300, 100, 2400], [0; 6], [0; 6]],
                ),
            ],
        }
    }

    #[test]
    fn chrome_trace_has_a_track_per_sm_and_nested_phases() {
        let v: Value = serde_json::from_str(&synthetic().to_chrome_trace()).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = ev
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["SM 0", "SM 0 loader", "SM 1", "SM 1 loader"]);
        let slices: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        let find = |name: &str, step: u64| {
            slices
                .iter()
                .find(|e| {
                    e["name"] == name
                        && e["args"]["step"] == step
                        && e["tid"].as_u64().unwrap() % 2 == 0
                })
                .unwrap_or_else(|| panic!("{name} step {step}"))
        };
        // Step 0's QKV: 0..3.5 µs on SM 0's track, its phases inside it.
        let qkv = find("RmsQkvRope", 0);
        assert_eq!(
            (qkv["tid"].as_u64(), qkv["ts"].as_f64(), qkv["dur"].as_f64()),
            (Some(0), Some(0.0), Some(3.5))
        );
        let phase = |name: &str, ts: f64| {
            slices
                .iter()
                .find(|e| e["name"] == name && e["ts"].as_f64() == Some(ts))
                .unwrap_or_else(|| panic!("phase {name} at {ts}"))
        };
        assert_eq!(phase("inputs + prepare", 0.0)["dur"].as_f64(), Some(1.0));
        assert_eq!(phase("tiles", 1.0)["dur"].as_f64(), Some(2.0));
        assert_eq!(phase("store", 3.0)["dur"].as_f64(), Some(0.5));
        // Attention's middle phase is its compute; its own stamps are arguments.
        let att = find("Attention", 0);
        assert_eq!(att["args"]["values_done_us"].as_f64(), Some(4.5));
        assert_eq!(phase("compute", 5.0)["dur"].as_f64(), Some(4.0));
        // The loader's span of the mat-vec, on SM 0's loader track; none for attention.
        let loads: Vec<&&Value> = slices.iter().filter(|e| e["tid"] == 1).collect();
        assert_eq!(loads.len(), 2, "{loads:?}");
        assert_eq!(
            (loads[0]["ts"].as_f64(), loads[0]["dur"].as_f64()),
            (Some(0.2), Some(2.3))
        );
        // The argmax on SM 1 (no tiles: no tiles phase), and step 1 placed at its own start.
        let am = find("Argmax", 0);
        assert_eq!(am["tid"].as_u64(), Some(2));
        assert_eq!(find("RmsQkvRope", 1)["ts"].as_f64(), Some(20.0));
        // Instructions without stamps (step 1's attention and argmax) are left out.
        assert!(slices
            .iter()
            .all(|e| !(e["name"] == "Attention" && e["args"]["step"] == 1)));
        // Every phase lies inside an instruction slice of its track.
        for p in slices.iter().filter(|e| e["args"].get("desc").is_none()) {
            let (t0, t1) = (
                p["ts"].as_f64().unwrap(),
                p["ts"].as_f64().unwrap() + p["dur"].as_f64().unwrap(),
            );
            assert!(
                slices.iter().any(|s| s["args"].get("desc").is_some()
                    && s["tid"] == p["tid"]
                    && s["ts"].as_f64().unwrap() <= t0 + 1e-9
                    && t1 <= s["ts"].as_f64().unwrap() + s["dur"].as_f64().unwrap() + 1e-9),
                "{p}"
            );
        }
    }

    #[test]
    fn csv_has_a_line_per_instruction_and_step() {
        let csv = synthetic().to_csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines[0],
            "step,pos,sm,kind,desc,start,prepared,tiles,stored,extra1,extra2"
        );
        assert_eq!(lines.len(), 1 + 2 * 3);
        assert!(lines[2].starts_with("0,1,0,Attention,"), "{}", lines[2]);
        assert!(
            lines[2].ends_with(",3500,5000,9000,9200,6000,8000"),
            "{}",
            lines[2]
        );
    }
}
