//! Happens-before as vector clocks over SMs.
//!
//! An instruction's clock holds, per SM, how many instructions of that SM's stream happen
//! before it: program order on its own SM, and through every wait, all signallers of the
//! counter and whatever happens before them (a wait's base is the full signaller count, so it
//! is released only after every one of them). Walking the instructions in the global order
//! computes all clocks in one pass, because every signaller of a waited counter comes earlier.

/// Running clocks of the SMs and counters during a walk in the global order.
pub(crate) struct Clocks {
    sms: usize,
    /// Per SM: the clock after its latest walked instruction.
    sm: Vec<u32>,
    /// Per counter: join of the clocks of its walked signallers.
    counter: Vec<u32>,
}

impl Clocks {
    pub fn new(sms: usize, counters: usize) -> Clocks {
        Clocks {
            sms,
            sm: vec![0; sms * sms],
            counter: vec![0; counters * sms],
        }
    }

    /// Starting clock of the next instruction of `sm`: program order alone.
    pub fn start(&self, sm: u32) -> Vec<u32> {
        self.sm[self.row(sm as usize)].to_vec()
    }

    fn row(&self, i: usize) -> std::ops::Range<usize> {
        i * self.sms..(i + 1) * self.sms
    }

    /// Whether everything a wait on `counter` would order is already in `clock`.
    pub fn implied(&self, clock: &[u32], counter: u32) -> bool {
        let c = &self.counter[self.row(counter as usize)];
        c.iter().zip(clock).all(|(c, k)| c <= k)
    }

    /// Adds a wait on `counter` to `clock`.
    pub fn join(&self, clock: &mut [u32], counter: u32) {
        let c = &self.counter[self.row(counter as usize)];
        clock.iter_mut().zip(c).for_each(|(k, c)| *k = (*k).max(*c));
    }

    /// Records that instruction `pos` of `sm`, with clock `clock`, finished and signalled.
    pub fn finish(&mut self, sm: u32, pos: u32, clock: &mut [u32], signal: Option<u32>) {
        clock[sm as usize] = pos + 1;
        let r = self.row(sm as usize);
        self.sm[r].copy_from_slice(clock);
        if let Some(s) = signal {
            let r = self.row(s as usize);
            self.counter[r]
                .iter_mut()
                .zip(clock.iter())
                .for_each(|(c, k)| *c = (*c).max(*k));
        }
    }
}
