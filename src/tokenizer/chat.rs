//! Chat templates: the Jinja `chat_template` of HF tokenizers, rendered with minijinja in the
//! environment transformers' `apply_chat_template` sets up (trim_blocks, lstrip_blocks,
//! `raise_exception`, `strftime_now`, a Python-style `tojson`, Python string methods).

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Result};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Instructions a chat template may execute. Real templates render a conversation in a few
/// thousand; this leaves room for very long conversations while stopping a template (which
/// comes from the model file) that loops for minutes.
pub const MAX_TEMPLATE_FUEL: u64 = 10_000_000;
/// Bytes a chat template may output: far more than any context window holds as text.
pub const MAX_TEMPLATE_OUTPUT_BYTES: usize = 16 << 20;

/// Renders `messages` through `template`, with the variables HF templates read, within
/// `MAX_TEMPLATE_FUEL` and `MAX_TEMPLATE_OUTPUT_BYTES`.
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    bos_token: &str,
    eos_token: &str,
    add_generation_prompt: bool,
) -> Result<String> {
    let env = environment();
    let tmpl = env
        .template_from_str(template)
        .map_err(|e| anyhow!("chat template does not parse: {e}"))?;
    let mut out = BoundedWriter {
        buf: Vec::new(),
        limit: MAX_TEMPLATE_OUTPUT_BYTES,
        exceeded: false,
    };
    let result = tmpl.render_captured_to(
        context! {
            messages => messages,
            bos_token => bos_token,
            eos_token => eos_token,
            add_generation_prompt => add_generation_prompt,
        },
        &mut out,
    );
    if out.exceeded {
        bail!(
            "chat template stopped: its output passed the limit of {MAX_TEMPLATE_OUTPUT_BYTES} \
             bytes (MAX_TEMPLATE_OUTPUT_BYTES)"
        );
    }
    match result {
        Ok(_) => String::from_utf8(out.buf)
            .map_err(|_| anyhow!("chat template output is not valid UTF-8")),
        Err(e) if e.kind() == ErrorKind::OutOfFuel => bail!(
            "chat template stopped after {MAX_TEMPLATE_FUEL} instructions \
             (MAX_TEMPLATE_FUEL): it loops too long"
        ),
        Err(e) => bail!("chat template failed: {e}"),
    }
}

