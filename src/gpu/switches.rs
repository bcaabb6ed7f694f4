//! Environment variables that pick a variant of a GPU path, so that both sides of a comparison
//! run from one binary (docs/gpu-machine.md lists them): on/off switches (`MEGAINFER_*=0|1`)
//! and counts.

/// The variable `name`: unset is `default`, else 0 or 1 (spaces around allowed); anything else
/// is an error that names the variable.
pub fn switch(name: &str, default: bool) -> anyhow::Result<bool> {
    parse_switch(name, std::env::var(name).ok().as_deref(), default).map_err(anyhow::Error::msg)
}

/// The variable `name` as 0 or 1 (spaces around allowed), or None where it is unset (the
/// caller chooses); anything else is an error that names the variable.
pub fn optional_switch(name: &str) -> anyhow::Result<Option<bool>> {
    std::env::var(name)
        .ok()
        .map(|v| parse_switch(name, Some(&v), false).map_err(anyhow::Error::msg))
        .transpose()
}

/// [`switch`] on a value already read.
pub fn parse_switch(name: &str, v: Option<&str>, default: bool) -> Result<bool, String> {
    match v.map(str::trim) {
        None => Ok(default),
        Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(other) => Err(format!("{name}: '{other}' is not 0 or 1")),
    }
}

/// The variable `name` as a positive count: unset is None; anything but a positive integer
/// (spaces around allowed) is an error that names the variable.
pub fn count(name: &str) -> anyhow::Result<Option<usize>> {
    parse_count(name, std::env::var(name).ok().as_deref()).map_err(anyhow::Error::msg)
}

/// [`count`] on a value already read.
pub fn parse_count(name: &str, v: Option<&str>) -> Result<Option<usize>, String> {
    match v.map(str::trim) {
        None => Ok(None),
        Some(t) => match t.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => Err(format!("{name}: '{t}' is not a positive count")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_count, parse_switch};

    #[test]
    fn counts_are_positive_integers() {
        assert_eq!(parse_count("X", None), Ok(None));
        assert_eq!(parse_count("X", Some("8")), Ok(Some(8)));
        assert_eq!(parse_count("X", Some(" 3 ")), Ok(Some(3)));
        for bad in ["0", "-1", "eight", "", "2.5"] {
            assert_eq!(
                parse_count("X", Some(bad)),
                Err(format!("X: '{bad}' is not a positive count"))
            );
        }
    }

    #[test]
    fn switches_are_parsed_strictly() {
        assert_eq!(parse_switch("X", None, true), Ok(true));
        assert_eq!(parse_switch("X", Some("0"), true), Ok(false));
        assert_eq!(parse_switch("X", Some(" 1 "), false), Ok(true));
        for bad in ["off", "", "2", "yes"] {
            assert_eq!(
                parse_switch("X", Some(bad), true),
                Err(format!("X: '{bad}' is not 0 or 1"))
            );
        }
    }
}
