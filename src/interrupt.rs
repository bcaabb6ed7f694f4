//! Ctrl-C during a generation ends it after the token being computed: the text so far is kept,
//! the statistics are printed, `run` exits with status 130 and `chat` returns to its prompt.
//! At any other time, and on a second Ctrl-C, the process ends at once (status 130), as
//! without a handler.
//!
//! The handler only touches two atomics and `_exit`, which are async-signal-safe.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Once;

static GENERATING: AtomicBool = AtomicBool::new(false);
static STOP: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_sigint(_signal: libc::c_int) {
    if GENERATING.load(SeqCst) && !STOP.swap(true, SeqCst) {
        return;
    }
    // SAFETY: _exit is async-signal-safe and ends the process without running Rust code.
    unsafe { libc::_exit(130) }
}

/// Installs the handler (once; later calls do nothing). `run` and `chat` call it; the other
/// commands keep the default Ctrl-C.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        #[cfg(unix)]
        // SAFETY: on_sigint has the signature of a signal handler and is async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
        }
    });
}

/// While alive, Ctrl-C asks the generation to stop instead of ending the process.
pub struct Generating(());

impl Generating {
    pub fn begin() -> Self {
        STOP.store(false, SeqCst);
        GENERATING.store(true, SeqCst);
        Generating(())
    }

    /// Whether Ctrl-C was pressed since `begin`.
    pub fn stop_requested(&self) -> bool {
        STOP.load(SeqCst)
    }
}

impl Drop for Generating {
    fn drop(&mut self) {
        GENERATING.store(false, SeqCst);
    }
}

/// Whether Ctrl-C asked the running generation to stop: a GPU generation running inside one
/// launch polls this while it waits for the next token, and passes the request on to the
/// kernel at once.
pub fn stop_pending() -> bool {
    GENERATING.load(SeqCst) && STOP.load(SeqCst)
}

/// Whether the last generation was stopped by Ctrl-C (for the exit status).
pub fn was_interrupted() -> bool {
    STOP.load(SeqCst)
}