/// Renders `messages` through `tok`'s chat template with its own BOS/EOS names and encodes
/// the result as `apply_chat_template(tokenize=True)` would (no BOS added: the template writes
/// its own).
pub fn render_ids(
    tok: &super::Tokenizer,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<Vec<u32>> {
    let template = tok
        .chat_template
        .as_deref()
        .ok_or_else(|| anyhow!("{}: this model has no chat template", tok.source))?;
    let name = |id: Option<u32>| {
        id.and_then(|i| tok.inner.id_to_token(i))
            .unwrap_or_default()
    };
    let text = render(
        template,
        messages,
        &name(tok.bos_token_id),
        &name(tok.eos_token_ids.first().copied()),
        add_generation_prompt,
    )?;
    tok.encode_chat(&text)
}

/// Collects output up to `limit` bytes and fails the write beyond it, which aborts rendering.
struct BoundedWriter {
    buf: Vec<u8>,
    limit: usize,
    exceeded: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.limit {
            self.exceeded = true;
            return Err(std::io::Error::other("chat template output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(MAX_TEMPLATE_FUEL));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers calls `datetime.now().strftime(format)`, i.e. local time; without a time-zone
/// database we use UTC, which differs only near midnight.
fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(secs, format)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Python `strftime` (C locale) for the directives date-stamping templates use, at `secs`
/// seconds after the Unix epoch, UTC.
fn strftime(secs: i64, format: &str) -> Result<String, Error> {
    let days = secs.div_euclid(86_400);
    let in_day = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (in_day / 3600, in_day / 60 % 60, in_day % 60);

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // Writing to a String cannot fail.
        let _ = match chars.next() {
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('b') => write!(out, "{}", &MONTHS[month as usize - 1][..3]),
            Some('B') => write!(out, "{}", MONTHS[month as usize - 1]),
            Some('d') => write!(out, "{day:02}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{:02}", (hour + 11) % 12 + 1),
            Some('j') => write!(out, "{day_of_year:03}"),
            Some('m') => write!(out, "{month:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('S') => write!(out, "{second:02}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('Y') => write!(out, "{year}"),
            Some('%') => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        };
    }
    Ok(out)
}

/// Proleptic Gregorian (year, month, day) of a day count since 1970-01-01, by counting 400-year
/// eras of 146097 days from 0000-03-01 (a March-based year puts the leap day last).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = year - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_from_march = i64::from((month + 9) % 12);
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// transformers' `tojson`: Python `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`. minijinja's own filter differs (compact
/// separators, HTML-escaped `<>&'`), which would change the prompt the model sees.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(usize::try_from(v)?),
        }),
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(pair) if pair.len() == 2 => (pair[0].clone(), pair[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item_separator, key_separator)",
            ))
        }
        // Python drops the space after ',' when indenting, since a newline follows anyway.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let writer = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    writer.value(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn value(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
            ValueKind::Number => out.push_str(&py_float(f64::try_from(v.clone())?)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i, depth, out);
                    self.value(item, depth + 1, out)?;
                }
                self.close(items.is_empty(), depth, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in v.try_iter()? {
                    let name = match key.as_str() {
                        Some(s) => s.to_string(),
                        None if key.kind() == ValueKind::Number => key.to_string(),
                        None => return Err(unserializable("a map key", &key)),
                    };
                    entries.push((name, v.get_item(&key)?));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                out.push('{');
                for (i, (name, item)) in entries.iter().enumerate() {
                    self.separate(i, depth, out);
                    self.string(name, out);
                    out.push_str(&self.key_sep);
                    self.value(item, depth + 1, out)?;
                }
                self.close(entries.is_empty(), depth, out);
                out.push('}');
            }
            _ => return Err(unserializable("a value", v)),
        }
        Ok(())
    }

    fn separate(&self, index: usize, depth: usize, out: &mut String) {
        if index > 0 {
            out.push_str(&self.item_sep);
        }
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
    }

    fn close(&self, empty: bool, depth: usize, out: &mut String) {
        if let (false, Some(ind)) = (empty, &self.indent) {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

fn unserializable(what: &str, v: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: {what} of type {} is not JSON serializable",
            v.kind()
        ),
    )
}

/// Python's `repr(float)`: shortest round-trip digits, scientific notation outside
/// [1e-4, 1e16), always a decimal point or exponent.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if x == 0.0 || (-4..16).contains(&exp) {
        let plain = x.to_string();
        if plain.contains('.') {
            plain
        } else {
            plain + ".0"
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_python_at_known_instants() {
        // 2024-07-26 00:00:00 UTC, a Friday (`date -u -d @1721952000`).
        assert_eq!(strftime(1_721_952_000, "%d %b %Y").unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime(
                1_721_952_000 + 13 * 3600 + 5 * 60 + 9,
                "%A %B %j %I:%M:%S %p %y %m %H %a %%"
            )
            .unwrap(),
            "Friday July 208 01:05:09 PM 24 07 13 Fri %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        // A leap day and the last day of a leap year.
        assert_eq!(
            strftime(951_782_400, "%Y-%m-%d %j").unwrap(),
            "2000-02-29 060"
        );
        assert_eq!(
            strftime(1_735_603_200, "%Y-%m-%d %j").unwrap(),
            "2024-12-31 366"
        );
        assert!(strftime(0, "%Q").is_err());
    }

    #[test]
    fn civil_round_trips() {
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn floats_print_like_python_repr() {
        for (x, want) in [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (0.1, "0.1"),
            (-0.0001, "-0.0001"),
            (1e-5, "1e-05"),
            (1.5e16, "1.5e+16"),
            (123456789.0, "123456789.0"),
            (0.0, "0.0"),
        ] {
            assert_eq!(py_float(x), want);
        }
    }
}
