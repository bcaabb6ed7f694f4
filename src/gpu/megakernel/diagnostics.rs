//! What a failed step reports: the kernel's error word turned into a message naming the
//! instruction, the element or page it waited for, and where every unfinished SM stood.

use anyhow::{bail, Context, Result};

use super::abi::{ERR_DATA, ERR_PAGE_CONSUMER, ERR_STEP, GEN_WHAT_TOKEN, STAGES, ST_DONE};
use super::MegakernelPath;

/// A consumer progress stage's name.
fn stage_name(stage: u32) -> &'static str {
    STAGES.get(stage as usize).map_or("?", |s| s.1)
}

/// Whether an SM running instructions `first..last` finished them, from its progress words
/// (consumer instruction, consumer stage, loader instruction, loader tile).
fn sm_finished(first: u32, last: u32, progress: &[u32]) -> bool {
    first == last || (progress[0] + 1 == last && progress[1] == ST_DONE)
}

impl MegakernelPath<'_> {
    /// Reads the kernel's error word; a timed-out wait becomes an error naming what it waited
    /// for and where every unfinished SM stood.
    pub fn check_error(&self) -> Result<()> {
        let e = self
            .gpu
            .stream
            .clone_dtoh(&self.error)
            .context("megakernel failed")?;
        if e[0] == 0 {
            return Ok(());
        }
        let name = |v: &[String], i: u32| v.get(i as usize).cloned().unwrap_or_else(|| "?".into());
        let what = match e[6] {
            ERR_DATA => format!(
                "waited too long for {} (tag {} expected, {} seen): nothing wrote it this step",
                self.streams().arena.element(e[3] as usize),
                e[4],
                e[5]
            ),
            ERR_STEP if e[3] == GEN_WHAT_TOKEN => format!(
                "waited too long for the previous step's token in a generation (tag {} expected, {} seen)",
                e[4], e[5]
            ),
            ERR_STEP => format!(
                "(loader) waited too long for SM {} to write the K/V rows of an earlier step of the generation (tag {} expected, {} seen)",
                e[3], e[4], e[5]
            ),
            ERR_PAGE_CONSUMER => {
                format!("waited too long for weight page of tile {} to arrive", e[3])
            }
            _ => format!(
                "(loader) waited too long for tile {}'s page to be released",
                e[3]
            ),
        };
        let progress = self.gpu.stream.clone_dtoh(&self.progress)?;
        // The streams of the last launch: later launches return at once after a failure, so
        // these are the failed launch's unless the sequence crossed into the next context
        // bucket right after it.
        let streams = self.streams();
        let offsets = &streams.sm_offsets;
        let stuck: Vec<String> = (0..offsets.len() - 1)
            .filter_map(|sm| {
                let pr = &progress[sm * 4..sm * 4 + 4];
                let last = offsets[sm + 1];
                (!sm_finished(offsets[sm], last, pr)).then(|| {
                    // Word 3, the loader's tile, is written only by a kernel built with
                    // MK_TILE_NOTES=1 (runtime.cuh).
                    let tile = if pr[3] != 0 {
                        format!(" tile {}", pr[3])
                    } else {
                        String::new()
                    };
                    format!(
                        "SM {sm} at {} ({}), loader at {}{tile}",
                        pr[0],
                        stage_name(pr[1]),
                        pr[2],
                    )
                })
            })
            .take(6)
            .collect();
        bail!(
            "megakernel: SM {} instruction {} ({}) {what}; the schedule cannot make progress. Unfinished: {}",
            e[1],
            e[2],
            name(&streams.descs, e[2]),
            stuck.join("; ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{sm_finished, stage_name, ST_DONE};

    #[test]
    fn stage_names() {
        assert_eq!(stage_name(ST_DONE), "done");
        assert_eq!(stage_name(1), "under way");
        assert_eq!(stage_name(99), "?");
    }

    #[test]
    fn an_sm_is_finished_once_its_last_instruction_is_done() {
        assert!(sm_finished(10, 20, &[19, ST_DONE, 19, 7]));
        assert!(!sm_finished(10, 20, &[19, ST_DONE - 1, 19, 7]));
        assert!(!sm_finished(10, 20, &[18, ST_DONE, 19, 7]));
        // An SM without instructions never reports progress.
        assert!(sm_finished(10, 10, &[0, 0, 0, 0]));
    }
}
