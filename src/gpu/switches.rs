//! On/off environment variables (`MEGAINFER_*=0|1`) that pick a variant of a GPU path, so that
//! both sides of a comparison run from one binary (docs/gpu-machine.md lists them).

/// The variable `name`: unset is `default`, else 0 or 1 (spaces around allowed); anything else
/// is an error that names the variable.
pub fn switch(name: &str, default: bool) -> anyhow::Result<bool> {
    parse_switch(name, std::env::var(name).ok().as_deref(), default).map_err(anyhow::Error::msg)
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

#[cfg(test)]
mod tests {
    use super::parse_switch;

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
