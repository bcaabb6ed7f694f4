//! Calls into the tokenizers crate, which panics (index out of range, `unwrap`, `expect`) on
//! some malformed `tokenizer.json` files instead of returning an error. Its panics become
//! errors here, and the default hook's message and backtrace are kept off the terminal while
//! one of these calls runs, so the user sees only our error that names the file.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

thread_local! {
    /// Set while this thread runs a guarded call: its panics are expected and reported as
    /// errors, so the hook stays quiet.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

static INSTALL: Once = Once::new();

/// Chains a hook in front of whatever hook was installed (once per process). Other threads'
/// panics still reach the previous hook, so installing it changes nothing for them.
fn install_quiet_hook() {
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
}

/// Runs `f`, turning a panic into `Err` with the panic's message.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    install_quiet_hook();
    let was_quiet = QUIET.with(|q| q.replace(true));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was_quiet));
    result.map_err(|payload| panic_message(payload.as_ref()))
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message() {
        let r: Result<(), String> = catch_panic(|| panic!("index {} out of range", 7));
        assert_eq!(r.unwrap_err(), "index 7 out of range");
        assert_eq!(catch_panic(|| 3).unwrap(), 3);
        // The flag is restored: a later panic outside a guard is not swallowed by our hook.
        assert!(!QUIET.with(Cell::get));
    }
}
